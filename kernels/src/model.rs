//! The llama-family forward pass.
