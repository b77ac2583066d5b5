//! DSLR (dslr-sigmod18.md §4–5) and the CAS spin lock baseline under stress:
//! several worker processes × threads on both backends, checked by the
//! cross-process oracle of `dslr-stress-worker` (no two writers, no writer
//! with readers, readers overlap, every acquisition completes, and for DSLR
//! the bakery's first-come-first-served order). Then DSLR's counter reset
//! (§4.9) with a small threshold, and its recovery (§4.7) from processes
//! SIGKILLed while holding, while queued, and while holding the ticket that
//! owes the counter reset. Finally the verbs an uncontended acquire + release
//! costs.
//!
//! The tests of this file run one at a time (they share two busy cores, and
//! the failure tests judge progress in leases).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use citron_lock::cas_spin::{CasSpinConfig, CasSpinLock, CasSpinWord};
use citron_lock::dslr::{DslrConfig, DslrLimits, DslrLock, DslrWord, COUNT_MAX};
use citron_lock::rdma::{Endpoint, Node, RemoteAddr, VerbKind};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::{Backend, TestFabric, Watched, BACKENDS, TEST_REGION};

const LOCK_AT: u64 = 0;
const ORACLE_AT: u64 = 4096;
/// The oracle's words (see the worker's doc comment).
const WRITERS: u64 = ORACLE_AT;
const READERS: u64 = ORACLE_AT + 8;
const DONE: u64 = ORACLE_AT + 16;
const WORKER: &str = env!("CARGO_BIN_EXE_dslr-stress-worker");

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn at(offset: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, offset)
}

/// One stress run: its worker arguments beyond fabric, lock and oracle.
struct Run<'a> {
    algo: &'a str,
    processes: u64,
    threads: u64,
    iterations: u64,
    read: u64,
    extra: Vec<String>,
}

impl Run<'_> {
    fn spawn(&self, fabric: &TestFabric, seed: u64) -> Vec<Child> {
        (0..self.processes)
            .map(|p| {
                let mut args = vec![
                    "stress".to_string(),
                    format!("--algo={}", self.algo),
                    format!("--fabric={}", fabric.addr),
                    format!("--threads={}", self.threads),
                    format!("--iterations={}", self.iterations),
                    format!("--read={}", self.read),
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
                    .expect("start dslr-stress-worker")
            })
            .collect()
    }

    fn total(&self) -> u64 {
        self.processes * self.threads * self.iterations
    }
}

/// Waits for the workers, fails if any failed, and adds up their `result`
/// lines (`max_readers` is a maximum).
fn collect(children: Vec<Child>) -> HashMap<String, u64> {
    let mut totals = HashMap::new();
    for child in children {
        let out = child.wait_with_output().expect("wait for worker");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "worker failed ({}); stdout: {stdout}", out.status);
        let line = stdout.lines().find_map(|l| l.strip_prefix("result ")).expect("a result line");
        for kv in line.split_whitespace() {
            let (k, v) = kv.split_once('=').expect("key=value");
            let v: u64 = v.parse().expect("a number");
            let e = totals.entry(k.to_string()).or_insert(0);
            *e = if k == "max_readers" { (*e).max(v) } else { *e + v };
        }
    }
    totals
}

fn get(totals: &HashMap<String, u64>, key: &str) -> u64 {
    totals.get(key).copied().unwrap_or(0)
}

/// Runs `run` on a fresh fabric and checks what holds for every run: every
/// acquisition completed and nobody is left inside.
fn stress(backend: Backend, run: &Run) -> (HashMap<String, u64>, Endpoint, TestFabric) {
    let fabric = TestFabric::new(backend, 1 << 16);
    let t = Instant::now();
    let totals = collect(run.spawn(&fabric, 1));
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    println!(
        "{backend:?} {} {}x{}x{} read {}%: {:?} in {:?}",
        run.algo,
        run.processes,
        run.threads,
        run.iterations,
        run.read,
        totals,
        t.elapsed()
    );
    assert_eq!(get(&totals, "done"), run.total(), "{backend:?}: every acquisition completed");
    assert_eq!(ep.read_u64(at(DONE)).unwrap(), run.total(), "{backend:?}: the oracle counted them all");
    assert_eq!(ep.read_u64(at(WRITERS)).unwrap(), 0, "{backend:?}: a writer left inside");
    assert_eq!(ep.read_u64(at(READERS)).unwrap(), 0, "{backend:?}: a reader left inside");
    (totals, ep, fabric)
}

