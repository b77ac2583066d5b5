//! Which unlinks the mount answers before it sends them (issue 13; the
//! client's `late_unlinks` module has the protocol and why it is
//! coherent): the unlink of a regular file this mount made in a directory
//! delegated to it, with one link, not open here, that the meta-server
//! will allow — the same check, on the directory's attributes kept here
//! and the file's held with the delegation, with the ids the meta-server
//! will see (none squashed).
//!
//! Such an unlink costs no round trip: the name leaves the delegation's
//! listing (so this mount's lookups find it gone), the directory's kept
//! attributes take the unlink's time as their mtime and ctime (so the
//! kernel's `GETATTR` of the directory after the unlink, which
//! `default_permissions` asks at the next path walk, is answered here as
//! it would be after a sent one), and the unlink is queued to go with
//! others in one `UnlinkMany`. Any other unlink goes at once, as before.
//!
//! Measured (mdtest-easy's remove phase, 4 ranks, 5,000 files each in
//! their own directories, one `--cache-ttl 1` mount, release builds side
//! by side): 18.7–21.5k/s sent at once, 35.7–39.4k/s answered first; in
//! IO500's `mdtest-easy-delete`, 18.7k/s against 31.5–34.7k/s.

use std::time::Duration;

use citronfs_core::permissions::may_remove;
use citronfs_core::proto::LateUnlink;
use citronfs_core::types::{Caller, FileKind, Ino, Timestamp};
use fuser::ReplyEmpty;

use crate::CitronFuse;

/// How long a delegation must still last for an unlink in it to be
/// answered first: far more than a batch waits to be sent
/// (`late_unlinks::LINGER` of the client), so the unlinks are there before
/// the meta-server could stop waiting for this mount.
const MARGIN: Duration = Duration::from_millis(100);

impl CitronFuse {
    /// Answers the unlink of `name` in `parent` at once and queues it, if
    /// it qualifies (see the module header); `reply` back if not.
    pub(crate) fn unlink_late(
        &self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        reply: ReplyEmpty,
    ) -> Option<ReplyEmpty> {
        if !self.caching() || self.client.squashes(caller.uid, caller.gid) {
            return Some(reply);
        }
        let delegations = self.invalidations.delegations();
        let Some(victim) = delegations.made_here(parent, name, MARGIN) else { return Some(reply) };
        let Some((dir, _)) = self.invalidations.attrs().get(parent) else { return Some(reply) };
        let qualifies = victim.kind == FileKind::File
            && victim.nlink == 1
            && may_remove(&dir, &victim, caller).is_ok()
            && !self.client.is_open_here(victim.ino);
        if !qualifies {
            return Some(reply);
        }
        let at = Timestamp::now();
        let unlink = LateUnlink { caller, parent, name: name.to_vec(), ino: victim.ino, at };
        if !delegations.remove_late(parent, name, victim.ino, MARGIN, || self.client.unlink_later(unlink)) {
            return Some(reply);
        }
        // The directory as the kernel will ask for it; if its attributes
        // ran out meanwhile, its next `GETATTR` goes to the meta-server,
        // after the unlink (every call sends the queue first).
        match self.invalidations.attrs().changed_here(parent, at) {
            Some(dir) => delegations.refresh(&dir),
            None => delegations.forget(parent),
        }
        self.attrs_changed(&[victim.ino]);
        reply.ok();
        None
    }
}
