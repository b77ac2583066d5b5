//! DQL (dql-icpp05.md §3–4) under stress and failures, on both backends:
//! several worker processes × threads checked by the cross-process oracle of
//! `dql-stress-worker` (mutual exclusion; every handover from exactly the
//! predecessor in the queue; for the starvation-free variant the FIFO order
//! of the tickets; every acquisition served), handles sharing an endpoint
//! with nested locks, the verbs of an uncontended acquire + release (Table
//! 3), the transient state of §4.3.1 forced by hand, and the failure
//! handling: processes SIGKILLed while holding and while queued, a ticket
//! taken and never used, a reset whose resetter vanished, and a holder that
//! overran its lease through a reset.
//!
//! The tests of this file run one at a time (they share two busy cores, and
//! the failure tests judge progress in leases).

use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use citron_lock::dql::{DqlConfig, DqlId, DqlLock, DqlVariant, Stamp, TailWord, Wire};
use citron_lock::rdma::{Endpoint, Node, RemoteAddr, VerbKind};
use citron_lock::rwlock::{LockError, Mode, RwLockClient};
use citronfs_tests::args::Totals;
use citronfs_tests::{Backend, TestFabric, Watched, BACKENDS, TEST_REGION};

const LOCK_AT: u64 = 0;
const ORACLE_AT: u64 = 4096;
const STRIDE: u64 = 64;
const WORKER: &str = env!("CARGO_BIN_EXE_dql-stress-worker");

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn at(offset: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, offset)
}

fn variant_arg(v: DqlVariant) -> &'static str {
    match v {
        DqlVariant::StarvationFree => "sf",
        DqlVariant::Distributed => "distributed",
    }
}

struct Run {
    variant: DqlVariant,
    processes: u64,
    threads: u64,
    iterations: u64,
    extra: Vec<String>,
}

impl Run {
    fn spawn(&self, fabric: &TestFabric, seed: u64) -> Vec<Child> {
        (0..self.processes)
            .map(|p| {
                let mut args = vec![
                    "stress".to_string(),
                    format!("--fabric={}", fabric.addr),
                    format!("--variant={}", variant_arg(self.variant)),
                    format!("--threads={}", self.threads),
                    format!("--iterations={}", self.iterations),
                    format!("--seed={}", seed * 100 + p),
                    format!("--lock-at={LOCK_AT}"),
                    format!("--oracle-at={ORACLE_AT}"),
                ];
                args.extend(self.extra.iter().cloned());
                Command::new(WORKER)
                    .args(&args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("start dql-stress-worker")
            })
            .collect()
    }

    fn total(&self) -> u64 {
        self.processes * self.threads * self.iterations
    }
}

/// Waits for the workers, fails if any failed, and adds up their results.
fn collect(children: Vec<Child>) -> Totals {
    let mut totals = Totals::default();
    for child in children {
        let out = child.wait_with_output().expect("wait for worker");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "worker failed ({}); stdout: {stdout}", out.status);
        totals.merge(&Totals::from_stdout(&stdout).expect("a result line"));
    }
    totals
}

const QUIET: [&str; 7] = ["resets", "restarts", "passed", "skips", "takeovers", "fenced", "dropped"];

fn tail(ep: &Endpoint, lock: u64) -> TailWord {
    TailWord(ep.read_u64(at(lock)).unwrap())
}

