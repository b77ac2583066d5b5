//! What the daemon learns about the process behind a lock request from
//! `/proc`, because FUSE (as fuser passes it) does not say it:
//!
//! * **Which interface took the lock.** The kernel sends `flock(2)` as a
//!   whole-file lock request whose owner is the open file — like an OFD lock
//!   — and marks it with `FUSE_LK_FLOCK`, which fuser does not pass on. The
//!   caller is blocked inside the system call while we answer, so
//!   `/proc/<tid>/syscall` names it: `flock`, or `fcntl` with `F_OFD_*` or
//!   plain `F_*LK*` commands.
//! * **Whether a waiting caller was signalled.** fuser answers
//!   `FUSE_INTERRUPT` with `ENOSYS`, after which the kernel never sends it
//!   and a caller in `F_SETLKW` waits until the daemon answers (only a fatal
//!   signal ends its wait, and only before the daemon read the request). So
//!   the waiter watches `/proc/<tid>/status` for a pending signal that is
//!   not blocked and that the process catches or dies of, and answers
//!   `EINTR` itself. Signals whose default is to stop, continue or be
//!   ignored do not interrupt (the kernel would restart the call after
//!   them). A handler installed with `SA_RESTART` cannot make the call
//!   restart through FUSE (the kernel refuses `ERESTARTSYS` from a daemon),
//!   so such a caller sees `EINTR` too.
//!
//! `tid` is the request's pid as FUSE sends it: the calling thread's id.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

use citronfs_core::locks::LockFlavor;
use parking_lot::Mutex;

/// Open `/proc/<tid>/syscall` files of recent callers: opening one costs more
/// than reading it, and the same threads lock again and again. An open
/// `/proc/<tid>` file refers to that task, not to the number: once the
/// thread has exited, reads fail and the file is opened again, so a reused
/// thread id is never read through a dead thread's file.
#[derive(Default)]
pub struct SyscallFiles {
    files: Mutex<HashMap<u32, File>>,
}

/// Most files kept open (one per recently locking thread).
const KEPT_FILES: usize = 64;

impl SyscallFiles {
    /// The flavour of the lock request the thread `tid` is making right now,
    /// or `None` if `/proc` does not say (the thread is gone or not in a
    /// call we know).
    pub fn lock_flavor(&self, tid: u32) -> Option<LockFlavor> {
        let mut buf = [0u8; 256];
        let kept = self.files.lock().remove(&tid);
        let (file, len) = match kept.and_then(|f| f.read_at(&mut buf, 0).ok().map(|n| (f, n))) {
            Some(read) => read,
            None => {
                let f = File::open(format!("/proc/{tid}/syscall")).ok()?;
                let n = f.read_at(&mut buf, 0).ok()?;
                (f, n)
            }
        };
        let flavor = flavor_of_syscall(std::str::from_utf8(&buf[..len]).ok()?);
        let mut files = self.files.lock();
        if files.len() >= KEPT_FILES {
            files.clear();
        }
        files.insert(tid, file);
        flavor
    }
}

fn flavor_of_syscall(text: &str) -> Option<LockFlavor> {
    let mut fields = text.split_whitespace();
    let nr: i64 = fields.next()?.parse().ok()?;
    let _fd = fields.next()?;
    let cmd = i64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    if nr == libc::SYS_flock {
        return Some(LockFlavor::Flock);
    }
    if nr != libc::SYS_fcntl {
        return None;
    }
    match cmd as i32 {
        libc::F_OFD_GETLK | libc::F_OFD_SETLK | libc::F_OFD_SETLKW => Some(LockFlavor::Ofd),
        libc::F_GETLK | libc::F_SETLK | libc::F_SETLKW => Some(LockFlavor::Posix),
        _ => None,
    }
}

/// Signals whose default action ends the process (so a pending one means
/// the caller is about to die and must be let go).
const FATAL_BY_DEFAULT: u64 = {
    let sigs = [
        libc::SIGHUP,
        libc::SIGINT,
        libc::SIGQUIT,
        libc::SIGILL,
        libc::SIGTRAP,
        libc::SIGABRT,
        libc::SIGBUS,
        libc::SIGFPE,
        libc::SIGKILL,
        libc::SIGUSR1,
        libc::SIGSEGV,
        libc::SIGUSR2,
        libc::SIGPIPE,
        libc::SIGALRM,
        libc::SIGTERM,
        libc::SIGSTKFLT,
        libc::SIGXCPU,
        libc::SIGXFSZ,
        libc::SIGVTALRM,
        libc::SIGPROF,
        libc::SIGIO,
        libc::SIGPWR,
        libc::SIGSYS,
    ];
    let mut mask = 0u64;
    let mut i = 0;
    while i < sigs.len() {
        mask |= 1 << (sigs[i] - 1);
        i += 1;
    }
    mask
};

