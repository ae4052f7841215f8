//! Fuzz target `kv_events`: the harness in `../harness/kv_events.rs` (also run over the saved inputs of
//! `../regressions/kv_events` by the crate's `fuzz_regressions` test).

#![no_main]

#[path = "../harness/kv_events.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
