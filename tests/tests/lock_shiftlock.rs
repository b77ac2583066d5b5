//! ShiftLock (shiftlock-fast25.md §3) on both backends: stress with an
//! oracle from several processes × threads, the consecutive-writer
//! threshold, clients killed while holding and while queued, the lock host's
//! one-recovery-per-era rule, and the verbs an acquire/release cycle costs.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use citron_lock::rdma::{Endpoint, Node, RemoteAddr, VerbCounts};
use citron_lock::rwlock::{Mode, RwLockClient};
use citron_lock::shiftlock::entry::{BOUNDARIES, READER_ENTER};
use citron_lock::shiftlock::{
    Entry, EraTable, Postbox, RecoveryReply, RecoveryService, ShiftLockClient, ShiftLockConfig, ShiftLockRef,
    TailPtr,
};
use citronfs_tests::{Backend, TestFabric, BACKENDS, TEST_REGION};

/// Test region layout (the worker takes the offsets as its LOCK argument).
const ENTRY_AT: u64 = 0;
const ERAS_AT: u64 = 64;
const ERA_COUNT: u32 = 4;
const ORACLE_AT: u64 = 128;
/// Oracle words, as the worker documents them.
const INSIDE: u64 = ORACLE_AT;
const ENTRIES: u64 = ORACLE_AT + 16;

const WORKER: &str = env!("CARGO_BIN_EXE_shiftlock-stress-worker");

/// A lock host: the fabric and its recovery service, in this process.
struct Host {
    fabric: TestFabric,
    node: Node,
    service: RecoveryService,
}

impl Host {
    fn new(backend: Backend) -> Host {
        let fabric = TestFabric::new(backend, 1 << 16);
        let node = Node::join(&fabric.addr).unwrap();
        let eras = EraTable { base: RemoteAddr::new(TEST_REGION, ERAS_AT), count: ERA_COUNT };
        let service = RecoveryService::spawn(&node, eras).unwrap();
        Host { fabric, node, service }
    }

    fn lock(&self) -> ShiftLockRef {
        ShiftLockRef { entry: RemoteAddr::new(TEST_REGION, ENTRY_AT), recovery: self.service.locator() }
    }

    fn spec(&self) -> String {
        let s = self.service.locator().service;
        format!("{ENTRY_AT}:{ERAS_AT}:{ERA_COUNT}:{}:{}:{ORACLE_AT}", s.node.0, s.mailbox.0)
    }

    fn client(&self, ep: &Endpoint, lease: Duration, threshold: u32) -> ShiftLockClient {
        let rtt = ep.measure_rtt(RemoteAddr::new(TEST_REGION, ORACLE_AT), 5).unwrap();
        let mut config = ShiftLockConfig::from_rtt(rtt).with_lease(lease);
        config.writer_threshold = threshold;
        ShiftLockClient::new(self.lock(), config, Arc::new(Postbox::new())).unwrap()
    }

    fn worker(&self, command: &str, rest: &[String]) -> (Child, BufReader<ChildStdout>) {
        let mut child = Command::new(WORKER)
            .arg(command)
            .arg(self.fabric.addr.to_string())
            .arg(self.spec())
            .args(rest)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {WORKER}: {e}"));
        let out = BufReader::new(child.stdout.take().unwrap());
        (child, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn stress(
        &self,
        threads: u32,
        iterations: u32,
        read_percent: u32,
        threshold: u32,
        lease: Duration,
        seed: u32,
    ) -> (Child, BufReader<ChildStdout>) {
        let args = [threads, iterations, read_percent, threshold, lease.as_millis() as u32, seed];
        self.worker("stress", &args.map(|a| a.to_string()))
    }

    fn entry(&self, ep: &Endpoint) -> Entry {
        Entry(ep.read_u128(self.lock().entry).unwrap())
    }

    /// No holder, no queue, no one inside by the oracle.
    fn check_idle(&self, ep: &Endpoint) {
        let e = self.entry(ep);
        assert!(e.tail().is_null() && e.rdr_cnt() == 0, "lock not idle: {e:?}");
        assert_eq!(ep.read_u64(RemoteAddr::new(TEST_REGION, INSIDE)).unwrap(), 0, "oracle: someone inside");
    }
}

/// Waits for a worker to print `line`.
fn expect_line(out: &mut BufReader<ChildStdout>, line: &str) {
    let mut s = String::new();
    out.read_line(&mut s).unwrap();
    assert_eq!(s.trim(), line, "worker said {s:?}");
}

/// Waits for a stress worker and returns its RESULT numbers.
fn results(mut child: Child, mut out: BufReader<ChildStdout>) -> HashMap<String, u64> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut out, &mut text).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "worker failed ({status}); said {text:?}");
    let line = text.lines().find_map(|l| l.strip_prefix("RESULT ")).expect("a RESULT line");
    line.split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

