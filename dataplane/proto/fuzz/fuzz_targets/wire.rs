//! Fuzz target `wire`: the harness in `../harness/wire.rs` (also run over the saved inputs of
//! `../regressions/wire` by the crate's `fuzz_regressions` test).

#![no_main]

#[path = "../harness/wire.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
