//! fcntl and flock locks across mounts: every semantic checked
//! from two mounts of one cluster, each a separate client, with each lock
//! owner a separate `lock-probe` process. Both mounts use the shm backend
//! unless a test says otherwise.

use std::time::{Duration, Instant};

use citronfs_tests::probe::Probe;
use citronfs_tests::{TestCluster, TestMount};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
/// Long enough that an answer that should not come would have come.
const QUIET: Duration = Duration::from_millis(400);

fn cluster() -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = c.mount();
    let b = c.mount();
    (c, a, b)
}

/// A probe with `path` open; returns it and the descriptor.
fn probe_on(path: &std::path::Path) -> (Probe, i32) {
    let mut p = Probe::spawn(PROBE);
    let fd = p.open(path);
    (p, fd)
}

#[test]
fn conflicts_across_mounts_and_getlk_reports_the_holder() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"0123456789").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} w 5 10")), "err EAGAIN");
    assert_eq!(q.ask(&format!("setlk {qf} r 9 1")), "err EAGAIN");
    assert_eq!(q.ask(&format!("setlk {qf} w 10 5")), "ok", "bytes past the lock are free");
    // F_GETLK from the other mount: type, start, length and pid of the holder.
    assert_eq!(q.ask(&format!("getlk {qf} r 3 1")), format!("w 0 10 {}", p.pid));
    assert_eq!(p.ask(&format!("getlk {pf} w 12 1")), format!("w 10 5 {}", q.pid));
    assert_eq!(p.ask(&format!("getlk {pf} w 20 1")), "unlocked");
    // The holder's own locks never conflict with it.
    assert_eq!(p.ask(&format!("getlk {pf} w 0 10")), "unlocked");
    // Read locks share; a write lock is refused while any reader holds.
    assert_eq!(p.ask(&format!("setlk {pf} r 0 10")), "ok", "atomic downgrade");
    assert_eq!(q.ask(&format!("setlk {qf} r 0 5")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "err EAGAIN", "upgrade blocked by the reader");
    assert_eq!(q.ask(&format!("getlk {qf} w 0 1")), format!("r 0 10 {}", p.pid));
}

#[test]
fn unlock_splits_conversion_is_atomic_and_to_eof_locks_reach_everything() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 100")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} u 40 20")), "ok", "unlock the middle");
    assert_eq!(q.ask(&format!("setlk {qf} w 40 20")), "ok", "the hole is free");
    assert_eq!(q.ask(&format!("getlk {qf} w 0 100")), format!("w 0 40 {}", p.pid), "left piece");
    assert_eq!(q.ask(&format!("getlk {qf} w 60 100")), format!("w 60 40 {}", p.pid), "right piece");
    // A conversion that is refused leaves the old locks as they were: p
    // asks for [30, 70) exclusive, which overlaps q's hole; p keeps its read
    // locks on [0,40) and [60,100) and gets nothing new.
    assert_eq!(p.ask(&format!("setlk {pf} r 0 100")), "err EAGAIN", "q holds the hole");
    assert_eq!(p.ask(&format!("setlk {pf} r 0 40")), "ok", "downgrade the left piece");
    assert_eq!(p.ask(&format!("setlk {pf} r 60 40")), "ok", "and the right one");
    assert_eq!(p.ask(&format!("setlk {pf} w 30 40")), "err EAGAIN");
    assert_eq!(q.ask(&format!("getlk {qf} w 35 1")), format!("r 0 40 {}", p.pid));
    assert_eq!(q.ask(&format!("setlk {qf} r 35 1")), "ok", "still only a read lock there");
    assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
    // A lock to end of file (l_len 0) covers any offset.
    assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 1000 0")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} w 5000000000 1")), "err EAGAIN");
    assert_eq!(q.ask(&format!("getlk {qf} r 999999 1")), format!("w 1000 0 {}", p.pid));
    assert_eq!(q.ask(&format!("setlk {qf} w 0 1000")), "ok", "up to the lock is free");
}

