//! The lock factory (`citron_lock::lock_host`): every algorithm this binary
//! has, opened through `open_lock` with a `LockHost`'s info handed to other
//! processes as hex, passes the cross-process oracle of `lock_stress` (no
//! writer beside anyone, no reader beside a writer, every acquisition
//! completes, nobody left inside) on shm and tcp, write-intensive and
//! read-intensive; algorithms that share readers are seen to overlap them.
//! The ShiftLock runs need no recovery (a lost handover would show as one).
//! Algorithms not built yet are refused with `NotBuilt`, and misuse of the
//! factory is refused before any verb.

use std::process::Child;
use std::time::{Duration, Instant};

use citron_lock::lock_host::{open_lock, LockContext, LockHost, LockHostConfig, LockTiming};
use citron_lock::rdma::{Node, RemoteAddr};
use citron_lock::rwlock::{Algorithm, LockError, Mode, RwLockGuard};
use citronfs_tests::lock_stress::{self, DONE_AT, LOCK_AT};
use citronfs_tests::{spawn_worker, Backend, TestFabric, BACKENDS, TEST_REGION};

const WORKER: &str = env!("CARGO_BIN_EXE_lock-stress-worker");
/// The lock host's area, below the lock (`LOCK_AT` = 4096) and the oracle.
const HOST_AREA_AT: u64 = 1024;
const PROCESSES: u64 = 2;
const THREADS: u64 = 3;
/// A worker that has not finished by then is hung: killed, and the test fails.
const WATCHDOG: Duration = Duration::from_secs(180);

fn at(offset: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, offset)
}

/// Waits for every child, killing all of them if one outlives the watchdog.
fn wait_bounded(mut children: Vec<Child>, what: &str) {
    let deadline = Instant::now() + WATCHDOG;
    let mut failures = Vec::new();
    while !children.is_empty() {
        // A child whose `try_wait` returned its status has been reaped.
        children.retain_mut(|c| match c.try_wait().expect("poll worker") {
            Some(status) => {
                if !status.success() {
                    failures.push(status);
                }
                false
            }
            None => true,
        });
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("{what}: {} workers still running after {WATCHDOG:?}", children.len());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(failures.is_empty(), "{what}: workers failed: {failures:?}");
}

#[test]
fn every_built_algorithm_passes_the_oracle_through_the_factory() {
    assert!(
        LockHostConfig::default().area_bytes() + HOST_AREA_AT <= LOCK_AT,
        "test layout: the host area overlaps the lock"
    );
    for backend in BACKENDS {
        let iterations: u64 = match backend {
            Backend::Shm => 2000,
            Backend::Tcp | Backend::Ib => 300,
        };
        for alg in Algorithm::BUILT {
            for read_percent in [50, 95] {
                // A fresh fabric each time: the lock word starts zeroed.
                let fabric = TestFabric::new(backend, 1 << 17);
                let node = Node::join(&fabric.addr).unwrap();
                let host = LockHost::start(&node, at(HOST_AREA_AT), LockHostConfig::default()).unwrap();
                let what = format!("{backend:?} {alg} {read_percent}% readers");
                let t = Instant::now();
                let children: Vec<Child> = (0..PROCESSES)
                    .map(|p| {
                        let args = [
                            alg.to_string(),
                            fabric.addr.to_string(),
                            host.info().to_hex(),
                            LOCK_AT.to_string(),
                            THREADS.to_string(),
                            iterations.to_string(),
                            read_percent.to_string(),
                            (p + 1).to_string(),
                        ];
                        spawn_worker(WORKER, &args)
                    })
                    .collect();
                wait_bounded(children, &what);
                let ep = node.endpoint().unwrap();
                let (done, overlaps) = lock_stress::totals(&ep);
                println!("{what}: {done} critical sections, {overlaps} reader overlaps in {:?}", t.elapsed());
                assert_eq!(done, PROCESSES * THREADS * iterations, "{what}: every acquisition completed");
                assert_eq!(ep.read_u64(at(DONE_AT)).unwrap(), done);
                let timing = LockTiming::measure(&ep, host.info()).unwrap();
                let ctx = LockContext::new(&ep);
                let probe = open_lock(alg, &ep, host.info(), at(LOCK_AT), timing, &ctx).unwrap();
                if read_percent == 95 && probe.shares_readers() {
                    assert!(overlaps > 0, "{what}: readers never overlapped");
                }
                if !probe.shares_readers() {
                    assert_eq!(overlaps, 0, "{what}: a mutex let two readers in");
                }
                let stats = host.stats().shiftlock_recovery;
                assert_eq!(stats.recovered, 0, "{what}: a stall needed recovery: {stats:?}");
            }
        }
    }
}

#[test]
fn a_reader_on_another_endpoint_waits_for_the_writer_and_then_gets_in() {
    // Two handles in one process, on two endpoints: the second cannot take
    // the lock while the first holds it exclusively (checked with a bounded
    // wait on a thread), and gets it once the first lets go.
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 17);
        let node = Node::join(&fabric.addr).unwrap();
        let host = LockHost::start(&node, at(HOST_AREA_AT), LockHostConfig::default()).unwrap();
        for (i, alg) in Algorithm::BUILT.into_iter().enumerate() {
            let addr = at(LOCK_AT + 64 * i as u64);
            let ep = node.endpoint().unwrap();
            let ctx = LockContext::new(&ep);
            let timing = LockTiming::measure(&ep, host.info()).unwrap();
            let mut first = open_lock(alg, &ep, host.info(), addr, timing, &ctx).unwrap();
            let guard = RwLockGuard::acquire(&mut *first, &ep, Mode::Exclusive).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let waiter = {
                let (node, info) = (node.clone(), host.info().clone());
                std::thread::spawn(move || {
                    let ep = node.endpoint().unwrap();
                    let ctx = LockContext::new(&ep);
                    let mut second = open_lock(alg, &ep, &info, addr, timing, &ctx).unwrap();
                    second.acquire(&ep, Mode::Shared).unwrap();
                    tx.send(()).unwrap();
                    second.release(&ep).unwrap();
                })
            };
            assert!(
                rx.recv_timeout(Duration::from_millis(300)).is_err(),
                "{backend:?} {alg}: a reader got in beside a writer"
            );
            guard.release().unwrap();
            rx.recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("{backend:?} {alg}: the waiter never got the lock"));
            waiter.join().unwrap();
        }
    }
}

