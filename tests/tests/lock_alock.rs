//! ALock (alock-spaa24.md §5) and the verbs layer's test mode that makes it
//! necessary ([`RemoteAtomicity::NicOnly`]: remote RMWs atomic among verbs but
//! not with the host's CPU atomics, as on a real RNIC).
//!
//! * The mode is what breaks a naive lock: host threads CAS a word locally,
//!   clients CAS it remotely. Under `NicOnly` the oracle sees two holders
//!   inside within seconds (the test runs until it does and asserts it);
//!   with the default atomicity the same lock never lets two in.
//! * ALock stays correct under the mode, on shm and tcp, with host threads
//!   in this process and remote clients as threads here and as separate
//!   worker processes (`alock-stress-worker`), under the cross-cohort
//!   oracle of `citronfs_tests::alock_oracle`.
//! * Budgets bound how many entries one cohort makes in a row while the
//!   other waits (≤ 2K, see `citron_lock::alock`), and a large budget is
//!   seen to break the small bound (so the measurement can fail).
//! * Costs: verbs, round trips and messages of an uncontended remote
//!   acquire + release and of a remote handover; no NIC work at all for
//!   local acquisitions.
//! * Bounded waits: every wait ends in `Timeout`; a leader that gives up in
//!   Peterson leaves the lock usable; a vanished host is an error.
//!
//! The tests run one at a time (two busy cores; the timing tests judge
//! waits).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use citron_lock::alock::{
    AlockClient, AlockConfig, AlockHost, AlockLayout, AlockLocalStats, RemoteTail, TAIL_LOCAL, TAIL_REMOTE,
};
use citron_lock::rdma::{Endpoint, Node, RemoteAddr, RemoteAtomicity, VerbKind};
use citron_lock::rwlock::{LockError, Mode, RwLockClient};
use citronfs_tests::alock_oracle::{self as oracle, Access, Oracle};
use citronfs_tests::{Backend, TestFabric, BACKENDS, TEST_REGION};

const REGION_LEN: u64 = 1 << 16;
const LOCK_AT: u64 = 0;
/// A second lock, for cases that leave a lock blocked.
const SPARE_LOCK_AT: u64 = 64;
const POOL_AT: u64 = 4096;
const POOL_SLOTS: u32 = 16;
const ORACLE_AT: u64 = 8192;
const NAIVE_AT: u64 = 12288;
const WORKER: &str = env!("CARGO_BIN_EXE_alock-stress-worker");

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn at(offset: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, offset)
}

fn host(fabric: &TestFabric, config: AlockConfig) -> AlockHost {
    AlockHost::new(fabric.region(), at(POOL_AT), POOL_SLOTS, config).expect("ALock host")
}

fn word(fabric: &TestFabric, offset: u64) -> u64 {
    fabric.region().word(at(offset)).unwrap().load(Ordering::SeqCst)
}

/// Who hammers the lock in one run.
#[derive(Clone, Copy, Debug)]
struct Mix {
    /// Worker processes × remote threads each × critical sections each.
    processes: u64,
    process_threads: u64,
    process_iterations: u64,
    /// Remote clients as threads of this process, and their critical sections.
    remote_threads: u64,
    remote_iterations: u64,
    /// Host threads; each runs until every remote client is done and it has
    /// made at least `local_iterations` entries (so they overlap the whole run).
    local_threads: u64,
    local_iterations: u64,
    local_budget: u32,
    remote_budget: u32,
}

/// What a run did: local handles' stats, remote totals (workers and threads
/// of this process), and the oracle's words.
#[derive(Debug, Default)]
struct Outcome {
    local: AlockLocalStats,
    local_done: u64,
    remote: HashMap<String, u64>,
    remote_done: u64,
    oracle: HashMap<&'static str, u64>,
    elapsed: Duration,
}

