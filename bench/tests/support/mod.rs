//! Shared helpers of kvx-bench's end-to-end tests.

pub mod openai_fixture;
