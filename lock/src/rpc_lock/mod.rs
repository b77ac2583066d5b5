//! The centralised lock server: the baseline that every decentralised lock
//! is measured against (dql-icpp05.md's "Basecase", §2.3 and Fig. 1: the
//! server keeps a FIFO queue per lock and answers a request when it grants
//! it). `--range-lock rpc` / `--inode-lock rpc`, and `bench locks`.
//!
//! * [`server`]: [`RpcLockServer`], a service of the lock host over the
//!   multiplexed framed RPC ([`crate::rdma::tcp::mux`]).
//! * [`client`]: [`RpcLockClient`], the [`crate::rwlock::RwLockClient`], and
//!   [`RpcLockSession`], the connection (and lease) its handles share.
//!
//! # Semantics
//!
//! Many named locks ([`RpcLockId`], a `u64`; [`RpcLockId::from_addr`] maps a
//! lock-memory address onto one), each a reader-writer lock served strictly
//! in arrival order: a request is granted at once only if nobody waits and
//! it is compatible with the holders (shared with shared); else it queues,
//! and a release grants the queue's head — a writer alone, or the run of
//! readers up to the next writer. Every request gets an `arrival` number
//! (per lock, from 0), returned with the grant, so tests can check FIFO.
//!
//! # Blocked requests: deferred answers, no thread per waiter
//!
//! An `Acquire` that cannot be granted keeps its [`crate::rdma::tcp::Call`]
//! in the lock's queue; the thread that releases (any connection's) answers
//! it. The server never polls and runs one thread per client connection
//! (not per waiter), one acceptor and one lease reaper; a client process
//! shares one connection ([`RpcLockSession`]) among all its lock handles and
//! threads, whose calls are multiplexed on it.
//!
//! # Leases and disconnection
//!
//! A session (one connection) holds a lease ([`RpcLockServerConfig::lease`],
//! from the RTT: 5000 RTT, at least 1 s); every request renews it, and the
//! session renews it every lease/4 from a background thread. When the
//! connection ends (the client process died: the kernel closes its socket)
//! or the lease lapses (the process hangs: SIGSTOP, a partition), the
//! server drops the session's holds and queued requests, grants whatever
//! that unblocks, and (for a lapse) cuts the connection. The bound: a dead
//! holder's lock is granted again as soon as its connection reset reaches
//! the server (milliseconds), a hung one's within lease + reaper wake-up.
//! A client whose session was dropped learns it at release
//! ([`LockError::Fenced`](crate::rwlock::LockError::Fenced)).
//!
//! Bad input (undecodable frames, releasing what one does not hold, asking
//! twice) is refused with an [`RpcLockRefusal`]; nothing a client sends can
//! panic the server or disturb other clients' locks.

pub mod client;
pub mod server;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::rdma::RemoteAddr;
use crate::rwlock::{LockError, Mode};

pub use client::{measure_rtt, RpcLockClient, RpcLockConfig, RpcLockSession, RpcLockStats};
pub use server::{RpcLockServer, RpcLockServerConfig, RpcLockServerStats};

/// A lock's name on the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RpcLockId(pub u64);

/// Bits of a region offset an [`RpcLockId`] keeps (the region id takes the rest).
pub const OFFSET_BITS: u32 = 48;

impl RpcLockId {
    /// The id of the lock that stands for the lock memory at `addr`:
    /// region in the top 16 bits, offset below. Refused (not truncated) if
    /// they do not fit.
    pub fn from_addr(addr: RemoteAddr) -> Result<Self, LockError> {
        if addr.region.0 > 0xFFFF || addr.offset >> OFFSET_BITS != 0 {
            return Err(LockError::Misuse(
                "address does not fit an RPC lock id (region < 2^16, offset < 2^48)",
            ));
        }
        Ok(RpcLockId(u64::from(addr.region.0) << OFFSET_BITS | addr.offset))
    }
}

impl From<u64> for RpcLockId {
    fn from(v: u64) -> Self {
        RpcLockId(v)
    }
}

/// One lock handle of a session: the owner of a hold or a queued request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HolderId(pub u64);

/// Client to server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RpcLockRequest {
    /// Opens the session (any request does) and asks for its lease.
    Hello,
    /// Renews the session's lease (any request does).
    Renew,
    /// Answered when granted ([`RpcLockResponse::Granted`]).
    Acquire {
        lock: RpcLockId,
        holder: HolderId,
        mode: Mode,
    },
    Release {
        lock: RpcLockId,
        holder: HolderId,
    },
    /// Withdraws a queued request (the client gave up waiting).
    Cancel {
        lock: RpcLockId,
        holder: HolderId,
    },
}

/// Server to client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RpcLockResponse {
    Welcome {
        lease: Duration,
    },
    Renewed,
    /// `arrival`: requests for this lock before this one; `queued`: it had
    /// to wait.
    Granted {
        lock: RpcLockId,
        arrival: u64,
        queued: bool,
    },
    Released {
        lock: RpcLockId,
    },
    /// `was_granted`: the request had been granted before the cancel came
    /// (the client then holds the lock and must release it).
    Cancelled {
        lock: RpcLockId,
        was_granted: bool,
    },
    Refused(RpcLockRefusal),
}

/// Why the server refused a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RpcLockRefusal {
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("holder {holder:?} already holds or waits for lock {lock:?}")]
    AlreadyRequested { lock: RpcLockId, holder: HolderId },
    #[error("holder {holder:?} does not hold lock {lock:?}")]
    NotHeld { lock: RpcLockId, holder: HolderId },
    #[error("the session was dropped (its lease lapsed or its connection broke)")]
    SessionDropped,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;

    #[test]
    fn lock_ids_from_addresses_are_exact() {
        let id = RpcLockId::from_addr(RemoteAddr::new(RegionId(3), 0x1234)).unwrap();
        assert_eq!(id, RpcLockId(3 << 48 | 0x1234));
        assert!(RpcLockId::from_addr(RemoteAddr::new(RegionId(0x1_0000), 0)).is_err());
        assert!(RpcLockId::from_addr(RemoteAddr::new(RegionId(1), 1 << 48)).is_err());
        assert_ne!(
            RpcLockId::from_addr(RemoteAddr::new(RegionId(1), 8)).unwrap(),
            RpcLockId::from_addr(RemoteAddr::new(RegionId(2), 8)).unwrap()
        );
    }

    #[test]
    fn protocol_round_trips() {
        use crate::rdma::codec;
        let lock = RpcLockId(9);
        let holder = HolderId(4);
        for r in [
            RpcLockRequest::Hello,
            RpcLockRequest::Acquire { lock, holder, mode: Mode::Shared },
            RpcLockRequest::Cancel { lock, holder },
        ] {
            assert_eq!(codec::decode::<RpcLockRequest>(&codec::encode(&r)).unwrap(), r);
        }
        for r in [
            RpcLockResponse::Welcome { lease: Duration::from_millis(1500) },
            RpcLockResponse::Granted { lock, arrival: 77, queued: true },
            RpcLockResponse::Refused(RpcLockRefusal::NotHeld { lock, holder }),
        ] {
            assert_eq!(codec::decode::<RpcLockResponse>(&codec::encode(&r)).unwrap(), r);
        }
    }
}
