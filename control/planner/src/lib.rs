//! kvx-planner: the SLA planner — what it observes of a frontend ([`observe`]), load
//! predictors ([`predict`]), pool sizing from a worker profile with guardrails ([`plan`]) and
//! from the workers' step times without one ([`load`]),
//! the connectors that apply decisions ([`connector`], [`kubernetes`]), one process's loop ([`driver`],
//! [`service`]) — and `kvx configure`: the deployment settings of a host ([`configure`]) and,
//! from profiles, the layouts its cores allow, predicted and ranked ([`layouts`]); a profile
//! drawn as HTML ([`report`]).

#![forbid(unsafe_code)]

pub mod configure;
pub mod connector;
pub mod driver;
pub mod kubernetes;
pub mod layouts;
pub mod load;
pub mod observe;
pub mod plan;
pub mod predict;
pub mod report;
pub mod service;
