//! The servers of CitronFS (DESIGN.md §2, §5, §6): the meta-server
//! (namespace, extent allocation, lock memory, attribute slots, client
//! leases) and the data server (DRAM for file data, served by a software
//! NIC; its CPU does no per-I/O work). Memory lent to clients comes back
//! through one reclamation point ([`reclaim`]).

pub mod access;
pub mod buddy;
pub mod data_dir;
pub mod data_link;
pub mod data_server;
pub mod extents;
pub mod grants;
pub mod identity;
pub mod journal;
pub mod lock_areas;
pub mod lock_cleanup;
pub mod lock_memory;
pub mod lock_tuning;
pub mod namespace;
pub mod permissions;
pub mod reclaim;
pub mod service;
pub mod waits_for_chain;

pub use data_server::DataServer;
pub use service::{CitronTreeState, MetaServer, MetaServerConfig};
