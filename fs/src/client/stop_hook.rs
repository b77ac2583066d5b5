//! A test-only hook for the stalled-mount tests (no takeover before a fence): with
//! `CITRONFS_TEST_STOP_HOLDING` set to `range`, `range-checked`, `inode` or
//! `alock` in its environment, a client process stops itself (SIGSTOP, the
//! whole process, its lease renewals too) the first time its write path
//! holds that lock: a byte-range lock right after its acquisition, the same
//! lock at the last moment before the data verbs go out (after every check
//! the write makes of its hold), the inode mutex exclusive, or the
//! attribute ALock around a size change. The test
//! resumes it with SIGCONT after the stall it studies. Read once; unset
//! (every real mount), it costs one load of a cached value.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The environment variable that arms the hook.
pub const STOP_HOLDING_VAR: &str = "CITRONFS_TEST_STOP_HOLDING";

/// A lock of the write path where the hook can stop the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holding {
    /// A Citron (or other) byte-range lock, right after its acquisition
    /// (before the layout work and the data verbs).
    Range,
    /// The same lock just before the data verbs are posted: after the
    /// write's last check of its hold, nothing of it left but the verbs.
    RangeChecked,
    /// The inode mutex in exclusive mode.
    InodeExclusive,
    /// The file's attribute ALock.
    AttrLock,
}

impl Holding {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "range" => Some(Holding::Range),
            "range-checked" => Some(Holding::RangeChecked),
            "inode" => Some(Holding::InodeExclusive),
            "alock" => Some(Holding::AttrLock),
            _ => None,
        }
    }
}

/// Whether the hook has fired (it fires once per process).
static FIRED: AtomicBool = AtomicBool::new(false);

fn armed() -> Option<Holding> {
    static ARMED: OnceLock<Option<Holding>> = OnceLock::new();
    *ARMED.get_or_init(|| {
        let value = std::env::var(STOP_HOLDING_VAR).ok()?;
        let armed = Holding::parse(&value);
        if armed.is_none() {
            log::warn!("{STOP_HOLDING_VAR}={value:?} is not range, range-checked, inode or alock: ignored");
        }
        armed
    })
}

/// Called where the write path holds `lock`: stops this process the first
/// time, if the hook is armed for it.
pub(crate) fn holding(lock: Holding) {
    if armed() != Some(lock) || FIRED.swap(true, Ordering::Relaxed) {
        return;
    }
    log::warn!("{STOP_HOLDING_VAR}: stopping this process while it holds {lock:?}");
    // SAFETY: raise(3) has no memory-safety preconditions; SIGSTOP stops
    // every thread of the process until a SIGCONT.
    unsafe {
        libc::raise(libc::SIGSTOP);
    }
}
