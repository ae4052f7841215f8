//! kvx-kernels: numbers only (quantized formats, CPU kernels, the llama-family forward pass); no I/O, no async.
