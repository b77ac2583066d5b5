//! `citronfs bench locks`: the lock microbenchmark of shiftlock-fast25.md
//! §4.2 (Figs. 4–6), every algorithm side by side in one run.
//!
//! Clients repeatedly pick a lock — uniformly or Zipf-0.99 over `--locks` —
//! and a mode (workloads WI: 50% shared, RI: 95%, RO: 100%), acquire it,
//! hold it for a short critical section (`--cs-ns` of busy waiting; the
//! paper releases at once, `--cs-ns 0`) and release it. Per configuration
//! (workload × distribution × algorithm × client count) the table gives the
//! goodput (acquire–release cycles per second, all clients), the p50 and p99
//! latency of an acquisition, and the verbs one cycle costs on average by
//! kind — atomics, READs, WRITEs, two-sided messages — and round trips,
//! from `Endpoint::counts()` (Fig. 6's figure of merit, machine-independent).
//!
//! Clients are `--processes P` × `--threads T`, one endpoint each: the bench
//! re-executes this binary as the hidden `bench-locks-worker` command for
//! every process, and those join the fabric the bench hosts (or `--fabric`).
//! The bench process itself is the lock host: it serves the memory (shm or
//! the tcp software NIC) and runs the [`LockHost`]; it takes no locks. A
//! sweep over `--clients 1,2,4,8` (default: powers of two up to P × T)
//! spreads each count over at most P processes. `--repeat R` runs every
//! configuration R times, interleaved with the others, and reports the
//! median goodput with its range (a busy machine's load drifts).
//!
//! Protocol between bench and worker (stdin / stdout, length-prefixed
//! bincode): the bench sends a [`WorkerPlan`]; the worker opens its
//! endpoints and lock handles, runs a few warm-up cycles, answers one
//! [`READY`] byte, waits for one [`GO`] byte, runs for the planned time and
//! sends a [`WorkerReport`]. Every wait of the bench is bounded; a worker
//! that errs reports the error, and one that hangs is killed.
//!
//! Memory: region 1 holds the lock host's area, then the locks, one per
//! 64-byte line, zeroed before every configuration.
//!
//! Deviations from the paper's setup, and why: one lock host and its
//! clients share one machine (the paper has 5 client machines × 48 cores
//! and a separate server); the default lock count is 1000 instead of 10
//! million, so that a handful of clients meets the contention that 240
//! clients meet over 10 million locks; the figures of merit that do not
//! depend on the machine are the verbs per cycle.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use citron_lock::lock_host::{open_lock, LockContext, LockHost, LockHostConfig, LockHostInfo, LockTiming};
use citron_lock::rdma::{
    Endpoint, FabricAddr, Node, RegionId, RegionMemory, RegionTable, RemoteAddr, ShmHost, TcpHost, VerbCounts,
};
use citron_lock::rwlock::{Algorithm, Mode, RwLockClient};
use clap::{Args, ValueEnum};
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::verbs::BackendChoice;
use crate::report::{fmt_ns, Table};

/// The paper's workloads (§4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum, Serialize, Deserialize)]
pub enum Workload {
    /// Write-intensive: 50% shared.
    Wi,
    /// Read-intensive: 95% shared.
    Ri,
    /// Read-only.
    Ro,
}

impl Workload {
    fn read_percent(self) -> u32 {
        match self {
            Workload::Wi => 50,
            Workload::Ri => 95,
            Workload::Ro => 100,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Workload::Wi => "WI",
            Workload::Ri => "RI",
            Workload::Ro => "RO",
        }
    }
}

/// How a client picks its next lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum)]
pub enum Distribution {
    Uniform,
    Zipf,
}

