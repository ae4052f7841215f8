//! kvx-planner: the SLA planner (load prediction, pool sizing, connectors) and `kvx configure`,
//! the deployment settings of a host. Only [`configure`] is built; the planner is not yet.

#![forbid(unsafe_code)]

pub mod configure;