fn spawn_workers(fabric: &TestFabric, mix: &Mix) -> Vec<Child> {
    (0..mix.processes)
        .map(|p| {
            Command::new(WORKER)
                .args([
                    "stress".to_string(),
                    format!("--fabric={}", fabric.addr),
                    format!("--threads={}", mix.process_threads),
                    format!("--iterations={}", mix.process_iterations),
                    format!("--lock-at={LOCK_AT}"),
                    format!("--oracle-at={ORACLE_AT}"),
                    format!("--seed={}", p + 1),
                    format!("--local-budget={}", mix.local_budget),
                    format!("--remote-budget={}", mix.remote_budget),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .expect("start alock-stress-worker")
        })
        .collect()
}

fn collect_workers(children: Vec<Child>, into: &mut HashMap<String, u64>) {
    for child in children {
        let out = child.wait_with_output().expect("wait for worker");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "worker failed ({}); stdout: {stdout}", out.status);
        let line = stdout.lines().find_map(|l| l.strip_prefix("result ")).expect("a result line");
        for kv in line.split_whitespace() {
            let (k, v) = kv.split_once('=').expect("key=value");
            *into.entry(k.to_string()).or_default() += v.parse::<u64>().expect("a number");
        }
    }
}

/// One critical section under the oracle; panics if anyone else was inside.
fn critical_section(oracle: &Oracle<'_>, who: &str, i: u64) {
    let others = oracle.enter();
    assert_eq!(others, 0, "{who} entered #{i} with {others} other holders inside");
    let waiting = oracle.access.other_tail(LOCK_AT) != 0;
    oracle.book(waiting);
    if i.is_multiple_of(4) {
        std::thread::yield_now();
    }
    oracle.leave();
}

fn run_mix(fabric: &TestFabric, mix: &Mix) -> Outcome {
    let t = Instant::now();
    let probe = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let rtt = probe.measure_rtt(at(LOCK_AT), 5).unwrap();
    let config = AlockConfig::from_rtt(rtt).with_budgets(mix.local_budget, mix.remote_budget);
    let host = host(fabric, config);
    let workers = spawn_workers(fabric, mix);
    let remote_left = AtomicU64::new(mix.remote_threads + 1);
    let mut out = Outcome::default();
    let (local, remote) = std::thread::scope(|s| {
        let locals: Vec<_> = (0..mix.local_threads)
            .map(|_| {
                let (host, remote_left) = (&host, &remote_left);
                s.spawn(move || {
                    let region = host.memory().clone();
                    let oracle = Oracle { access: Access::Local(&region), base: ORACLE_AT };
                    let mut handle = host.local().unwrap();
                    let mut i = 0;
                    while i < mix.local_iterations || remote_left.load(Ordering::SeqCst) > 0 {
                        let guard =
                            handle.lock(at(LOCK_AT)).unwrap_or_else(|e| panic!("local acquire #{i}: {e}"));
                        critical_section(&oracle, "a host thread", i);
                        guard.unlock().unwrap_or_else(|e| panic!("local release #{i}: {e}"));
                        oracle::think(i);
                        i += 1;
                    }
                    (handle.stats(), i)
                })
            })
            .collect();
        let remotes: Vec<_> = (0..mix.remote_threads)
            .map(|_| {
                let (fabric, remote_left) = (&fabric, &remote_left);
                s.spawn(move || {
                    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
                    let oracle = Oracle { access: Access::Remote(&ep), base: ORACLE_AT };
                    let mut client = AlockClient::new(at(LOCK_AT), config);
                    for i in 0..mix.remote_iterations {
                        client
                            .acquire(&ep, Mode::Exclusive)
                            .unwrap_or_else(|e| panic!("remote acquire #{i}: {e}"));
                        critical_section(&oracle, "a remote client thread", i);
                        client.release(&ep).unwrap_or_else(|e| panic!("remote release #{i}: {e}"));
                        oracle::think(i + 1);
                    }
                    remote_left.fetch_sub(1, Ordering::SeqCst);
                    client.stats()
                })
            })
            .collect();
        collect_workers(workers, &mut out.remote);
        remote_left.fetch_sub(1, Ordering::SeqCst);
        let remote: Vec<_> = remotes.into_iter().map(|h| h.join().expect("remote thread")).collect();
        let local: Vec<_> = locals.into_iter().map(|h| h.join().expect("local thread")).collect();
        (local, remote)
    });
    for (s, n) in local {
        out.local.acquisitions += s.acquisitions;
        out.local.uncontended += s.uncontended;
        out.local.passed += s.passed;
        out.local.peterson += s.peterson;
        out.local.reacquires += s.reacquires;
        out.local.handovers += s.handovers;
        out.local.timeouts += s.timeouts;
        out.local_done += n;
    }
    for s in remote {
        for (k, v) in [
            ("acquisitions", s.acquisitions),
            ("uncontended", s.uncontended),
            ("passed", s.passed),
            ("peterson", s.peterson),
            ("reacquires", s.reacquires),
            ("polls", s.polls),
            ("handovers", s.handovers),
            ("timeouts", s.timeouts),
        ] {
            *out.remote.entry(k.to_string()).or_default() += v;
        }
    }
    out.remote_done = mix.processes * mix.process_threads * mix.process_iterations
        + mix.remote_threads * mix.remote_iterations;
    for (name, off) in [
        ("inside_local", oracle::INSIDE_LOCAL),
        ("inside_remote", oracle::INSIDE_REMOTE),
        ("done_local", oracle::DONE_LOCAL),
        ("done_remote", oracle::DONE_REMOTE),
        ("max_streak_local", oracle::MAX_STREAK_LOCAL),
        ("max_streak_remote", oracle::MAX_STREAK_REMOTE),
        ("switches", oracle::SWITCHES),
        ("contended_local", oracle::CONTENDED_LOCAL),
        ("contended_remote", oracle::CONTENDED_REMOTE),
    ] {
        out.oracle.insert(name, word(fabric, ORACLE_AT + off));
    }
    out.elapsed = t.elapsed();
    out
}

/// What holds after every run: all done, nobody inside, the lock idle.
fn check_complete(backend: Backend, out: &Outcome, fabric: &TestFabric) {
    let o = &out.oracle;
    assert_eq!(o["inside_local"] + o["inside_remote"], 0, "{backend:?}: someone left inside");
    assert_eq!(o["done_local"], out.local_done, "{backend:?}: local entries");
    assert_eq!(o["done_remote"], out.remote_done, "{backend:?}: remote entries");
    assert_eq!(out.remote.get("acquisitions").copied().unwrap_or(0), out.remote_done, "{backend:?}");
    assert_eq!(out.local.acquisitions, out.local_done, "{backend:?}");
    assert_eq!(out.local.timeouts + out.remote.get("timeouts").copied().unwrap_or(0), 0);
    assert!(
        !RemoteTail(word(fabric, LOCK_AT + TAIL_REMOTE)).has_client(),
        "{backend:?}: the remote queue is empty"
    );
    assert_eq!(word(fabric, LOCK_AT + TAIL_LOCAL), 0, "{backend:?}: the local queue is empty");
    assert!(o["switches"] > 0, "{backend:?}: the cohorts never alternated: {out:?}");
}

#[test]
fn alock_excludes_host_threads_and_remote_processes_under_nic_only_atomics() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::with_atomicity(backend, REGION_LEN, RemoteAtomicity::NicOnly);
        let (process_iterations, remote_iterations, local_iterations) = match backend {
            Backend::Shm => (300, 300, 300),
            Backend::Tcp | Backend::Ib => (60, 60, 60),
        };
        let mix = Mix {
            processes: 2,
            process_threads: 2,
            process_iterations,
            remote_threads: 1,
            remote_iterations,
            local_threads: 3,
            local_iterations,
            local_budget: 5,
            remote_budget: 20,
        };
        let out = run_mix(&fabric, &mix);
        println!("{backend:?} nic-only {mix:?}:\n  {out:?}");
        check_complete(backend, &out, &fabric);
        assert!(out.local.handovers > 0, "{backend:?}: no local handover");
        assert!(out.remote["handovers"] > 0, "{backend:?}: no remote handover");
        assert!(
            out.local.peterson > 0 && out.remote["peterson"] > 0,
            "{backend:?}: Peterson never contended"
        );
    }
}