#[derive(Args, Debug)]
pub struct LocksArgs {
    /// Which backend to host the locks on.
    #[arg(long, value_enum, default_value = "shm")]
    backend: BackendChoice,
    /// Lock algorithms, comma-separated (default: every one built in).
    #[arg(long, value_delimiter = ',')]
    algorithms: Option<Vec<Algorithm>>,
    /// Workloads: wi (50% readers), ri (95%), ro (100%).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "wi,ri,ro")]
    workloads: Vec<Workload>,
    /// Lock choice: uniform and/or zipf.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "zipf")]
    dist: Vec<Distribution>,
    /// Zipf exponent.
    #[arg(long, default_value_t = 0.99)]
    zipf: f64,
    /// Number of locks the clients choose from.
    #[arg(long, default_value_t = 1000)]
    locks: u64,
    /// Client processes (at most; a sweep point with fewer clients uses fewer).
    #[arg(long, default_value_t = 2)]
    processes: u32,
    /// Client threads per process, one endpoint each.
    #[arg(long, default_value_t = 4)]
    threads: u32,
    /// Client counts to sweep, comma-separated (default: 1, 2, 4, ... up to
    /// processes × threads).
    #[arg(long, value_delimiter = ',')]
    clients: Option<Vec<u32>>,
    /// Measured seconds per configuration.
    #[arg(long, default_value_t = 1.0)]
    secs: f64,
    /// Runs of every configuration (interleaved); the table gives the
    /// median goodput and its range, and latencies and verbs over all runs.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Critical section: nanoseconds of busy waiting while holding.
    #[arg(long, default_value_t = 1000)]
    cs_ns: u64,
    /// Use a running region host (`citronfs region-host`) instead of an
    /// in-process one; its region 1 must hold the locks. The lock host
    /// services still run in this process.
    #[arg(long)]
    fabric: Option<FabricAddr>,
    /// Directory for locks-<backend>.csv and the PNG charts.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Seed of the clients' random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

const REGION: RegionId = RegionId(1);
/// The lock host's area starts the region; the locks follow it.
const LOCKS_AT: u64 = 4096;
/// Cycles each client runs before the measurement starts.
const WARMUP_CYCLES: u64 = 20;
/// How long workers may take to join, open and warm up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Beyond the planned run time, how long a worker may take to report.
const REPORT_GRACE: Duration = Duration::from_secs(60);
/// The region never grows beyond this (a shm region is a file in /dev/shm).
const MAX_REGION: u64 = 4 << 30;
/// Locks are this far apart (at least).
const CACHE_LINE: u64 = 64;
/// The worker's answer once it is ready, and the bench's start signal.
const READY: u8 = b'R';
const GO: u8 = b'G';

/// What one worker process does.
#[derive(Debug, Serialize, Deserialize)]
struct WorkerPlan {
    fabric: String,
    host: LockHostInfo,
    algorithm: Algorithm,
    threads: u32,
    locks: u64,
    /// Lock `i` is at `lock_base + i × lock_stride`.
    lock_base: RemoteAddr,
    lock_stride: u64,
    read_percent: u32,
    /// `None`: uniform; `Some(s)`: Zipf with exponent s.
    zipf: Option<f64>,
    run_for: Duration,
    critical_section: Duration,
    seed: u64,
}

/// What one worker process measured.
#[derive(Debug, Serialize, Deserialize)]
struct WorkerReport {
    cycles: u64,
    counts: VerbCounts,
    /// Acquisition latencies in ns, hdrhistogram V2 serialised.
    acquire_ns: Vec<u8>,
    /// The longest thread's measured time.
    wall: Duration,
    /// The median of the threads' measured RTTs.
    rtt: Duration,
    /// What went wrong, one entry per failed thread.
    errors: Vec<String>,
}

/// The host a run uses, kept alive for the run.
enum LocalHost {
    Shm(#[allow(dead_code)] ShmHost),
    Tcp(TcpHost),
    Remote,
}

/// One configuration's result.
struct Row {
    workload: Workload,
    dist: Distribution,
    algorithm: Algorithm,
    threads_per_process: Vec<u32>,
    clients: u32,
    cycles: u64,
    /// Goodput of each repetition.
    goodputs: Vec<f64>,
    hist: Histogram<u64>,
    counts: VerbCounts,
    rtt: Duration,
}

impl Row {
    /// The median goodput over the repetitions (their mean, for two).
    fn goodput(&self) -> f64 {
        let mut g = self.goodputs.clone();
        g.sort_by(f64::total_cmp);
        let n = g.len();
        if n == 0 {
            0.0
        } else if n % 2 == 1 {
            g[n / 2]
        } else {
            (g[n / 2 - 1] + g[n / 2]) / 2.0
        }
    }

    fn goodput_range(&self) -> (f64, f64) {
        let min = self.goodputs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.goodputs.iter().copied().fold(0.0, f64::max);
        (min, max)
    }

    fn same_configuration(&self, other: &Row) -> bool {
        (self.workload, self.dist, self.algorithm, self.clients)
            == (other.workload, other.dist, other.algorithm, other.clients)
    }

