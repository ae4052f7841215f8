//! Fuzz target `chat_template`: the harness in `../harness/chat_template.rs` (also run over the saved inputs of
//! `../regressions/chat_template` by the crate's `fuzz_regressions` test).

#![no_main]

#[path = "../harness/chat_template.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