fn dslr_word(ep: &Endpoint) -> DslrWord {
    DslrWord(ep.read_u64(at(LOCK_AT)).unwrap())
}

#[test]
fn dslr_mixed_load_excludes_and_serves_in_ticket_order() {
    let _serial = serial();
    for backend in BACKENDS {
        let iterations = if backend == Backend::Shm { 1500 } else { 120 };
        let run = Run {
            algo: "dslr",
            processes: 3,
            threads: 3,
            iterations,
            read: 60,
            extra: vec!["--fifo=1".into()],
        };
        let (totals, ep, _fabric) = stress(backend, &run);
        assert!(get(&totals, "conflicts") > 0, "{backend:?}: the lock was never contended");
        assert_eq!(get(&totals, "fifo_checked"), get(&totals, "exclusive"), "{backend:?}");
        for quiet in ["lease_resets", "passed", "overflow_resets", "stuck_resets", "fenced"] {
            assert_eq!(get(&totals, quiet), 0, "{backend:?}: {quiet} without failures");
        }
        let w = dslr_word(&ep);
        assert!(w.drained(), "{backend:?}: the lock is idle at the end: {w:?}");
        assert_eq!(u64::from(w.maxx()) + u64::from(w.maxs()), run.total(), "{backend:?}: one ticket each");
    }
}

#[test]
fn dslr_readers_overlap_in_a_reader_heavy_run() {
    let _serial = serial();
    for backend in BACKENDS {
        let iterations = if backend == Backend::Shm { 800 } else { 100 };
        let run = Run { algo: "dslr", processes: 3, threads: 3, iterations, read: 90, extra: vec![] };
        let (totals, ep, _fabric) = stress(backend, &run);
        assert!(get(&totals, "overlaps") > 0, "{backend:?}: readers never overlapped");
        assert!(get(&totals, "max_readers") >= 2, "{backend:?}");
        assert!(dslr_word(&ep).drained());
    }
}

#[test]
fn dslr_counters_reset_before_overflow_and_stay_exclusive() {
    let _serial = serial();
    const SMALL: u16 = 32;
    for backend in BACKENDS {
        let (processes, iterations) = if backend == Backend::Shm { (3, 700) } else { (2, 120) };
        let run = Run {
            algo: "dslr",
            processes,
            threads: 3,
            iterations,
            read: 50,
            extra: vec![format!("--count-max={SMALL}")],
        };
        let (totals, ep, _fabric) = stress(backend, &run);
        // A generation serves fewer than 2 × count_max tickets before one
        // max field reaches count_max; every generation but the last ends in
        // a reset.
        let generations = run.total().div_ceil(2 * u64::from(SMALL) - 1);
        let resets = get(&totals, "overflow_resets");
        assert!(resets >= generations - 1, "{backend:?}: {resets} resets for {generations} generations");
        assert!(get(&totals, "canary_backoffs") > 0, "{backend:?}: nobody ever met a pending reset");
        for quiet in ["lease_resets", "passed", "stuck_resets", "fenced"] {
            assert_eq!(get(&totals, quiet), 0, "{backend:?}: {quiet} without failures");
        }
        let w = dslr_word(&ep);
        assert!(w.drained() && w.maxx() < SMALL && w.maxs() < SMALL, "{backend:?}: {w:?}");
    }
}

fn hold_args(fabric: &TestFabric, mode: &str, lease: Duration, count_max: u16) -> Vec<String> {
    vec![
        "hold".into(),
        "--algo=dslr".into(),
        format!("--fabric={}", fabric.addr),
        format!("--mode={mode}"),
        format!("--lock-at={LOCK_AT}"),
        format!("--lease-ms={}", lease.as_millis()),
        format!("--count-max={count_max}"),
    ]
}

