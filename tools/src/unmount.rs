//! Leaving no stale mount point behind.
//!
//! A FUSE mount whose daemon is gone answers ENOTCONN ("transport endpoint
//! is not connected") at its mount point until someone unmounts it. So the
//! daemon unmounts before it exits, whatever holds the file system:
//!
//! * a plain `umount(2)` first: it succeeds when nothing is open, and the
//!   kernel then ends the FUSE session;
//! * when the file system is busy (an open file, a process's working
//!   directory, a call blocked in `F_SETLKW`), a lazy unmount
//!   (`MNT_DETACH`): the mount point is free at once, and the open files
//!   keep a detached file system whose connection ends when the daemon
//!   exits (their calls then fail with ENOTCONN instead of hanging).

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{umount2, MntFlags};

/// How a mount point was left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmounted {
    /// Unmounted: the kernel ends the session.
    Clean,
    /// It was busy and is detached: the session goes on for the open files
    /// until the daemon exits.
    Detached,
    /// Nothing was mounted there any more (unmounted from outside).
    Gone,
}

/// Unmounts `dir`, lazily if it is busy.
pub fn unmount(dir: &Path) -> nix::Result<Unmounted> {
    match umount2(dir, MntFlags::empty()) {
        Ok(()) => Ok(Unmounted::Clean),
        Err(Errno::EBUSY) => {
            log::warn!(
                "{} is busy: detaching it (open files get ENOTCONN once the daemon exits)",
                dir.display()
            );
            umount2(dir, MntFlags::MNT_DETACH).map(|()| Unmounted::Detached)
        }
        Err(Errno::EINVAL | Errno::ENOENT) => Ok(Unmounted::Gone),
        Err(e) => Err(e),
    }
}

/// The file-system type mounted at `dir`, if `dir` is a mount point (the
/// last mount there, the one a path lookup sees).
pub fn mounted_type(dir: &Path) -> std::io::Result<Option<String>> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let target = dir.as_os_str().as_bytes();
    // Field 5 is the mount point (octal escapes for space, tab, newline and
    // backslash); the type follows the " - " separator.
    Ok(mountinfo
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| unescape(m) == target))
        .filter_map(|l| l.split(" - ").nth(1)?.split(' ').next().map(str::to_string))
        .next_back())
}

/// A path as the kernel writes it in mountinfo (`\ooo` octal escapes).
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d[0] <= b'3' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn mountinfo_escapes() {
        assert_eq!(super::unescape("/mnt/a\\040b\\134c\\011d"), b"/mnt/a b\\c\td");
        assert_eq!(super::unescape("/plain"), b"/plain");
    }
}