#[test]
fn closing_any_descriptor_releases_the_process_locks() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let other = p.open(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} w 0 10")), "err EAGAIN");
    // Close a *different* descriptor of the same file: POSIX releases all
    // of the process's locks on it.
    assert_eq!(p.ask(&format!("close {other}")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} w 0 10")), "ok");
    // And a process that exits loses its locks.
    assert_eq!(q.ask(&format!("setlk {qf} u 0 10")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    p.kill();
    assert_eq!(q.ask(&format!("setlk {qf} w 0 10")), "ok");
}

#[test]
fn setlkw_waits_for_the_other_mount_and_is_woken() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    q.send(&format!("setlkw {qf} w 5 1"));
    assert_eq!(q.answer_within(QUIET), None, "must wait while p holds");
    // Unlocking an unrelated range does not grant it.
    assert_eq!(p.ask(&format!("setlk {pf} u 0 2")), "ok");
    assert_eq!(q.answer_within(QUIET), None);
    let t = Instant::now();
    assert_eq!(p.ask(&format!("setlk {pf} u 2 8")), "ok");
    assert_eq!(q.answer(), "ok");
    let woken = t.elapsed();
    assert!(woken < Duration::from_millis(450), "woken by message, not by the periodic retry: {woken:?}");
    assert_eq!(p.ask(&format!("getlk {pf} r 5 1")), format!("w 5 1 {}", q.pid));
}

#[test]
fn flock_is_shared_or_exclusive_per_open_file_and_goes_at_last_close() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("flock {pf} sh")), "ok");
    assert_eq!(q.ask(&format!("flock {qf} sh nb")), "ok", "shared locks share");
    assert_eq!(q.ask(&format!("flock {qf} ex nb")), "err EAGAIN");
    assert_eq!(q.ask(&format!("flock {qf} un")), "ok");
    assert_eq!(p.ask(&format!("flock {pf} ex")), "ok", "upgrade");
    assert_eq!(q.ask(&format!("flock {qf} sh nb")), "err EAGAIN");
    // flock and fcntl locks do not conflict (Linux).
    assert_eq!(q.ask(&format!("setlk {qf} w 0 0")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
    // The lock belongs to the open file: a dup shares it, and it goes only
    // when the last descriptor of that open file is closed.
    let dup = p.ask(&format!("dup {pf}"));
    let dup: i32 = dup.strip_prefix("fd ").unwrap().parse().unwrap();
    assert_eq!(p.ask(&format!("close {pf}")), "ok");
    assert_eq!(q.ask(&format!("flock {qf} ex nb")), "err EAGAIN", "the dup still holds it");
    // A blocking flock waits and is granted at the last close.
    q.send(&format!("flock {qf} ex"));
    assert_eq!(q.answer_within(QUIET), None);
    assert_eq!(p.ask(&format!("close {dup}")), "ok");
    assert_eq!(q.answer(), "ok");
}

#[test]
fn ofd_locks_belong_to_the_open_file_and_conflict_with_posix_locks() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let second = p.open(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("ofd-setlk {pf} w 0 10")), "ok");
    // Another open file of the same process is another owner.
    assert_eq!(p.ask(&format!("ofd-setlk {second} w 5 1")), "err EAGAIN");
    assert_eq!(q.ask(&format!("setlk {qf} r 0 1")), "err EAGAIN", "OFD and POSIX locks conflict");
    assert_eq!(
        q.ask(&format!("ofd-getlk {qf} w 0 1")).split(' ').take(3).collect::<Vec<_>>(),
        ["w", "0", "10"]
    );
    // Closing another descriptor does not release an OFD lock.
    assert_eq!(p.ask(&format!("close {second}")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} r 0 1")), "err EAGAIN");
    assert_eq!(p.ask(&format!("close {pf}")), "ok");
    // The kernel sends FUSE_RELEASE in the background after the last close
    // returns, so the release may lag the close by a moment.
    let t = Instant::now();
    while q.ask(&format!("setlk {qf} r 0 1")) != "ok" {
        assert!(t.elapsed() < Duration::from_secs(5), "the OFD lock outlived its open file");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_wait_for_cycle_across_two_mounts_is_refused_with_edeadlk() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    std::fs::write(a.path("g"), b"x").unwrap();
    // Within one file: p holds [0,10) and waits for [20,30); q holds
    // [20,30) and asks for [0,10).
    let (mut p, pf) = probe_on(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} w 20 10")), "ok");
    p.send(&format!("setlkw {pf} w 20 10"));
    assert_eq!(p.answer_within(QUIET), None);
    assert_eq!(q.ask(&format!("setlkw {qf} w 0 10")), "err EDEADLK");
    // The refused request left nothing behind; q gives way and p gets in.
    assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
    assert_eq!(p.answer(), "ok");
    // Across files: p holds f, waits for g; q holds g, asks for f.
    let pg = p.open(&a.path("g"));
    let qg = q.open(&b.path("g"));
    assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 0 1")), "ok");
    assert_eq!(q.ask(&format!("setlk {qg} w 0 1")), "ok");
    p.send(&format!("setlkw {pg} w 0 1"));
    assert_eq!(p.answer_within(QUIET), None);
    assert_eq!(q.ask(&format!("setlkw {qf} w 0 1")), "err EDEADLK");
    assert_eq!(q.ask(&format!("setlk {qg} u 0 0")), "ok");
    assert_eq!(p.answer(), "ok");
}

#[test]
fn a_signal_interrupts_setlkw_with_eintr_and_a_killed_waiter_gets_nothing() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&a.path("f"));
    let (mut q, qf) = probe_on(&b.path("f"));
    assert_eq!(q.ask("catch-usr1"), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    q.send(&format!("setlkw {qf} w 0 10"));
    assert_eq!(q.answer_within(QUIET), None);
    q.signal(libc::SIGUSR1);
    assert_eq!(q.answer(), "err EINTR");
    // The interrupted request is gone: after p unlocks, nobody holds.
    assert_eq!(p.ask(&format!("setlk {pf} u 0 10")), "ok");
    assert_eq!(p.ask(&format!("getlk {pf} w 0 10")), "unlocked");
    // A waiter killed while it waits must never end up holding the lock.
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    let (mut r, rf) = probe_on(&b.path("f"));
    r.send(&format!("setlkw {rf} w 0 10"));
    assert_eq!(r.answer_within(QUIET), None);
    r.kill();
    assert_eq!(p.ask(&format!("setlk {pf} u 0 10")), "ok");
    std::thread::sleep(QUIET);
    assert_eq!(q.ask(&format!("setlk {qf} w 0 10")), "ok", "the killed waiter holds nothing");
}