/// A survivor in this process: takes the lock exclusively and says how long
/// it waited.
fn survivor_acquires(fabric: &TestFabric, lease: Duration, count_max: u16) -> (Duration, DslrLock) {
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let config = DslrConfig::from_rtt(ep.measure_rtt(at(LOCK_AT), 5).unwrap()).with_lease(lease);
    let mut lock = DslrLock::with_limits(at(LOCK_AT), config, DslrLimits::new(count_max, 1).unwrap());
    let t = Instant::now();
    lock.lock_exclusive(&ep).unwrap();
    let waited = t.elapsed();
    lock.unlock(&ep).unwrap();
    (waited, lock)
}

/// After the crash: a survivor here must get the lock within the paper's
/// bound, and survivor processes must run a mixed load correctly.
fn survivors_recover(backend: Backend, fabric: &TestFabric, lease: Duration, count_max: u16, what: &str) {
    let run = Run {
        algo: "dslr",
        processes: 2,
        threads: 2,
        iterations: if backend == Backend::Shm { 200 } else { 40 },
        read: 50,
        extra: vec![format!("--lease-ms={}", lease.as_millis()), format!("--count-max={count_max}")],
    };
    let (waited, lock) = survivor_acquires(fabric, lease, count_max);
    let workers = run.spawn(fabric, 7);
    let totals = collect(workers);
    let stats = lock.stats();
    println!(
        "{backend:?} {what}: survivor waited {waited:?} (lease {lease:?}); {stats:?}; workers {totals:?}"
    );
    // The bound: two dead tickets cost at most two silences of 2 × lease
    // each (§4.7); twice that leaves room for a loaded machine.
    assert!(waited < lease * 8, "{backend:?} {what}: no progress within 8 leases ({waited:?})");
    assert!(
        stats.lease_resets + stats.stuck_resets + stats.passed > 0,
        "{backend:?} {what}: the survivor got in without noticing the dead tickets"
    );
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    assert_eq!(get(&totals, "done"), run.total());
    assert_eq!(ep.read_u64(at(WRITERS)).unwrap(), 0);
    assert_eq!(ep.read_u64(at(READERS)).unwrap(), 0);
    assert!(dslr_word(&ep).drained(), "{backend:?} {what}: {:?}", dslr_word(&ep));
}

