//! What the daemon learns about the process behind a lock request from
//! `/proc`, because FUSE (as fuser passes it) does not say it:
//!
//! * **Which interface took the lock.** The kernel sends `flock(2)` as a
//!   whole-file lock request whose owner is the open file — like an OFD lock
//!   — and marks it with `FUSE_LK_FLOCK`, which fuser does not pass on. The
//!   caller is blocked inside the system call while we answer, so
//!   `/proc/<tid>/syscall` names it: `flock`, or `fcntl` with `F_OFD_*` or
//!   plain `F_*LK*` commands. The kernel names the call only while the
//!   thread sleeps; one still on its way into FUSE's wait (the daemon read
//!   the request first, or the caller was preempted, or a signal woke it
//!   for a moment) shows as `running` and is read again until it sleeps.
//!
//!   When `/proc` does not say (the caller is outside the daemon's pid
//!   namespace, so FUSE sends tid 0; or it is gone), the call is **refused
//!   with `ENOLCK`** and logged, never guessed: a flock taken for POSIX is
//!   owned by the open file but released only by a close of a POSIX owner
//!   (a process's file table), which never comes, so it would be held until
//!   the file is released everywhere; a POSIX lock taken for flock would
//!   outlive its process's close. Either guess breaks a rule the program
//!   relies on; a clear refusal does not. (A caller already seen making
//!   POSIX calls through the same handle with the same owner is known, see
//!   the mount's `lock_flavor`.)
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
//! # Which pending signals are the waiting thread's
//!
//! `SigPnd` in `/proc/<tid>/status` is the thread's own queue: signals
//! sent to that thread (`tgkill`, `pthread_kill`, a fault). Such a signal
//! can only be taken by this thread, so one it does not block interrupts.
//! `ShdPnd` is the process's queue (`kill`, `sigqueue`, a timer, SIGCHLD):
//! the kernel gives such a signal to any thread that does not block it.
//! It often lands on the waiting thread only because that thread looks
//! idle to the kernel (it sleeps killable in FUSE, so the kernel marks it
//! and cannot wake it) while another thread could run the handler as
//! well. Ending the wait then would turn a signal meant for the process
//! into a failed lock call of one thread. So a process-directed signal
//! interrupts only if every other live thread of the process blocks it
//! (no one else can take it), or if it is fatal and not caught (the whole
//! process is dying: let the waiter go). The other threads' masks are read
//! from `/proc/<tgid>/task/*/status` at the moment of the check; a thread
//! that unblocks the signal later will take it then, and one that blocks
//! it later makes the next check (every few milliseconds) answer `EINTR`.
//!
//! A caller with tid 0 (outside the daemon's pid namespace) cannot be
//! watched: it is never taken for interrupted (before, `/proc/0` did not
//! exist and every such wait was answered `EINTR` at once). Its wait ends
//! with the grant, or when its file is released.
//!
//! `tid` is the request's pid as FUSE sends it: the calling thread's id.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

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

/// How long a caller may show as running before its request is refused.
/// The caller is inside the lock call until we answer, so it goes to sleep
/// in FUSE's wait soon: it ran only because it had not reached the wait
/// yet (the daemon read the request on the other core first, or the
/// caller was preempted on the way, for as long as a busy machine keeps
/// it off a core) or because a signal woke it for a moment.
const RUNNING_BOUND: Duration = Duration::from_secs(10);
/// The first and the longest pause between two reads of a running caller
/// (each pause doubles the last).
const RUNNING_PAUSE_MIN: Duration = Duration::from_micros(20);
const RUNNING_PAUSE_MAX: Duration = Duration::from_millis(2);

/// What one read of `/proc/<tid>/syscall` said.
enum SyscallRead {
    /// The thread sleeps in this call (the file's text).
    Sleeping(File, usize),
    /// The thread is on a core or runnable: the kernel only shows the call
    /// of a sleeping thread.
    Running(File),
    /// The thread is gone.
    Gone,
}

