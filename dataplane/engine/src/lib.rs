//! kvx-engine: the serving engine (sans-IO scheduler, block pool and prefix cache, sampler, model runner).

#![forbid(unsafe_code)]
