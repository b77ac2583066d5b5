//! The remote cohort's handover messages (our replacement for the remote MCS
//! descriptor of Alg. 1 lines 8–10, see the module comment of [`super`]) and
//! the postbox that sorts them by lock and kind.
//!
//! A message is the 4-byte tag [`TAG`] followed by the bincode encoding of
//! a [`Letter`]. The tag keeps ALock's messages apart from other protocols
//! sharing the mailbox: its first byte, 'A' = 65, is no variant index of
//! ShiftLock's `Wire` (whose decoder then files it as foreign), and any
//! message without the tag is foreign to ALock.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::postbox::ForeignMessages;
use crate::rdma::{codec, ClientAddr, Endpoint, Message, RemoteAddr};

/// First bytes of every ALock message.
pub const TAG: [u8; 4] = *b"ALK1";

/// What one remote client tells another about one lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Handoff {
    /// "I enqueued behind you" (Alg. 3 line 8, the rWrite of `&desc` into
    /// the predecessor's `next`). The successor is the sender.
    Successor,
    /// "The lock is yours, with this budget" (Alg. 3 line 18, the rWrite of
    /// `budget − 1` into the successor's descriptor). Budget 0: compete in
    /// Peterson first (line 10).
    Handover { budget: u32 },
}

impl Handoff {
    fn kind(self) -> HandoffKind {
        match self {
            Handoff::Successor => HandoffKind::Successor,
            Handoff::Handover { .. } => HandoffKind::Handover,
        }
    }
}

/// The two kinds of [`Handoff`], to wait for one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum HandoffKind {
    Successor,
    Handover,
}

/// A handoff, the lock it is about, and the epoch of the queue it belongs
/// to (a letter of an older epoch is stale: the queue was recovered since).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Letter {
    pub lock: RemoteAddr,
    pub epoch: u8,
    pub handoff: Handoff,
}

impl Letter {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = TAG.to_vec();
        codec::encode_into(&mut out, self);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Letter, String> {
        let body = bytes.strip_prefix(&TAG).ok_or("not an ALock message")?;
        codec::decode(body)
    }
}

/// A kept letter: its sender, its epoch, the handoff.
type Kept = (ClientAddr, u8, Handoff);

#[derive(Default)]
struct Slots {
    owner: Option<ClientAddr>,
    kept: HashMap<(RemoteAddr, HandoffKind), VecDeque<Kept>>,
}

/// The ALock messages that arrived at one endpoint before their handle
/// looked for them: a `Successor` for a lock whose holder is still inside,
/// or any message for another lock than the one the thread waits on. Share
/// one postbox (an `Arc`) among all ALock handles used with one endpoint.
pub struct AlockPostbox {
    slots: Mutex<Slots>,
    /// Messages of other protocols, shared with their postboxes on this
    /// endpoint (see [`crate::postbox::ForeignMessages`]).
    foreign: std::sync::Arc<ForeignMessages>,
}

impl Default for AlockPostbox {
    fn default() -> Self {
        Self { slots: Mutex::new(Slots::default()), foreign: ForeignMessages::new() }
    }
}

impl std::fmt::Debug for AlockPostbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.slots.lock();
        f.debug_struct("AlockPostbox")
            .field("owner", &s.owner)
            .field("kept", &s.kept.values().map(VecDeque::len).sum::<usize>())
            .field("foreign", &self.foreign.len())
            .finish()
    }
}