/// Runs `run` on `fabric` and checks what holds for every run without
/// failures: every acquisition completed, the lock was contended, no
/// failure handling ran, and every lock is free at the end.
fn stress_on(backend: Backend, fabric: &TestFabric, run: &Run, locks: u64) -> Totals {
    let t = Instant::now();
    let totals = collect(run.spawn(fabric, 1));
    let per = |k: &str| totals.get(k) as f64 / totals.get("acquisitions").max(1) as f64;
    println!(
        "{backend:?} {:?}: {} acquisitions in {:?}, {:.0}% queued; per acquisition: {:.2} verbs, {:.2} round trips, \
         {:.2} messages; {totals:?}",
        run.variant,
        totals.get("acquisitions"),
        t.elapsed(),
        100.0 * per("queued"),
        per("lock_verbs"),
        per("lock_round_trips"),
        per("lock_messages")
    );
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    assert_eq!(totals.get("acquisitions"), totals.get("done"), "{backend:?}: one acquisition per section");
    assert!(totals.get("queued") > 0, "{backend:?}: the lock was never contended");
    assert!(totals.get("handovers_checked") > 0, "{backend:?}");
    assert_eq!(totals.get("grants_received"), totals.get("grants_sent"), "{backend:?}: no grant lost");
    assert_eq!(totals.get("queued"), totals.get("grants_received"), "{backend:?}: every waiter served");
    for quiet in QUIET {
        assert_eq!(totals.get(quiet), 0, "{backend:?}: {quiet} without failures");
    }
    let mut completed = 0;
    for l in 0..locks {
        let w = tail(&ep, LOCK_AT + STRIDE * l);
        assert!(w.is_free() && w.era().get() == 0, "{backend:?}: lock {l} is idle at the end: {w:?}");
        assert_eq!(ep.read_u64(at(ORACLE_AT + STRIDE * l)).unwrap(), 0, "{backend:?}: nobody inside");
        let done = ep.read_u64(at(ORACLE_AT + STRIDE * l + 8)).unwrap();
        if run.variant == DqlVariant::StarvationFree {
            // One ticket per section, and the tail stands at the last one.
            assert_eq!(ep.read_u64(at(LOCK_AT + STRIDE * l + 8)).unwrap(), done, "{backend:?}");
            assert_eq!(w.stamp(), Stamp::new(done as u32), "{backend:?}");
        }
        completed += done;
    }
    assert_eq!(completed, totals.get("done"), "{backend:?}: the oracle counted every section");
    totals
}

fn iterations(backend: Backend) -> u64 {
    if backend == Backend::Shm {
        500
    } else {
        80
    }
}

#[test]
fn starvation_free_dql_excludes_serves_everyone_in_ticket_order() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let run = Run {
            variant: DqlVariant::StarvationFree,
            processes: 3,
            threads: 3,
            iterations: iterations(backend),
            extra: vec![],
        };
        let totals = stress_on(backend, &fabric, &run, 1);
        assert_eq!(totals.get("done"), run.total());
        assert_eq!(totals.get("fifo_checked"), run.total(), "{backend:?}: every entry in ticket order");
    }
}

#[test]
fn distributed_dql_excludes_and_hands_over_along_the_queue() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let run = Run {
            variant: DqlVariant::Distributed,
            processes: 3,
            threads: 3,
            iterations: iterations(backend),
            extra: vec![],
        };
        let totals = stress_on(backend, &fabric, &run, 1);
        assert_eq!(totals.get("done"), run.total());
        assert!(totals.get("cas_failures") > 0, "{backend:?}: §4.2's CAS never had to retry");
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        assert_eq!(tail(&ep, LOCK_AT), TailWord::ZERO, "{backend:?}: the constant free word");
    }
}

#[test]
fn dql_handles_sharing_an_endpoint_keep_each_others_messages() {
    let _serial = serial();
    for backend in BACKENDS {
        for variant in [DqlVariant::StarvationFree, DqlVariant::Distributed] {
            let fabric = TestFabric::new(backend, 1 << 16);
            let run = Run {
                variant,
                processes: 2,
                threads: 3,
                iterations: iterations(backend) / 2,
                extra: vec!["--locks=2".into(), "--nested=1".into()],
            };
            let totals = stress_on(backend, &fabric, &run, 2);
            assert!(totals.get("done") >= run.total(), "{backend:?}");
            assert_eq!(totals.get("foreign_messages"), 0, "{backend:?}");
        }
    }
}

