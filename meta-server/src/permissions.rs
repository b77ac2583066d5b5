//! Permission checks that only the meta-server can make for every client:
//! owner, mode and sticky bit on open, create, unlink, rmdir, rename and
//! setattr, as Linux's `generic_permission` and `may_delete` make them.
//!
//! Every mount also mounts with `default_permissions`, so the calling
//! node's kernel checks first; these checks are the cluster's own, for a
//! client that does not go through a kernel (a program using the client
//! library, or a mount that was changed) and for root squashing, which
//! only the meta-server can apply ([`crate::identity`]).
//!
//! The caller's identity is what its mount reports (uid, gid), as NFS's
//! AUTH_SYS trusts its clients; squashing is what a key can restrict. The
//! mount does not send supplementary groups, so a caller who is neither
//! owner nor in the file's primary group is granted what the group *or*
//! others may do (it may belong to the group): never stricter than the
//! kernel that already checked, so no request a kernel allowed is refused
//! for want of a group list. Likewise a size or time change by an owner
//! without write permission is allowed (an `ftruncate` through a file
//! opened for writing before a `chmod`, which the meta-server cannot tell
//! from a `truncate`).
//!
//! Checks run under the namespace lock, together with the change they
//! guard, so no rename can slip between a check and its operation.
//!
//! They apply to registered clients of a keyed cluster ([`Checks::ON`]);
//! without keys anyone who reaches the ports is trusted with everything
//! (raw verbs included), and the kernels' checks are the only ones, as
//! before keys existed.

use citronfs_core::types::{Attr, Caller, FileKind, Ino, SetAttr};
use citronfs_core::FsError;

use crate::namespace::Namespace;

pub use citronfs_core::permissions::{may, MAY_EXEC, MAY_READ, MAY_WRITE};

fn check(attr: &Attr, caller: Caller, mask: u32) -> Result<(), FsError> {
    if may(attr, caller, mask) {
        Ok(())
    } else {
        Err(FsError::Access)
    }
}

/// Whether permission checks apply to a request ([`Checks::ON`] for a
/// registered client of a keyed cluster); every check passes when off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checks(bool);

impl Checks {
    pub const ON: Checks = Checks(true);
    pub const OFF: Checks = Checks(false);

    /// Opening `ino` with open(2) `flags`.
    pub fn open(self, ns: &Namespace, caller: Caller, ino: Ino, flags: i32) -> Result<(), FsError> {
        if !self.0 {
            return Ok(());
        }
        check(&ns.attr(ino)?, caller, open_mask(flags))
    }

    /// See [`add_entry`].
    pub fn add_entry(self, ns: &Namespace, caller: Caller, parent: Ino) -> Result<(), FsError> {
        if self.0 {
            add_entry(ns, caller, parent)
        } else {
            Ok(())
        }
    }

    /// See [`remove_entry`].
    pub fn remove_entry(
        self,
        ns: &Namespace,
        caller: Caller,
        parent: Ino,
        name: &[u8],
    ) -> Result<(), FsError> {
        if self.0 {
            remove_entry(ns, caller, parent, name)
        } else {
            Ok(())
        }
    }

    /// See [`rename`].
    pub fn rename(
        self,
        ns: &Namespace,
        caller: Caller,
        (parent, name): (Ino, &[u8]),
        (new_parent, new_name): (Ino, &[u8]),
    ) -> Result<(), FsError> {
        if self.0 {
            rename(ns, caller, parent, name, new_parent, new_name)
        } else {
            Ok(())
        }
    }

    /// See [`setattr`].
    pub fn setattr(self, ns: &Namespace, caller: Caller, ino: Ino, set: &SetAttr) -> Result<(), FsError> {
        if self.0 {
            setattr(ns, caller, ino, set)
        } else {
            Ok(())
        }
    }

    /// Setting or removing the extended attribute `name`: `trusted.*` is
    /// root's; the others need write permission, as Linux's
    /// `xattr_permission` has it.
    pub fn xattr_write(self, ns: &Namespace, caller: Caller, ino: Ino, name: &[u8]) -> Result<(), FsError> {
        if !self.0 {
            return Ok(());
        }
        if name.starts_with(b"trusted.") {
            return if caller.uid == 0 { Ok(()) } else { Err(FsError::Perm) };
        }
        check(&ns.attr(ino)?, caller, MAY_WRITE)
    }

    /// `access(2)`: `mask` on `ino` (existence only when off).
    pub fn access(self, ns: &Namespace, caller: Caller, ino: Ino, mask: u32) -> Result<(), FsError> {
        let attr = ns.attr(ino)?;
        if self.0 {
            check(&attr, caller, mask)
        } else {
            Ok(())
        }
    }
}

