//! The permission rules the meta-server checks for every client
//! (meta-server `permissions`, which has why they are what they are), here
//! so that a mount can tell beforehand what the meta-server will decide:
//! a mount that answers a create or unlink before it sends it (a late
//! change, `client::late_changes`) must not answer one the meta-server
//! refuses.

use crate::error::FsError;
use crate::types::{Attr, Caller, FileKind};

/// `access(2)` bits.
pub const MAY_EXEC: u32 = 1;
pub const MAY_WRITE: u32 = 2;
pub const MAY_READ: u32 = 4;

/// The sticky bit of a mode.
pub const STICKY: u16 = 0o1000;

/// Whether `caller` may do `mask` (MAY_* bits) on a file with `attr`. The
/// caller's supplementary groups are not known: one who is neither the
/// owner nor in the file's group gets what the group *or* others may do,
/// never less than its kernel allowed.
pub fn may(attr: &Attr, caller: Caller, mask: u32) -> bool {
    let mask = mask & 7;
    if caller.uid == 0 {
        // Root: anything but executing a file nobody may execute.
        let exec_ok = attr.kind == FileKind::Dir || attr.perm & 0o111 != 0;
        return mask & MAY_EXEC == 0 || exec_ok;
    }
    let bits = |shift: u16| u32::from((attr.perm >> shift) & 7);
    let allowed = if caller.uid == attr.uid {
        bits(6)
    } else if caller.gid == attr.gid {
        bits(3)
    } else {
        // Maybe in the group through a supplementary group we are not told.
        bits(3) | bits(0)
    };
    allowed & mask == mask
}

/// Removing `victim` from directory `dir` (unlink, rmdir, the source of a
/// rename, a replaced target): write and search on the directory, and in a
/// sticky directory only the owner of the entry or of the directory (or
/// root), as Linux's `may_delete`.
pub fn may_remove(dir: &Attr, victim: &Attr, caller: Caller) -> Result<(), FsError> {
    if !may(dir, caller, MAY_WRITE | MAY_EXEC) {
        return Err(FsError::Access);
    }
    sticky_allows(dir, victim, caller)
}

/// The sticky-directory half of [`may_remove`]: in a sticky `dir`, only
/// the owner of `victim` or of `dir` (or root) removes it.
pub fn sticky_allows(dir: &Attr, victim: &Attr, caller: Caller) -> Result<(), FsError> {
    if dir.perm & STICKY != 0 && caller.uid != 0 && caller.uid != dir.uid && caller.uid != victim.uid {
        return Err(FsError::Perm);
    }
    Ok(())
}