/// Verbs of `cycles` uncontended acquire + release.
fn verbs_per_cycle(ep: &Endpoint, lock: &mut DqlLock) -> (f64, f64, f64, u64) {
    const CYCLES: u64 = 200;
    ep.reset_counts();
    for _ in 0..CYCLES {
        lock.acquire(ep, Mode::Exclusive).unwrap();
        lock.release(ep).unwrap();
    }
    let c = ep.counts();
    let per = |n: u64| n as f64 / CYCLES as f64;
    (per(c.verbs()), per(c.round_trips), per(c.get(VerbKind::Cas)), c.messages_sent + c.messages_received)
}

#[test]
fn uncontended_dql_costs_the_papers_verbs() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let rtt = ep.measure_rtt(at(LOCK_AT), 9).unwrap();
        let config = DqlConfig::from_rtt(rtt);
        let mut sf = DqlLock::new(at(LOCK_AT), config).unwrap();
        let mut distributed =
            DqlLock::new(at(LOCK_AT + STRIDE), config.with_variant(DqlVariant::Distributed)).unwrap();
        assert!(!sf.shares_readers(), "DQL is a mutex");
        let s = verbs_per_cycle(&ep, &mut sf);
        let d = verbs_per_cycle(&ep, &mut distributed);
        println!("{backend:?}: starvation-free {s:?}, distributed {d:?} (verbs, round trips, CAS, messages per cycle)");
        // Table 3: lock = FA + CAS, unlock = CAS.
        assert_eq!(s, (3.0, 3.0, 2.0, 0), "{backend:?} starvation-free");
        // Table 3: lock = CAS, unlock = CAS.
        assert_eq!(d, (2.0, 2.0, 2.0, 0), "{backend:?} distributed");
        assert_eq!(sf.stats().immediate, 200);
        assert_eq!(distributed.stats().cas_failures, 0);
        // Shared is the same mutex.
        ep.reset_counts();
        sf.acquire(&ep, Mode::Shared).unwrap();
        sf.release(&ep).unwrap();
        assert_eq!(ep.counts().verbs(), 3);
    }
}

/// §4.3.1 forced: a client B swaps itself into the tail behind holder A but
/// has not alerted A when A releases. A's CAS fails, A waits for B's alert
/// and grants B. Then the same with a B that never alerts: A gives up after
/// the silence S and returns.
#[test]
fn dql_release_in_the_transient_state_waits_for_the_alert() {
    let _serial = serial();
    let lease = Duration::from_millis(400);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let node = Node::join(&fabric.addr).unwrap();
        let (ep_a, ep_b) = (node.endpoint().unwrap(), node.endpoint().unwrap());
        let config = DqlConfig::from_rtt(Duration::from_micros(1))
            .with_lease(lease)
            .with_variant(DqlVariant::Distributed);
        let lock = at(LOCK_AT);
        let b_id = DqlId::from_client(ep_b.addr()).unwrap();
        let (ep_a, stats) = std::thread::scope(|s| {
            let (tokens, from_a) = mpsc::channel();
            let (released, a_released) = mpsc::channel();
            let (freed, b_freed) = mpsc::channel();
            let a = s.spawn(move || {
                let mut a = DqlLock::new(lock, config).unwrap();
                for alerted in [true, false] {
                    a.acquire(&ep_a, Mode::Exclusive).unwrap();
                    tokens.send(a.token().unwrap()).unwrap();
                    // B swaps in now; wait until it has.
                    while tail_at(&ep_a, lock).id() != b_id {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    let t = Instant::now();
                    a.release(&ep_a).expect("a transient release succeeds");
                    if !alerted {
                        assert!(t.elapsed() >= config.silence(), "{backend:?}: gave up early");
                    }
                    released.send(()).unwrap();
                    b_freed.recv().unwrap();
                }
                (ep_a, a.stats())
            });
            for (round, alerted) in [(1u32, true), (2, false)] {
                let a_token: TailWord = from_a.recv().unwrap();
                let b_token = TailWord::new(a_token.era(), Stamp::new(round), b_id);
                assert_eq!(ep_b.cas(lock, a_token.0, b_token.0).unwrap(), a_token.0);
                if alerted {
                    std::thread::sleep(Duration::from_millis(30));
                    let alert = Wire::Alert { lock, pred: a_token, succ: b_token };
                    ep_b.send(a_token.id().client().unwrap(), &alert.encode()).unwrap();
                    let m = ep_b.recv_timeout(Duration::from_secs(10)).expect("a grant");
                    assert_eq!(Wire::decode(&m.payload).unwrap(), Wire::Grant { lock, to: b_token });
                }
                // B releases with nobody behind it, once A is done.
                a_released.recv().unwrap();
                let free = TailWord::free(b_token.era());
                assert_eq!(ep_b.cas(lock, b_token.0, free.0).unwrap(), b_token.0);
                freed.send(()).unwrap();
            }
            a.join().unwrap()
        });
        println!("{backend:?}: {stats:?}");
        assert_eq!((stats.transient, stats.grants_sent, stats.dropped), (2, 1, 1), "{backend:?}");
        assert_eq!(tail_at(&ep_a, lock), TailWord::ZERO);
    }
}

