//! What a request names in the namespace: the inodes it acts on or in, and
//! the names it resolves. The meta-server recalls a directory delegated to
//! another client before it serves a request that names the directory, a
//! name in it or a child held with it (meta-server `grants`, "Late
//! unlinks"): that client may have answered unlinks there it has not sent
//! yet.

use super::MetaRequest;
use crate::types::Ino;

/// The inodes and names a request names ([`MetaRequest::named`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Named<'a> {
    /// Inodes acted on or in (a directory whose entries it reads or
    /// changes, a file it reads or changes).
    pub inos: Vec<Ino>,
    /// Names it resolves, each in its directory (also in `inos`): what
    /// they name is acted on too.
    pub names: Vec<(Ino, &'a [u8])>,
}

impl MetaRequest {
    /// What the request names; nothing for requests that do not touch
    /// the namespace (registration, leases, lock memory, statistics) or
    /// name only what they are given to hand back (releases).
    pub fn named(&self) -> Named<'_> {
        use MetaRequest as R;
        let (inos, names): (Vec<Ino>, Vec<(Ino, &[u8])>) = match self {
            R::Lookup { parent, name, .. }
            | R::Create { parent, name, .. }
            | R::CreateOpen { parent, name, .. }
            | R::Symlink { parent, name, .. }
            | R::Unlink { parent, name, .. }
            | R::Rmdir { parent, name, .. } => (vec![*parent], vec![(*parent, &name[..])]),
            R::LateChanges { changes, .. } => (
                changes.iter().map(|c| c.parent()).collect(),
                changes.iter().map(|c| (c.parent(), c.name())).collect(),
            ),
            R::Link { ino, new_parent, new_name, .. } => {
                (vec![*ino, *new_parent], vec![(*new_parent, &new_name[..])])
            }
            R::Rename { parent, name, new_parent, new_name, .. } => {
                (vec![*parent, *new_parent], vec![(*parent, &name[..]), (*new_parent, &new_name[..])])
            }
            R::GetAttr { ino }
            | R::SetAttr { ino, .. }
            | R::ReadLink { ino }
            | R::ReadDir { ino, .. }
            | R::ReadDirPlus { ino, .. }
            | R::Access { ino, .. }
            | R::Open { ino, .. }
            | R::Layout { ino }
            | R::GrowLockTable { ino, .. }
            | R::KillSuidGid { ino, .. }
            | R::AllocChunks { ino, .. }
            | R::GrowExtents { ino, .. }
            | R::Fallocate { ino, .. }
            | R::SetXattr { ino, .. }
            | R::GetXattr { ino, .. }
            | R::ListXattr { ino, .. }
            | R::RemoveXattr { ino, .. } => (vec![*ino], Vec::new()),
            R::Caching { request, .. } | R::Once { request, .. } => return request.named(),
            R::RegisterClient { .. }
            | R::ReclaimClient { .. }
            | R::DataServers
            | R::Heartbeat { .. }
            | R::ClientLeaves { .. }
            | R::RegisterDataServer { .. }
            | R::DataServerLeaves { .. }
            | R::Release { .. }
            | R::ReleaseMany { .. }
            | R::LendInodes { .. }
            | R::GrowWaitsFor { .. }
            | R::Clients
            | R::StatFs
            | R::Status
            | R::AwaitInvalidations { .. }
            | R::ReportLockTiming { .. } => (Vec::new(), Vec::new()),
        };
        Named { inos, names }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{LateChange, LateCreate, LateUnlink, RenameMode};
    use crate::types::{Caller, ClientId, Timestamp};

    const CALLER: Caller = Caller { uid: 0, gid: 0, pid: 1 };

    #[test]
    fn a_rename_names_both_directories_and_both_names() {
        let r = MetaRequest::Rename {
            caller: CALLER,
            parent: Ino(2),
            name: b"a".to_vec(),
            new_parent: Ino(3),
            new_name: b"b".to_vec(),
            flags: RenameMode::Replace,
        };
        let named = r.named();
        assert_eq!(named.inos, vec![Ino(2), Ino(3)]);
        assert_eq!(named.names, vec![(Ino(2), &b"a"[..]), (Ino(3), &b"b"[..])]);
    }

    #[test]
    fn a_wrapped_request_names_what_it_wraps_and_a_release_nothing() {
        let getattr = MetaRequest::GetAttr { ino: Ino(7) };
        let wrapped = MetaRequest::Caching { client: ClientId(1), ttl_ms: 1000, request: Box::new(getattr) };
        assert_eq!(wrapped.named().inos, vec![Ino(7)]);
        let release = MetaRequest::Release { client: ClientId(1), ino: Ino(7), opens: 1 };
        assert_eq!(release.named(), Named::default());
    }

    #[test]
    fn late_changes_name_each_directory_and_name() {
        let unlink = LateChange::Unlink(LateUnlink {
            caller: CALLER,
            parent: Ino(4),
            name: b"x".to_vec(),
            ino: Ino(9),
            at: Timestamp::default(),
        });
        let create = LateChange::Create(LateCreate {
            caller: CALLER,
            parent: Ino(5),
            name: b"y".to_vec(),
            ino: Ino(10),
            perm: 0o644,
            at: Timestamp::default(),
            first_write: Vec::new(),
        });
        let r = MetaRequest::LateChanges { client: ClientId(1), changes: vec![unlink, create] };
        let named = r.named();
        assert_eq!(named.inos, vec![Ino(4), Ino(5)]);
        assert_eq!(named.names, vec![(Ino(4), &b"x"[..]), (Ino(5), &b"y"[..])]);
    }
}