#[test]
fn algorithms_not_built_and_misuse_are_refused_without_a_verb() {
    let fabric = TestFabric::new(Backend::Shm, 1 << 17);
    let node = Node::join(&fabric.addr).unwrap();
    let host = LockHost::start(&node, at(HOST_AREA_AT), LockHostConfig::default()).unwrap();
    let ep = node.endpoint().unwrap();
    let ctx = LockContext::new(&ep);
    let timing = LockTiming::measure(&ep, host.info()).unwrap();
    let before = ep.counts();
    for alg in Algorithm::ALL {
        let r = open_lock(alg, &ep, host.info(), at(LOCK_AT), timing, &ctx);
        match (alg.is_built(), r) {
            (true, Ok(_)) => {}
            (false, Err(LockError::NotBuilt(a))) => {
                assert_eq!(a, alg);
                let msg = LockError::NotBuilt(a).to_string();
                assert!(msg.contains(alg.name()) && msg.contains("not built"), "{msg}");
            }
            (built, r) => panic!("{alg} (built: {built}) opened as {:?}", r.map(|_| "a handle")),
        }
        if alg.is_built() {
            let r = open_lock(alg, &ep, host.info(), at(LOCK_AT + alg.lock_align() / 2), timing, &ctx);
            assert!(matches!(r, Err(LockError::Misuse(_))), "{alg}: misaligned lock accepted");
            let other = node.endpoint().unwrap();
            let r = open_lock(alg, &other, host.info(), at(LOCK_AT), timing, &ctx);
            assert!(matches!(r, Err(LockError::Misuse(_))), "{alg}: another endpoint's context accepted");
        }
    }
    assert_eq!(ep.counts(), before, "opening issued verbs");
    let bad_area = LockHost::start(&node, at(HOST_AREA_AT + 8), LockHostConfig::default());
    assert!(matches!(bad_area, Err(LockError::Misuse(_))), "a misaligned host area was accepted");
    let outside = LockHost::start(&node, at(1 << 17), LockHostConfig::default());
    assert!(outside.is_err(), "a host area outside the region was accepted");
}
