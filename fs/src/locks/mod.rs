//! Distributed byte-range locks of the file system (DESIGN.md §4): POSIX
//! `fcntl` locks (process- and open-file-owned) and `flock` locks, exact
//! across every mount of a cluster.
//!
//! The records of held locks and of waiting requests live in a per-file
//! table in lock-server memory ([`record`], [`table`]); every change to them
//! is made under a range lock over the bytes concerned ([`guard`]), with
//! one-sided verbs only ([`protocol`]); what a request does to the records
//! is a pure function ([`plan`]); blocked POSIX owners publish what they
//! wait for so a cycle is refused with `EDEADLK` ([`waits_for`]). A file's
//! lock memory — table head, Citron tree, spillover and inode mutex — is
//! its [`area::LockArea`]. A mount that is the only one locking a file
//! keeps its records locally under the file's lock token ([`token`]).

pub mod area;
pub mod guard;
pub mod plan;
pub mod protocol;
pub mod record;
pub mod table;
pub mod token;
pub mod types;
pub mod waiter;
pub mod waits_for;

pub use area::LockArea;
pub use guard::{ClusterLockParams, LockTiming};
pub use plan::Request;
pub use protocol::{FileLocks, LockMessage, Outcome, Registration, WaitSpec};
pub use record::LockRecord;
pub use types::{ByteRange, LockFlavor, LockMode, LockOwner, OwnerKey, OFFSET_MAX};
pub use waits_for::WaitsFor;