    /// Adds another repetition of the same configuration.
    fn absorb(&mut self, other: Row) -> Result<()> {
        self.cycles += other.cycles;
        self.goodputs.extend(other.goodputs);
        self.hist.add(other.hist)?;
        self.counts += other.counts;
        Ok(())
    }

    fn per_cycle(&self, n: u64) -> f64 {
        n as f64 / self.cycles.max(1) as f64
    }
}

pub fn run(args: LocksArgs) -> Result<()> {
    let algorithms = args.algorithms.clone().unwrap_or_else(|| Algorithm::BUILT.to_vec());
    check_args(&args, &algorithms)?;
    let clients = args.clients.clone().unwrap_or_else(|| default_sweep(args.processes * args.threads));
    // One lock per cache line: hot locks of a Zipf draw are neighbours, and
    // on shm, locks sharing a line would contend in the CPU caches whatever
    // the algorithm (RDMA atomics on distinct words do not).
    let stride = algorithms
        .iter()
        .map(|a| a.lock_bytes().next_multiple_of(a.lock_align()))
        .max()
        .unwrap_or(16)
        .next_multiple_of(CACHE_LINE);
    let locks_bytes = args.locks.checked_mul(stride).filter(|b| *b <= MAX_REGION - LOCKS_AT);
    let Some(locks_bytes) = locks_bytes else {
        bail!("--locks {} needs more than {} of lock memory", args.locks, crate::size::ByteSize(MAX_REGION))
    };
    let region_len = (LOCKS_AT + locks_bytes).next_multiple_of(4096);
    let host_config = LockHostConfig::default();
    assert!(host_config.area_bytes() <= LOCKS_AT, "the lock host's area fits below the locks");

    let (fabric, local) = host_fabric(&args, region_len)?;
    let node = Node::join(&fabric).with_context(|| format!("cannot join {fabric}"))?;
    let ep = node.endpoint()?;
    let last = RemoteAddr::new(REGION, region_len - 8);
    ep.read_u64(last).with_context(|| {
        format!("region {} of {fabric} must hold at least {}", REGION.0, crate::size::ByteSize(region_len))
    })?;
    let lock_host = LockHost::start(&node, RemoteAddr::new(REGION, 0), host_config)?;
    let backend = node.backend_name();
    let exe = std::env::current_exe().context("cannot find this executable to start workers")?;
    println!(
        "bench locks: backend {backend}, fabric {fabric}, {} locks, algorithms {}, clients {:?} \
         (at most {} processes), {:.1}s per configuration, critical section {} ns",
        args.locks,
        algorithms.iter().map(|a| a.name()).collect::<Vec<_>>().join(","),
        clients,
        args.processes,
        args.secs,
        args.cs_ns
    );

    // Algorithms innermost, and repetitions outermost: the configurations
    // compared with each other run close together in time, so a change in
    // the machine's load touches all of them alike.
    let mut rows: Vec<Row> = Vec::new();
    for repetition in 0..args.repeat {
        for &workload in &args.workloads {
            for &dist in &args.dist {
                for &c in &clients {
                    for &algorithm in &algorithms {
                        zero_locks(&ep, RemoteAddr::new(REGION, LOCKS_AT), locks_bytes)?;
                        let split = split_clients(c, args.processes);
                        let plan = |threads: u32, p: usize| WorkerPlan {
                            fabric: fabric.to_string(),
                            host: lock_host.info().clone(),
                            algorithm,
                            threads,
                            locks: args.locks,
                            lock_base: RemoteAddr::new(REGION, LOCKS_AT),
                            lock_stride: stride,
                            read_percent: workload.read_percent(),
                            zipf: (dist == Distribution::Zipf).then_some(args.zipf),
                            run_for: Duration::from_secs_f64(args.secs),
                            critical_section: Duration::from_nanos(args.cs_ns),
                            seed: args
                                .seed
                                .wrapping_mul(1_000_003)
                                .wrapping_add(u64::from(repetition) << 16)
                                .wrapping_add(p as u64),
                        };
                        let plans: Vec<WorkerPlan> =
                            split.iter().enumerate().map(|(p, &t)| plan(t, p)).collect();
                        let what = format!("{} {dist:?} {algorithm} {c} clients", workload.name());
                        let reports = run_workers(&exe, plans).with_context(|| what.clone())?;
                        let run = merge(workload, dist, algorithm, &split, reports)
                            .with_context(|| what.clone())?;
                        println!(
                            "  {what:<32} {:>12.0} cycles/s  p50 {:>9}  p99 {:>9}  {:.2} atomics {:.2} reads {:.2} msgs /cycle",
                            run.goodput(),
                            fmt_ns(run.hist.value_at_quantile(0.5) as f64),
                            fmt_ns(run.hist.value_at_quantile(0.99) as f64),
                            run.per_cycle(run.counts.atomics()),
                            run.per_cycle(run.counts.reads()),
                            run.per_cycle(run.counts.messages_sent),
                        );
                        match rows.iter_mut().find(|r| r.same_configuration(&run)) {
                            Some(r) => r.absorb(run)?,
                            None => rows.push(run),
                        }
                    }
                }
            }
        }
    }
    report(&args, backend, &rows)?;
    let recovery = lock_host.stats().shiftlock_recovery;
    println!(
        "lock host: {} ShiftLock recoveries, {} stale and {} progressed requests",
        recovery.recovered, recovery.stale, recovery.progressed
    );
    if let LocalHost::Tcp(h) = &local {
        println!("tcp host: {} verbs executed", h.verbs_executed());
    }
    drop(lock_host);
    drop(local);
    Ok(())
}

fn check_args(args: &LocksArgs, algorithms: &[Algorithm]) -> Result<()> {
    if algorithms.is_empty() {
        bail!("--algorithms is empty");
    }
    if let Some(a) = algorithms.iter().find(|a| !a.is_built()) {
        let built: Vec<&str> = Algorithm::BUILT.iter().map(|a| a.name()).collect();
        bail!("lock algorithm {a} is not built in this binary yet (built: {})", built.join(", "));
    }
    if args.locks == 0 || args.processes == 0 || args.threads == 0 {
        bail!("--locks, --processes and --threads must be at least 1");
    }
    if !(args.secs > 0.0 && args.secs <= 600.0) {
        bail!("--secs must be in (0, 600]");
    }
    if args.repeat == 0 || args.repeat > 100 {
        bail!("--repeat must be between 1 and 100");
    }
    if args.cs_ns > 1_000_000_000 {
        bail!("--cs-ns must be at most one second");
    }
    if !(args.zipf >= 0.0 && args.zipf.is_finite()) {
        bail!("--zipf must be a finite exponent >= 0");
    }
    if args.workloads.is_empty() || args.dist.is_empty() {
        bail!("--workloads and --dist need at least one value");
    }
    if let Some(c) = &args.clients {
        if c.is_empty() || c.contains(&0) || c.iter().any(|&c| c > 4096) {
            bail!("--clients must list counts between 1 and 4096");
        }
    }
    Ok(())
}

/// 1, 2, 4, ... and `max` itself.
fn default_sweep(max: u32) -> Vec<u32> {
    let mut v: Vec<u32> =
        std::iter::successors(Some(1u32), |c| c.checked_mul(2)).take_while(|&c| c < max).collect();
    v.push(max);
    v
}

/// Threads per process for `clients` clients over at most `processes`
/// processes, as even as possible.
fn split_clients(clients: u32, processes: u32) -> Vec<u32> {
    let p = processes.min(clients).max(1);
    (0..p).map(|i| clients / p + u32::from(i < clients % p)).collect()
}

fn host_fabric(args: &LocksArgs, region_len: u64) -> Result<(FabricAddr, LocalHost)> {
    Ok(match (&args.fabric, args.backend) {
        (Some(f), _) => (f.clone(), LocalHost::Remote),
        (None, BackendChoice::Shm) => {
            let name = format!("bench-locks-{}", std::process::id());
            let host = ShmHost::create(&name)?;
            host.add_region(REGION, region_len)?;
            (FabricAddr::Shm(name), LocalHost::Shm(host))
        }
        (None, BackendChoice::Tcp) => {
            let regions = Arc::new(RegionTable::new());
            regions.insert(RegionMemory::anonymous(REGION, region_len)?)?;
            let host = TcpHost::spawn("127.0.0.1:0".parse()?, regions)?;
            (FabricAddr::Tcp(host.local_addr()), LocalHost::Tcp(host))
        }
    })
}

/// Zeroes the lock array (idle for every algorithm) before a configuration.
fn zero_locks(ep: &Endpoint, base: RemoteAddr, len: u64) -> Result<()> {
    const CHUNK: u64 = 1 << 20;
    let zeros = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0;
    while done < len {
        let n = CHUNK.min(len - done);
        ep.write(base + done, &zeros[..n as usize])?;
        done += n;
    }
    Ok(())
}

fn write_frame(w: &mut impl Write, value: &impl Serialize) -> Result<()> {
    let bytes = bincode::serialize(value)?;
    w.write_all(&u32::try_from(bytes.len())?.to_le_bytes())?;
    w.write_all(&bytes)?;
    w.flush()?;
    Ok(())
}

fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 64 << 20 {
        bail!("frame of {len} bytes refused");
    }
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes)?;
    Ok(bincode::deserialize(&bytes)?)
}

