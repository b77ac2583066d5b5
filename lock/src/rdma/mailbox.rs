//! Two-sided messages: the mailboxes of one node and the routing of incoming
//! messages to them.
//!
//! Each endpoint owns a mailbox (a receive queue, like a QP's RQ). A backend's
//! listener thread decodes incoming messages and hands them to
//! [`MailboxRouter::deliver`]; the endpoint takes them with `recv`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

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

#[derive(Default)]
pub(crate) struct MailboxRouter {
    next: AtomicU32,
    queues: Mutex<HashMap<MailboxId, Sender<Message>>>,
}

impl MailboxRouter {
    pub fn open(&self) -> (MailboxId, Receiver<Message>) {
        // Relaxed: the counter only has to hand out distinct values.
        let id = MailboxId(self.next.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = crossbeam_channel::unbounded();
        self.queues.lock().insert(id, tx);
        (id, rx)
    }

    pub fn close(&self, id: MailboxId) {
        self.queues.lock().remove(&id);
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
