//! The servers of CitronFS (DESIGN.md §2, §5, §6): the meta-server
//! (namespace, chunk allocation, attribute slots, client leases) and the data
//! server (DRAM for file chunks, served by a software NIC; its CPU does no
//! per-I/O work).

pub mod chunks;
pub mod data_server;
pub mod lock_cleanup;
pub mod lock_memory;
pub mod lock_tuning;
pub mod namespace;
pub mod service;

pub use data_server::DataServer;
pub use service::{CitronTreeState, MetaServer, MetaServerConfig};