#[test]
fn alock_budgets_bound_consecutive_entries_of_a_cohort() {
    let _serial = serial();
    let (k_local, k_remote) = (2, 3);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, REGION_LEN);
        let (process_iterations, local_iterations) = match backend {
            Backend::Shm => (400, 400),
            Backend::Tcp | Backend::Ib => (80, 80),
        };
        let mix = Mix {
            processes: 2,
            process_threads: 2,
            process_iterations,
            remote_threads: 0,
            remote_iterations: 0,
            local_threads: 4,
            local_iterations,
            local_budget: k_local,
            remote_budget: k_remote,
        };
        let out = run_mix(&fabric, &mix);
        println!("{backend:?} budgets {k_local}/{k_remote} {mix:?}:\n  {out:?}");
        check_complete(backend, &out, &fabric);
        let o = &out.oracle;
        // The bound: counted from the moment the other cohort's tail is set,
        // at most 2K entries of a cohort (see citron_lock::alock, "Budgets").
        assert!(o["max_streak_local"] <= 2 * u64::from(k_local), "{backend:?}: {o:?}");
        assert!(o["max_streak_remote"] <= 2 * u64::from(k_remote), "{backend:?}: {o:?}");
        // The bound was exercised: each cohort entered while the other waited,
        // and each ran out of budget inside its own cohort.
        assert!(o["contended_local"] > 0 && o["contended_remote"] > 0, "{backend:?}: {o:?}");
        assert!(out.local.reacquires > 0 && out.remote["reacquires"] > 0, "{backend:?}: {out:?}");
    }
}