fn tail_at(ep: &Endpoint, lock: RemoteAddr) -> TailWord {
    TailWord(ep.read_u64(lock).unwrap())
}

fn worker_args(command: &str, fabric: &TestFabric, variant: DqlVariant, lease: Duration) -> Vec<String> {
    vec![
        command.into(),
        format!("--fabric={}", fabric.addr),
        format!("--variant={}", variant_arg(variant)),
        format!("--lock-at={LOCK_AT}"),
        format!("--lease-ms={}", lease.as_millis()),
    ]
}

/// After a failure: survivor processes run a load correctly. They use the
/// standard lease (1 s), not the failure test's short one, which a loaded
/// machine's scheduler could make a holder overrun.
fn survivors_run(backend: Backend, fabric: &TestFabric, variant: DqlVariant) {
    let lease = DqlConfig::MIN_LEASE;
    let run = Run {
        variant,
        processes: 2,
        threads: 2,
        iterations: if backend == Backend::Shm { 100 } else { 25 },
        // The tickets before the failure were not all served in the oracle.
        extra: vec![format!("--lease-ms={}", lease.as_millis()), "--fifo=0".into()],
    };
    let totals = collect(run.spawn(fabric, 7));
    assert_eq!(totals.get("done"), run.total(), "{backend:?}");
    assert_eq!(totals.get("fenced"), 0, "{backend:?}");
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    assert_eq!(ep.read_u64(at(ORACLE_AT)).unwrap(), 0);
    let w = tail(&ep, LOCK_AT);
    assert!(w.is_free(), "{backend:?}: {w:?}");
}

/// A thread that joins the queue (tells `joined`), then waits for the lock
/// and returns how long it waited after `start` arrives, and its handle.
fn waiter(
    node: &Node,
    config: DqlConfig,
    joined: mpsc::Sender<()>,
    start: mpsc::Receiver<Instant>,
) -> (Duration, DqlLock) {
    let ep = node.endpoint().unwrap();
    let mut lock = DqlLock::new(at(LOCK_AT), config).unwrap();
    let held = lock.begin(&ep).unwrap();
    assert!(!held, "the lock is held by someone else");
    joined.send(()).unwrap();
    let t0 = start.recv().unwrap();
    lock.complete(&ep).expect("the waiter gets the lock after the failure");
    let waited = t0.elapsed();
    lock.release(&ep).unwrap();
    (waited, lock)
}