/// Whether the thread `tid` has a signal pending that should end its wait
/// with `EINTR`; also true when the thread is gone.
pub fn interrupted(tid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{tid}/status")) {
        Ok(text) => signal_pending_in(&text),
        Err(_) => true,
    }
}

fn signal_pending_in(status: &str) -> bool {
    let mask = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let pending = mask("SigPnd:") | mask("ShdPnd:");
    let blocked = mask("SigBlk:");
    let caught = mask("SigCgt:");
    // Realtime signals (34 and up) are fatal by default too.
    let fatal = FATAL_BY_DEFAULT | !((1u64 << 33) - 1);
    pending & !blocked & (caught | fatal) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscalls_name_the_flavour() {
        let fcntl =
            |cmd: i32| format!("{} 0x3 {:#x} 0x7ffc1234 0x0 0x0 0x0 0x7ffc0000 0x7f00", libc::SYS_fcntl, cmd);
        assert_eq!(flavor_of_syscall(&fcntl(libc::F_SETLKW)), Some(LockFlavor::Posix));
        assert_eq!(flavor_of_syscall(&fcntl(libc::F_GETLK)), Some(LockFlavor::Posix));
        assert_eq!(flavor_of_syscall(&fcntl(libc::F_OFD_SETLK)), Some(LockFlavor::Ofd));
        assert_eq!(flavor_of_syscall(&format!("{} 0x3 0x2 0x0", libc::SYS_flock)), Some(LockFlavor::Flock));
        assert_eq!(flavor_of_syscall("running"), None);
        assert_eq!(flavor_of_syscall(&format!("{} 0x3 0x400", libc::SYS_fcntl)), None);
    }

    /// A thread blocked in `F_OFD_SETLKW` is seen as making an OFD call, on
    /// the first read and through the kept file; once it has exited, its
    /// kept file fails and nothing is reported.
    #[test]
    fn a_blocked_thread_is_read_through_its_kept_file() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let holder = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let ofd = |fd: i32, cmd: i32, typ: i32| {
            // SAFETY: an all-zero flock is valid; it outlives the call.
            let mut fl: libc::flock = unsafe { std::mem::zeroed() };
            fl.l_type = typ as i16;
            // SAFETY: fcntl on an open descriptor with a valid flock.
            unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) }
        };
        assert_eq!(ofd(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK), 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let path2 = path.clone();
        let waiter = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let f = std::fs::OpenOptions::new().read(true).write(true).open(path2).unwrap();
            ofd(f.as_raw_fd(), libc::F_OFD_SETLKW, libc::F_WRLCK)
        });
        let tid = rx.recv().unwrap();
        let files = SyscallFiles::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while files.lock_flavor(tid) != Some(LockFlavor::Ofd) {
            assert!(std::time::Instant::now() < deadline, "never saw the thread block in F_OFD_SETLKW");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(files.lock_flavor(tid), Some(LockFlavor::Ofd), "read again through the kept file");
        assert_eq!(ofd(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_UNLCK), 0);
        assert_eq!(waiter.join().unwrap(), 0);
        assert_eq!(files.lock_flavor(tid), None, "a thread that exited reports nothing");
    }

    #[test]
    fn pending_signals_that_interrupt() {
        let status = |pnd: u64, shd: u64, blk: u64, cgt: u64| {
            format!("Name:\tx\nSigQ:\t0/1\nSigPnd:\t{pnd:016x}\nShdPnd:\t{shd:016x}\nSigBlk:\t{blk:016x}\nSigIgn:\t0000000000000000\nSigCgt:\t{cgt:016x}\n")
        };
        let bit = |s: i32| 1u64 << (s - 1);
        assert!(!signal_pending_in(&status(0, 0, 0, 0)));
        // A caught SIGUSR1 interrupts, blocked it does not.
        assert!(signal_pending_in(&status(bit(libc::SIGUSR1), 0, 0, bit(libc::SIGUSR1))));
        assert!(!signal_pending_in(&status(bit(libc::SIGUSR1), 0, bit(libc::SIGUSR1), bit(libc::SIGUSR1))));
        // SIGKILL, process-wide, is fatal.
        assert!(signal_pending_in(&status(0, bit(libc::SIGKILL), 0, 0)));
        // An uncaught SIGCHLD or SIGCONT does not interrupt; a caught one does.
        assert!(!signal_pending_in(&status(bit(libc::SIGCHLD), 0, 0, 0)));
        assert!(!signal_pending_in(&status(0, bit(libc::SIGCONT), 0, 0)));
        assert!(signal_pending_in(&status(bit(libc::SIGCHLD), 0, 0, bit(libc::SIGCHLD))));
        assert!(!signal_pending_in(&status(0, bit(libc::SIGSTOP), 0, 0)));
    }
}
