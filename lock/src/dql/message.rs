//! DQL's client-to-client messages: the alerts that the paper writes into
//! the peer's memory with RDMA Write with Immediate (§4.2, §4.3), as
//! two-sided messages, plus the liveness beat of our failure handling.
//!
//! Every message names its lock and the token (the tail word) of the
//! acquisition it is for, so it is never taken for another acquisition; it
//! travels in an envelope with a protocol tag, so that a message of another
//! protocol on the same mailbox does not decode as DQL's by accident.

use serde::{Deserialize, Serialize};

use super::word::TailWord;
use crate::postbox::Addressed;
use crate::rdma::{codec, RemoteAddr};

/// "DQL1": the tag of every DQL message.
pub const DQL_TAG: u32 = 0x4451_4C31;

/// What one DQL client tells another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wire {
    /// §4.2: "I swapped your token `pred` out of the tail for mine, `succ`:
    /// I am your successor." Sent by the successor to its predecessor.
    Alert { lock: RemoteAddr, pred: TailWord, succ: TailWord },
    /// §4.3: the lock passes to the successor whose token is `to`.
    Grant { lock: RemoteAddr, to: TailWord },
    /// Ours (failure handling): the predecessor of `to` is alive and still
    /// waiting for the lock itself. Sent every beat after the alert came.
    Alive { lock: RemoteAddr, to: TailWord },
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    tag: u32,
    wire: Wire,
}

impl Wire {
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(&Envelope { tag: DQL_TAG, wire: *self })
    }

    pub fn decode(bytes: &[u8]) -> Result<Wire, String> {
        let e: Envelope = codec::decode(bytes)?;
        if e.tag != DQL_TAG {
            return Err(format!("not a DQL message (tag {:#x})", e.tag));
        }
        Ok(e.wire)
    }

    pub fn lock(&self) -> RemoteAddr {
        match *self {
            Wire::Alert { lock, .. } | Wire::Grant { lock, .. } | Wire::Alive { lock, .. } => lock,
        }
    }
}

impl Addressed for Wire {
    fn decode(bytes: &[u8]) -> Result<Wire, String> {
        Wire::decode(bytes)
    }

    fn lock(&self) -> Option<RemoteAddr> {
        Some(Wire::lock(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;

    #[test]
    fn wire_round_trips_and_refuses_strangers() {
        let lock = RemoteAddr::new(RegionId(3), 4096);
        let (a, b) = (TailWord(0x0102_0304_0001_0002), TailWord(0x0102_0305_0002_0007));
        for w in [
            Wire::Alert { lock, pred: a, succ: b },
            Wire::Grant { lock, to: b },
            Wire::Alive { lock, to: TailWord(u64::MAX >> 1) },
        ] {
            assert_eq!(Wire::decode(&w.encode()).unwrap(), w);
            assert_eq!(w.lock(), lock);
        }
        assert!(Wire::decode(b"\x01\x02 garbage").is_err());
        // A ShiftLock message does not pass for a DQL one.
        let other = crate::shiftlock::Wire::Peer {
            lock,
            message: crate::shiftlock::PeerMessage::Successor { enqueued_at: crate::shiftlock::RelCnt(1) },
        };
        assert!(Wire::decode(&other.encode()).is_err());
        let mut wrong_tag = Wire::Grant { lock, to: b }.encode();
        wrong_tag[0] ^= 1;
        assert!(Wire::decode(&wrong_tag).is_err());
    }
}