/// What a worker's stdout said, as its reader thread saw it.
enum Event {
    Ready,
    /// Boxed: a report is large next to `Ready`.
    Report(usize, Box<Result<WorkerReport>>),
}

/// Kills the workers still running when dropped (an error path).
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// Starts one worker per plan, starts them together, and collects reports.
fn run_workers(exe: &std::path::Path, plans: Vec<WorkerPlan>) -> Result<Vec<WorkerReport>> {
    let n = plans.len();
    let run_for = plans[0].run_for;
    let (tx, rx) = mpsc::channel();
    let mut workers = Workers(Vec::with_capacity(n));
    let mut stdins: Vec<ChildStdin> = Vec::with_capacity(n);
    for (i, plan) in plans.iter().enumerate() {
        let mut child = Command::new(exe)
            .arg("bench-locks-worker")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start worker {}", exe.display()))?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = child.stdout.take().expect("piped stdout");
        workers.0.push(child);
        write_frame(&mut stdin, plan).context("cannot send the plan to a worker")?;
        stdins.push(stdin);
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut b = [0u8; 1];
            match stdout.read_exact(&mut b) {
                Ok(()) if b[0] == READY => {
                    let _ = tx.send(Event::Ready);
                    let _ = tx.send(Event::Report(i, Box::new(read_frame(&mut stdout))));
                }
                Ok(()) => {
                    let _ = tx.send(Event::Report(
                        i,
                        Box::new(Err(anyhow!("worker said {:?} instead of ready", b[0]))),
                    ));
                }
                Err(e) => {
                    let _ = tx.send(Event::Report(
                        i,
                        Box::new(Err(anyhow!("worker exited before it was ready: {e}"))),
                    ));
                }
            }
        });
    }
    drop(tx);
    let mut reports: Vec<Option<WorkerReport>> = (0..n).map(|_| None).collect();
    let mut ready = 0;
    let setup_deadline = Instant::now() + SETUP_TIMEOUT;
    while ready < n {
        let wait = setup_deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Event::Ready) => ready += 1,
            Ok(Event::Report(i, r)) => bail!(
                "worker {i} failed during setup: {:#}",
                r.err().unwrap_or_else(|| anyhow!("early report"))
            ),
            Err(_) => bail!("{} of {n} workers not ready after {SETUP_TIMEOUT:?}", n - ready),
        }
    }
    for s in &mut stdins {
        s.write_all(&[GO])?;
        s.flush()?;
    }
    let report_deadline = Instant::now() + run_for + REPORT_GRACE;
    let mut got = 0;
    while got < n {
        let wait = report_deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Event::Report(i, r)) => {
                let r = (*r).with_context(|| format!("worker {i}"))?;
                if !r.errors.is_empty() {
                    bail!("worker {i}: {}", r.errors.join("; "));
                }
                reports[i] = Some(r);
                got += 1;
            }
            Ok(Event::Ready) => {}
            Err(_) => bail!("{} of {n} workers did not report within {:?}", n - got, run_for + REPORT_GRACE),
        }
    }
    drop(stdins);
    // The workers exit after reporting; `Workers::drop` reaps them.
    let exit_deadline = Instant::now() + REPORT_GRACE;
    for c in &mut workers.0 {
        loop {
            if let Some(status) = c.try_wait()? {
                if !status.success() {
                    bail!("a worker exited with {status} after reporting");
                }
                break;
            }
            if Instant::now() > exit_deadline {
                bail!("a worker did not exit after reporting");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    Ok(reports.into_iter().map(|r| r.expect("every worker reported")).collect())
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

fn merge(
    workload: Workload,
    dist: Distribution,
    algorithm: Algorithm,
    split: &[u32],
    reports: Vec<WorkerReport>,
) -> Result<Row> {
    let mut hist = new_hist();
    let mut counts = VerbCounts::default();
    let mut cycles = 0;
    let mut wall = Duration::ZERO;
    let mut rtts = Vec::new();
    for r in reports {
        let h: Histogram<u64> = Deserializer::new()
            .deserialize(&mut &r.acquire_ns[..])
            .map_err(|e| anyhow!("a worker's histogram: {e:?}"))?;
        hist.add(h)?;
        counts += r.counts;
        cycles += r.cycles;
        wall = wall.max(r.wall);
        rtts.push(r.rtt);
    }
    rtts.sort();
    Ok(Row {
        workload,
        dist,
        algorithm,
        threads_per_process: split.to_vec(),
        clients: split.iter().sum(),
        cycles,
        goodputs: vec![cycles as f64 / wall.as_secs_f64().max(1e-9)],
        hist,
        counts,
        rtt: rtts[rtts.len() / 2],
    })
}

/// (clients, goodput) points of one algorithm.
type Series = Vec<(f64, f64)>;

fn report(args: &LocksArgs, backend: &str, rows: &[Row]) -> Result<()> {
    let mut table = Table::new(&[
        "backend",
        "workload",
        "dist",
        "locks",
        "algorithm",
        "clients",
        "procs",
        "cycles",
        "cycles/s",
        "range",
        "p50",
        "p99",
        "atomics",
        "reads",
        "writes",
        "msgs",
        "rtts",
        "rtt",
        "p50_ns",
        "p99_ns",
    ]);
    for r in rows {
        let p50 = r.hist.value_at_quantile(0.5) as f64;
        let p99 = r.hist.value_at_quantile(0.99) as f64;
        let pc = |n: u64| format!("{:.2}", r.per_cycle(n));
        table.push(vec![
            backend.into(),
            r.workload.name().into(),
            format!("{:?}", r.dist).to_lowercase(),
            args.locks.to_string(),
            r.algorithm.to_string(),
            r.clients.to_string(),
            r.threads_per_process.iter().map(u32::to_string).collect::<Vec<_>>().join("+"),
            r.cycles.to_string(),
            format!("{:.0}", r.goodput()),
            {
                let (lo, hi) = r.goodput_range();
                format!("{:.0}-{:.0}", lo, hi)
            },
            fmt_ns(p50),
            fmt_ns(p99),
            pc(r.counts.atomics()),
            pc(r.counts.reads()),
            pc(r.counts.writes()),
            pc(r.counts.messages_sent),
            pc(r.counts.round_trips),
            fmt_ns(r.rtt.as_nanos() as f64),
            format!("{p50:.0}"),
            format!("{p99:.0}"),
        ]);
    }
    println!(
        "\ncycles/s: median over {} run(s), range: slowest-fastest run; per acquire-release cycle: \
         atomics, reads, writes, msgs (two-sided sends), rtts (round trips)",
        args.repeat
    );
    table.print();
    std::fs::create_dir_all(&args.out)?;
    let csv = args.out.join(format!("locks-{backend}.csv"));
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());

    // Goodput against clients, one chart per workload and distribution.
    let mut charts: BTreeMap<(Workload, Distribution), BTreeMap<String, Series>> = BTreeMap::new();
    for r in rows {
        charts
            .entry((r.workload, r.dist))
            .or_default()
            .entry(r.algorithm.to_string())
            .or_default()
            .push((f64::from(r.clients), r.goodput()));
    }
    for ((w, d), by_alg) in &charts {
        let dist = format!("{d:?}").to_lowercase();
        let png = args.out.join(format!("locks-{backend}-{}-{dist}.png", w.name().to_lowercase()));
        let series: Vec<(String, Vec<(f64, f64)>)> =
            by_alg.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let title = format!("{} {dist}, {} locks, {backend}: goodput", w.name(), args.locks);
        match crate::plot::lines(&png, &title, "clients", "acquire-release cycles/s", &series) {
            Ok(()) => println!("wrote {}", png.display()),
            Err(e) => log::warn!("no plot: {e}"),
        }
    }

    // Ratios at the largest client count, and ShiftLock beside Fig. 6.
    println!();
    let top = rows.iter().map(|r| r.clients).max().unwrap_or(0);
    let at_top: HashMap<(Workload, Distribution, Algorithm), &Row> =
        rows.iter().filter(|r| r.clients == top).map(|r| ((r.workload, r.dist, r.algorithm), r)).collect();
    for &w in &args.workloads {
        for &d in &args.dist {
            let Some(shift) = at_top.get(&(w, d, Algorithm::ShiftLock)) else { continue };
            for other in Algorithm::BUILT.into_iter().filter(|a| *a != Algorithm::ShiftLock) {
                if let Some(o) = at_top.get(&(w, d, other)) {
                    println!(
                        "ratio goodput shiftlock / {other}, {} {d:?}, {top} clients: {:.2}",
                        w.name(),
                        shift.goodput() / o.goodput()
                    );
                }
            }
            let paper = match w {
                Workload::Wi => Some((2.01, 0.36)),
                Workload::Ri => Some((2.01, 0.20)),
                Workload::Ro => None,
            };
            if let (Some((atomics, reads)), Distribution::Zipf) = (paper, d) {
                println!(
                    "shiftlock {} zipf, {top} clients: {:.2} atomics and {:.2} reads per cycle (paper Fig. 6: {atomics} and {reads})",
                    w.name(),
                    shift.per_cycle(shift.counts.atomics()),
                    shift.per_cycle(shift.counts.reads()),
                );
            }
        }
    }
    Ok(())
}

/// The hidden `bench-locks-worker` command: one client process.
pub fn worker() -> Result<()> {
    let mut stdin = std::io::stdin().lock();
    let plan: WorkerPlan = read_frame(&mut stdin).context("reading the plan")?;
    let fabric: FabricAddr = plan.fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric).with_context(|| format!("cannot join {fabric}"))?;
    let threads = plan.threads as usize;
    let ready = Barrier::new(threads + 1);
    let go = Barrier::new(threads + 1);
    let abort = AtomicBool::new(false);
    let results: Vec<Result<ThreadResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (node, plan, ready, go, abort) = (&node, &plan, &ready, &go, &abort);
                s.spawn(move || {
                    let setup = Client::new(node, plan, t);
                    ready.wait();
                    go.wait();
                    let mut client = setup?;
                    if abort.load(Ordering::Relaxed) {
                        bail!("the bench went away before the start");
                    }
                    client.run(plan)
                })
            })
            .collect();
        ready.wait();
        let started =
            std::io::stdout().write_all(&[READY]).and_then(|()| std::io::stdout().flush()).and_then(|()| {
                let mut b = [0u8; 1];
                stdin.read_exact(&mut b)?;
                if b[0] == GO {
                    Ok(())
                } else {
                    Err(std::io::Error::other(format!("expected the start byte, got {:?}", b[0])))
                }
            });
        if let Err(e) = started {
            log::warn!("bench-locks-worker: no start signal ({e}); stopping");
            // Relaxed: the barrier below orders it before the threads' load.
            abort.store(true, Ordering::Relaxed);
        }
        go.wait();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("client thread panicked"))))
            .collect()
    });
    let mut report = WorkerReport {
        cycles: 0,
        counts: VerbCounts::default(),
        acquire_ns: Vec::new(),
        wall: Duration::ZERO,
        rtt: Duration::ZERO,
        errors: Vec::new(),
    };
    let mut hist = new_hist();
    let mut rtts = Vec::new();
    for (t, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                report.cycles += r.cycles;
                report.counts += r.counts;
                report.wall = report.wall.max(r.wall);
                hist.add(r.hist)?;
                rtts.push(r.rtt);
            }
            Err(e) => report.errors.push(format!("thread {t}: {e:#}")),
        }
    }
    rtts.sort();
    report.rtt = rtts.get(rtts.len() / 2).copied().unwrap_or_default();
    V2Serializer::new().serialize(&hist, &mut report.acquire_ns).map_err(|e| anyhow!("histogram: {e:?}"))?;
    let failed = !report.errors.is_empty();
    write_frame(&mut std::io::stdout().lock(), &report)?;
    if failed {
        bail!("some client threads failed");
    }
    Ok(())
}

