//! Set-user-ID and set-group-ID bits after writes, truncates and chowns by
//! processes without `CAP_FSETID`, as Linux's local file systems clear them
//! ([`citronfs_core::types::perm_without_setid`]). Who does what (DESIGN.md §7):
//!
//! * **write**: the kernel clears nothing on a direct write; it marks every
//!   write by a process without `CAP_FSETID` with `FUSE_WRITE_KILL_SUIDGID`
//!   (whether or not `FUSE_HANDLE_KILLPRIV_V2` was negotiated). The client
//!   sees the file's bits in the slot read every write makes and clears
//!   them by RPC only when there is one to clear
//!   ([`citronfs_core::client::WriteMode`]).
//! * **truncate, chown**: we do not negotiate `FUSE_HANDLE_KILLPRIV(_V2)`,
//!   because then the kernel would leave them to the daemon with
//!   `FATTR_KILL_SUIDGID`, a flag fuser 0.18 does not pass. Without it the
//!   kernel re-reads the mode and sends it, cleared, in the same
//!   `SETATTR` — but by a simpler rule than the local one: it clears
//!   set-group-ID only with group-execute. A set-group-ID bit without
//!   group-execute also goes, locally, when the caller is not in the
//!   file's (old) group: [`SgidCheck`] does that part.
//! * **`open(O_TRUNC)` of a file another mount just created**: see
//!   [`crate::access`]; the daemon truncates and clears itself.

use citronfs_core::types::{Attr, FileKind, S_ISGID, S_IXGRP};

use crate::access::{Capability, Credentials};

/// The groups a set-group-ID bit is judged against: the caller's
/// filesystem gid and its supplementary groups (from `/proc/<tid>`).
pub fn groups_of(tid: u32, uid: u32, gid: u32) -> Vec<u32> {
    Credentials::of(tid, uid, gid).all_groups()
}

/// A set-group-ID bit that only membership of the group protects.
fn sgid_without_group_exec(perm: u16) -> bool {
    perm & (S_ISGID | S_IXGRP) == S_ISGID
}

/// The part of a truncate's or chown's clearing the kernel leaves out:
/// made before the `setattr` (a chown is judged by the file's old group),
/// finished after it.
pub struct SgidCheck {
    /// The group to judge the caller against, if the file may need it.
    judged_gid: Option<u32>,
    /// Whether the `setattr` truncates or changes the owner at all.
    applies: bool,
}

impl SgidCheck {
    /// For a `setattr` that changes `size`, `uid` or `gid`; `before` gives
    /// the file's attributes before a chown (one RPC, only for chowns).
    pub fn before(
        size: Option<u64>,
        uid: Option<u32>,
        gid: Option<u32>,
        before: impl FnOnce() -> Option<Attr>,
    ) -> Self {
        let chown = uid.is_some() || gid.is_some();
        let judged_gid = match chown {
            true => before()
                .filter(|a| a.kind == FileKind::File && sgid_without_group_exec(a.perm))
                .map(|a| a.gid),
            false => None,
        };
        Self { judged_gid, applies: chown || size.is_some() }
    }

    /// The permission bits the file must get after the `setattr` that
    /// answered `after`, if Linux would have cleared more than the kernel
    /// sent; asks for the caller's credentials only in that case.
    pub fn after(&self, after: &Attr, caller_gid: u32, creds: impl FnOnce() -> Credentials) -> Option<u16> {
        if !self.applies || after.kind != FileKind::File || !sgid_without_group_exec(after.perm) {
            return None;
        }
        let gid = self.judged_gid.unwrap_or(after.gid);
        if gid == caller_gid {
            return None;
        }
        let creds = creds();
        if creds.has(Capability::Fsetid) || creds.groups.contains(&gid) {
            return None;
        }
        Some(after.perm & !S_ISGID)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(gid: u32, perm: u16) -> Attr {
        crate::access::tests::file(0, gid, perm)
    }

    fn nobody(groups: &[u32]) -> Credentials {
        Credentials { uid: 65534, gid: 65534, groups: groups.to_vec(), effective: 0 }
    }

    #[test]
    fn a_truncate_by_an_outsider_drops_a_bare_set_group_id_bit() {
        let truncate = SgidCheck::before(Some(1), None, None, || unreachable!("no getattr for a truncate"));
        assert_eq!(truncate.after(&file(0, 0o2767), 65534, || nobody(&[])), Some(0o0767));
        assert_eq!(truncate.after(&file(0, 0o2767), 65534, || nobody(&[0])), None, "a member keeps it");
        assert_eq!(truncate.after(&file(0, 0o2767), 0, || unreachable!()), None, "the file's own group");
        let root = Credentials { effective: 1 << Capability::Fsetid as u32, ..nobody(&[]) };
        assert_eq!(truncate.after(&file(0, 0o2767), 65534, || root), None, "CAP_FSETID keeps it");
        assert_eq!(truncate.after(&file(0, 0o0767), 65534, || unreachable!()), None);
        let chmod = SgidCheck::before(None, None, None, || unreachable!());
        assert_eq!(chmod.after(&file(0, 0o2767), 65534, || unreachable!()), None, "chmod clears nothing");
    }

    #[test]
    fn a_chown_is_judged_by_the_old_group() {
        // nobody (a member of 65534 only) moves its 2767 file from group 0
        // to 65534: judged against group 0, the bit goes.
        let chgrp = SgidCheck::before(None, None, Some(65534), || Some(file(0, 0o2767)));
        assert_eq!(chgrp.after(&file(65534, 0o2767), 65534, || nobody(&[])), Some(0o0767));
        // The same from group 65534: it stays.
        let stays = SgidCheck::before(None, None, Some(65534), || Some(file(65534, 0o2767)));
        assert_eq!(stays.after(&file(65534, 0o2767), 65534, || nobody(&[])), None);
    }
}
