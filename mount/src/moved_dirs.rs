//! Directories another mount moved, and the kernel's old entries of them.
//!
//! The kernel keeps at most one entry (dentry) per directory. When another
//! mount moves a directory, this mount's kernel may still hold its entry
//! under the old name, unused (nothing walks there any more; a zero TTL or
//! an epoch bump only makes it revalidate when a walk passes it). A
//! `LOOKUP` that finds the directory under its new name then makes the
//! kernel move that old entry (`d_splice_alias`), which needs the
//! superblock's rename mutex, and the kernel only *tries* it: inside a
//! rename (which holds it) the lookup fails with ESTALE, and so does the
//! retry the kernel makes. A rename of a directory another mount had
//! moved would fail every time.
//!
//! So before a `LOOKUP` answers a directory, the mount asks the kernel to
//! drop the unused entries it holds of it (`FUSE_NOTIFY_PRUNE`, kernel
//! 6.18 and later; it takes no directory lock, so a worker may send it
//! while the kernel waits for its answer). An entry in use — a process's
//! working directory, an open directory, entries cached below it — is not
//! dropped, and that rename still answers ESTALE.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use citronfs_core::types::Ino;

/// `fuse_notify_code::FUSE_NOTIFY_PRUNE`.
const FUSE_NOTIFY_PRUNE: i32 = 9;

/// Drops the kernel's unused entries of directories; shared by the
/// workers.
#[derive(Clone, Default)]
pub(crate) struct MovedDirs(Arc<Shared>);

#[derive(Default)]
struct Shared {
    /// A descriptor of the session's `/dev/fuse`, once the session exists.
    device: OnceLock<OwnedFd>,
    /// Set once the kernel refused the notification.
    refused: AtomicBool,
}

impl MovedDirs {
    /// The session's device (a duplicate descriptor), set once it exists.
    pub fn set_device(&self, device: OwnedFd) {
        let _ = self.0.device.set(device);
    }

    /// Asks the kernel to drop the unused entries of directory `dir`
    /// before a `LOOKUP` answers it under a name that may be new.
    pub fn prune(&self, dir: Ino) {
        if self.0.refused.load(Ordering::Relaxed) {
            return;
        }
        let Some(device) = self.0.device.get() else { return };
        // fuse_out_header { len, error: the notify code, unique: 0 }, then
        // fuse_notify_prune_out { count, padding, spare } and the node ids.
        let len: u32 = 16 + 16 + 8;
        let mut buf = Vec::with_capacity(len as usize);
        buf.extend_from_slice(&len.to_ne_bytes());
        buf.extend_from_slice(&FUSE_NOTIFY_PRUNE.to_ne_bytes());
        buf.extend_from_slice(&0u64.to_ne_bytes());
        buf.extend_from_slice(&1u32.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&0u64.to_ne_bytes());
        buf.extend_from_slice(&dir.0.to_ne_bytes());
        // SAFETY: `buf` is a live, initialised buffer of `buf.len()` bytes
        // and the descriptor is ours for as long as `self` lives.
        let n = unsafe { libc::write(device.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOENT) && !self.0.refused.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "the kernel refuses FUSE_NOTIFY_PRUNE ({e}; before 6.18?): renaming a directory another \
                     mount moved may answer ESTALE"
                );
            }
        }
    }
}