/// 4 processes on 2 mounts increment a counter in the file under F_SETLKW:
/// no update is lost (the data path is uncached, so what one mount wrote
/// under the lock is what the next holder reads).
#[test]
fn a_counter_under_setlkw_from_four_processes_on_two_mounts_loses_no_update() {
    const ROUNDS: u64 = 150;
    let (_c, a, b) = cluster();
    std::fs::write(a.path("counter"), b"").unwrap();
    let mut probes: Vec<(Probe, i32)> =
        (0..4).map(|i| probe_on(&if i % 2 == 0 { a.path("counter") } else { b.path("counter") })).collect();
    // Pipeline the commands: each probe runs its rounds without waiting for us.
    for (p, fd) in probes.iter_mut() {
        for _ in 0..ROUNDS {
            p.send(&format!("setlkw {fd} w 0 1"));
            p.send(&format!("incr {fd} 0"));
            p.send(&format!("setlk {fd} u 0 1"));
        }
    }
    for (p, _) in probes.iter() {
        for _ in 0..ROUNDS {
            assert_eq!(p.answer(), "ok");
            assert!(p.answer().starts_with("ok "));
            assert_eq!(p.answer(), "ok");
        }
    }
    let text = std::fs::read_to_string(b.path("counter")).unwrap();
    assert_eq!(text.trim_matches('\0').parse::<u64>().unwrap(), 4 * ROUNDS);
}

