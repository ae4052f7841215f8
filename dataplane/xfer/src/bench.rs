//! The transfer benchmark behind `kvx bench xfer`: GB/s and latency percentiles per backend.