/// What an open with `flags` (open(2) flags) needs.
pub fn open_mask(flags: i32) -> u32 {
    let mut mask = match flags & libc::O_ACCMODE {
        libc::O_RDONLY => MAY_READ,
        libc::O_WRONLY => MAY_WRITE,
        _ => MAY_READ | MAY_WRITE,
    };
    if flags & libc::O_TRUNC != 0 {
        mask |= MAY_WRITE;
    }
    mask
}

/// Adding an entry to `parent` (create, mknod, mkdir, symlink, link).
pub fn add_entry(ns: &Namespace, caller: Caller, parent: Ino) -> Result<(), FsError> {
    check(&ns.attr(parent)?, caller, MAY_WRITE | MAY_EXEC)
}

/// Removing `name` from `parent` (unlink, rmdir, the source of a rename,
/// a replaced target): write and search on the directory, and in a sticky
/// directory only the owner of the entry or of the directory (or root).
pub fn remove_entry(ns: &Namespace, caller: Caller, parent: Ino, name: &[u8]) -> Result<(), FsError> {
    let dir = ns.attr(parent)?;
    // The directory first: no lookup for a caller who may not remove.
    check(&dir, caller, MAY_WRITE | MAY_EXEC)?;
    citronfs_core::permissions::sticky_allows(&dir, &ns.lookup(parent, name)?, caller)
}

/// A rename: the source is removed from `parent`, the target (if any)
/// from `new_parent`, and a directory moved to another parent needs write
/// permission on itself (its ".." changes).
pub fn rename(
    ns: &Namespace,
    caller: Caller,
    parent: Ino,
    name: &[u8],
    new_parent: Ino,
    new_name: &[u8],
) -> Result<(), FsError> {
    remove_entry(ns, caller, parent, name)?;
    match ns.lookup(new_parent, new_name) {
        Ok(_) => remove_entry(ns, caller, new_parent, new_name)?,
        Err(FsError::NotFound) => add_entry(ns, caller, new_parent)?,
        Err(e) => return Err(e),
    }
    let source = ns.lookup(parent, name)?;
    if source.kind == FileKind::Dir && parent != new_parent {
        check(&source, caller, MAY_WRITE)?;
    }
    Ok(())
}

/// A setattr: chmod by the owner or root; chown by root, chgrp by the
/// owner (to a group it belongs to, which the kernel checked); size and
/// times by the owner or with write permission.
pub fn setattr(ns: &Namespace, caller: Caller, ino: Ino, set: &SetAttr) -> Result<(), FsError> {
    let attr = ns.attr(ino)?;
    let root = caller.uid == 0;
    let owner = root || caller.uid == attr.uid;
    if set.perm.is_some() && !owner {
        return Err(FsError::Perm);
    }
    if set.uid.is_some_and(|u| u != attr.uid) && !root {
        return Err(FsError::Perm);
    }
    if set.gid.is_some_and(|g| g != attr.gid) && !owner {
        return Err(FsError::Perm);
    }
    let writes = set.size.is_some() || set.atime.is_some() || set.mtime.is_some();
    if writes && !owner && !may(&attr, caller, MAY_WRITE) {
        return Err(FsError::Access);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use citronfs_core::types::Timestamp;

    use super::*;

    fn file(perm: u16, uid: u32, gid: u32) -> Attr {
        let t = Timestamp::from_nanos(0);
        Attr {
            ino: Ino(5),
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

    fn who(uid: u32, gid: u32) -> Caller {
        Caller { uid, gid, pid: 1 }
    }

    #[test]
    fn owner_group_other_and_root() {
        let f = file(0o640, 1000, 100);
        assert!(may(&f, who(1000, 1), MAY_READ | MAY_WRITE));
        assert!(!may(&f, who(1000, 1), MAY_EXEC));
        assert!(may(&f, who(2000, 100), MAY_READ));
        assert!(!may(&f, who(2000, 100), MAY_WRITE));
        // Possibly in group 100 through a supplementary group: read is allowed.
        assert!(may(&f, who(2000, 200), MAY_READ));
        assert!(!may(&file(0o600, 1000, 100), who(2000, 200), MAY_READ));
        // The owner class decides for the owner, even when others may more.
        assert!(!may(&file(0o077, 1000, 100), who(1000, 100), MAY_READ));
        assert!(may(&f, who(0, 0), MAY_READ | MAY_WRITE));
        assert!(!may(&f, who(0, 0), MAY_EXEC), "root executes only what someone may");
        assert!(may(&file(0o100, 1, 1), who(0, 0), MAY_EXEC));
    }

    #[test]
    fn open_flags_map_to_masks() {
        assert_eq!(open_mask(libc::O_RDONLY), MAY_READ);
        assert_eq!(open_mask(libc::O_WRONLY | libc::O_APPEND), MAY_WRITE);
        assert_eq!(open_mask(libc::O_RDWR), MAY_READ | MAY_WRITE);
        assert_eq!(open_mask(libc::O_RDONLY | libc::O_TRUNC), MAY_READ | MAY_WRITE);
    }
}
