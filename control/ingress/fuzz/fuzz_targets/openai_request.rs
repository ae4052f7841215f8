//! Fuzz target `openai_request`: the harness in `../harness/openai_request.rs` (also run over the saved inputs of
//! `../regressions/openai_request` by the crate's `fuzz_regressions` test).

#![no_main]

#[path = "../harness/openai_request.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