impl AlockPostbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// A postbox that shares foreign messages with the other protocols'
    /// postboxes of the same endpoint.
    pub fn sharing(foreign: std::sync::Arc<ForeignMessages>) -> Self {
        Self { slots: Mutex::new(Slots::default()), foreign }
    }

    fn keep(&self, from: ClientAddr, letter: Letter) {
        let key = (letter.lock, letter.handoff.kind());
        self.slots.lock().kept.entry(key).or_default().push_back((from, letter.epoch, letter.handoff));
    }

    /// Adopts the ALock messages other postboxes set aside.
    fn adopt_foreign(&self) {
        for (from, letter) in self.foreign.adopt(|m| Letter::decode(&m.payload).ok().map(|l| (m.from, l))) {
            self.keep(from, letter);
        }
    }

    /// Binds the postbox to `ep`'s mailbox on first use; `false` if it
    /// belongs to another endpoint.
    pub fn bind(&self, ep: &Endpoint) -> bool {
        let mut s = self.slots.lock();
        *s.owner.get_or_insert(ep.addr()) == ep.addr()
    }

    /// Messages that were not ALock's, in arrival order (for whatever other
    /// protocol shares the mailbox).
    pub fn take_foreign(&self) -> Vec<Message> {
        self.foreign.take_all()
    }

    /// Messages kept for later, of every lock.
    pub fn kept(&self) -> usize {
        self.slots.lock().kept.values().map(VecDeque::len).sum()
    }

    /// Waits until `deadline` for a `kind` message about `lock` in `epoch`:
    /// first among the kept ones, then from the mailbox (keeping the others,
    /// and dropping this lock's letters of other epochs: stale ones, or,
    /// should a newer one come first, ones the caller will see again once
    /// it notices the recovery and enqueues in that epoch).
    pub(crate) fn receive(
        &self,
        ep: &Endpoint,
        lock: RemoteAddr,
        epoch: u8,
        kind: HandoffKind,
        deadline: Instant,
    ) -> Option<(ClientAddr, Handoff)> {
        self.adopt_foreign();
        {
            let mut slots = self.slots.lock();
            if let Some(kept) = slots.kept.get_mut(&(lock, kind)) {
                while let Some((from, e, handoff)) = kept.pop_front() {
                    if e == epoch {
                        return Some((from, handoff));
                    }
                    log::debug!("dropping a {kind:?} of epoch {e} for ALock {lock} (now {epoch})");
                }
            }
        }
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            let message = if wait.is_zero() { ep.try_recv()? } else { ep.recv_timeout(wait)? };
            let letter = match Letter::decode(&message.payload) {
                Ok(l) => l,
                Err(e) => {
                    log::debug!("setting aside a foreign message from {} ({e})", message.from);
                    self.foreign.put(message);
                    continue;
                }
            };
            if letter.lock == lock && letter.handoff.kind() == kind {
                if letter.epoch == epoch {
                    return Some((message.from, letter.handoff));
                }
                log::debug!("dropping a {kind:?} of epoch {} for ALock {lock} (now {epoch})", letter.epoch);
                continue;
            }
            self.keep(message.from, letter);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;

    #[test]
    fn letters_round_trip_and_carry_the_tag() {
        let lock = RemoteAddr::new(RegionId(3), 4096 + 24);
        for handoff in [Handoff::Successor, Handoff::Handover { budget: 0 }, Handoff::Handover { budget: 20 }]
        {
            let l = Letter { lock, epoch: 7, handoff };
            let bytes = l.encode();
            assert!(bytes.starts_with(&TAG));
            assert_eq!(Letter::decode(&bytes), Ok(l));
        }
        assert!(Letter::decode(b"ALK1\xff\xff garbage").is_err());
        assert!(Letter::decode(b"").is_err());
        let untagged = codec::encode(&Letter { lock, epoch: 0, handoff: Handoff::Successor });
        assert!(Letter::decode(&untagged).is_err(), "no tag, not ours");
    }

    #[test]
    fn shiftlock_does_not_mistake_an_alock_message_for_its_own() {
        let lock = RemoteAddr::new(RegionId(1), 0);
        let bytes = Letter { lock, epoch: 1, handoff: Handoff::Handover { budget: 3 } }.encode();
        assert!(crate::shiftlock::Wire::decode(&bytes).is_err());
        let theirs = crate::shiftlock::Wire::Request(crate::shiftlock::RecoveryRequest::Shutdown).encode();
        assert!(Letter::decode(&theirs).is_err());
    }
}