impl SyscallFiles {
    /// The flavour of the lock request the thread `tid` is making right now,
    /// or `None` if `/proc` does not say (the thread is gone, is not in a
    /// call we know, or ran for all of [`RUNNING_BOUND`]).
    pub fn lock_flavor(&self, tid: Tid) -> Option<LockFlavor> {
        if !tid.visible() {
            return None;
        }
        let mut buf = [0u8; 256];
        let mut kept = self.files.lock().remove(&tid.0);
        let deadline = Instant::now() + RUNNING_BOUND;
        let mut pause = RUNNING_PAUSE_MIN;
        let (file, len) = loop {
            match Self::read(tid, kept.take(), &mut buf) {
                SyscallRead::Sleeping(file, len) => break (file, len),
                SyscallRead::Gone => return None,
                SyscallRead::Running(file) => {
                    if Instant::now() >= deadline {
                        log::warn!("thread {} ran for {RUNNING_BOUND:?} inside a lock call", tid.0);
                        return None;
                    }
                    kept = Some(file);
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(RUNNING_PAUSE_MAX);
                }
            }
        };
        let flavor = flavor_of_syscall(std::str::from_utf8(&buf[..len]).ok()?);
        let mut files = self.files.lock();
        if files.len() >= KEPT_FILES {
            files.clear();
        }
        files.insert(tid.0, file);
        flavor
    }

    /// One read of `tid`'s syscall file, through `kept` if it still reads.
    fn read(tid: Tid, kept: Option<File>, buf: &mut [u8]) -> SyscallRead {
        let read = kept.and_then(|f| f.read_at(buf, 0).ok().map(|n| (f, n))).or_else(|| {
            let f = File::open(format!("/proc/{}/syscall", tid.0)).ok()?;
            let n = f.read_at(buf, 0).ok()?;
            Some((f, n))
        });
        match read {
            None => SyscallRead::Gone,
            Some((f, n)) if buf[..n].starts_with(b"running") => SyscallRead::Running(f),
            Some((f, n)) => SyscallRead::Sleeping(f, n),
        }
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

/// A thread id as FUSE sends it (the request's pid); 0 when the caller is
/// outside the daemon's pid namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tid(pub u32);

impl Tid {
    /// Whether `/proc` can name the thread.
    pub fn visible(self) -> bool {
        self.0 != 0
    }
}

/// The signal masks of one thread, from its `/proc/.../status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SignalState {
    /// The thread group (process) id.
    pub tgid: u32,
    /// Pending for this thread only (`SigPnd`).
    pub own: u64,
    /// Pending for the process (`ShdPnd`).
    pub shared: u64,
    pub blocked: u64,
    /// Signals the process catches (`SigCgt`; shared by its threads).
    pub caught: u64,
    /// A zombie or dead thread takes no signal.
    pub dead: bool,
}

impl SignalState {
    pub fn parse(status: &str) -> SignalState {
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim);
        let mask = |key: &str| field(key).and_then(|v| u64::from_str_radix(v, 16).ok()).unwrap_or(0);
        SignalState {
            tgid: field("Tgid:").and_then(|v| v.parse().ok()).unwrap_or(0),
            own: mask("SigPnd:"),
            shared: mask("ShdPnd:"),
            blocked: mask("SigBlk:"),
            caught: mask("SigCgt:"),
            dead: field("State:").is_some_and(|s| s.starts_with('Z') || s.starts_with('X')),
        }
    }

    fn read(path: &str) -> Option<SignalState> {
        std::fs::read_to_string(path).ok().map(|s| Self::parse(&s))
    }
}

/// Whether the thread `tid` has a signal pending that should end its wait
/// with `EINTR` (see the module comment); also true when the thread is
/// gone, never for tid 0.
pub fn interrupted(tid: Tid) -> bool {
    if !tid.visible() {
        return false;
    }
    let Some(me) = SignalState::read(&format!("/proc/{}/status", tid.0)) else {
        return true; // gone
    };
    if me.dead {
        return true;
    }
    let others = || other_threads(tid, me.tgid);
    signal_pending_for(&me, others)
}