fn sum(all: &[HashMap<String, u64>], key: &str) -> u64 {
    all.iter().map(|r| r[key]).sum()
}

fn max(all: &[HashMap<String, u64>], key: &str) -> u64 {
    all.iter().map(|r| r[key]).max().unwrap_or(0)
}

/// Mutual exclusion, reader overlap, bounded bypass and no lost handover:
/// 3 processes × 3 threads, write-intensive (50% readers) and read-intensive
/// (95%), with the paper's threshold N = 16 and with N = 2.
#[test]
fn stress_mutual_exclusion_overlap_bypass_and_handover() {
    for backend in BACKENDS {
        let iterations = match backend {
            Backend::Shm => 800,
            Backend::Tcp | Backend::Ib => 150,
        };
        // A lease far above any critical section here: a recovery or a
        // fenced holder would mean a stalled queue, i.e. a lost handover.
        let lease = Duration::from_secs(2);
        for (read_percent, threshold) in [(50, 16), (50, 2), (95, 16)] {
            let host = Host::new(backend);
            let t = Instant::now();
            let workers: Vec<_> =
                (0..3).map(|p| host.stress(3, iterations, read_percent, threshold, lease, p + 1)).collect();
            let all: Vec<_> = workers.into_iter().map(|(c, o)| results(c, o)).collect();
            let label = format!("{backend:?} {read_percent}% readers, N = {threshold}");
            println!("{label}: {:?} for {} cycles; {all:?}", t.elapsed(), 9 * iterations);
            assert_eq!(
                sum(&all, "shared") + sum(&all, "exclusive"),
                9 * u64::from(iterations),
                "{label}: every acquisition completes"
            );
            for key in ["recovery_requests", "restarts", "dropped", "fenced", "stale_messages"] {
                assert_eq!(sum(&all, key), 0, "{label}: {key} without any failure");
            }
            assert_eq!(host.service.stats().recovered, 0, "{label}");
            assert!(max(&all, "max_cons_wrt") <= u64::from(threshold), "{label}");
            assert!(max(&all, "max_bypass") <= u64::from(threshold) + 1, "{label}");
            if threshold == 2 {
                assert!(sum(&all, "mode_changes") > 0, "{label}: no writer reached the threshold");
            }
            if read_percent == 95 {
                assert!(sum(&all, "overlaps") > 0, "{label}: readers never overlapped");
                assert!(max(&all, "max_readers") >= 2, "{label}");
            }
            let ep = host.node.endpoint().unwrap();
            host.check_idle(&ep);
            assert_eq!(
                ep.read_u64(RemoteAddr::new(TEST_REGION, ENTRIES)).unwrap(),
                9 * u64::from(iterations),
                "{label}: oracle entries"
            );
        }
    }
}

