//! File-system types, the meta-server protocol and the client-side file logic
//! of CitronFS (DESIGN.md §2, §5).
//!
//! * [`types`]: inode numbers, attributes, chunk locations — the vocabulary.
//! * [`proto`]: requests to the meta-server and its answers (serde + bincode).
//! * [`counts`]: events counted by kind, the mechanism behind [`rpc_counts`]
//!   and the mount's FUSE request counts.
//! * [`rpc_counts`]: metadata round trips counted by request kind.
//! * [`status`]: the cluster as `citronfs status` shows it.
//! * [`layout`]: the arithmetic of splitting byte ranges over chunks.
//! * [`locks`]: byte-range locks (fcntl, flock) across mounts, over one-sided
//!   verbs on lock-server memory.
//! * [`client`]: what a mount does: metadata by RPC, file data by one-sided
//!   verbs straight to data-server memory (Octopus's client-active I/O).

pub mod client;
pub mod counts;
pub mod error;
pub mod layout;
pub mod locks;
pub mod permissions;
pub mod proto;
pub mod rpc_counts;
pub mod session;
pub mod status;
pub mod types;

pub use error::FsError;