/// What one client thread measured.
struct ThreadResult {
    cycles: u64,
    counts: VerbCounts,
    hist: Histogram<u64>,
    wall: Duration,
    rtt: Duration,
}

/// One client thread: its endpoint, its handles (one per lock it has
/// touched, opened through the factory), and its random choices.
struct Client {
    ep: Endpoint,
    ctx: LockContext,
    timing: LockTiming,
    host: LockHostInfo,
    handles: HashMap<u64, Box<dyn RwLockClient>>,
    rng: rand::rngs::StdRng,
    zipf: Option<rand_distr::Zipf<f64>>,
}

impl Client {
    fn new(node: &Node, plan: &WorkerPlan, thread: usize) -> Result<Client> {
        let ep = node.endpoint()?;
        let timing = LockTiming::measure(&ep, &plan.host)?;
        let ctx = LockContext::new(&ep);
        let zipf = match plan.zipf {
            Some(s) => Some(rand_distr::Zipf::new(plan.locks, s).map_err(|e| anyhow!("zipf: {e}"))?),
            None => None,
        };
        let rng =
            rand::rngs::StdRng::seed_from_u64(plan.seed.wrapping_mul(1 << 20).wrapping_add(thread as u64));
        let mut client =
            Client { ep, ctx, timing, host: plan.host.clone(), handles: HashMap::new(), rng, zipf };
        for _ in 0..WARMUP_CYCLES {
            client.cycle(plan)?;
        }
        Ok(client)
    }

