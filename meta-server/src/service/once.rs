//! Changes a client asks at most once ([`MetaRequest::Once`]): the
//! service's side of the kept answers (the protocol is in
//! [`crate::journal::kept_answers`]).
//!
//! A first sending is made with every namespace hold it makes naming it
//! ([`crate::journal::Logged::for_change`]); if any hold changed something,
//! its answer is kept, journaled in a hold of its own before the answer
//! leaves. A second sending is answered from what is kept:
//!
//! * the kept answer, with no grant in it: grants (attributes, parents,
//!   delegations) are the meta-server's promises to a caching client, and
//!   one made by an earlier process of the meta-server is not known to
//!   this one. An answer with none promises nothing;
//! * an open (`Open`, `CreateOpen`) is made again instead, as an open of
//!   what the first sending made (no `O_TRUNC`, no `O_EXCL`): opens are
//!   not journaled (a restart forgets them, and the client reclaims only
//!   the opens it knew of), so the kept answer would name an open this
//!   process does not have;
//! * "applied, answer lost" (a crash between the change's batch and its
//!   answer's) fails with an error that says so.
//!
//! A change nothing is kept of was not applied, and is made now.

use std::time::Duration;

use citronfs_core::proto::{MetaRequest, MetaResponse};
use citronfs_core::types::{ChangeSeq, ClientId};
use citronfs_core::FsError;

use super::MetaService;
use crate::identity::Asker;
use crate::journal::kept_answers::Kept;

/// The numbering a [`MetaRequest::Once`] wrapper gave its change.
#[derive(Clone, Copy, Debug)]
pub(super) struct OnceChange {
    pub client: ClientId,
    pub seq: ChangeSeq,
    pub answered_below: ChangeSeq,
    pub resent: bool,
}

impl OnceChange {
    /// `request` out of its [`MetaRequest::Once`] wrapper, and the
    /// wrapper's numbering, if it has one.
    pub fn unwrap(request: MetaRequest) -> (MetaRequest, Option<Self>) {
        match request {
            MetaRequest::Once { client, seq, answered_below, resent, request } => {
                (*request, Some(Self { client, seq, answered_below, resent }))
            }
            other => (other, None),
        }
    }
}

impl MetaService {
    /// Answers `request`, which `change` numbers, at most once.
    pub(super) fn answer_once(
        &self,
        change: OnceChange,
        asker: &Asker,
        caching: Option<(ClientId, Duration)>,
        mut request: MetaRequest,
    ) -> MetaResponse {
        let OnceChange { client, seq, answered_below, resent } = change;
        let mut opened_again = false;
        if resent {
            let kept = self.ns.lock().kept_answers().get(client, seq).cloned();
            match kept {
                None => {}
                Some(_) if open_again(&mut request) => opened_again = true,
                Some(Kept::Answered(answer)) => {
                    log::info!("client {} asked change {} again; answered as kept", client.0, seq.0);
                    return bincode::deserialize(&answer).unwrap_or_else(|e| {
                        MetaResponse::Failed(FsError::Io(format!("a kept answer does not decode: {e}")))
                    });
                }
                Some(Kept::Applied) => {
                    return MetaResponse::Failed(FsError::Io(
                        "this change was applied, and its answer lost as the meta-server stopped".into(),
                    ))
                }
            }
        }
        let (answer, applied) = self.ns.for_change(client, seq, || self.dispatch(asker, caching, request));
        let answer = answer.unwrap_or_else(MetaResponse::Failed);
        let answer = if opened_again { created(answer) } else { answer };
        if applied {
            match bincode::serialize(&answer).map(|encoded| without_grants(&answer, encoded)) {
                Ok(kept) => self.ns.lock().keep_answer(client, seq, answered_below, kept),
                Err(e) => {
                    log::error!("the answer to change {} of client {} does not encode: {e}", seq.0, client.0)
                }
            }
        }
        answer
    }
}

/// Makes an opening request one that opens what its first sending made
/// (see the module header); whether it is one.
fn open_again(request: &mut MetaRequest) -> bool {
    let plain = match request {
        MetaRequest::Caching { request, .. } => request.as_mut(),
        plain => plain,
    };
    match plain {
        MetaRequest::CreateOpen { exclusive, .. } => {
            *exclusive = false;
            true
        }
        MetaRequest::Open { flags, .. } => {
            *flags &= !libc::O_TRUNC;
            true
        }
        _ => false,
    }
}

/// The answer to a `CreateOpen` made again: the file the first sending
/// made, opened as made.
fn created(answer: MetaResponse) -> MetaResponse {
    match answer {
        MetaResponse::OpenedExisting(attr, layout) => MetaResponse::Opened(attr, layout),
        MetaResponse::ParentGranted { answer, parent, created: _, delegated } => {
            MetaResponse::ParentGranted {
                answer: Box::new(self::created(*answer)),
                parent,
                created: true,
                delegated,
            }
        }
        other => other,
    }
}

/// `answer`, `encoded`, as kept: without the grants a caching change's
/// answer carries (see the module header).
fn without_grants(answer: &MetaResponse, encoded: Vec<u8>) -> Vec<u8> {
    if !matches!(answer, MetaResponse::ParentGranted { .. }) {
        return encoded;
    }
    // A copy to take the grants out of (answers are not `Clone`).
    match bincode::deserialize::<MetaResponse>(&encoded) {
        Ok(MetaResponse::ParentGranted { answer, .. }) => {
            let plain = MetaResponse::ParentGranted {
                answer,
                parent: None,
                created: false,
                delegated: Default::default(),
            };
            bincode::serialize(&plain).unwrap_or(encoded)
        }
        _ => encoded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use citronfs_core::types::{Caller, Ino};

    #[test]
    fn an_open_asked_again_opens_what_it_made() {
        let mut create = MetaRequest::CreateOpen {
            caller: Caller::ROOT,
            client: ClientId(2),
            parent: Ino::ROOT,
            name: b"f".to_vec(),
            perm: 0o644,
            exclusive: true,
        };
        assert!(open_again(&mut create));
        assert!(matches!(create, MetaRequest::CreateOpen { exclusive: false, .. }));
        let mut open = MetaRequest::Open {
            caller: Caller::ROOT,
            client: ClientId(2),
            ino: Ino(9),
            flags: libc::O_RDWR | libc::O_TRUNC,
        };
        assert!(open_again(&mut open));
        assert!(matches!(open, MetaRequest::Open { flags: libc::O_RDWR, .. }));
        let mut unlink = MetaRequest::Unlink { caller: Caller::ROOT, parent: Ino::ROOT, name: b"f".to_vec() };
        assert!(!open_again(&mut unlink), "only opens are made again");
    }

    #[test]
    fn kept_answers_carry_no_grant() {
        let granted = MetaResponse::ParentGranted {
            answer: Box::new(MetaResponse::Removed(Ino(5))),
            parent: None,
            created: true,
            delegated: citronfs_core::proto::Delegated { dir: true, ..Default::default() },
        };
        let kept = without_grants(&granted, bincode::serialize(&granted).unwrap());
        match bincode::deserialize(&kept).unwrap() {
            MetaResponse::ParentGranted { answer, created, delegated, .. } => {
                assert!(matches!(*answer, MetaResponse::Removed(Ino(5))));
                assert!(!created && !delegated.dir);
            }
            other => panic!("kept as {other:?}"),
        }
    }
}