/// More processes wait in F_SETLKW than the mount has FUSE workers (4): the
/// mount still serves everything else at once, and every waiter is granted
/// in turn when the holder lets go.
#[test]
fn blocked_setlkw_calls_occupy_no_fuse_worker() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), b"x").unwrap();
    let (mut p, pf) = probe_on(&b.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 0")), "ok");
    let mut waiters: Vec<(Probe, i32)> = (0..8).map(|_| probe_on(&a.path("f"))).collect();
    for (w, fd) in waiters.iter_mut() {
        w.send(&format!("setlkw {fd} w 0 1"));
    }
    std::thread::sleep(QUIET);
    for (w, _) in &waiters {
        assert_eq!(w.answer_within(Duration::ZERO), None);
    }
    // Eight waiters on a mount with four workers: it still answers.
    let t = Instant::now();
    std::fs::write(a.path("other"), b"served").unwrap();
    assert_eq!(std::fs::read(a.path("other")).unwrap(), b"served");
    assert!(t.elapsed() < Duration::from_secs(2), "the mount stalled behind its waiters: {:?}", t.elapsed());
    assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
    // They are granted one at a time, each after the previous unlocks.
    let mut granted = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while granted < waiters.len() {
        assert!(Instant::now() < deadline, "only {granted} of {} waiters were granted", waiters.len());
        let i = waiters
            .iter()
            .position(|(w, _)| w.answer_within(Duration::from_millis(20)).is_some())
            .unwrap_or(usize::MAX);
        if i == usize::MAX {
            continue;
        }
        granted += 1;
        let (w, fd) = &mut waiters[i];
        assert_eq!(w.ask(&format!("setlk {fd} u 0 1")), "ok");
    }
}

/// Distance: fcntl semantics between a near mount and one 0.1, 1 and 5 ms
/// farther from the servers (tcp, every round trip longer): conflicts both
/// ways, F_GETLK with the holder's pid, split and atomic conversion, a
/// F_SETLKW woken across the distance, EDEADLK across it, flock.
#[test]
fn fcntl_semantics_hold_between_a_near_and_a_far_mount() {
    const HANG: Duration = Duration::from_secs(300);
    for ms in [0.1, 1.0, 5.0] {
        let t = Instant::now();
        let c = TestCluster::start(1, 64 << 20, 1 << 20);
        let near = c.mount();
        let far = c.mount_far(Duration::from_secs_f64(ms / 1000.0));
        let _guards = (near.watchdog(HANG), far.watchdog(HANG));
        std::fs::write(near.path("f"), b"0123456789").unwrap();
        let (mut p, pf) = probe_on(&near.path("f"));
        let (mut q, qf) = probe_on(&far.path("f"));
        // Conflicts and F_GETLK, both ways.
        assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
        assert_eq!(q.ask(&format!("setlk {qf} w 5 10")), "err EAGAIN", "+{ms} ms");
        assert_eq!(q.ask(&format!("setlk {qf} w 10 5")), "ok");
        assert_eq!(q.ask(&format!("getlk {qf} r 3 1")), format!("w 0 10 {}", p.pid));
        assert_eq!(p.ask(&format!("getlk {pf} w 12 1")), format!("w 10 5 {}", q.pid));
        // Split by an unlock in the middle; a refused conversion changes nothing.
        assert_eq!(p.ask(&format!("setlk {pf} u 4 2")), "ok");
        assert_eq!(q.ask(&format!("getlk {qf} w 0 100")), format!("w 0 4 {}", p.pid));
        assert_eq!(q.ask(&format!("setlk {qf} r 4 2")), "ok", "the hole is free");
        assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "err EAGAIN", "q reads the hole");
        assert_eq!(q.ask(&format!("getlk {qf} w 7 1")), format!("w 6 4 {}", p.pid));
        assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
        // A waiter on the far mount is woken by the near one's unlock, and
        // the other way round.
        q.send(&format!("setlkw {qf} w 0 1"));
        assert_eq!(q.answer_within(QUIET), None, "+{ms} ms: must wait while p holds");
        assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
        assert_eq!(q.answer(), "ok");
        p.send(&format!("setlkw {pf} r 0 1"));
        assert_eq!(p.answer_within(QUIET), None);
        assert_eq!(q.ask(&format!("setlk {qf} u 0 1")), "ok");
        assert_eq!(p.answer(), "ok");
        // A wait-for cycle across the distance is refused.
        assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
        assert_eq!(p.ask(&format!("setlk {pf} w 0 1")), "ok");
        assert_eq!(q.ask(&format!("setlk {qf} w 5 1")), "ok");
        p.send(&format!("setlkw {pf} w 5 1"));
        assert_eq!(p.answer_within(QUIET), None);
        assert_eq!(q.ask(&format!("setlkw {qf} w 0 1")), "err EDEADLK", "+{ms} ms");
        assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
        assert_eq!(p.answer(), "ok");
        // flock across the distance.
        assert_eq!(q.ask(&format!("flock {qf} ex nb")), "ok");
        assert_eq!(p.ask(&format!("flock {pf} sh nb")), "err EAGAIN");
        assert_eq!(q.ask(&format!("flock {qf} un")), "ok");
        assert_eq!(p.ask(&format!("flock {pf} sh nb")), "ok");
        eprintln!("+{ms} ms: fcntl semantics ok in {:?}", t.elapsed());
    }
}