/// The control for the bound above: with a local budget far above it, host
/// threads pass the lock among themselves past 2 × 2 entries while a remote
/// client waits. Runs until the oracle sees it (or fails after 20 s).
#[test]
fn a_large_local_budget_overruns_the_small_bound() {
    let _serial = serial();
    let small_bound = 2 * 2;
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, REGION_LEN);
        let config = AlockConfig::default().with_budgets(10_000, 3);
        let host = host(&fabric, config);
        let stop = AtomicBool::new(false);
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..3 {
                let (host, stop) = (&host, &stop);
                s.spawn(move || {
                    let region = host.memory().clone();
                    let oracle = Oracle { access: Access::Local(&region), base: ORACLE_AT };
                    let mut handle = host.local().unwrap();
                    let mut i = 0;
                    while !stop.load(Ordering::SeqCst) {
                        let _g = handle.lock(at(LOCK_AT)).unwrap();
                        critical_section(&oracle, "a host thread", i);
                        i += 1;
                    }
                });
            }
            for _ in 0..2 {
                let (fabric, stop) = (&fabric, &stop);
                s.spawn(move || {
                    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
                    let oracle = Oracle { access: Access::Remote(&ep), base: ORACLE_AT };
                    let mut client = AlockClient::new(at(LOCK_AT), config);
                    let mut i = 0;
                    while !stop.load(Ordering::SeqCst) {
                        client.lock(&ep).unwrap();
                        critical_section(&oracle, "a remote client thread", i);
                        client.unlock(&ep).unwrap();
                        i += 1;
                    }
                });
            }
            while word(&fabric, ORACLE_AT + oracle::MAX_STREAK_LOCAL) <= small_bound
                && t.elapsed() < Duration::from_secs(20)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            stop.store(true, Ordering::SeqCst);
        });
        let streak = word(&fabric, ORACLE_AT + oracle::MAX_STREAK_LOCAL);
        println!("{backend:?}: local budget 10000 gave a local streak of {streak} in {:?}", t.elapsed());
        assert!(streak > small_bound, "{backend:?}: the streak measure never exceeded {small_bound}");
    }
}

/// Pause between two critical sections of a naive-lock thread.
const THINK: Duration = Duration::from_micros(20);

/// The naive lock: one word, host threads CAS it locally, clients remotely
/// (both retry after a yield). Threads of this process on both sides; runs
/// while `keep_going(fabric, elapsed, double entries so far)`.
struct NaiveRun {
    violations: u64,
    local_done: u64,
    remote_done: u64,
    local_failed_cas: u64,
    remote_failed_cas: u64,
    elapsed: Duration,
}

