//! Two-sided messages: the mailboxes of one node and the routing of incoming
//! messages to them.
//!
//! Each endpoint owns a mailbox (a receive queue, like a QP's RQ). A backend's
//! listener thread decodes incoming messages and hands them to
//! [`MailboxRouter::deliver`]; the endpoint takes them with `recv`.
//!
//! **Mailbox ids are recycled**, as an RNIC recycles QP numbers: the lock
//! algorithms put them in narrow fields (DQL: 16 bits, ShiftLock: 24), so a
//! long-lived process that opens and drops endpoints must not run through
//! them. A closed id is reused only after [`QUARANTINE`], oldest first:
//! messages for the endpoint that had it (a predecessor's handover to a
//! waiter that gave up, a grant to an endpoint dropped on an error) are
//! sent by peers that read the id from a lock word, and the locks' own
//! leases and give-up times (seconds) have long since taken it out of
//! every word by then. Fresh ids are handed out while any is younger.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::addr::{ClientAddr, MailboxId};

/// Largest payload of one two-sided message.
pub const MAX_MESSAGE: usize = 60 * 1024;

/// A message as received.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub from: ClientAddr,
    pub payload: Vec<u8>,
}

/// A message on the wire between nodes: the destination mailbox travels with it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Envelope {
    pub to: MailboxId,
    pub message: Message,
}

/// How long a closed mailbox id rests before it is handed out again.
pub const QUARANTINE: Duration = Duration::from_secs(600);

pub(crate) struct MailboxRouter {
    /// [`QUARANTINE`], shorter in tests.
    quarantine: Duration,
    next: AtomicU32,
    queues: Mutex<HashMap<MailboxId, Sender<Message>>>,
    /// Closed ids, oldest first, with when they were closed.
    closed: Mutex<VecDeque<(MailboxId, Instant)>>,
}

impl Default for MailboxRouter {
    fn default() -> Self {
        Self {
            quarantine: QUARANTINE,
            next: AtomicU32::new(0),
            queues: Mutex::new(HashMap::new()),
            closed: Mutex::new(VecDeque::new()),
        }
    }
}

impl MailboxRouter {
    pub fn open(&self) -> (MailboxId, Receiver<Message>) {
        let rested = {
            let mut closed = self.closed.lock();
            match closed.front() {
                Some(&(id, at)) if at.elapsed() >= self.quarantine => {
                    closed.pop_front();
                    Some(id)
                }
                _ => None,
            }
        };
        // Relaxed: the counter only has to hand out distinct values.
        let id = rested.unwrap_or_else(|| MailboxId(self.next.fetch_add(1, Ordering::Relaxed)));
        let (tx, rx) = crossbeam_channel::unbounded();
        self.queues.lock().insert(id, tx);
        (id, rx)
    }

    pub fn close(&self, id: MailboxId) {
        if self.queues.lock().remove(&id).is_some() {
            self.closed.lock().push_back((id, Instant::now()));
        }
    }

    /// Ids handed out for the first time so far (for tests).
    #[cfg(test)]
    fn fresh_ids(&self) -> u32 {
        self.next.load(Ordering::Relaxed)
    }

    /// Queues `envelope` for its mailbox; a message to a closed or unknown
    /// mailbox is dropped (its receiver is gone, as a destroyed QP's would be).
    pub fn deliver(&self, envelope: Envelope) {
        let tx = self.queues.lock().get(&envelope.to).cloned();
        match tx {
            Some(tx) => {
                // A send error means the endpoint is being dropped right now.
                let _ = tx.send(envelope.message);
            }
            None => log::debug!(
                "dropping message from {} to closed mailbox {:?}",
                envelope.message.from,
                envelope.to
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_ids_are_reused_after_their_quarantine_only() {
        let quarantine = Duration::from_millis(50);
        let router = MailboxRouter { quarantine, ..MailboxRouter::default() };
        let (a, _ra) = router.open();
        let (b, _rb) = router.open();
        assert_ne!(a, b);
        router.close(a);
        let (c, _rc) = router.open();
        assert_ne!(c, a, "a freshly closed id rests");
        assert_eq!(router.fresh_ids(), 3);
        std::thread::sleep(quarantine);
        let (d, _rd) = router.open();
        assert_eq!(d, a, "a rested id is reused");
        assert_eq!(router.fresh_ids(), 3);
        router.close(d);
        router.close(d);
        assert_eq!(router.closed.lock().len(), 1, "closing twice frees once");
    }
}
