//! CitronFS's lowest layer: the one-sided verbs layer ([`rdma`]) and, on top
//! of it, the distributed lock algorithms behind one interface ([`rwlock`]).

pub mod cas_spin;
pub mod citron;
pub mod dslr;
pub mod rdma;
pub mod rwlock;
pub mod shiftlock;
