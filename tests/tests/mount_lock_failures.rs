//! Client failure and locks (DESIGN.md §6): a mount that dies or
//! stops answering loses its lease; the meta-server removes its lock
//! records, which wakes the waiters it blocked, within 2 × lease plus the
//! fence delay (removing them takes the records' range lock, and a range
//! lock the dead mount held is taken over only a fence delay after its
//! own lock lease: the lease ordering); a fenced mount answers EIO for lock and I/O
//! calls on what it had open and never writes under a lock it lost.

use std::time::{Duration, Instant};

use citronfs_core::locks::guard::fence_delay_for;
use citronfs_tests::probe::Probe;
use citronfs_tests::{ProcessMount, TestCluster, TEST_LEASE};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const MOUNT_WORKER: &str = env!("CARGO_BIN_EXE_mount-worker");

/// How long after its death a mount's POSIX locks may take to go (module
/// comment).
fn release_bound() -> Duration {
    2 * TEST_LEASE + fence_delay_for(TEST_LEASE)
}

/// A mount of `cluster` served by a process of its own.
fn process_mount(cluster: &TestCluster) -> ProcessMount {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(MOUNT_WORKER);
    cmd.arg(cluster.meta.local_addr().to_string()).arg(dir.path());
    ProcessMount::start(cmd, dir, "mounted")
}

#[test]
fn a_killed_mount_loses_its_locks_to_the_other_mount_within_two_leases() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let doomed = process_mount(&cluster);
    let survivor = cluster.mount();
    std::fs::write(survivor.path("f"), b"x").unwrap();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&doomed.path("f"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&survivor.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 0")), "ok");
    assert_eq!(p.ask(&format!("flock {pf} ex")), "ok");
    assert_eq!(q.ask(&format!("getlk {qf} w 10 1")), format!("w 0 0 {}", p.pid));
    q.send(&format!("setlkw {qf} w 10 1"));
    assert_eq!(q.answer_within(Duration::from_millis(300)), None, "p holds it");
    // The whole node goes: its daemon is SIGKILLed (its processes' calls now
    // fail, and it sends no more heartbeats).
    let killed = Instant::now();
    doomed.signal(libc::SIGKILL);
    assert_eq!(q.answer(), "ok");
    let waited = killed.elapsed();
    assert!(
        waited < release_bound(),
        "the dead mount's lock went after {waited:?}, over {:?}",
        release_bound()
    );
    // Its flock went too.
    assert_eq!(q.ask(&format!("flock {qf} ex nb")), "ok");
    eprintln!("released {waited:?} after the kill (lease {TEST_LEASE:?})");
    p.kill();
}

#[test]
fn a_stopped_mount_is_fenced_and_never_writes_under_a_lock_it_lost() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let stalled = process_mount(&cluster);
    let other = cluster.mount();
    std::fs::write(other.path("f"), b"0000").unwrap();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&stalled.path("f"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&other.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 4")), "ok");
    // The node stops answering (as if cut off the network): no heartbeat.
    stalled.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    assert_eq!(q.ask(&format!("setlkw {qf} w 0 4")), "ok");
    let waited = stopped.elapsed();
    assert!(
        waited < release_bound(),
        "the fenced mount's lock went after {waited:?}, over {:?}",
        release_bound()
    );
    assert_eq!(q.ask(&format!("write {qf} 0 qqqq")), "ok");
    // The node comes back, still believing it holds the lock: its writes
    // and lock calls through what it had open fail instead of clobbering.
    stalled.signal(libc::SIGCONT);
    assert_eq!(p.ask(&format!("write {pf} 0 pppp")), "err EIO");
    assert_eq!(p.ask(&format!("setlk {pf} u 0 4")), "err EIO");
    assert_eq!(std::fs::read(other.path("f")).unwrap(), b"qqqq", "the fenced mount wrote under a lost lock");
    // Once it has registered again, a new open works normally.
    let t = Instant::now();
    loop {
        let mut r = Probe::spawn(PROBE);
        let rf = r.ask(&format!("open {}", stalled.path("f").display()));
        if let Some(fd) = rf.strip_prefix("fd ") {
            if r.ask(&format!("getlk {fd} w 0 1")) == format!("w 0 4 {}", q.pid) {
                break;
            }
        }
        assert!(t.elapsed() < 10 * TEST_LEASE, "the fenced mount never recovered: {rf}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A grant to a waiter whose whole mount then dies, and a wait of that
/// mount still pending, are both removed by the lease cleanup (no
/// orphaned locks across a fence). A single killed waiter process on a live mount cannot leave
/// such a grant: on this kernel (6.18) a FUSE request the daemon has read
/// is not abandoned when its caller gets SIGKILL — the caller waits in D
/// state for the answer, and its close (flush) comes after it, releasing
/// the grant — so only the death of the whole mount orphans a grant, and
/// the lease covers that.
#[test]
fn a_grant_to_a_waiter_whose_mount_died_is_released_by_the_lease() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let doomed = process_mount(&cluster);
    let survivor = cluster.mount();
    std::fs::write(survivor.path("f"), b"x").unwrap();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&survivor.path("f"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&doomed.path("f"));
    let mut r = Probe::spawn(PROBE);
    let rf = r.open(&doomed.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 10")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w 20 10")), "ok");
    q.send(&format!("setlkw {qf} w 0 10"));
    r.send(&format!("setlkw {rf} w 20 10"));
    assert_eq!(q.answer_within(Duration::from_millis(300)), None, "p holds 0..10");
    // q's wait is granted; r's still waits.
    assert_eq!(p.ask(&format!("setlk {pf} u 0 10")), "ok");
    assert_eq!(q.answer(), "ok");
    assert_eq!(p.ask(&format!("getlk {pf} w 0 10")), format!("w 0 10 {}", q.pid));
    let doomed_client = {
        let records =
            survivor.client.lock_records(citronfs_core::types::Ino(ino_of(&survivor.path("f")))).unwrap();
        records.iter().find(|l| l.pid == q.pid).expect("q's granted record").owner.client
    };
    doomed.signal(libc::SIGKILL);
    // p takes the granted range (and r's wait does not stand in its way).
    assert_eq!(p.ask(&format!("setlkw {pf} w 0 30")), "ok");
    let ino = citronfs_core::types::Ino(ino_of(&survivor.path("f")));
    let t = Instant::now();
    loop {
        let left: Vec<_> = survivor
            .client
            .lock_records(ino)
            .unwrap()
            .into_iter()
            .filter(|l| l.owner.client == doomed_client)
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(t.elapsed() < 4 * TEST_LEASE, "records of the dead mount are left: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    q.kill();
    r.kill();
}

fn ino_of(path: &std::path::Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap())
}