#[test]
fn dslr_recovers_from_processes_killed_holding_and_queued() {
    let _serial = serial();
    let lease = Duration::from_millis(250);
    for backend in BACKENDS {
        for (holder_mode, queued_mode) in [("exclusive", "exclusive"), ("shared", "exclusive")] {
            let fabric = TestFabric::new(backend, 1 << 16);
            let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
            let mut holder = Watched::spawn(WORKER, &hold_args(&fabric, holder_mode, lease, COUNT_MAX));
            holder.wait_for("held");
            let queued = Watched::spawn(WORKER, &hold_args(&fabric, queued_mode, lease, COUNT_MAX));
            // Queued: its ticket is in the word, and it is not served.
            let watchdog = Instant::now();
            while {
                let w = dslr_word(&ep);
                u32::from(w.maxx()) + u32::from(w.maxs()) < 2
            } {
                assert!(
                    watchdog.elapsed() < Duration::from_secs(60),
                    "the queued worker never took a ticket"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            let before = dslr_word(&ep);
            holder.kill();
            queued.kill();
            let what = format!("{holder_mode} holder + {queued_mode} waiter killed at {before:?}");
            assert!(!before.drained());
            survivors_recover(backend, &fabric, lease, COUNT_MAX, &what);
        }
    }
}

#[test]
fn dslr_recovers_when_the_resetter_is_killed() {
    let _serial = serial();
    let lease = Duration::from_millis(250);
    const SMALL: u16 = 16;
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let config = DslrConfig::from_rtt(Duration::from_micros(1)).with_lease(lease);
        let mut lock = DslrLock::with_limits(at(LOCK_AT), config, DslrLimits::new(SMALL, 1).unwrap());
        for _ in 0..SMALL - 1 {
            lock.lock_exclusive(&ep).unwrap();
            lock.unlock(&ep).unwrap();
        }
        // The next ticket, x = count_max − 1, owes the reset (§4.9).
        let mut holder = Watched::spawn(WORKER, &hold_args(&fabric, "exclusive", lease, SMALL));
        holder.wait_for("held");
        let before = dslr_word(&ep);
        assert!(before.canary(SMALL), "{before:?}");
        holder.kill();
        survivors_recover(backend, &fabric, lease, SMALL, &format!("resetter killed at {before:?}"));
    }
}

/// Verbs of `cycles` uncontended acquire + release in `mode`.
fn verbs_per_cycle(ep: &Endpoint, lock: &mut dyn RwLockClient, mode: Mode) -> (f64, f64, f64) {
    const CYCLES: u64 = 200;
    ep.reset_counts();
    for _ in 0..CYCLES {
        lock.acquire(ep, mode).unwrap();
        lock.release(ep).unwrap();
    }
    let c = ep.counts();
    let per = |n: u64| n as f64 / CYCLES as f64;
    (per(c.verbs()), per(c.round_trips), per(c.reads()))
}

#[test]
fn uncontended_verbs_per_acquire_and_release() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let rtt = ep.measure_rtt(at(LOCK_AT), 9).unwrap();
        let mut dslr = DslrLock::new(at(LOCK_AT), DslrConfig::from_rtt(rtt));
        let mut cas = CasSpinLock::new(at(LOCK_AT + 64), CasSpinConfig::from_rtt(rtt));
        for mode in [Mode::Exclusive, Mode::Shared] {
            let d = verbs_per_cycle(&ep, &mut dslr, mode);
            let c = verbs_per_cycle(&ep, &mut cas, mode);
            println!("{backend:?} {mode:?}: dslr {d:?}, cas {c:?} (verbs, round trips, reads per cycle)");
            // DSLR: one FA to take the ticket, one FA to release (§4.5, §4.8).
            assert_eq!(d, (2.0, 2.0, 0.0), "{backend:?} {mode:?} dslr");
            // CAS: one CAS to take the word, one FAA to release.
            assert_eq!(c, (2.0, 2.0, 0.0), "{backend:?} {mode:?} cas");
        }
        ep.reset_counts();
        dslr.lock_exclusive(&ep).unwrap();
        dslr.unlock(&ep).unwrap();
        assert_eq!(ep.counts().get(VerbKind::MaskedFaa), 2, "{backend:?}: the plain mutex API is as cheap");
        assert!(dslr_word(&ep).drained());
        assert_eq!(CasSpinWord(ep.read_u64(at(LOCK_AT + 64)).unwrap()), CasSpinWord::FREE);
    }
}

#[test]
fn cas_spin_lock_excludes_and_readers_overlap() {
    let _serial = serial();
    for backend in BACKENDS {
        let iterations = if backend == Backend::Shm { 1500 } else { 120 };
        let mixed = Run { algo: "cas", processes: 3, threads: 3, iterations, read: 60, extra: vec![] };
        let (totals, ep, _fabric) = stress(backend, &mixed);
        assert!(get(&totals, "failed_cas") > 0, "{backend:?}: the lock was never contended");
        assert_eq!(CasSpinWord(ep.read_u64(at(LOCK_AT)).unwrap()), CasSpinWord::FREE);
        let readers = Run { read: 90, ..mixed };
        let (totals, ep, _fabric) = stress(backend, &readers);
        assert!(get(&totals, "overlaps") > 0, "{backend:?}: readers never overlapped");
        assert_eq!(CasSpinWord(ep.read_u64(at(LOCK_AT)).unwrap()), CasSpinWord::FREE);
    }
}