fn naive_mixed_cas(
    fabric: &TestFabric,
    keep_going: impl Fn(&TestFabric, Duration, u64) -> bool + Sync,
) -> NaiveRun {
    let stop = AtomicBool::new(false);
    let done = [AtomicU64::new(0), AtomicU64::new(0)];
    let failed = [AtomicU64::new(0), AtomicU64::new(0)];
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (stop, done, failed) = (&stop, &done, &failed);
            s.spawn(move || {
                let region = fabric.region();
                let oracle = Oracle { access: Access::Local(&region), base: ORACLE_AT };
                let w = region.word(at(NAIVE_AT)).unwrap();
                while !stop.load(Ordering::SeqCst) {
                    while w.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                        failed[0].fetch_add(1, Ordering::Relaxed);
                        std::thread::yield_now();
                    }
                    if oracle.enter() > 0 {
                        oracle.violation();
                    }
                    std::thread::yield_now();
                    oracle.leave();
                    w.store(0, Ordering::SeqCst);
                    done[0].fetch_add(1, Ordering::Relaxed);
                    // Think time, or a spin lock this unfair starves the
                    // clients, whose CAS takes a round trip.
                    std::thread::sleep(THINK);
                }
            });
        }
        for _ in 0..2 {
            let (stop, done, failed) = (&stop, &done, &failed);
            s.spawn(move || {
                let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
                let oracle = Oracle { access: Access::Remote(&ep), base: ORACLE_AT };
                while !stop.load(Ordering::SeqCst) {
                    while ep.cas(at(NAIVE_AT), 0, 1).unwrap() != 0 {
                        failed[1].fetch_add(1, Ordering::Relaxed);
                        std::thread::yield_now();
                    }
                    if oracle.enter() > 0 {
                        oracle.violation();
                    }
                    std::thread::yield_now();
                    oracle.leave();
                    ep.write_u64(at(NAIVE_AT), 0).unwrap();
                    done[1].fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(THINK);
                }
            });
        }
        loop {
            let violations = word(fabric, ORACLE_AT + oracle::VIOLATIONS_LOCAL)
                + word(fabric, ORACLE_AT + oracle::VIOLATIONS_REMOTE);
            if !keep_going(fabric, t.elapsed(), violations) {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        stop.store(true, Ordering::SeqCst);
    });
    NaiveRun {
        violations: word(fabric, ORACLE_AT + oracle::VIOLATIONS_LOCAL)
            + word(fabric, ORACLE_AT + oracle::VIOLATIONS_REMOTE),
        local_done: done[0].load(Ordering::SeqCst),
        remote_done: done[1].load(Ordering::SeqCst),
        local_failed_cas: failed[0].load(Ordering::SeqCst),
        remote_failed_cas: failed[1].load(Ordering::SeqCst),
        elapsed: t.elapsed(),
    }
}

#[test]
fn a_naive_mixed_cas_lock_breaks_under_nic_only_atomics() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::with_atomicity(backend, REGION_LEN, RemoteAtomicity::NicOnly);
        let run = naive_mixed_cas(&fabric, |_, elapsed, violations| {
            violations == 0 && elapsed < Duration::from_secs(20)
        });
        println!(
            "{backend:?} nic-only: {} double entries after {:?} ({} local, {} remote entries)",
            run.violations, run.elapsed, run.local_done, run.remote_done
        );
        assert!(run.violations > 0, "{backend:?}: the oracle never saw two holders inside at once");
    }
}

