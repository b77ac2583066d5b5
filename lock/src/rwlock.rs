//! The interface every distributed lock of this crate offers, so the file
//! system and the benchmarks can switch algorithms by name.
//!
//! A lock lives in host memory at a [`RemoteAddr`] (its words; the layout is
//! the algorithm's). A client reaches it through a [`RwLockClient`]: one
//! client's handle to one lock, holding whatever per-acquisition state the
//! algorithm needs (a DSLR ticket, a ShiftLock queue position). Verbs go
//! through the caller's [`Endpoint`], so they are counted there.
//!
//! ```text
//!   let mut handle = algorithm.client(&ep, lock_addr)?;   // once per (client, lock)
//!   {
//!       let _g = RwLockGuard::acquire(&mut *handle, &ep, Mode::Exclusive)?;
//!       ... critical section, may use `ep` ...
//!   }                                                    // released on drop
//! ```
//!
//! Every algorithm is a reader-writer lock in this interface; a pure mutex
//! (DQL, the CAS spin lock) treats `Shared` as `Exclusive` and says so through
//! [`RwLockClient::shares_readers`].

use std::fmt;
use std::str::FromStr;

use crate::rdma::{Endpoint, RdmaError, TransportError};

/// How a lock is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Mode {
    Shared,
    Exclusive,
}

/// Why an acquisition or release failed.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(transparent)]
    Rdma(#[from] RdmaError),
    /// This client's lease ran out: others may have recovered the lock, so it
    /// must not act as the holder. Re-register and start over.
    #[error("this client's lease expired and it was fenced")]
    Fenced,
    #[error("gave up waiting after {0:?}")]
    Timeout(std::time::Duration),
    /// `release` without a matching `acquire`, or similar misuse.
    #[error("lock misuse: {0}")]
    Misuse(&'static str),
    /// The lock host refused or failed a control request (recovery, RPC lock).
    #[error("lock host: {0}")]
    Host(String),
}

impl From<TransportError> for LockError {
    fn from(e: TransportError) -> Self {
        LockError::Rdma(RdmaError::Transport(e))
    }
}

impl From<crate::rdma::VerbError> for LockError {
    fn from(e: crate::rdma::VerbError) -> Self {
        LockError::Rdma(RdmaError::Verb(e))
    }
}

/// One client's handle to one distributed reader-writer lock.
///
/// A handle is used by one thread at a time (it is `Send`, not shared). It
/// holds the lock at most once: `acquire` twice without `release` is misuse.
pub trait RwLockClient: Send {
    /// Blocks until the lock is held in `mode`.
    fn acquire(&mut self, ep: &Endpoint, mode: Mode) -> Result<(), LockError>;
    /// Releases what `acquire` took.
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError>;
    /// Whether two `Shared` holders can be inside at once.
    fn shares_readers(&self) -> bool {
        true
    }
}

/// Holds a lock until dropped. A release that fails on drop is logged: the
/// algorithms' lease recovery is what frees a lock whose holder cannot reach
/// the host, so there is nothing better to do there. Call
/// [`RwLockGuard::release`] to see the error.
pub struct RwLockGuard<'a> {
    client: &'a mut dyn RwLockClient,
    ep: &'a Endpoint,
    held: bool,
}

impl<'a> RwLockGuard<'a> {
    pub fn acquire(
        client: &'a mut dyn RwLockClient,
        ep: &'a Endpoint,
        mode: Mode,
    ) -> Result<Self, LockError> {
        client.acquire(ep, mode)?;
        Ok(Self { client, ep, held: true })
    }

    pub fn release(mut self) -> Result<(), LockError> {
        self.held = false;
        self.client.release(self.ep)
    }
}

impl Drop for RwLockGuard<'_> {
    fn drop(&mut self) {
        if self.held {
            if let Err(e) = self.client.release(self.ep) {
                log::warn!("releasing a lock on drop failed: {e}");
            }
        }
    }
}

/// The selectable lock algorithms (`--inode-lock`, `bench locks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    ShiftLock,
    Dslr,
    Dql,
    Cas,
    Rpc,
}

impl Algorithm {
    pub const ALL: [Algorithm; 5] =
        [Algorithm::ShiftLock, Algorithm::Dslr, Algorithm::Dql, Algorithm::Cas, Algorithm::Rpc];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::ShiftLock => "shiftlock",
            Algorithm::Dslr => "dslr",
            Algorithm::Dql => "dql",
            Algorithm::Cas => "cas",
            Algorithm::Rpc => "rpc",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown lock algorithm {s:?}; one of shiftlock, dslr, dql, cas, rpc"))
    }
}
