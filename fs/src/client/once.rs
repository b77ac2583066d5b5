//! The numbers of the changes this client asks of the meta-server, each at
//! most once ([`MetaRequest::Once`]; the meta-server keeps the answer of a
//! change it applied, meta-server `journal::kept_answers`).
//!
//! A change goes out numbered, and with the lowest number this client still
//! waits for an answer to, below which the meta-server drops what it kept.
//! When the meta-server stopped while a change was on its way, the change
//! is sent again under its number once the meta-server is back, and is
//! answered as it was the first time, or made now if it never arrived.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::proto::MetaRequest;
use crate::types::{ChangeSeq, ClientId};

/// The numbering of this client's changes.
#[derive(Debug)]
pub(super) struct ChangeNumbers {
    next: AtomicU64,
    /// Changes sent and not answered yet.
    waiting: Mutex<BTreeSet<ChangeSeq>>,
}

impl Default for ChangeNumbers {
    fn default() -> Self {
        Self { next: AtomicU64::new(1), waiting: Mutex::new(BTreeSet::new()) }
    }
}

impl ChangeNumbers {
    /// `request` numbered as `client`'s next change; its number is waited
    /// for until the returned wrapper is dropped.
    pub fn number(&self, client: ClientId, request: &MetaRequest) -> Numbered<'_> {
        let seq = ChangeSeq(self.next.fetch_add(1, Ordering::Relaxed));
        let answered_below = {
            let mut waiting = self.waiting.lock();
            waiting.insert(seq);
            // `seq` is in the set: the first is at most it.
            *waiting.first().expect("just inserted")
        };
        let request = MetaRequest::Once {
            client,
            seq,
            answered_below,
            resent: false,
            request: Box::new(request.clone()),
        };
        Numbered { numbers: self, seq, request }
    }

    #[cfg(test)]
    fn waiting(&self) -> Vec<ChangeSeq> {
        self.waiting.lock().iter().copied().collect()
    }
}

/// A change numbered by [`ChangeNumbers::number`], waiting for its answer.
pub(super) struct Numbered<'a> {
    numbers: &'a ChangeNumbers,
    seq: ChangeSeq,
    request: MetaRequest,
}

impl Numbered<'_> {
    pub fn request(&self) -> &MetaRequest {
        &self.request
    }

    /// It went out: whatever is sent from now on is a second sending.
    pub fn sent(&mut self) {
        if let MetaRequest::Once { resent, .. } = &mut self.request {
            *resent = true;
        }
    }
}

impl Drop for Numbered<'_> {
    fn drop(&mut self) {
        self.numbers.waiting.lock().remove(&self.seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers_of(request: &MetaRequest) -> (ChangeSeq, ChangeSeq, bool) {
        match request {
            MetaRequest::Once { seq, answered_below, resent, .. } => (*seq, *answered_below, *resent),
            other => panic!("not numbered: {other:?}"),
        }
    }

    #[test]
    fn changes_are_numbered_up_and_answered_below_the_oldest_waiting() {
        let numbers = ChangeNumbers::default();
        let c = ClientId(3);
        let mut first = numbers.number(c, &MetaRequest::StatFs);
        let second = numbers.number(c, &MetaRequest::StatFs);
        assert_eq!(numbers_of(first.request()), (ChangeSeq(1), ChangeSeq(1), false));
        assert_eq!(numbers_of(second.request()), (ChangeSeq(2), ChangeSeq(1), false), "change 1 still waits");
        first.sent();
        assert!(numbers_of(first.request()).2, "sent again after it went out once");
        drop(first);
        let third = numbers.number(c, &MetaRequest::StatFs);
        assert_eq!(numbers_of(third.request()), (ChangeSeq(3), ChangeSeq(2), false));
        drop((second, third));
        assert!(numbers.waiting().is_empty());
    }
}