#[test]
fn the_same_naive_lock_holds_when_remote_atomics_are_atomic_with_the_host() {
    let _serial = serial();
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, REGION_LEN);
        let enough = match backend {
            Backend::Shm => 4000,
            Backend::Tcp | Backend::Ib => 600,
        };
        let run = naive_mixed_cas(&fabric, |f, elapsed, _| {
            let done = word(f, ORACLE_AT + oracle::DONE_LOCAL).min(word(f, ORACLE_AT + oracle::DONE_REMOTE));
            done < enough && elapsed < Duration::from_secs(20)
        });
        println!(
            "{backend:?} with-host: {} double entries in {:?} ({} local, {} remote entries; {} + {} failed CAS)",
            run.violations, run.elapsed, run.local_done, run.remote_done, run.local_failed_cas, run.remote_failed_cas
        );
        assert_eq!(run.violations, 0, "{backend:?}: two holders inside with atomic verbs");
        assert!(run.local_done >= enough && run.remote_done >= enough, "{backend:?}: too few entries");
        assert!(run.local_failed_cas > 0 && run.remote_failed_cas > 0, "{backend:?}: never contended");
    }
}

/// Verbs per cycle of `cycles` uncontended acquire + release.
fn per_cycle(ep: &Endpoint, client: &mut AlockClient, cycles: u64) -> citron_lock::rdma::VerbCounts {
    ep.reset_counts();
    for _ in 0..cycles {
        client.lock(ep).unwrap();
        client.unlock(ep).unwrap();
    }
    ep.counts()
}

#[test]
fn uncontended_and_handover_costs() {
    let _serial = serial();
    for backend in BACKENDS {
        let mut fabric = TestFabric::new(backend, REGION_LEN);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let config = AlockConfig::from_rtt(ep.measure_rtt(at(LOCK_AT), 5).unwrap());
        // Remote, uncontended: swap + read in one batch, then the release
        // (a masked-CAS on the client and epoch fields).
        let mut client = AlockClient::new(at(LOCK_AT), config);
        const CYCLES: u64 = 100;
        let c = per_cycle(&ep, &mut client, CYCLES);
        println!("{backend:?} remote uncontended, {CYCLES} cycles: {c:?}");
        assert_eq!(c.verbs(), 3 * CYCLES, "{backend:?}: verbs");
        assert_eq!(c.round_trips, 2 * CYCLES, "{backend:?}: round trips");
        assert_eq!(c.get(VerbKind::MaskedCas), 2 * CYCLES, "{backend:?}: the enqueue swap, the release");
        assert_eq!(c.get(VerbKind::Read), CYCLES, "{backend:?}: the Peterson read");
        assert_eq!(c.messages_sent + c.messages_received, 0, "{backend:?}: no messages");
        assert_eq!(client.stats().uncontended, CYCLES);
        assert!(!client.shares_readers());

        // Local, uncontended: the host's CPU only, no verb reaches the NIC.
        let host = host(&fabric, config);
        let mut local = host.local().unwrap();
        let nic_before = fabric.tcp_host().map(|h| h.verbs_executed());
        for _ in 0..1000 {
            local.lock(at(LOCK_AT)).unwrap().unlock().unwrap();
        }
        let nic_after = fabric.tcp_host().map(|h| h.verbs_executed());
        assert_eq!(nic_before, nic_after, "{backend:?}: a local acquisition used the NIC");
        assert_eq!(local.stats().uncontended, 1000);

        // A remote handover: A holds, B queues behind it; A's release finds
        // B's tail, receives B's Successor message and sends a Handover.
        let ep_b = node.endpoint().unwrap();
        let mut b = AlockClient::new(at(LOCK_AT), config);
        client.lock(&ep).unwrap();
        ep.reset_counts();
        let b_tail = RemoteTail::of(ep_b.addr()).unwrap().0;
        std::thread::scope(|s| {
            let b = &mut b;
            let waiter = s.spawn(move || {
                b.lock(&ep_b).unwrap();
                b.unlock(&ep_b).unwrap();
                ep_b.counts()
            });
            let watchdog = Instant::now();
            while ep.read_u64(at(LOCK_AT + TAIL_REMOTE)).unwrap() & RemoteTail::CLIENT != b_tail {
                assert!(watchdog.elapsed() < Duration::from_secs(20), "B never enqueued");
                std::thread::yield_now();
            }
            let before = ep.counts();
            client.unlock(&ep).unwrap();
            let a = ep.counts() - before;
            let bc = waiter.join().unwrap();
            println!("{backend:?} handover: holder {a:?}\n  successor {bc:?}");
            assert_eq!(
                (a.messages_received, a.messages_sent),
                (1, 1),
                "{backend:?}: Successor in, Handover out"
            );
            assert_eq!(a.verbs(), 1, "{backend:?}: only the failed release CAS");
            assert_eq!(
                (bc.messages_sent, bc.messages_received),
                (1, 1),
                "{backend:?}: Successor out, Handover in"
            );
            // B: enqueue batch; waited without a verb; recorded its entry
            // (one masked-FAA, for recovery); released with one masked-CAS.
            assert_eq!((bc.verbs(), bc.round_trips), (4, 3), "{backend:?}: B");
            assert_eq!(bc.get(VerbKind::MaskedFaa), 1, "{backend:?}: B's entry record");
        });
        assert_eq!(b.stats().passed, 1);
        assert_eq!(client.stats().handovers, 1);
        assert!(!RemoteTail(ep.read_u64(at(LOCK_AT + TAIL_REMOTE)).unwrap()).has_client());
        assert_eq!(ep.read_u64(at(LOCK_AT + TAIL_LOCAL)).unwrap(), 0);
        assert_eq!(AlockLayout::LOCK_BYTES, 24);
    }
}