#[test]
fn dql_recovers_from_a_holder_killed() {
    let _serial = serial();
    let lease = Duration::from_millis(300);
    for backend in BACKENDS {
        for variant in [DqlVariant::StarvationFree, DqlVariant::Distributed] {
            let fabric = TestFabric::new(backend, 1 << 16);
            let node = Node::join(&fabric.addr).unwrap();
            let config =
                DqlConfig::from_rtt(Duration::from_micros(1)).with_lease(lease).with_variant(variant);
            let mut holder = Watched::spawn(WORKER, &worker_args("hold", &fabric, variant, lease));
            holder.wait_for("held");
            let (waited, lock) = std::thread::scope(|s| {
                let (joined_tx, joined) = mpsc::channel();
                let (start, start_rx) = mpsc::channel();
                let w = s.spawn(|| waiter(&node, config, joined_tx, start_rx));
                joined.recv().unwrap();
                holder.kill();
                start.send(Instant::now()).unwrap();
                w.join().unwrap()
            });
            let stats = lock.stats();
            println!(
                "{backend:?} {variant:?} holder killed: waiter waited {waited:?} (bound {:?}); {stats:?}",
                config.recovery_bound()
            );
            // The documented bound is about 3.1 leases; three times it
            // leaves room for a loaded machine.
            assert!(
                waited < lease * 10,
                "{backend:?} {variant:?}: no progress within 10 leases ({waited:?})"
            );
            assert_eq!((stats.resets, stats.restarts), (1, 1), "{backend:?} {variant:?}");
            assert_eq!(tail(&node.endpoint().unwrap(), LOCK_AT).era().get(), 1, "one reset, one era");
            survivors_run(backend, &fabric, variant);
        }
    }
}

#[test]
fn dql_recovers_from_a_queued_waiter_killed() {
    let _serial = serial();
    let lease = Duration::from_millis(300);
    for backend in BACKENDS {
        for variant in [DqlVariant::StarvationFree, DqlVariant::Distributed] {
            let fabric = TestFabric::new(backend, 1 << 16);
            let node = Node::join(&fabric.addr).unwrap();
            let config =
                DqlConfig::from_rtt(Duration::from_micros(1)).with_lease(lease).with_variant(variant);
            // A live holder here, a worker queued behind it, and a waiter
            // here behind the worker.
            let ep = node.endpoint().unwrap();
            let mut holder = DqlLock::new(at(LOCK_AT), config).unwrap();
            holder.acquire(&ep, Mode::Exclusive).unwrap();
            let mut queued = Watched::spawn(WORKER, &worker_args("queue", &fabric, variant, lease));
            queued.wait_for("queued");
            let (waited, lock) = std::thread::scope(|s| {
                let (joined_tx, joined) = mpsc::channel();
                let (start, start_rx) = mpsc::channel();
                let w = s.spawn(|| waiter(&node, config, joined_tx, start_rx));
                joined.recv().unwrap();
                queued.kill();
                start.send(Instant::now()).unwrap();
                // The holder leaves within its lease, handing the lock to
                // the dead worker.
                holder.release(&ep).expect("the live holder releases normally");
                w.join().unwrap()
            });
            let stats = lock.stats();
            println!("{backend:?} {variant:?} queued worker killed: waiter waited {waited:?}; {stats:?}; holder {:?}", holder.stats());
            assert!(
                waited < lease * 10,
                "{backend:?} {variant:?}: no progress within 10 leases ({waited:?})"
            );
            assert_eq!(
                holder.stats().grants_sent,
                1,
                "{backend:?}: the holder handed over to the dead worker"
            );
            assert_eq!((stats.resets, stats.restarts), (1, 1), "{backend:?} {variant:?}");
            survivors_run(backend, &fabric, variant);
        }
    }
}

/// §4.4 with a failure: a ticket taken by a client that died before it
/// swapped into the tail. The next ticket skips it after one gap.
#[test]
fn starvation_free_dql_skips_a_ticket_that_was_never_used() {
    let _serial = serial();
    let lease = Duration::from_millis(150);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let config = DqlConfig::from_rtt(Duration::from_micros(1)).with_lease(lease);
        let mut lock = DqlLock::new(at(LOCK_AT), config).unwrap();
        lock.acquire(&ep, Mode::Exclusive).unwrap();
        lock.release(&ep).unwrap();
        // The dead client's FA.
        assert_eq!(ep.faa(at(LOCK_AT + 8), 1).unwrap(), 1);
        let t = Instant::now();
        lock.acquire(&ep, Mode::Exclusive).unwrap();
        let waited = t.elapsed();
        assert_eq!(lock.position(), Some(2));
        lock.release(&ep).unwrap();
        println!("{backend:?}: skipped a dead ticket after {waited:?}; {:?}", lock.stats());
        assert!(waited >= config.gap(), "{backend:?}: skipped before the gap");
        assert!(waited < lease * 10, "{backend:?}: {waited:?}");
        assert_eq!(lock.stats().skips, 1);
        // Back to one FA + two CASes.
        ep.reset_counts();
        lock.acquire(&ep, Mode::Exclusive).unwrap();
        lock.release(&ep).unwrap();
        assert_eq!(ep.counts().verbs(), 3, "{backend:?}");
        assert_eq!(tail(&ep, LOCK_AT).stamp(), Stamp::new(4));
    }
}

