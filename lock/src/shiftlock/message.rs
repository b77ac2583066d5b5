//! The two-sided messages of ShiftLock (§3.3, §3.5.2, §3.6) and the postbox
//! that sorts them by lock.
//!
//! Clients notify each other with `Successor`, `Handover` and `ModeChanged`
//! ([`PeerMessage`]); a client that finds a lock stalled asks the lock host's
//! recovery service with [`RecoveryRequest`] and gets a [`RecoveryReply`].
//! All of them travel as one [`Wire`] enum, bincode-encoded with the verbs
//! layer's codec, and each names its lock: one endpoint (one mailbox, the
//! `TailPtr` of §3.2) serves every ShiftLock its thread uses, so a message
//! for lock A may arrive while the thread waits on lock B. The [`Postbox`]
//! keeps such messages until A's handle looks for them.

use serde::{Deserialize, Serialize};

use super::entry::{Epoch, RelCnt};
use crate::postbox::Addressed;
pub use crate::postbox::Verdict;
use crate::rdma::{codec, RemoteAddr};

/// Client-to-client notifications (Alg. 2 line 15, Alg. 3 lines 18 and 23).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMessage {
    /// "I enqueued behind you" (Alg. 2 line 15). The successor is the
    /// message's sender; `enqueued_at` is the `RelCnt` its enqueue returned,
    /// which lets the receiver discard a message from before a recovery.
    Successor { enqueued_at: RelCnt },
    /// The lock is yours (Alg. 3 line 23): `RelCnt` after our release, the
    /// consecutive-writer count, and the current epoch. The paper's payload
    /// is `(curRelCnt, consWrt)`; the epoch is ours (see [`super`]).
    Handover { rel_cnt: RelCnt, cons_wrt: u32, epoch: Epoch },
    /// The lock went to the readers (Alg. 3 line 18): take it when `RelCnt`
    /// reaches `expected`; `epoch` is the epoch after the flip.
    ModeChanged { expected: RelCnt, epoch: Epoch },
}

/// Asks the lock host to recover a lock (§3.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecoveryRequest {
    /// Recover `lock` if `era` is still the current era of its era counter
    /// and its `RelCnt` is still `stuck_at`, the value the client saw stand
    /// still.
    Recover { lock: RemoteAddr, era: u64, stuck_at: RelCnt },
    /// Stop the service (accepted only from the service's own node).
    Shutdown,
}

/// The lock host's answer to [`RecoveryRequest::Recover`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecoveryReply {
    /// The lock was reset; its era counter is now `era`.
    Recovered { lock: RemoteAddr, era: u64 },
    /// `requested` is not the current era (`current`): someone recovered
    /// under this era already. Wait T_lease and look at `RelCnt` again.
    Stale { lock: RemoteAddr, requested: u64, current: u64 },
    /// `RelCnt` is no longer the value the request saw stuck: a client is
    /// alive after all, nothing was reset.
    Progressed { lock: RemoteAddr, era: u64, rel_cnt: RelCnt },
    /// The request is invalid (misaligned address, unknown region...).
    Refused { lock: RemoteAddr, reason: String },
}

impl RecoveryReply {
    pub fn lock(&self) -> RemoteAddr {
        match *self {
            RecoveryReply::Recovered { lock, .. }
            | RecoveryReply::Stale { lock, .. }
            | RecoveryReply::Progressed { lock, .. }
            | RecoveryReply::Refused { lock, .. } => lock,
        }
    }
}

/// Everything ShiftLock puts in a mailbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wire {
    Peer { lock: RemoteAddr, message: PeerMessage },
    Request(RecoveryRequest),
    Reply(RecoveryReply),
}

impl Wire {
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Wire, String> {
        codec::decode(bytes)
    }

    /// The lock a client-bound message is about.
    pub fn lock(&self) -> Option<RemoteAddr> {
        match self {
            Wire::Peer { lock, .. } => Some(*lock),
            Wire::Reply(r) => Some(r.lock()),
            Wire::Request(_) => None,
        }
    }
}

impl Addressed for Wire {
    fn decode(bytes: &[u8]) -> Result<Wire, String> {
        Wire::decode(bytes)
    }

    /// Requests are for the recovery service, never for a client.
    fn lock(&self) -> Option<RemoteAddr> {
        Wire::lock(self)
    }
}

/// A received ShiftLock message.
pub type Letter = crate::postbox::Letter<Wire>;

/// Messages that arrived at one endpoint for a lock other than the one its
/// thread was waiting on ([`crate::postbox`]). Share one postbox (an `Arc`)
/// among all ShiftLock handles used with the same endpoint; a handle with
/// its own postbox loses the messages of other locks to it.
pub type Postbox = crate::postbox::Postbox<Wire>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;

    #[test]
    fn wire_round_trips() {
        let lock = RemoteAddr::new(RegionId(2), 48);
        for w in [
            Wire::Peer { lock, message: PeerMessage::Successor { enqueued_at: RelCnt(5) } },
            Wire::Peer {
                lock,
                message: PeerMessage::Handover {
                    rel_cnt: RelCnt(u64::MAX),
                    cons_wrt: 15,
                    epoch: Epoch(true),
                },
            },
            Wire::Peer {
                lock,
                message: PeerMessage::ModeChanged { expected: RelCnt(9), epoch: Epoch(false) },
            },
            Wire::Request(RecoveryRequest::Recover { lock, era: 3, stuck_at: RelCnt(8) }),
            Wire::Request(RecoveryRequest::Shutdown),
            Wire::Reply(RecoveryReply::Recovered { lock, era: 4 }),
            Wire::Reply(RecoveryReply::Stale { lock, requested: 3, current: 4 }),
            Wire::Reply(RecoveryReply::Progressed { lock, era: 3, rel_cnt: RelCnt(9) }),
            Wire::Reply(RecoveryReply::Refused { lock, reason: "x".into() }),
        ] {
            assert_eq!(Wire::decode(&w.encode()).unwrap(), w);
        }
        assert!(Wire::decode(b"\xff\xff\xff garbage").is_err());
    }
}
