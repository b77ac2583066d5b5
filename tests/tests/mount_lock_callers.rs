//! What the mount learns about a waiting caller from `/proc` (
//! `mount/src/caller.rs`): a process-directed signal that another thread of
//! the process can take does not end an `F_SETLKW` with `EINTR`; one sent
//! to the waiting thread itself does.

use std::time::{Duration, Instant};

use citronfs_mount::caller::{interrupted, Tid};
use citronfs_tests::probe::Probe;
use citronfs_tests::TestCluster;

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
/// A failure bound only: how long the kernel may take to show a state.
const BOUND: Duration = Duration::from_secs(30);

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + BOUND;
    while !f() {
        assert!(Instant::now() < end, "{what}: not seen in {BOUND:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `pid`'s main thread is inside fcntl (blocked in F_SETLKW).
fn in_fcntl(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/syscall"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse::<i64>().ok()))
        == Some(libc::SYS_fcntl)
}

fn shared_pending(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("ShdPnd:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0)
}

/// The signal lines of every thread of `pid`, for a failure message.
fn threads_of(pid: u32) -> String {
    let mut out = String::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let lines: Vec<&str> = status
            .lines()
            .filter(|l| l.starts_with("Sig") || l.starts_with("ShdPnd") || l.starts_with("State"))
            .collect();
        out += &format!("{:?}: {}\n", t.file_name(), lines.join(" | "));
    }
    out
}

/// A cluster with one mount, where p holds a write lock on f's bytes 0..10
/// and q, which catches SIGUSR1 and has a second thread that does not block
/// it, waits in F_SETLKW for the same bytes.
struct Waiting {
    cluster: TestCluster,
    mount: citronfs_tests::TestMount,
    p: Probe,
    pf: i32,
    q: Probe,
}

fn waiting() -> Waiting {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let mount = cluster.mount();
    std::fs::write(mount.path("f"), b"x").unwrap();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&mount.path("f"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&mount.path("f"));
    assert_eq!(q.ask("catch-usr1"), "ok");
    assert_eq!(q.ask("spare-thread"), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    q.send(&format!("setlkw {qf} w 0 10"));
    until("q blocked in F_SETLKW", || in_fcntl(q.pid));
    Waiting { cluster, mount, p, pf, q }
}

/// q waits in F_SETLKW for p's lock, catching SIGUSR1, with a second
/// thread that does not block it. `kill(q, SIGUSR1)` leaves the signal in
/// the process's queue (the kernel marked the waiting thread, which it
/// cannot wake from FUSE's wait): the spare thread could take it, so the
/// wait goes on, and is granted when p unlocks.
#[test]
fn a_process_directed_signal_another_thread_can_take_does_not_interrupt() {
    let Waiting { cluster: _c, mount: _a, mut p, pf, q } = waiting();
    q.signal(libc::SIGUSR1);
    let usr1 = 1u64 << (libc::SIGUSR1 - 1);
    until("SIGUSR1 pending for q's process", || shared_pending(q.pid) & usr1 != 0);
    // The probe the mount's waiter asks every few milliseconds.
    let interrupted_now = interrupted(Tid(q.pid));
    assert!(!interrupted_now, "a signal the spare thread can take ended the wait:\n{}", threads_of(q.pid));
    assert_eq!(p.ask(&format!("setlk {pf} u 0 10")), "ok");
    assert_eq!(q.answer(), "ok", "granted, not interrupted");
}

/// The same waiter, signalled through its own thread (`tgkill`): the
/// signal is the waiting thread's, so the wait ends with EINTR.
#[test]
fn a_signal_sent_to_the_waiting_thread_interrupts() {
    let Waiting { cluster: _c, mount: _a, mut p, pf, q } = waiting();
    // SAFETY: a signal to the main thread of our own child process.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, q.pid as i64, q.pid as i64, libc::SIGUSR1 as i64) };
    assert_eq!(r, 0);
    assert_eq!(q.answer(), "err EINTR");
    assert_eq!(p.ask(&format!("setlk {pf} u 0 10")), "ok");
    assert_eq!(p.ask(&format!("getlk {pf} w 0 10")), "unlocked", "the interrupted wait left nothing");
}

/// A caller outside the daemon's pid namespace comes with tid 0, which
/// `/proc` cannot name: it is not taken for interrupted (before, every
/// such wait was answered EINTR at once).
#[test]
fn tid_zero_is_not_interrupted() {
    assert!(!interrupted(Tid(0)));
}
