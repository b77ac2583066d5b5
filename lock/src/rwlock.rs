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
//!   let mut handle = open_lock(algorithm, &ep, &host, lock_addr, timing, &ctx)?; // once per (client, lock)
//!   {
//!       let _g = RwLockGuard::acquire(&mut *handle, &ep, Mode::Exclusive)?;
//!       ... critical section, may use `ep` ...
//!   }                                                    // released on drop
//! ```
//!
//! Every algorithm is a reader-writer lock in this interface; a pure mutex
//! (DQL, the CAS spin lock) treats `Shared` as `Exclusive` and says so through
//! [`RwLockClient::shares_readers`].
//!
//! [`crate::lock_host`] is the factory: how much memory each [`Algorithm`]
//! needs, the lock host's services, and `open_lock` for clients.

use std::fmt;
use std::str::FromStr;

use crate::rdma::{Endpoint, RdmaError, TransportError, Verb, VerbError, VerbReply};

/// How many fence delays an algorithm's give-up time grows by when it is
/// given one (`with_fence_delay` of each config): room for that many
/// takeovers of silent holders in one wait, each of which now waits a
/// fence delay longer (see `citron::lock::recovery`, "The fence delay").
pub const GIVE_UP_FENCES: u32 = 4;

/// How long a waiter of a queue lock (ShiftLock, DQL) waits before it gives
/// up, for a lock `lease` and a `fence_delay`: 60 leases, and
/// [`GIVE_UP_FENCES`] fence delays more.
pub fn give_up_after(lease: std::time::Duration, fence_delay: std::time::Duration) -> std::time::Duration {
    lease * 60 + fence_delay * GIVE_UP_FENCES
}

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
    /// The algorithm is named but its module is not part of this build yet
    /// (see [`Algorithm::is_built`]).
    #[error("lock algorithm {0} is not built in this binary yet")]
    NotBuilt(Algorithm),
}

impl From<TransportError> for LockError {
    fn from(e: TransportError) -> Self {
        LockError::Rdma(RdmaError::Transport(e))
    }
}

impl From<crate::rdma::tcp::RpcError> for LockError {
    fn from(e: crate::rdma::tcp::RpcError) -> Self {
        TransportError::from(e).into()
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
    /// Calls to a lock server this handle has made: the round trips of an
    /// algorithm whose lock is not in fabric memory (no verb counts them).
    fn server_calls(&self) -> u64 {
        0
    }

    /// [`RwLockClient::acquire`], and then the reads `riders` (on lock
    /// memory of the same endpoint) under the lock. An algorithm whose
    /// first verb can take the lock posts them in the same ordered batch,
    /// right after that verb, and answers their replies when that verb did
    /// take it: the verbs of one endpoint execute in order, so the reads
    /// ran after the lock was ours, as reads posted after `acquire`
    /// returned would have. `None` (the default, and whenever the lock had
    /// to be waited for) means the replies are not to be trusted: the
    /// caller reads again. The riders must be reads: they may run whether
    /// or not the lock was taken.
    fn acquire_with_reads(
        &mut self,
        ep: &Endpoint,
        mode: Mode,
        riders: &[Verb],
    ) -> Result<Riders, LockError> {
        let _ = riders;
        self.acquire(ep, mode)?;
        Ok(None)
    }

    /// Posts `verbs` (writes on lock memory of the same endpoint, made
    /// under the lock) and then [`RwLockClient::release`]s. An algorithm
    /// whose release starts with one verb posts them in the same ordered
    /// batch, before that verb: they execute before it, so whoever takes
    /// the lock next sees them, as when they were waited for before the
    /// release (the default does exactly that). A refused verb fails the
    /// call, and the lock is released all the same.
    fn release_after(&mut self, ep: &Endpoint, verbs: &[Verb]) -> Result<(), LockError> {
        let posted = execute_all(ep, verbs);
        let released = self.release(ep);
        posted.and(released)
    }

    /// The verbs that release the lock now, for the caller to post last in
    /// a batch of its own on the endpoint it acquired with (right away: a
    /// lease may be running), when the release is a fixed list of verbs
    /// whose replies the algorithm needs not see; the handle then counts
    /// as released. `None` (the default, and whenever the release must
    /// look at what it finds): call [`RwLockClient::release`].
    fn release_verbs(&mut self) -> Option<Vec<Verb>> {
        None
    }
}

/// Replies of reads that rode on an acquisition
/// ([`RwLockClient::acquire_with_reads`]); `None`: read them again.
pub type Riders = Option<Vec<Result<VerbReply, VerbError>>>;

/// Runs `verbs` as one ordered batch (nothing when empty) and fails on the
/// first refused one.
pub fn execute_all(ep: &Endpoint, verbs: &[Verb]) -> Result<(), LockError> {
    if verbs.is_empty() {
        return Ok(());
    }
    for r in ep.execute(verbs)? {
        r?;
    }
    Ok(())
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
///
/// [`crate::lock_host::open_lock`] opens any of them; [`Algorithm::BUILT`]
/// lists those this binary has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Algorithm {
    /// shiftlock-fast25.md: writers queue and hand over; the inode mutex.
    ShiftLock,
    /// dslr-sigmod18.md: the bakery reader-writer lock on one FAA.
    Dslr,
    /// dql-icpp05.md: the distributed FIFO queue lock (a mutex).
    Dql,
    /// The CAS spin reader-writer lock with backoff (the papers' baseline).
    Cas,
    /// A centralised lock server taking lock requests as RPCs (baseline).
    Rpc,
    /// alock-spaa24.md: the asymmetric lock (host threads and remote clients).
    ALock,
}

impl Algorithm {
    pub const ALL: [Algorithm; 6] = [
        Algorithm::ShiftLock,
        Algorithm::Dslr,
        Algorithm::Dql,
        Algorithm::Cas,
        Algorithm::Rpc,
        Algorithm::ALock,
    ];