    fn pick(&mut self, plan: &WorkerPlan) -> (u64, Mode) {
        let lock = match &self.zipf {
            // Zipf samples are ranks 1..=n as floats.
            Some(z) => (self.rng.sample(z) as u64).clamp(1, plan.locks) - 1,
            None => self.rng.gen_range(0..plan.locks),
        };
        let mode =
            if self.rng.gen_range(0..100) < plan.read_percent { Mode::Shared } else { Mode::Exclusive };
        (lock, mode)
    }

    /// One acquire–hold–release cycle; returns the acquisition's latency.
    fn cycle(&mut self, plan: &WorkerPlan) -> Result<Duration> {
        let (lock, mode) = self.pick(plan);
        let handle = match self.handles.entry(lock) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let addr = plan.lock_base + lock * plan.lock_stride;
                e.insert(open_lock(plan.algorithm, &self.ep, &self.host, addr, self.timing, &self.ctx)?)
            }
        };
        let t0 = Instant::now();
        handle.acquire(&self.ep, mode).with_context(|| format!("acquire lock {lock} {mode:?}"))?;
        let latency = t0.elapsed();
        if !plan.critical_section.is_zero() {
            let t = Instant::now();
            while t.elapsed() < plan.critical_section {
                std::hint::spin_loop();
            }
        }
        handle.release(&self.ep).with_context(|| format!("release lock {lock} {mode:?}"))?;
        Ok(latency)
    }

    /// Calls to a lock server made so far by this thread's handles.
    fn server_calls(&self) -> u64 {
        self.handles.values().map(|h| h.server_calls()).sum()
    }

    fn run(&mut self, plan: &WorkerPlan) -> Result<ThreadResult> {
        let mut hist = new_hist();
        self.ep.reset_counts();
        let calls_before = self.server_calls();
        let start = Instant::now();
        let end = start + plan.run_for;
        let mut cycles = 0;
        let mut now = start;
        while now < end {
            let latency = self.cycle(plan)?;
            hist.record((latency.as_nanos() as u64).max(1))?;
            cycles += 1;
            now = Instant::now();
        }
        // An RPC lock's round trips are its calls to the server.
        let mut counts = self.ep.counts();
        counts.round_trips += self.server_calls() - calls_before;
        Ok(ThreadResult { cycles, counts, hist, wall: now - start, rtt: self.timing.rtt })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_and_splits() {
        assert_eq!(default_sweep(8), vec![1, 2, 4, 8]);
        assert_eq!(default_sweep(6), vec![1, 2, 4, 6]);
        assert_eq!(default_sweep(1), vec![1]);
        assert_eq!(split_clients(1, 2), vec![1]);
        assert_eq!(split_clients(8, 2), vec![4, 4]);
        assert_eq!(split_clients(7, 3), vec![3, 2, 2]);
        assert_eq!(split_clients(2, 4), vec![1, 1]);
        for c in 1..40 {
            for p in 1..6 {
                let s = split_clients(c, p);
                assert_eq!(s.iter().sum::<u32>(), c);
                assert!(s.len() as u32 <= p && s.iter().all(|&t| t >= 1));
            }
        }
    }

    #[test]
    fn frames_round_trip_and_refuse_garbage() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &(7u32, "x".to_string())).unwrap();
        let back: (u32, String) = read_frame(&mut &buf[..]).unwrap();
        assert_eq!(back, (7, "x".to_string()));
        assert!(read_frame::<(u32, String)>(&mut &buf[..buf.len() - 1]).is_err());
        assert!(read_frame::<u64>(&mut &[0xff, 0xff, 0xff, 0xff][..]).is_err());
    }
}