/// Refusals cost nothing lasting, through FUSE: a mount that
/// reaches the servers over tcp refuses F_SETLK thousands of times, with
/// every inode mutex; it opens no connection at the NICs, and then writes,
/// reads and locks normally. (A million below FUSE: `fs_refusals.rs`.)
#[test]
fn refused_setlk_through_a_mount_opens_nothing() {
    use citron_lock::rwlock::Algorithm;
    use citronfs_core::locks::area::LockChoice;
    use std::sync::atomic::Ordering::Relaxed;
    const N: usize = 2_000;
    for inode in [
        Algorithm::ShiftLock,
        Algorithm::Dslr,
        Algorithm::Dql,
        Algorithm::Cas,
        Algorithm::Rpc,
        Algorithm::ALock,
    ] {
        let c = TestCluster::with_locks(LockChoice { inode, ..LockChoice::default() });
        let near = c.mount();
        let far = c.mount_tcp();
        std::fs::write(near.path("f"), b"0123456789").unwrap();
        let (mut p, pf) = probe_on(&near.path("f"));
        let (mut q, qf) = probe_on(&far.path("f"));
        assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
        assert_eq!(q.ask(&format!("setlk {qf} w 0 10")), "err EAGAIN");
        let connections = || {
            c.meta.nic_stats().connections.load(Relaxed)
                + c.data.iter().map(|d| d.nic_stats().connections.load(Relaxed)).sum::<u64>()
        };
        let before = connections();
        for i in 0..N {
            q.send(&format!("setlk {qf} {} 0 10", if i % 2 == 0 { "w" } else { "r" }));
        }
        for _ in 0..N {
            assert_eq!(q.answer(), "err EAGAIN");
        }
        let opened = connections() - before;
        assert_eq!(q.ask(&format!("write {qf} 0 abcd")), "ok", "{inode}: I/O after refusals");
        assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
        assert_eq!(q.ask(&format!("setlk {qf} w 0 10")), "ok", "{inode}");
        assert_eq!(opened, 0, "--inode-lock {inode}: {N} refusals opened {opened} connections");
    }
}