#[test]
fn every_wait_is_bounded_and_a_peterson_give_up_leaves_the_lock_usable() {
    let _serial = serial();
    let give_up = Duration::from_millis(300);
    for backend in BACKENDS {
        let mut fabric = TestFabric::new(backend, REGION_LEN);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let config = AlockConfig::from_rtt(ep.measure_rtt(at(LOCK_AT), 5).unwrap()).with_give_up(give_up);
        let host = host(&fabric, config);
        let mut local = host.local().unwrap();
        let mut remote = AlockClient::new(at(LOCK_AT), config);

        // A host thread gives up in Peterson while a client holds.
        remote.lock(&ep).unwrap();
        let t = Instant::now();
        let r = local.lock(at(LOCK_AT)).map(|_| ());
        assert!(matches!(r, Err(LockError::Timeout(_))), "{backend:?}: {r:?}");
        assert!(t.elapsed() >= give_up && t.elapsed() < give_up * 20, "{backend:?}: {:?}", t.elapsed());
        assert_eq!(local.poisoned(), None, "{backend:?}: a Peterson give-up leaves cleanly");
        assert_eq!(word(&fabric, LOCK_AT + TAIL_LOCAL), 0, "{backend:?}: left the local queue");
        remote.unlock(&ep).unwrap();
        local.lock(at(LOCK_AT)).unwrap().unlock().unwrap();

        // A client gives up in Peterson while a host thread holds.
        let guard = local.lock(at(LOCK_AT)).unwrap();
        let r = remote.lock(&ep);
        assert!(matches!(r, Err(LockError::Timeout(_))), "{backend:?}: {r:?}");
        assert_eq!(remote.poisoned(), None, "{backend:?}");
        assert!(
            !RemoteTail(word(&fabric, LOCK_AT + TAIL_REMOTE)).has_client(),
            "{backend:?}: left the remote queue"
        );
        guard.unlock().unwrap();
        remote.lock(&ep).unwrap();
        remote.unlock(&ep).unwrap();

        // A client queued behind another client gives up: its handle is
        // poisoned (it cannot leave an MCS queue), on a spare lock.
        let ep_b = node.endpoint().unwrap();
        let mut holder = AlockClient::new(at(SPARE_LOCK_AT), config);
        let mut queued = AlockClient::new(at(SPARE_LOCK_AT), config);
        holder.lock(&ep).unwrap();
        let r = queued.lock(&ep_b);
        assert!(matches!(r, Err(LockError::Timeout(_))), "{backend:?}: {r:?}");
        assert!(queued.poisoned().is_some(), "{backend:?}");
        assert!(matches!(queued.lock(&ep_b), Err(LockError::Misuse(_))), "{backend:?}: stays unusable");

        // A vanished host is an error, not a hang.
        if let Some(h) = fabric.tcp_host() {
            h.shutdown();
            let t = Instant::now();
            let r = remote.lock(&ep);
            assert!(matches!(r, Err(LockError::Rdma(_))), "{backend:?}: {r:?}");
            assert!(t.elapsed() < Duration::from_secs(15), "{backend:?}: {:?}", t.elapsed());
        }
    }
}

