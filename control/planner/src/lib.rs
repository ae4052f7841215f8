//! kvx-planner: the SLA planner (load prediction, pool sizing, connectors).

#![forbid(unsafe_code)]