/// A resetter that closed the tail and died: a waiter reopens it after
/// R + S and gets the lock in the next era.
#[test]
fn dql_reopens_a_reset_whose_resetter_vanished() {
    let _serial = serial();
    let lease = Duration::from_millis(100);
    for backend in BACKENDS {
        for variant in [DqlVariant::StarvationFree, DqlVariant::Distributed] {
            let fabric = TestFabric::new(backend, 1 << 16);
            let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
            let config =
                DqlConfig::from_rtt(Duration::from_micros(1)).with_lease(lease).with_variant(variant);
            ep.write_u64(at(LOCK_AT), TailWord::ZERO.closed().0).unwrap();
            let mut lock = DqlLock::new(at(LOCK_AT), config).unwrap();
            let t = Instant::now();
            lock.acquire(&ep, Mode::Exclusive).unwrap();
            let waited = t.elapsed();
            lock.release(&ep).unwrap();
            println!("{backend:?} {variant:?}: reopened after {waited:?}; {:?}", lock.stats());
            assert!(waited >= config.abandoned_close(), "{backend:?}: reopened before R + S");
            assert!(waited < lease * 20, "{backend:?}: {waited:?}");
            assert_eq!(lock.stats().takeovers, 1);
            let w = tail(&ep, LOCK_AT);
            assert!(w.is_free() && w.era().get() == 1, "{backend:?}: {w:?}");
        }
    }
}

/// A holder that overruns its lease while a waiter resets the lock: the
/// waiter gets the lock in the next era, and the late release is told it
/// was fenced and changes nothing.
#[test]
fn dql_late_release_through_a_reset_is_fenced() {
    let _serial = serial();
    let lease = Duration::from_millis(80);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let node = Node::join(&fabric.addr).unwrap();
        let config = DqlConfig::from_rtt(Duration::from_micros(1)).with_lease(lease);
        let ep = node.endpoint().unwrap();
        let mut slow = DqlLock::new(at(LOCK_AT), config).unwrap();
        slow.acquire(&ep, Mode::Exclusive).unwrap();
        let (waited, other) = std::thread::scope(|s| {
            let w = s.spawn(|| {
                let ep = node.endpoint().unwrap();
                let mut lock = DqlLock::new(at(LOCK_AT), config).unwrap();
                let t = Instant::now();
                lock.acquire(&ep, Mode::Exclusive).unwrap();
                let waited = t.elapsed();
                lock.release(&ep).unwrap();
                (waited, lock.stats())
            });
            let (waited, other) = w.join().unwrap();
            let err = slow.release(&ep).expect_err("released far past its lease, through a reset");
            assert!(matches!(err, LockError::Fenced), "{backend:?}: {err}");
            (waited, other)
        });
        println!("{backend:?}: waiter {waited:?} {other:?}; slow {:?}", slow.stats());
        assert_eq!(other.resets, 1, "{backend:?}");
        assert_eq!((slow.stats().late_releases, slow.stats().fenced), (1, 1));
        let w = tail(&ep, LOCK_AT);
        assert!(w.is_free() && w.era().get() == 1, "{backend:?}: the fenced release left {w:?}");
        // A holder that overran with nobody resetting releases normally.
        slow.acquire(&ep, Mode::Exclusive).unwrap();
        std::thread::sleep(lease * 2);
        slow.release(&ep).expect("nobody reset");
        assert_eq!(slow.stats().fenced, 1);
    }
}
