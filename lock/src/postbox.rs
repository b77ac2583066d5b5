//! The postbox: sorts the two-sided messages that arrive at one endpoint by
//! the lock they are about, so that several lock handles can share the
//! endpoint (its one mailbox).
//!
//! Lock protocols that hand a lock from client to client (ShiftLock §3.3,
//! DQL §3.2) name the lock in every message. A thread waits on one lock at a
//! time, but a message for lock A may arrive while it waits on lock B; the
//! postbox keeps it until A's handle looks. Every handle of one protocol used
//! with one endpoint shares one postbox (an `Arc`); a handle with a postbox
//! of its own would lose the messages of the other locks to it.
//!
//! The postbox is generic over the protocol's message type ([`Addressed`]):
//! ShiftLock's `Wire` and DQL's `Wire` each get theirs. Messages that do not
//! decode as the protocol's type go to a queue of foreign messages. Several
//! protocols can share one endpoint if their postboxes share that queue
//! ([`ForeignMessages`], [`Postbox::sharing`]): a postbox adopts its
//! protocol's messages from it before it waits on the mailbox, so a
//! message taken from the mailbox by another protocol's postbox (say, a
//! ShiftLock `Successor` that arrives while the thread waits for an ALock)
//! is not lost. Only one thread uses an endpoint at a time, so at most one
//! postbox of an endpoint waits on its mailbox at any moment.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::Mutex;

use crate::rdma::{ClientAddr, Endpoint, Message, RemoteAddr};

/// A protocol's message, as the postbox needs to see it.
pub trait Addressed: Sized + std::fmt::Debug {
    /// Decodes a payload; an error means the message is not this protocol's.
    fn decode(bytes: &[u8]) -> Result<Self, String>;
    /// The lock a client-bound message is about; `None` for a message that
    /// no client should receive (a request meant for a service), which the
    /// postbox drops.
    fn lock(&self) -> Option<RemoteAddr>;
}

/// What a receiver does with a message it is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The message it waits for.
    Take,
    /// Stale (from an earlier acquisition, or before a recovery): drop it.
    Discard,
    /// Not now: keep it for later.
    Keep,
}

/// A received message and its sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Letter<W> {
    pub from: ClientAddr,
    pub wire: W,
}

/// Messages of one endpoint that the postbox which took them from the
/// mailbox could not decode, for the other protocols' postboxes of that
/// endpoint. Share one (an `Arc`) among all of an endpoint's postboxes.
#[derive(Debug, Default)]
pub struct ForeignMessages {
    queue: Mutex<VecDeque<Message>>,
}

impl ForeignMessages {
    pub fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self::default())
    }

    /// Sets a message aside for the other postboxes.
    pub fn put(&self, message: Message) {
        self.queue.lock().push_back(message);
    }

    /// Takes out, in arrival order, the messages that `decode` accepts.
    pub fn adopt<T>(&self, mut decode: impl FnMut(&Message) -> Option<T>) -> Vec<T> {
        let mut q = self.queue.lock();
        if q.is_empty() {
            return Vec::new();
        }
        let mut adopted = Vec::new();
        q.retain(|m| match decode(m) {
            Some(t) => {
                adopted.push(t);
                false
            }
            None => true,
        });
        adopted
    }

    /// Everything set aside, in arrival order.
    pub fn take_all(&self) -> Vec<Message> {
        self.queue.lock().drain(..).collect()
    }

    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Slots<W> {
    owner: Option<ClientAddr>,
    by_lock: HashMap<RemoteAddr, VecDeque<Letter<W>>>,
}

impl<W> Default for Slots<W> {
    fn default() -> Self {
        Self { owner: None, by_lock: HashMap::new() }
    }
}

/// Messages of one protocol that arrived at one endpoint, sorted by lock.
pub struct Postbox<W> {
    slots: Mutex<Slots<W>>,
    foreign: std::sync::Arc<ForeignMessages>,
}

impl<W> Default for Postbox<W> {
    fn default() -> Self {
        Self { slots: Mutex::new(Slots::default()), foreign: ForeignMessages::new() }
    }
}