/// §3.5.2 step by step: W1 holds; W2, a reader R and W3 join in that order.
/// With N = 1, W2 (handed the lock once) gives it to the readers with
/// ModeChanged, so R enters before W3, and W3 waits for R's release; with
/// N = 16 the writers keep it (write-preferring) and R enters last.
#[test]
fn writer_threshold_hands_the_lock_to_waiting_readers() {
    for backend in BACKENDS {
        for (threshold, order) in [(1, ["W2", "R", "W3"]), (16, ["W2", "W3", "R"])] {
            let host = Host::new(backend);
            let lease = Duration::from_secs(5);
            let mut handles = Vec::new();
            for (name, mode) in [
                ("W1", Mode::Exclusive),
                ("W2", Mode::Exclusive),
                ("R", Mode::Shared),
                ("W3", Mode::Exclusive),
            ] {
                let ep = host.node.endpoint().unwrap();
                let client = host.client(&ep, lease, threshold);
                handles.push((name, mode, ep, client));
            }
            let (w1, _, w1_ep, mut w1_client) = handles.remove(0);
            assert!(w1_client.begin(&w1_ep, Mode::Exclusive).unwrap(), "{w1} finds the lock free");
            for (name, mode, ep, client) in &mut handles {
                assert!(!client.begin(ep, *mode).unwrap(), "{name} has to wait");
            }
            let e = host.entry(&w1_ep);
            assert_eq!(e.rdr_cnt(), 1);
            assert_eq!(e.tail(), TailPtr::from_client(handles[2].2.addr()).unwrap(), "W3 is the tail");
            let inside = Arc::new(Mutex::new(Vec::<&str>::new()));
            let (entered_tx, entered_rx) = mpsc::channel();
            let mut leave_txs = HashMap::new();
            std::thread::scope(|s| {
                let mut threads = Vec::new();
                for (name, _, ep, mut client) in handles.drain(..) {
                    let (leave_tx, leave_rx) = mpsc::channel::<()>();
                    leave_txs.insert(name, leave_tx);
                    let entered_tx = entered_tx.clone();
                    let inside = inside.clone();
                    threads.push(s.spawn(move || {
                        client.complete(&ep).unwrap();
                        inside.lock().unwrap().push(name);
                        entered_tx.send(name).unwrap();
                        leave_rx.recv().unwrap();
                        inside.lock().unwrap().retain(|n| *n != name);
                        client.release(&ep).unwrap();
                        client.stats()
                    }));
                }
                w1_client.release(&w1_ep).unwrap();
                for expected in order {
                    let name = entered_rx.recv_timeout(Duration::from_secs(20)).expect("someone enters");
                    assert_eq!(name, expected, "{backend:?} N = {threshold}: order of entry");
                    assert_eq!(*inside.lock().unwrap(), vec![name], "{name} is alone inside");
                    leave_txs[name].send(()).unwrap();
                }
                let stats: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
                assert_eq!(w1_client.stats().handovers_sent, 1, "W1 hands over to W2");
                let (w2, w3) = (stats[0], stats[2]);
                if threshold == 1 {
                    assert_eq!((w2.mode_changes_sent, w3.mode_changes_received), (1, 1));
                    assert_eq!(w2.max_cons_wrt, 1);
                } else {
                    assert_eq!((w2.handovers_sent, w3.handovers_received, w3.max_cons_wrt), (1, 1, 2));
                }
            });
            host.check_idle(&host.node.endpoint().unwrap());
        }
    }
}

/// Polls until `cond` holds; returns how long it took.
fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "{what} did not happen within {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    t.elapsed()
}

