//! The answers of applied changes, kept for a client that asks a change
//! again ([`citronfs_core::proto::MetaRequest::Once`]): the meta-server's
//! reply cache, after NFSv4.1's sessions (RFC 8881 §2.10.6).
//!
//! A client sends a change a second time when its connection broke while
//! the change was on its way, the meta-server having stopped: it cannot
//! know whether the change was applied. Applying it again is wrong for
//! most changes (a create answers EEXIST, an unlink ENOENT, an allocation
//! hands out a second extent), so what the first sending did is kept:
//!
//! * the batch of every namespace hold a change made names it
//!   ([`Change::Applied`]), so "applied" is durable with the change itself;
//! * its answer follows in a record of its own ([`Change::Answered`])
//!   before the answer leaves (the answer waits for every batch it could
//!   have seen).
//!
//! A second sending finds the answer, or only that it was applied: a crash
//! came between the change's batch and its answer's record (a window of
//! one namespace hold, and only when another request's group commit wrote
//! the first batch in between). That one is answered with an error that
//! says so; the change is not made twice. A change found neither way was
//! not applied, and is made now.
//!
//! Answers are kept per client until the client says it waits for no
//! number below them any more (`answered_below`, carried by each of its
//! changes), and go with the client when it is fenced or leaves.

use std::collections::BTreeMap;

use citronfs_core::types::{ChangeSeq, ClientId};
use serde::{Deserialize, Serialize};

/// What is kept of one change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kept {
    /// Applied, its answer not (yet) recorded.
    Applied,
    /// Applied and answered: the answer's encoding.
    Answered(Vec<u8>),
}

/// Every client's kept answers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptAnswers {
    by_client: BTreeMap<ClientId, BTreeMap<ChangeSeq, Kept>>,
}

impl KeptAnswers {
    pub fn get(&self, client: ClientId, seq: ChangeSeq) -> Option<&Kept> {
        self.by_client.get(&client)?.get(&seq)
    }

    /// Change `seq` of `client` made a batch; whether it is news (its
    /// first batch).
    pub fn applied(&mut self, client: ClientId, seq: ChangeSeq) -> bool {
        let kept = self.by_client.entry(client).or_default();
        match kept.get(&seq) {
            Some(_) => false,
            None => {
                kept.insert(seq, Kept::Applied);
                true
            }
        }
    }

    /// Change `seq` of `client` was answered with `answer`; the client no
    /// longer waits for any change numbered below `answered_below`.
    pub fn answered(&mut self, client: ClientId, seq: ChangeSeq, answered_below: ChangeSeq, answer: Vec<u8>) {
        self.forget_below(client, answered_below);
        self.by_client.entry(client).or_default().insert(seq, Kept::Answered(answer));
    }

    /// Drops the answers of `client`'s changes numbered below `below`.
    pub fn forget_below(&mut self, client: ClientId, below: ChangeSeq) {
        if let Some(kept) = self.by_client.get_mut(&client) {
            *kept = kept.split_off(&below);
            if kept.is_empty() {
                self.by_client.remove(&client);
            }
        }
    }

    /// The client is gone (fenced or left): nobody will ask again.
    pub fn forget_client(&mut self, client: ClientId) {
        self.by_client.remove(&client);
    }

    /// How many answers are kept.
    pub fn len(&self) -> usize {
        self.by_client.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_client.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: ClientId = ClientId(4);

    #[test]
    fn an_answer_is_kept_until_the_client_waits_for_nothing_below_it() {
        let mut kept = KeptAnswers::default();
        assert!(kept.applied(C, ChangeSeq(1)));
        assert!(!kept.applied(C, ChangeSeq(1)), "a second batch of the same change is no news");
        assert_eq!(kept.get(C, ChangeSeq(1)), Some(&Kept::Applied));
        kept.answered(C, ChangeSeq(1), ChangeSeq(1), b"one".to_vec());
        kept.answered(C, ChangeSeq(2), ChangeSeq(1), b"two".to_vec());
        assert_eq!(kept.get(C, ChangeSeq(1)), Some(&Kept::Answered(b"one".to_vec())));
        assert_eq!(kept.len(), 2);
        // Change 3's answer says the client waits for nothing below 3.
        kept.answered(C, ChangeSeq(3), ChangeSeq(3), b"three".to_vec());
        assert_eq!(kept.get(C, ChangeSeq(1)), None);
        assert_eq!(kept.get(C, ChangeSeq(2)), None);
        assert_eq!(kept.len(), 1);
        kept.forget_below(C, ChangeSeq(4));
        assert!(kept.is_empty(), "a client with nothing kept has no map left");
    }

    #[test]
    fn a_gone_client_takes_its_answers_with_it() {
        let mut kept = KeptAnswers::default();
        kept.answered(C, ChangeSeq(9), ChangeSeq(9), Vec::new());
        kept.answered(ClientId(5), ChangeSeq(9), ChangeSeq(9), Vec::new());
        kept.forget_client(C);
        assert_eq!(kept.get(C, ChangeSeq(9)), None);
        assert_eq!(kept.len(), 1);
    }
}
