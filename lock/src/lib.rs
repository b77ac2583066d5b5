//! CitronFS's lowest layer: the one-sided verbs layer ([`rdma`]) and, on top
//! of it, the distributed lock algorithms.

pub mod rdma;