/// What the survivors of a failure must do: the service recovers exactly
/// once, the others get the lock again within 3 × T_lease (+ drift) plus one
/// check period and one lease of slack after `failed_at`, finish every
/// acquisition, and leave the lock idle.
fn check_survivors(
    host: &Host,
    label: &str,
    failed_at: Instant,
    lease: Duration,
    survivors: Vec<(Child, BufReader<ChildStdout>)>,
    cycles: u64,
) {
    let ep = host.node.endpoint().unwrap();
    let entries = || ep.read_u64(RemoteAddr::new(TEST_REGION, ENTRIES)).unwrap();
    let config = ShiftLockConfig::from_rtt(Duration::ZERO).with_lease(lease);
    let bound = config.stall_timeout() + lease / 2 + lease;
    let recovered =
        failed_at.elapsed() + wait_until("recovery", bound * 4, || host.service.stats().recovered >= 1);
    // Progress: an entry after the recovery (or the survivors already done,
    // if this thread was descheduled while they finished).
    let before = entries();
    let progress = failed_at.elapsed()
        + wait_until("progress after recovery", bound * 4, || {
            let now = entries();
            now > before || now == cycles
        });
    println!(
        "{label}: recovered {recovered:?} and progress {progress:?} after the failure (lease {lease:?}, bound {bound:?})"
    );
    assert!(progress <= bound, "{label}: progress after {progress:?}, beyond {bound:?}");
    let all: Vec<_> = survivors.into_iter().map(|(c, o)| results(c, o)).collect();
    println!("{label}: {all:?}; service {:?}", host.service.stats());
    assert_eq!(sum(&all, "shared") + sum(&all, "exclusive"), cycles, "{label}: every acquisition completes");
    assert_eq!(host.service.stats().recovered, 1, "{label}: one recovery per failure");
    assert!(sum(&all, "recovery_requests") >= 1, "{label}: a waiter asked the host");
    assert_eq!(sum(&all, "fenced"), 0, "{label}");
    host.check_idle(&ep);
}

/// §3.6: a client killed (SIGKILL) while it holds the lock, as writer and as
/// reader; the others wait 3 × T_lease, the host recovers, they go on.
#[test]
fn holder_killed_is_recovered_by_the_host() {
    let lease = Duration::from_millis(400);
    for backend in BACKENDS {
        for mode in ["exclusive", "shared"] {
            let host = Host::new(backend);
            let (mut victim, mut out) = host.worker("hold", &[mode.into(), lease.as_millis().to_string()]);
            expect_line(&mut out, "HOLDING");
            let survivors: Vec<_> = (0..2).map(|p| host.stress(2, 25, 50, 16, lease, p + 1)).collect();
            std::thread::sleep(lease / 2);
            victim.kill().unwrap();
            let killed = Instant::now();
            victim.wait().unwrap();
            check_survivors(
                &host,
                &format!("{backend:?} {mode} holder killed"),
                killed,
                lease,
                survivors,
                100,
            );
        }
    }
}

/// §3.6: a writer killed while queued. The holder (this process) hands over
/// to the dead writer on release; the writers queued behind it and the
/// readers that wait for an epoch flip recover through the host.
#[test]
fn queued_writer_killed_is_recovered_by_the_host() {
    let lease = Duration::from_millis(400);
    for backend in BACKENDS {
        let host = Host::new(backend);
        let ep = host.node.endpoint().unwrap();
        let mut holder = host.client(&ep, lease * 8, 16);
        holder.acquire(&ep, Mode::Exclusive).unwrap();
        let (mut victim, mut out) = host.worker("queue", &[lease.as_millis().to_string()]);
        expect_line(&mut out, "QUEUED");
        let survivors: Vec<_> = (0..2).map(|p| host.stress(2, 25, 50, 16, lease, p + 1)).collect();
        std::thread::sleep(lease / 2);
        victim.kill().unwrap();
        victim.wait().unwrap();
        holder.release(&ep).unwrap();
        let released = Instant::now();
        assert_eq!(holder.stats().handovers_sent, 1, "the holder handed over to the dead writer");
        check_survivors(&host, &format!("{backend:?} queued writer killed"), released, lease, survivors, 100);
    }
}