/// §5.1: a holder with k slots may hold for k leases; a waiter does not
/// take its silence for a failure until 2 × min(δ, max_slots) leases.
#[test]
fn dslr_multi_slot_lease_outlives_a_single_lease() {
    let _serial = serial();
    let lease = Duration::from_millis(60);
    let limits = DslrLimits::new(COUNT_MAX, 4).unwrap();
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let node = Node::join(&fabric.addr).unwrap();
        let config = DslrConfig::from_rtt(Duration::from_micros(1)).with_lease(lease);
        let released = at(ORACLE_AT + 64);
        let holder_ep = node.endpoint().unwrap();
        let mut holder = DslrLock::with_limits(at(LOCK_AT), config, limits);
        holder.acquire_slots(&holder_ep, Mode::Exclusive, 4).unwrap();
        assert_eq!(dslr_word(&holder_ep), DslrWord::new(0, 0, 4, 0), "{backend:?}: four tickets, one FA");
        let waiter = std::thread::scope(|s| {
            let waiter = s.spawn(move || {
                let waiter_ep = node.endpoint().unwrap();
                let mut lock = DslrLock::with_limits(at(LOCK_AT), config, limits);
                lock.acquire(&waiter_ep, Mode::Shared).unwrap();
                let after_release = waiter_ep.read_u64(released).unwrap();
                lock.release(&waiter_ep).unwrap();
                (after_release, lock.stats())
            });
            // Three leases: a single-slot holder would have been reset.
            std::thread::sleep(lease * 3);
            holder_ep.write_u64(released, 1).unwrap();
            holder.unlock(&holder_ep).expect("released within its four leases");
            waiter.join().unwrap()
        });
        println!("{backend:?}: waiter {waiter:?}");
        assert_eq!(waiter.0, 1, "{backend:?}: the waiter entered before the 4-slot holder released");
        assert_eq!(waiter.1.lease_resets, 0, "{backend:?}");
        assert!(dslr_word(&holder_ep).drained());
        assert!(holder.acquire_slots(&holder_ep, Mode::Exclusive, 5).is_err(), "more than max_slots");
    }
}

/// Alg. 3 line 1: a holder whose lease ran out and whose ticket a waiter
/// has reset past does not release: it is told it was fenced, and the word
/// stays consistent. A holder that merely overran its lease, with nobody
/// resetting past it, releases normally.
#[test]
fn dslr_release_after_the_lease_is_fenced_only_if_passed() {
    let _serial = serial();
    let lease = Duration::from_millis(50);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 16);
        let node = Node::join(&fabric.addr).unwrap();
        let config = DslrConfig::from_rtt(Duration::from_micros(1)).with_lease(lease);
        let (slow_ep, ep) = (node.endpoint().unwrap(), node.endpoint().unwrap());
        let mut slow = DslrLock::new(at(LOCK_AT), config);
        let mut other = DslrLock::new(at(LOCK_AT), config);

        // Overran, nobody waiting: an ordinary release.
        for mode in [Mode::Exclusive, Mode::Shared] {
            slow.acquire(&slow_ep, mode).unwrap();
            std::thread::sleep(lease * 2);
            slow.release(&slow_ep).expect("nobody reset past it");
            assert!(dslr_word(&ep).drained(), "{backend:?} {mode:?}");
        }
        assert_eq!((slow.stats().late_releases, slow.stats().fenced), (2, 0));

        // Overran while a waiter reset past it: fenced.
        slow.lock_exclusive(&slow_ep).unwrap();
        other.lock_exclusive(&ep).unwrap();
        other.unlock(&ep).unwrap();
        assert_eq!(other.stats().lease_resets, 1, "{backend:?}");
        let err = slow.unlock(&slow_ep).expect_err("released long after its lease, and passed");
        assert!(matches!(err, citron_lock::rwlock::LockError::Fenced), "{backend:?}: {err}");
        assert_eq!((slow.stats().late_releases, slow.stats().fenced), (3, 1));
        let w = dslr_word(&ep);
        assert!(w.drained(), "{backend:?}: a fenced release must not count: {w:?}");
        other.acquire(&ep, Mode::Shared).unwrap();
        other.release(&ep).unwrap();
    }
}