/// The signal states of the live threads of process `tgid` other than `tid`.
fn other_threads(tid: Tid, tgid: u32) -> Vec<SignalState> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{tgid}/task")) else { return Vec::new() };
    tasks
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|&t| t != tid.0)
        .filter_map(|t| SignalState::read(&format!("/proc/{tgid}/task/{t}/status")))
        .filter(|s| !s.dead)
        .collect()
}

/// Whether `me` has a signal that is its own to take (module comment);
/// `others` (read only if needed) are the other live threads.
fn signal_pending_for(me: &SignalState, others: impl FnOnce() -> Vec<SignalState>) -> bool {
    // Realtime signals (34 and up) are fatal by default too.
    let fatal = FATAL_BY_DEFAULT | !((1u64 << 33) - 1);
    let takes = |pending: u64| pending & !me.blocked & (me.caught | fatal);
    if takes(me.own) != 0 {
        return true;
    }
    let shared = takes(me.shared);
    if shared == 0 {
        return false;
    }
    if shared & fatal & !me.caught != 0 {
        return true; // uncaught and fatal: the process is dying
    }
    // Caught and process-directed: ours only if nobody else can take it.
    let nobody_else = others().iter().fold(shared, |left, t| left & t.blocked);
    nobody_else != 0
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

    /// A whole-file OFD lock call (`F_OFD_SETLK`, `F_OFD_SETLKW`) of type
    /// `typ` on `fd`: fcntl's answer.
    fn ofd(fd: i32, cmd: i32, typ: i32) -> i32 {
        // SAFETY: an all-zero flock is valid; it outlives the call.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        // SAFETY: fcntl on an open descriptor with a valid flock.
        unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) }
    }

    /// A file `f` in a fresh directory, open and write-locked (OFD) through
    /// the returned handle.
    fn write_locked_file() -> (tempfile::TempDir, std::fs::File) {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let holder = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        assert_eq!(ofd(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_WRLCK), 0);
        (dir, holder)
    }

    /// A thread blocked in `F_OFD_SETLKW` is seen as making an OFD call, on
    /// the first read and through the kept file; once it has exited, its
    /// kept file fails and nothing is reported.
    #[test]
    fn a_blocked_thread_is_read_through_its_kept_file() {
        use std::os::fd::AsRawFd;
        let (dir, holder) = write_locked_file();
        let path = dir.path().join("f");
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
        while files.lock_flavor(Tid(tid)) != Some(LockFlavor::Ofd) {
            assert!(std::time::Instant::now() < deadline, "never saw the thread block in F_OFD_SETLKW");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(files.lock_flavor(Tid(tid)), Some(LockFlavor::Ofd), "read again through the kept file");
        assert_eq!(ofd(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_UNLCK), 0);
        assert_eq!(waiter.join().unwrap(), 0);
        assert_eq!(files.lock_flavor(Tid(tid)), None, "a thread that exited reports nothing");
    }

    /// A caller that still runs when its request is read (it has not gone
    /// to sleep in FUSE's wait yet: on a busy machine it may be preempted
    /// there for a while, or a signal woke it for a moment) shows as
    /// `running` in `/proc/<tid>/syscall`; its flavour is read once it
    /// sleeps, not refused.
    #[test]
    fn a_caller_still_running_is_read_once_it_sleeps() {
        use std::os::fd::AsRawFd;
        let (dir, holder) = write_locked_file();
        let path = dir.path().join("f");
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            // Running, in no system call, for a while: as a caller that
            // was preempted before it went to sleep.
            let until = std::time::Instant::now() + std::time::Duration::from_millis(200);
            while std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
            ofd(f.as_raw_fd(), libc::F_OFD_SETLKW, libc::F_WRLCK)
        });
        let tid = Tid(rx.recv().unwrap());
        assert_eq!(SyscallFiles::default().lock_flavor(tid), Some(LockFlavor::Ofd));
        assert_eq!(ofd(holder.as_raw_fd(), libc::F_OFD_SETLK, libc::F_UNLCK), 0);
        assert_eq!(waiter.join().unwrap(), 0);
    }

    fn state(own: u64, shared: u64, blocked: u64, caught: u64) -> SignalState {
        SignalState { tgid: 1, own, shared, blocked, caught, dead: false }
    }

    fn bit(s: i32) -> u64 {
        1u64 << (s - 1)
    }

    #[test]
    fn status_is_parsed() {
        let text = "Name:\tx\nState:\tS (sleeping)\nTgid:\t42\nSigQ:\t0/1\nSigPnd:\t0000000000000200\nShdPnd:\t0000000000000001\nSigBlk:\t0000000000000002\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000000200\n";
        assert_eq!(
            SignalState::parse(text),
            SignalState { tgid: 42, own: 0x200, shared: 1, blocked: 2, caught: 0x200, dead: false }
        );
        assert!(SignalState::parse("State:\tZ (zombie)\n").dead);
    }

    #[test]
    fn pending_signals_that_interrupt() {
        let alone = Vec::new;
        assert!(!signal_pending_for(&state(0, 0, 0, 0), alone));
        // A caught SIGUSR1 interrupts, blocked it does not.
        let usr1 = bit(libc::SIGUSR1);
        assert!(signal_pending_for(&state(usr1, 0, 0, usr1), alone));
        assert!(!signal_pending_for(&state(usr1, 0, usr1, usr1), alone));
        // SIGKILL, process-wide, is fatal.
        assert!(signal_pending_for(&state(0, bit(libc::SIGKILL), 0, 0), alone));
        // An uncaught SIGCHLD or SIGCONT does not interrupt; a caught one does.
        assert!(!signal_pending_for(&state(bit(libc::SIGCHLD), 0, 0, 0), alone));
        assert!(!signal_pending_for(&state(0, bit(libc::SIGCONT), 0, 0), alone));
        assert!(signal_pending_for(&state(bit(libc::SIGCHLD), 0, 0, bit(libc::SIGCHLD)), alone));
        assert!(!signal_pending_for(&state(0, bit(libc::SIGSTOP), 0, 0), alone));
    }

    /// A caught process-directed signal is the waiter's only if every other
    /// thread blocks it; a thread-directed one is always its own; an
    /// uncaught fatal one ends the wait whoever takes it.
    #[test]
    fn process_directed_signals_go_to_threads_that_can_take_them() {
        let usr1 = bit(libc::SIGUSR1);
        let other = |blocked| vec![state(0, usr1, blocked, usr1)];
        assert!(!signal_pending_for(&state(0, usr1, 0, usr1), || other(0)), "another thread takes it");
        assert!(signal_pending_for(&state(0, usr1, 0, usr1), || other(usr1)), "everyone else blocks it");
        assert!(signal_pending_for(&state(0, usr1, 0, usr1), Vec::new), "no other thread");
        assert!(signal_pending_for(&state(usr1, 0, 0, usr1), || other(0)), "sent to this thread");
        assert!(signal_pending_for(&state(0, bit(libc::SIGTERM), 0, 0), || other(0)), "the process dies");
    }

    /// A caller outside the daemon's pid namespace (tid 0) cannot be
    /// watched and is not taken for interrupted.
    #[test]
    fn tid_zero_is_never_interrupted() {
        assert!(!interrupted(Tid(0)));
    }

    /// A thread that has exited is let go.
    ///
    /// `join` returns when the kernel clears the thread's tid word, in
    /// `exit_mm`, before `exit_notify` reaps it: for that window, longer on
    /// a busy machine, the thread still shows as running in /proc. The waiter
    /// polls, so what matters (and what is asserted) is that the gone thread
    /// is seen as interrupted once the kernel has finished with it.
    #[test]
    fn a_gone_thread_is_interrupted() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
        })
        .join()
        .unwrap();
        let tid = Tid(rx.recv().unwrap());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !interrupted(tid) {
            assert!(std::time::Instant::now() < deadline, "an exited thread was never let go");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