/// §3.6: the host recovers once per era. A second request for the same
/// (now old) era is rejected and changes nothing; so is one whose stuck
/// `RelCnt` has moved; of several simultaneous requests for one era exactly
/// one recovers.
#[test]
fn stale_second_recovery_for_an_old_era_is_rejected() {
    for backend in BACKENDS {
        let host = Host::new(backend);
        let locator = host.service.locator();
        let lock = host.lock().entry;
        let ep = host.node.endpoint().unwrap();
        let timeout = Duration::from_secs(10);
        // A reader that died holding.
        ep.ext_faa(lock, READER_ENTER, BOUNDARIES).unwrap();
        let stuck = host.entry(&ep);
        let era = locator.current_era(&ep, lock).unwrap();
        let at = stuck.rel_cnt();
        assert_eq!(
            locator.request(&ep, lock, era, at, timeout).unwrap(),
            RecoveryReply::Recovered { lock, era: era + 1 }
        );
        let recovered = host.entry(&ep);
        assert_eq!(recovered, stuck.recovered());
        assert!(recovered.rel_cnt().leaped_from(stuck.rel_cnt()));
        // The same era again (a waiter that timed out on the same stall).
        let ep2 = host.node.endpoint().unwrap();
        assert_eq!(
            locator.request(&ep2, lock, era, at, timeout).unwrap(),
            RecoveryReply::Stale { lock, requested: era, current: era + 1 }
        );
        assert_eq!(host.entry(&ep), recovered, "a rejected request leaves the entry alone");
        assert_eq!(locator.current_era(&ep, lock).unwrap(), era + 1);

        // The current era, but RelCnt has moved since the waiter saw it
        // stuck (a release raced with the request): nothing is reset.
        let era = locator.current_era(&ep, lock).unwrap();
        assert_eq!(
            locator.request(&ep, lock, era, at, timeout).unwrap(),
            RecoveryReply::Progressed { lock, era, rel_cnt: recovered.rel_cnt() }
        );
        assert_eq!(host.entry(&ep), recovered);
        assert_eq!(locator.current_era(&ep, lock).unwrap(), era);

        // A new stall, four waiters asking under the same era at once.
        ep.ext_faa(lock, READER_ENTER, BOUNDARIES).unwrap();
        let stuck = host.entry(&ep);
        let at = stuck.rel_cnt();
        let replies: Vec<RecoveryReply> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let node = host.node.clone();
                    s.spawn(move || {
                        locator.request(&node.endpoint().unwrap(), lock, era, at, timeout).unwrap()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let won = replies.iter().filter(|r| matches!(r, RecoveryReply::Recovered { .. })).count();
        assert_eq!(won, 1, "{backend:?}: {replies:?}");
        assert_eq!(host.entry(&ep), stuck.recovered(), "exactly one leap");
        assert_eq!(locator.current_era(&ep, lock).unwrap(), era + 1);
        // A misaligned address is refused, not "recovered".
        let bad = RemoteAddr::new(TEST_REGION, ENTRY_AT + 8);
        let reply = locator.request(&ep, bad, era + 1, at, timeout).unwrap();
        assert!(matches!(reply, RecoveryReply::Refused { .. }), "{reply:?}");
        let stats = host.service.stats();
        assert_eq!(
            (stats.recovered, stats.stale, stats.progressed, stats.refused),
            (2, 4, 1, 1),
            "{backend:?}"
        );
        // After recovery the lock works.
        let mut c = host.client(&ep, Duration::from_secs(2), 16);
        c.acquire(&ep, Mode::Exclusive).unwrap();
        c.release(&ep).unwrap();
        host.check_idle(&ep);
    }
}

/// Verbs per acquire + release cycle, from the endpoints' counters (only
/// the lock's verbs: the counts are taken around acquire and release).
#[derive(Default)]
struct CycleCounts {
    cycles: u64,
    counts: VerbCounts,
}

impl CycleCounts {
    fn cycle(&mut self, ep: &Endpoint, client: &mut ShiftLockClient, mode: Mode) {
        let before = ep.counts();
        client.acquire(ep, mode).unwrap();
        self.counts += ep.counts() - before;
        std::hint::black_box(ep.read_u64(RemoteAddr::new(TEST_REGION, ORACLE_AT)).unwrap());
        let before = ep.counts();
        client.release(ep).unwrap();
        self.counts += ep.counts() - before;
        self.cycles += 1;
    }

    fn per_cycle(&self) -> String {
        let c = &self.counts;
        let n = self.cycles as f64;
        format!(
            "{:.2} atomics ({:.2} ext_cas, {:.2} ext_faa), {:.2} reads, {:.2} writes, {:.2} messages sent, \
             {:.2} received, {:.2} round trips per cycle over {} cycles",
            c.atomics() as f64 / n,
            c.get(citron_lock::rdma::VerbKind::ExtCas) as f64 / n,
            c.get(citron_lock::rdma::VerbKind::ExtFaa) as f64 / n,
            c.reads() as f64 / n,
            c.writes() as f64 / n,
            c.messages_sent as f64 / n,
            c.messages_received as f64 / n,
            c.round_trips as f64 / n,
            self.cycles
        )
    }
}

/// G1 (§3.1): without contention a cycle is one atomic to acquire and one
/// to release, in either mode, on both backends. Under contention (8
/// threads, 50% readers) we print the averages to compare with Fig. 6
/// (2.01 atomics and 0.36 reads per WI cycle).
#[test]
fn verbs_per_acquire_release_cycle() {
    for backend in BACKENDS {
        let host = Host::new(backend);
        let ep = host.node.endpoint().unwrap();
        let mut client = host.client(&ep, Duration::from_secs(2), 16);
        for mode in [Mode::Shared, Mode::Exclusive] {
            let mut c = CycleCounts::default();
            for _ in 0..200 {
                c.cycle(&ep, &mut client, mode);
            }
            println!("{backend:?} uncontended {mode:?}: {}", c.per_cycle());
            let per = c.counts;
            assert_eq!((per.atomics(), per.reads(), per.writes()), (400, 0, 0), "{backend:?} {mode:?}");
            assert_eq!((per.messages_sent, per.messages_received, per.round_trips), (0, 0, 400));
        }
    }
    for (backend, per_thread) in [(Backend::Shm, 1000), (Backend::Tcp, 150)] {
        let host = Host::new(backend);
        let totals = Mutex::new((CycleCounts::default(), 0, 0));
        let t = Instant::now();
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (host, totals) = (&host, &totals);
                s.spawn(move || {
                    use rand::{Rng, SeedableRng};
                    let ep = host.node.endpoint().unwrap();
                    let mut client = host.client(&ep, Duration::from_secs(2), 16);
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                    let mut c = CycleCounts::default();
                    for _ in 0..per_thread {
                        let mode = if rng.gen_bool(0.5) { Mode::Shared } else { Mode::Exclusive };
                        c.cycle(&ep, &mut client, mode);
                    }
                    let mut all = totals.lock().unwrap();
                    all.0.cycles += c.cycles;
                    all.0.counts += c.counts;
                    all.1 += client.stats().reader_polls;
                    all.2 += client.stats().writer_polls;
                });
            }
        });
        let (all, reader_polls, writer_polls) = totals.into_inner().unwrap();
        println!(
            "{backend:?} contended 8 threads WI, {:?}: {}; reads: {:.2} by waiting readers, {:.2} by waiting \
             writers (paper Fig. 6: 2.01 atomics, 0.36 reads)",
            t.elapsed(),
            all.per_cycle(),
            reader_polls as f64 / all.cycles as f64,
            writer_polls as f64 / all.cycles as f64,
        );
        assert!(all.counts.atomics() >= 2 * all.cycles, "at least one atomic to acquire and one to release");
        assert_eq!(all.counts.reads(), reader_polls + writer_polls, "every read is a counted poll");
        host.check_idle(&host.node.endpoint().unwrap());
    }
}