/// ALock recovery by leases (the paper assumes no failures): a
/// client process SIGKILLed holding the lock, and one SIGKILLed while
/// queued behind a live holder with another client queued behind it. The
/// host's thread (its leader in Peterson, through the host's recovery
/// endpoint) and the clients queued behind the dead one recover the remote
/// queue after 3/2 of the lease; every acquisition then completes, under
/// the oracle.
#[test]
fn clients_killed_holding_or_queued_are_recovered() {
    use citronfs_tests::Watched;
    let _serial = serial();
    let hold = env!("CARGO_BIN_EXE_lock-hold-worker");
    let lease = Duration::from_millis(300);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, REGION_LEN);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let config = AlockConfig::from_rtt(ep.measure_rtt(at(LOCK_AT), 5).unwrap()).with_lease(lease);
        let host = host(&fabric, config).with_recovery(node.endpoint().unwrap());
        let worker = |lock: u64| {
            let args = [
                "alock".to_string(),
                fabric.addr.to_string(),
                lock.to_string(),
                lease.as_millis().to_string(),
            ];
            Watched::spawn(hold, &args)
        };
        let inside = at(ORACLE_AT);
        let enter = |ep: &Endpoint, who: &str| {
            assert_eq!(ep.faa(inside, 1).unwrap(), 0, "{backend:?}: {who} entered beside someone");
        };
        let leave = |ep: &Endpoint| ep.faa(inside, u64::MAX).map(|_| ()).unwrap();

        // 1. A client dies holding: the host's thread gets in, then a client.
        let mut dead = worker(LOCK_AT);
        dead.wait_for("held");
        dead.kill();
        let mut local = host.local().unwrap();
        let g = local.lock(at(LOCK_AT)).unwrap();
        enter(&ep, "the host thread");
        leave(&ep);
        g.unlock().unwrap();
        assert_eq!(local.stats().recoveries, 1, "{backend:?}: {:?}", local.stats());
        let mut c = AlockClient::new(at(LOCK_AT), config);
        c.lock(&ep).unwrap();
        c.unlock(&ep).unwrap();

        // 2. A holds; D queues behind A and dies; E queues behind D. A's
        //    handover goes to the dead; E recovers and gets in; so does the
        //    host's thread.
        let mut a = AlockClient::new(at(LOCK_AT), config);
        a.lock(&ep).unwrap();
        let a_tail = RemoteTail::of(ep.addr()).unwrap().0;
        let mut d = worker(LOCK_AT);
        d.wait_for("acquiring");
        let watchdog = Instant::now();
        while ep.read_u64(at(LOCK_AT + TAIL_REMOTE)).unwrap() & RemoteTail::CLIENT == a_tail {
            assert!(watchdog.elapsed() < Duration::from_secs(20), "D never enqueued");
            std::thread::sleep(Duration::from_millis(1));
        }
        d.kill();
        let stats = std::thread::scope(|s| {
            let e = s.spawn(|| {
                let ep_e = node.endpoint().unwrap();
                let mut e = AlockClient::new(at(LOCK_AT), config);
                e.lock(&ep_e).unwrap();
                enter(&ep_e, "E");
                leave(&ep_e);
                e.unlock(&ep_e).unwrap();
                e.stats()
            });
            std::thread::sleep(lease / 4);
            a.unlock(&ep).unwrap();
            e.join().unwrap()
        });
        assert!(stats.recoveries + stats.requeues > 0, "{backend:?}: {stats:?}");
        let g = local.lock(at(LOCK_AT)).unwrap();
        enter(&ep, "the host thread, after");
        leave(&ep);
        g.unlock().unwrap();
        assert!(!RemoteTail(word(&fabric, LOCK_AT + TAIL_REMOTE)).has_client(), "{backend:?}");
        assert_eq!(word(&fabric, LOCK_AT + TAIL_LOCAL), 0, "{backend:?}");
    }
}
