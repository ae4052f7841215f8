//! Fuzz target `agent_metadata`: the harness in `../harness/agent_metadata.rs` (also run over the saved inputs of
//! `../regressions/agent_metadata` by the crate's `fuzz_regressions` test).

#![no_main]

#[path = "../harness/agent_metadata.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
