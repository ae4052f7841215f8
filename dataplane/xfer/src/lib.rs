//! kvx-xfer: the KV transfer library (agents, registered regions, descriptor lists, backends).