impl<W> std::fmt::Debug for Postbox<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.slots.lock();
        f.debug_struct("Postbox")
            .field("owner", &s.owner)
            .field("kept", &s.by_lock.values().map(VecDeque::len).sum::<usize>())
            .field("foreign", &self.foreign.len())
            .finish()
    }
}

impl<W: Addressed> Postbox<W> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A postbox that shares its foreign messages with the other protocols'
    /// postboxes of the same endpoint.
    pub fn sharing(foreign: std::sync::Arc<ForeignMessages>) -> Self {
        Self { slots: Mutex::new(Slots::default()), foreign }
    }

    /// Moves this protocol's messages that other postboxes set aside into
    /// this one.
    fn adopt_foreign(&self) {
        let letters = self.foreign.adopt(|m| {
            let wire = W::decode(&m.payload).ok()?;
            Some((wire.lock()?, Letter { from: m.from, wire }))
        });
        for (lock, letter) in letters {
            self.keep(lock, letter);
        }
    }

    /// Binds the postbox to `ep`'s mailbox on first use; `false` if it
    /// belongs to another endpoint.
    pub fn bind(&self, ep: &Endpoint) -> bool {
        let mut s = self.slots.lock();
        *s.owner.get_or_insert(ep.addr()) == ep.addr()
    }

    /// Messages that were not this protocol's (nor adopted by another
    /// postbox sharing the queue), in arrival order.
    pub fn take_foreign(&self) -> Vec<Message> {
        self.foreign.take_all()
    }

    /// Messages kept for `lock`.
    pub fn kept(&self, lock: RemoteAddr) -> usize {
        self.slots.lock().by_lock.get(&lock).map_or(0, VecDeque::len)
    }

    fn keep(&self, lock: RemoteAddr, letter: Letter<W>) {
        self.slots.lock().by_lock.entry(lock).or_default().push_back(letter);
    }

    /// Shows the kept messages of `lock` to `judge`, oldest first; returns
    /// the first it takes and drops those it discards.
    fn search(&self, lock: RemoteAddr, judge: &mut impl FnMut(&Letter<W>) -> Verdict) -> Option<Letter<W>> {
        let mut s = self.slots.lock();
        let queue = s.by_lock.get_mut(&lock)?;
        let mut i = 0;
        while i < queue.len() {
            match judge(&queue[i]) {
                Verdict::Take => return queue.remove(i),
                Verdict::Discard => {
                    queue.remove(i);
                }
                Verdict::Keep => i += 1,
            }
        }
        None
    }

    /// Waits until `deadline` for a message about `lock` that `judge` takes:
    /// first among the kept ones, then from the mailbox. Messages about
    /// other locks, and those `judge` keeps, are kept; messages that are not
    /// this protocol's go to the foreign queue. With `deadline` in the past
    /// this only looks at what has already arrived.
    pub fn receive(
        &self,
        ep: &Endpoint,
        lock: RemoteAddr,
        deadline: Instant,
        mut judge: impl FnMut(&Letter<W>) -> Verdict,
    ) -> Option<Letter<W>> {
        self.adopt_foreign();
        if let Some(l) = self.search(lock, &mut judge) {
            return Some(l);
        }
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            let message = if wait.is_zero() { ep.try_recv()? } else { ep.recv_timeout(wait)? };
            let (wire, about) = match W::decode(&message.payload) {
                Ok(w) => match w.lock() {
                    Some(about) => (w, about),
                    None => {
                        log::warn!("dropping {w:?} from {}: a request sent to a client", message.from);
                        continue;
                    }
                },
                Err(e) => {
                    log::debug!("setting aside a foreign message from {} ({e})", message.from);
                    self.foreign.put(message);
                    continue;
                }
            };
            let letter = Letter { from: message.from, wire };
            if about != lock {
                self.keep(about, letter);
                continue;
            }
            match judge(&letter) {
                Verdict::Take => return Some(letter),
                Verdict::Discard => log::debug!("discarding stale {letter:?}"),
                Verdict::Keep => self.keep(about, letter),
            }
        }
    }
}
