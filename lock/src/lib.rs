//! CitronFS's lowest layer: the one-sided verbs layer ([`rdma`]) and, on top
//! of it, the distributed lock algorithms behind one interface ([`rwlock`]),
//! opened by name through one factory ([`lock_host`]); range locks behind
//! [`range_lock`].

pub mod alock;
pub mod cas_spin;
pub mod citron;
pub mod dql;
pub mod dslr;
pub mod lock_host;
pub mod postbox;
pub mod range_lock;
pub mod rdma;
pub mod rpc_lock;
pub mod rwlock;
pub mod shiftlock;
