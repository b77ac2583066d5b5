//! DSLR under stress (several processes × threads, both backends), through a
//! counter reset (§4.9), and with a dead holder (§4.7).

use std::time::{Duration, Instant};

use citron_lock::dslr::{DslrConfig, DslrLock, DslrWord, COUNT_MAX};
use citron_lock::rdma::{Node, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::{lock_stress, spawn_worker, wait_all, Backend, TestFabric, BACKENDS, TEST_REGION};

fn lock_addr() -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, lock_stress::LOCK_AT)
}

#[test]
fn readers_share_writers_exclude_across_processes() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let iterations: u64 = if backend == Backend::Shm { 3000 } else { 300 };
        let exe = env!("CARGO_BIN_EXE_lock-stress-worker");
        let workers: Vec<_> = (0..2u64)
            .map(|p| {
                let args = [
                    "dslr".to_string(),
                    fabric.addr.to_string(),
                    "3".into(),
                    iterations.to_string(),
                    "80".into(),
                    p.to_string(),
                ];
                spawn_worker(exe, &args)
            })
            .collect();
        let node = Node::join(&fabric.addr).unwrap();
        std::thread::scope(|s| {
            for t in 0..2 {
                let node = node.clone();
                s.spawn(move || {
                    let ep = node.endpoint().unwrap();
                    let mut lock =
                        DslrLock::new(lock_addr(), DslrConfig::from_rtt(Duration::from_micros(10)));
                    lock_stress::run(&ep, &mut lock, iterations, 80, 1000 + t);
                });
            }
        });
        wait_all(workers);
        let ep = node.endpoint().unwrap();
        let (done, overlaps) = lock_stress::totals(&ep);
        assert_eq!(done, 8 * iterations, "{backend:?}: every acquisition completed");
        assert!(overlaps > 0, "{backend:?}: readers never overlapped");
        let w = DslrWord(ep.read_u64(lock_addr()).unwrap());
        assert_eq!((w.nx(), w.ns()), (w.maxx(), w.maxs()), "{backend:?}: idle at the end: {w:?}");
    }
}

#[test]
fn counters_reset_before_overflow() {
    // More than 2 × COUNT_MAX tickets of each kind through one lock.
    let fabric = TestFabric::new(Backend::Shm, 1 << 20);
    let node = Node::join(&fabric.addr).unwrap();
    let per_thread = COUNT_MAX + COUNT_MAX / 2;
    std::thread::scope(|s| {
        for t in 0..2 {
            let node = node.clone();
            s.spawn(move || {
                let ep = node.endpoint().unwrap();
                let mut lock = DslrLock::new(lock_addr(), DslrConfig::from_rtt(Duration::from_micros(1)));
                lock_stress::run(&ep, &mut lock, per_thread, 50, 7 + t);
            });
        }
    });
    let ep = node.endpoint().unwrap();
    let (done, _) = lock_stress::totals(&ep);
    assert_eq!(done, 2 * per_thread);
    let w = DslrWord(ep.read_u64(lock_addr()).unwrap());
    // 3 × COUNT_MAX tickets were taken; the counters are far below that.
    assert!(w.maxx() + w.maxs() < 2 * COUNT_MAX, "no reset happened: {w:?}");
    assert_eq!((w.nx(), w.ns()), (w.maxx(), w.maxs()));
}

#[test]
fn a_dead_holder_is_reset_after_twice_the_lease() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let config = DslrConfig { omega: Duration::from_micros(5), lease: Duration::from_millis(100) };
        // Holds exclusively and dies (never releases).
        let dead_ep = node.endpoint().unwrap();
        let mut dead = DslrLock::new(lock_addr(), config);
        dead.acquire(&dead_ep, Mode::Exclusive).unwrap();
        let ep = node.endpoint().unwrap();
        let t = Instant::now();
        let mut survivor = DslrLock::new(lock_addr(), config);
        survivor.acquire(&ep, Mode::Exclusive).unwrap();
        let waited = t.elapsed();
        survivor.release(&ep).unwrap();
        assert!(survivor.resets > 0, "{backend:?}");
        println!("{backend:?}: acquired after {waited:?} (lease {:?})", config.lease);
        // The lock works normally afterwards.
        let mut again = DslrLock::new(lock_addr(), config);
        again.acquire(&ep, Mode::Shared).unwrap();
        again.release(&ep).unwrap();
        // `dead` never released: it is gone, as a crashed client would be.
        let _ = (dead, dead_ep);
    }
}

/// §4.7 with real crashes: a process SIGKILLed while holding, and one
/// SIGKILLed while queued behind it; a survivor gets the lock once their
/// tickets have been silent for twice the lease (bounded by a few leases).
#[test]
fn processes_killed_holding_and_queued_are_recovered() {
    use citronfs_tests::Watched;
    let exe = env!("CARGO_BIN_EXE_lock-hold-worker");
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let lease_ms = 100;
        let args = |mode: &str| {
            vec!["dslr".to_string(), fabric.addr.to_string(), mode.to_string(), lease_ms.to_string()]
        };
        let mut holder = Watched::spawn(exe, &args("exclusive"));
        holder.wait_for("held");
        let mut queued = Watched::spawn(exe, &args("exclusive"));
        queued.wait_for("acquiring");
        std::thread::sleep(Duration::from_millis(20)); // let it take its ticket
        holder.kill();
        queued.kill();
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let config = DslrConfig { omega: Duration::from_micros(5), lease: Duration::from_millis(lease_ms) };
        let t = Instant::now();
        let mut survivor = DslrLock::new(lock_addr(), config);
        survivor.acquire(&ep, Mode::Exclusive).unwrap();
        survivor.release(&ep).unwrap();
        println!("{backend:?}: survivor acquired after {:?} ({} resets)", t.elapsed(), survivor.resets);
        assert!(survivor.resets >= 1);
    }
}
