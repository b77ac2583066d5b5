//! The one permission check the daemon makes itself.
//!
//! Every mount uses `default_permissions`: the kernel checks access before
//! it asks the daemon — except when `open(O_CREAT)` finds no name. The
//! kernel then sends `FUSE_CREATE` and marks the open file as created
//! (`FMODE_CREATED` in `fuse_atomic_open`), so `do_open` skips an open's
//! permission check (`may_open`) and its `O_TRUNC` (`handle_truncate`).
//! If another mount created the name in between, the daemon opens that
//! existing file — `O_CREAT` without `O_EXCL` is idempotent — and must do
//! what the kernel skipped: check the caller's access to the file as
//! `generic_permission` does, and truncate.
//!
//! FUSE gives the caller's filesystem uid and gid and its thread id; the
//! supplementary groups and the effective capabilities come from
//! `/proc/<tid>/status` (the caller is blocked in `open` while we look).

use citronfs_core::types::Attr;

/// Capability numbers (`linux/capability.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    /// Bypass read and write permission checks.
    DacOverride = 1,
    /// Bypass read permission checks.
    DacReadSearch = 2,
    /// Keep set-user/group-ID bits across writes, truncates and chowns.
    Fsetid = 4,
}

/// What the kernel would check an open against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// `CapEff`: one bit per [`Capability`].
    pub effective: u64,
}

const MAY_READ: u16 = 4;
const MAY_WRITE: u16 = 2;

impl Credentials {
    /// The credentials of thread `tid` (a FUSE request's pid) whose
    /// filesystem ids the request carries. A thread that is gone has no
    /// groups and no capabilities: checks fail closed.
    pub fn of(tid: u32, uid: u32, gid: u32) -> Self {
        let status = std::fs::read_to_string(format!("/proc/{tid}/status")).unwrap_or_default();
        Self::from_status(&status, uid, gid)
    }

    fn from_status(status: &str, uid: u32, gid: u32) -> Self {
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim);
        let groups = field("Groups:")
            .map(|g| g.split_whitespace().filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_default();
        let effective = field("CapEff:").and_then(|c| u64::from_str_radix(c, 16).ok()).unwrap_or(0);
        Self { uid, gid, groups, effective }
    }

    /// The groups a set-group-ID bit is judged against: the filesystem
    /// gid and the supplementary groups.
    pub fn all_groups(&self) -> Vec<u32> {
        let mut groups = self.groups.clone();
        groups.push(self.gid);
        groups
    }

    pub fn has(&self, cap: Capability) -> bool {
        self.effective & (1 << cap as u32) != 0
    }

    /// Whether an open of the regular file `attr` with `flags` (their
    /// access mode: `O_RDONLY`, `O_WRONLY`, `O_RDWR`) is allowed, as
    /// `generic_permission` decides it without ACLs: the owner's bits for
    /// the owner, else the group's for a member of the file's group, else
    /// the others'; `CAP_DAC_OVERRIDE` allows reading and writing,
    /// `CAP_DAC_READ_SEARCH` reading.
    pub fn may_open(&self, attr: &Attr, flags: i32) -> bool {
        let want = match flags & libc::O_ACCMODE {
            libc::O_RDONLY => MAY_READ,
            libc::O_WRONLY => MAY_WRITE,
            _ => MAY_READ | MAY_WRITE,
        } | if flags & libc::O_TRUNC != 0 { MAY_WRITE } else { 0 };
        let bits = if self.uid == attr.uid {
            attr.perm >> 6
        } else if self.gid == attr.gid || self.groups.contains(&attr.gid) {
            attr.perm >> 3
        } else {
            attr.perm
        } & 0o7;
        want & !bits == 0
            || self.has(Capability::DacOverride)
            || (want == MAY_READ && self.has(Capability::DacReadSearch))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use citronfs_core::types::{FileKind, Ino, Timestamp};

    /// A regular file's attributes, for tests.
    pub(crate) fn file(uid: u32, gid: u32, perm: u16) -> Attr {
        let t = Timestamp::default();
        Attr {
            ino: Ino(2),
            kind: FileKind::File,
            perm,
            uid,
            gid,
            size: 0,
            nlink: 1,
            rdev: 0,
            allocated: 0,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
        }
    }

    fn user(uid: u32, gid: u32, groups: &[u32]) -> Credentials {
        Credentials { uid, gid, groups: groups.to_vec(), effective: 0 }
    }

    #[test]
    fn owner_group_and_others_bits() {
        let f = file(1000, 100, 0o640);
        assert!(user(1000, 1, &[]).may_open(&f, libc::O_RDWR));
        assert!(user(2000, 100, &[]).may_open(&f, libc::O_RDONLY));
        assert!(!user(2000, 100, &[]).may_open(&f, libc::O_WRONLY));
        assert!(user(2000, 7, &[5, 100]).may_open(&f, libc::O_RDONLY), "a supplementary group");
        assert!(!user(2000, 7, &[5]).may_open(&f, libc::O_RDONLY));
        assert!(!user(2000, 100, &[]).may_open(&f, libc::O_RDONLY | libc::O_TRUNC), "O_TRUNC needs write");
        // The owner gets the owner's bits even where the group's are wider.
        let g = file(1000, 100, 0o070);
        assert!(!user(1000, 100, &[]).may_open(&g, libc::O_RDONLY));
    }

    #[test]
    fn capabilities_override_and_status_is_parsed() {
        let status = "Name:\tx\nGroups:\t4 24 100 \nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        let root = Credentials::from_status(status, 0, 0);
        assert_eq!(root.groups, vec![4, 24, 100]);
        assert!(root.has(Capability::Fsetid) && root.has(Capability::DacOverride));
        assert!(root.may_open(&file(1000, 100, 0o000), libc::O_RDWR));
        let reader = Credentials { effective: 1 << Capability::DacReadSearch as u32, ..user(5, 5, &[]) };
        assert!(reader.may_open(&file(1000, 100, 0o000), libc::O_RDONLY));
        assert!(!reader.may_open(&file(1000, 100, 0o000), libc::O_WRONLY));
        let nobody = Credentials::from_status("Name:\tx\nCapEff:\t0000000000000000\n", 65534, 65534);
        assert!(!nobody.has(Capability::Fsetid) && nobody.groups.is_empty());
        assert_eq!(Credentials::from_status("", 1, 1).effective, 0, "unreadable status: no capabilities");
    }
}