    /// The algorithms this binary can open, in [`Algorithm::ALL`]'s order.
    pub const BUILT: [Algorithm; 6] = Algorithm::ALL;

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::ShiftLock => "shiftlock",
            Algorithm::Dslr => "dslr",
            Algorithm::Dql => "dql",
            Algorithm::Cas => "cas",
            Algorithm::Rpc => "rpc",
            Algorithm::ALock => "alock",
        }
    }

    /// Whether [`crate::lock_host::open_lock`] can open this algorithm here;
    /// the others fail with [`LockError::NotBuilt`].
    pub const fn is_built(self) -> bool {
        match self {
            Algorithm::ShiftLock
            | Algorithm::Dslr
            | Algorithm::Dql
            | Algorithm::Cas
            | Algorithm::Rpc
            | Algorithm::ALock => true,
        }
    }

    /// Bytes of host memory one lock needs; zeroed memory is an idle lock.
    /// Allocate at an address aligned to [`Algorithm::lock_align`].
    pub const fn lock_bytes(self) -> u64 {
        self.layout().0
    }

    /// Alignment of one lock's memory (a power of two).
    pub const fn lock_align(self) -> u64 {
        self.layout().1
    }

    /// (bytes, alignment), from each algorithm's own layout constants.
    const fn layout(self) -> (u64, u64) {
        match self {
            Algorithm::ShiftLock => (crate::shiftlock::ENTRY_BYTES, crate::shiftlock::ENTRY_ALIGN),
            Algorithm::Dslr => (crate::dslr::DSLR_BYTES, crate::dslr::DSLR_ALIGN),
            Algorithm::Cas => (crate::cas_spin::CAS_SPIN_BYTES, crate::cas_spin::CAS_SPIN_ALIGN),
            Algorithm::Dql => (crate::dql::DQL_BYTES, crate::dql::DQL_ALIGN),
            // The server keeps the lock's state; the address only names it.
            Algorithm::Rpc => (8, 8),
            Algorithm::ALock => {
                (crate::alock::AlockLayout::LOCK_BYTES, crate::alock::AlockLayout::LOCK_ALIGN)
            }
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
        Algorithm::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            format!("unknown lock algorithm {s:?}; one of {}", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>(), Ok(a));
            assert_eq!(a.to_string(), a.name());
        }
        let e = "mcs".parse::<Algorithm>().unwrap_err();
        assert!(e.contains("mcs") && e.contains("shiftlock") && e.contains("alock"), "{e}");
    }

    #[test]
    fn built_is_the_built_subset_of_all_in_order() {
        let built: Vec<Algorithm> = Algorithm::ALL.into_iter().filter(|a| a.is_built()).collect();
        assert_eq!(built, Algorithm::BUILT.to_vec());
    }

    #[test]
    fn layouts_are_the_modules_constants_and_hold_aligned_words() {
        assert_eq!((Algorithm::ShiftLock.lock_bytes(), Algorithm::ShiftLock.lock_align()), (16, 16));
        assert_eq!((Algorithm::Dslr.lock_bytes(), Algorithm::Dslr.lock_align()), (8, 8));
        assert_eq!((Algorithm::Cas.lock_bytes(), Algorithm::Cas.lock_align()), (8, 8));
        for a in Algorithm::ALL {
            assert!(a.lock_align().is_power_of_two() && a.lock_align() >= 8, "{a}");
            assert!(a.lock_bytes() > 0 && a.lock_bytes().is_multiple_of(8), "{a}");
        }
    }
}
