//! kvx-kvbm: the KV block manager (tiers G1..G4, offload and onboard policy).

#![forbid(unsafe_code)]
