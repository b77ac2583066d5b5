//! `citronfs bench ranges`: the range lock microbenchmarks of
//! citron-fast23.md §4.2 (Fig. 6 and 7), with §4.6's false-conflict rate and
//! §4.7's abort rate, every lock side by side in one run.
//!
//! Workload (§4.2): each client acquires and releases ranges of L units
//! (L = 1, 16, 256, or `mixed`: a third of the clients each), left borders
//! Zipf-0.9 over `[0, N - L]` (rank 1 = unit 0, the hottest), no critical
//! section. Clients = processes × threads; the worker processes are this
//! binary re-executed as the hidden `citronfs bench ranges-worker`, started
//! together on a "go" line after every one has set up and warmed up.
//!
//! Locks, all in the same run, on a lock host the bench starts itself (a shm
//! fabric or a tcp software NIC holding the lock memory, plus the RPC range
//! server on loopback tcp):
//! * `citron` — Citron (§3), k = 2, m = 4, T_wait from the measured RTT;
//! * `ss-exact`, `ss-over`, `ss-under` — static segmentation with segment
//!   size L, 8L and L/8 (at least 1); for `mixed` the paper's 1, 16 and 256;
//! * `rpc` — the centralised range lock server (type I), one thread per
//!   connection, an interval tree per instance.
//!
//! Figures per configuration: goodput (acquire+release pairs per second over
//! the run's wall time), p50/p99 acquire latency, verbs per acquire+release
//! by kind and round trips (`Endpoint::counts()`; the RPC server's calls
//! instead, it uses no verbs), and Citron's abort and restart rates
//! (`CitronClient::stats()`). Then §4.6: for k = 1, 2, 5, two independent
//! uniform ranges of size L, whether they overlap logically vs. whether the
//! nodes `TreeShape::split` gives them conflict on the tree (same internal
//! node, ancestor and descendant, or the same leaf with common bits); the
//! rate is false conflicts per lock request (two requests per trial), as in
//! the paper.
//!
//! Choices: N defaults to 2^20 units (the paper's 2^28 would need 2 GiB of
//! lock memory for SS with S = 1; `--units` raises it); the latency is the
//! acquisition's alone, the goodput counts whole pairs.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use citron_lock::citron::tree::{Cover, TreeShape};
use citron_lock::range_lock::rpc::{spawn_range_server, RangeInstanceId, RangeServerConfig};
use citron_lock::range_lock::segments::SegmentLayout;
use citron_lock::range_lock::{RangeLockClient, RangeLockContext, RangeLockSite, RangeLockStats};
use citron_lock::rdma::{
    FabricAddr, Node, RegionId, RegionMemory, RegionTable, RemoteAddr, ShmHost, TcpHost, VerbCounts, VerbKind,
};
use clap::{Args, ValueEnum};
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::{Deserialize, Serialize};

use super::verbs::BackendChoice;
use crate::report::{fmt_ns, Table};

const REGION: RegionId = RegionId(1);
/// The mixed workload's sizes (§4.2).
const MIXED: [u64; 3] = [1, 16, 256];
/// Acquire+release pairs each thread runs before the measured part.
const WARM_UP: u64 = 32;
/// Largest lock region the bench allocates.
const MAX_REGION: u64 = 4 << 30;

/// A range size: a number of units, or the mixed workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LenSpec {
    Fixed(u64),
    Mixed,
}

impl FromStr for LenSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "mixed" {
            return Ok(LenSpec::Mixed);
        }
        match s.parse::<u64>() {
            Ok(0) | Err(_) => Err(format!("range size {s:?} is neither a positive number nor `mixed`")),
            Ok(n) => Ok(LenSpec::Fixed(n)),
        }
    }
}

impl std::fmt::Display for LenSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LenSpec::Fixed(n) => write!(f, "{n}"),
            LenSpec::Mixed => f.write_str("mixed"),
        }
    }
}

impl LenSpec {
    /// The range size of client number `client`.
    fn of_client(self, client: usize) -> u64 {
        match self {
            LenSpec::Fixed(n) => n,
            LenSpec::Mixed => MIXED[client % MIXED.len()],
        }
    }

    fn largest(self) -> u64 {
        match self {
            LenSpec::Fixed(n) => n,
            LenSpec::Mixed => MIXED[MIXED.len() - 1],
        }
    }
}

/// The locks compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum LockChoice {
    Citron,
    SsExact,
    SsOver,
    SsUnder,
    Rpc,
}

impl LockChoice {
    /// The segment size for range size `len`, for the SS variants.
    fn segment(self, len: LenSpec) -> Option<u64> {
        let (under, exact, over) = match len {
            LenSpec::Fixed(l) => ((l / 8).max(1), l, 8 * l),
            // §4.2: "For SS, we test three granularities: 1, 16, and 256."
            LenSpec::Mixed => (1, 16, 256),
        };
        match self {
            LockChoice::SsUnder => Some(under),
            LockChoice::SsExact => Some(exact),
            LockChoice::SsOver => Some(over),
            LockChoice::Citron | LockChoice::Rpc => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            LockChoice::Citron => "citron",
            LockChoice::SsExact => "ss-exact",
            LockChoice::SsOver => "ss-over",
            LockChoice::SsUnder => "ss-under",
            LockChoice::Rpc => "rpc",
        }
    }
}

#[derive(Args, Debug)]
pub struct RangesArgs {
    /// Which verbs backend the one-sided locks use (the RPC server is always
    /// reached over loopback tcp).
    #[arg(long, value_enum, default_value = "shm")]
    backend: BackendChoice,
    /// Range sizes L, comma-separated: numbers and/or `mixed`.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256,mixed")]
    lens: Vec<LenSpec>,
    /// Client counts to run, comma-separated (processes × threads each).
    #[arg(long, value_delimiter = ',', default_value = "2,8")]
    clients: Vec<usize>,
    /// Most worker processes a client count is spread over.
    #[arg(long, default_value_t = 2)]
    processes: usize,
    /// Measured seconds per configuration.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// N: lock units covered (Citron's tree, the segment arrays).
    #[arg(long, default_value_t = 1 << 20)]
    units: u64,
    /// Zipf exponent of the left borders (0 = uniform).
    #[arg(long, default_value_t = 0.9)]
    zipf: f64,
    /// Locks to compare, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "citron,ss-exact,ss-over,ss-under,rpc")]
    locks: Vec<LockChoice>,
    /// Trials (pairs of ranges) per L and k for the false-conflict rate.
    #[arg(long, default_value_t = 100_000)]
    fc_trials: u64,
    /// Citron's T_wait in microseconds (§3.5.5, §4.7), instead of the one
    /// derived from the measured RTT (`CitronConfig::from_rtt`).
    #[arg(long)]
    citron_t_wait_us: Option<f64>,
    /// Seed of every random draw.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Directory for ranges-<backend>.csv, ranges-false-conflicts.csv and
    /// ranges-<backend>-L<len>.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

/// One worker process of `bench ranges` (started by it; not for users).
#[derive(Args, Debug)]
pub struct RangesWorkerArgs {
    #[arg(long)]
    fabric: FabricAddr,
    /// The lock instance: a bincode-encoded `RangeLockSite`, in hex.
    #[arg(long)]
    site: String,
    #[arg(long)]
    len: LenSpec,
    #[arg(long)]
    units: u64,
    #[arg(long)]
    zipf: f64,
    #[arg(long)]
    threads: usize,
    /// The global number of this process's first client (mixed sizes).
    #[arg(long)]
    first_client: usize,
    #[arg(long)]
    seconds: f64,
    #[arg(long)]
    seed: u64,
    /// Citron's T_wait in nanoseconds, if not from the RTT.
    #[arg(long)]
    t_wait_ns: Option<u64>,
    /// Where to write the bincode-encoded report.
    #[arg(long)]
    report: PathBuf,
}

/// What one worker process measured.
#[derive(Debug, Default, Serialize, Deserialize)]
struct WorkerReport {
    ops: u64,
    /// Pairs completed by range size (mixed).
    ops_by_len: Vec<(u64, u64)>,
    /// The longest measured span of its threads.
    elapsed_ns: u64,
    /// Acquire latencies, hdrhistogram V2.
    hist: Vec<u8>,
    counts: VerbCounts,
    stats: RangeLockStats,
    errors: Vec<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        bail!("odd-length hex");
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).context("bad hex")).collect()
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

fn stats_since(now: RangeLockStats, then: RangeLockStats) -> RangeLockStats {
    RangeLockStats {
        acquisitions: now.acquisitions - then.acquisitions,
        aborts: now.aborts - then.aborts,
        restarts: now.restarts - then.restarts,
        mutexes: now.mutexes - then.mutexes,
        waits: now.waits - then.waits,
        rpc_calls: now.rpc_calls - then.rpc_calls,
    }
}

/// Left borders Zipf(s) over `[0, units - len]`.
struct Borders {
    zipf: Zipf<f64>,
}

impl Borders {
    fn new(units: u64, len: u64, s: f64) -> Result<Self> {
        let zipf = Zipf::new(units - len + 1, s).map_err(|e| anyhow!("zipf: {e:?}"))?;
        Ok(Self { zipf })
    }

    fn sample(&self, rng: &mut impl Rng) -> u64 {
        self.zipf.sample(rng) as u64 - 1
    }
}

/// The hidden worker: set up, say `ready`, wait for `go`, run, report.
pub fn worker(args: RangesWorkerArgs) -> Result<()> {
    let site: RangeLockSite =
        citron_lock::rdma::codec::decode(&unhex(&args.site)?).map_err(anyhow::Error::msg)?;
    let node = Node::join(&args.fabric).with_context(|| format!("cannot join {}", args.fabric))?;
    let probe = node.endpoint()?;
    let rtt = probe.measure_rtt(RemoteAddr::new(REGION, 0), 20)?;
    let mut ctx = RangeLockContext::from_rtt(rtt).with_give_up(Duration::from_secs(60));
    if let Some(ns) = args.t_wait_ns {
        ctx.citron.t_wait = Duration::from_nanos(ns);
    }
    let ctx = Arc::new(ctx);
    let barrier = Arc::new(Barrier::new(args.threads + 1));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let handles: Vec<_> = (0..args.threads)
        .map(|t| {
            let (node, ctx, barrier, ready) = (node.clone(), ctx.clone(), barrier.clone(), ready_tx.clone());
            let client = args.first_client + t;
            let len = args.len.of_client(client);
            let (units, zipf, seconds, site) = (args.units, args.zipf, args.seconds, site);
            let seed = args.seed.wrapping_mul(1_000_003).wrapping_add(client as u64);
            std::thread::spawn(move || -> WorkerReport {
                let mut report = WorkerReport::default();
                let setup = (|| -> Result<_> {
                    let ep = node.endpoint()?;
                    let lock = ctx.client(&site)?;
                    Ok((ep, lock, Borders::new(units, len, zipf)?))
                })();
                let (ep, mut lock, borders) = match setup {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready.send(Err(anyhow!("{e:#}")));
                        barrier.wait();
                        report.errors.push(format!("{e:#}"));
                        return report;
                    }
                };
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                // One acquire+release pair; the acquisition's latency.
                let one =
                    |lock: &mut dyn RangeLockClient, rng: &mut rand::rngs::StdRng| -> Result<Duration> {
                        let l = borders.sample(rng);
                        let t = Instant::now();
                        let held = lock.acquire(&ep, l, l + len)?;
                        let latency = t.elapsed();
                        lock.release(&ep, held)?;
                        Ok(latency)
                    };
                let warm = (0..WARM_UP).try_for_each(|_| one(&mut *lock, &mut rng).map(|_| ()));
                let _ = ready.send(warm.map_err(|e| anyhow!("warm-up: {e:#}")));
                barrier.wait();
                ep.reset_counts();
                let before = lock.stats();
                let mut hist = new_hist();
                let start = Instant::now();
                let deadline = start + Duration::from_secs_f64(seconds);
                while Instant::now() < deadline {
                    match one(&mut *lock, &mut rng) {
                        Ok(lat) => {
                            let _ = hist.record((lat.as_nanos() as u64).max(1));
                            report.ops += 1;
                        }
                        Err(e) => {
                            report.errors.push(format!("{e:#}"));
                            break;
                        }
                    }
                }
                report.elapsed_ns = start.elapsed().as_nanos() as u64;
                report.counts = ep.counts();
                report.stats = stats_since(lock.stats(), before);
                report.ops_by_len = vec![(len, report.ops)];
                let mut bytes = Vec::new();
                if let Err(e) = V2Serializer::new().serialize(&hist, &mut bytes) {
                    report.errors.push(format!("histogram: {e:?}"));
                }
                report.hist = bytes;
                report
            })
        })
        .collect();
    drop(ready_tx);
    for _ in 0..args.threads {
        ready_rx.recv().context("a thread ended before it was ready")??;
    }
    println!("ready");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    if line.trim() != "go" {
        bail!("expected `go`, got {line:?}");
    }
    barrier.wait();
    let mut total = WorkerReport::default();
    let mut hist = new_hist();
    for h in handles {
        let r = h.join().map_err(|_| anyhow!("a bench thread panicked"))?;
        total.ops += r.ops;
        total.elapsed_ns = total.elapsed_ns.max(r.elapsed_ns);
        total.counts += r.counts;
        total.stats += r.stats;
        total.errors.extend(r.errors);
        for (len, ops) in r.ops_by_len {
            match total.ops_by_len.iter_mut().find(|(l, _)| *l == len) {
                Some(e) => e.1 += ops,
                None => total.ops_by_len.push((len, ops)),
            }
        }
        if !r.hist.is_empty() {
            let h: Histogram<u64> =
                Deserializer::new().deserialize(&mut r.hist.as_slice()).map_err(|e| anyhow!("{e:?}"))?;
            hist.add(h)?;
        }
    }
    V2Serializer::new().serialize(&hist, &mut total.hist).map_err(|e| anyhow!("{e:?}"))?;
    std::fs::write(&args.report, bincode::serialize(&total)?)
        .with_context(|| format!("cannot write {}", args.report.display()))?;
    Ok(())
}

/// One compared lock at one range size.
struct LockConfig {
    choice: LockChoice,
    segment: Option<u64>,
    site: RangeLockSite,
}

impl LockConfig {
    fn label(&self) -> String {
        match self.segment {
            Some(s) => format!("{} S={s}", self.choice.name()),
            None => self.choice.name().to_string(),
        }
    }
}

/// A running worker process.
struct Worker {
    child: Child,
    report: PathBuf,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.report);
    }
}

/// What one configuration measured.
struct Measured {
    ops: u64,
    wall: Duration,
    hist: Histogram<u64>,
    counts: VerbCounts,
    stats: RangeLockStats,
    ops_by_len: Vec<(u64, u64)>,
}

struct Run<'a> {
    args: &'a RangesArgs,
    fabric: FabricAddr,
    tmp: tempfile::TempDir,
}

impl Run<'_> {
    fn t_wait(&self) -> Option<Duration> {
        self.args.citron_t_wait_us.map(|us| Duration::from_secs_f64(us / 1e6))
    }

    /// Runs `clients` clients of `config` at range size `len`.
    fn measure(&self, config: &LockConfig, len: LenSpec, clients: usize, seq: u64) -> Result<Measured> {
        let procs = self.args.processes.min(clients);
        let exe = std::env::current_exe().context("cannot find the citronfs binary")?;
        let site = hex(&citron_lock::rdma::codec::encode(&config.site));
        let mut workers = Vec::with_capacity(procs);
        let mut first = 0;
        for p in 0..procs {
            let threads = clients / procs + usize::from(p < clients % procs);
            let report = self.tmp.path().join(format!("worker-{seq}-{p}.bin"));
            let child = Command::new(&exe)
                .args(["bench", "ranges-worker", "--fabric", &self.fabric.to_string(), "--site", &site])
                .args(["--len", &len.to_string(), "--units", &self.args.units.to_string()])
                .args(["--zipf", &self.args.zipf.to_string(), "--threads", &threads.to_string()])
                .args(["--first-client", &first.to_string(), "--seconds", &self.args.seconds.to_string()])
                .args(["--seed", &(self.args.seed * 7919 + seq).to_string()])
                .args(self.t_wait().map(|t| format!("--t-wait-ns={}", t.as_nanos())))
                .arg("--report")
                .arg(&report)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("cannot start {}", exe.display()))?;
            workers.push(Worker { child, report });
            first += threads;
        }
        // Every worker set up and warmed up, then all start together.
        let (tx, rx) = std::sync::mpsc::channel();
        for (i, w) in workers.iter_mut().enumerate() {
            let out = w.child.stdout.take().expect("piped");
            let tx = tx.clone();
            std::thread::spawn(move || {
                let line = BufReader::new(out).lines().next();
                let _ = tx.send((i, matches!(line, Some(Ok(ref l)) if l == "ready")));
            });
        }
        drop(tx);
        for _ in 0..procs {
            let (i, ok) =
                rx.recv_timeout(Duration::from_secs(120)).context("a worker did not get ready in 120 s")?;
            if !ok {
                bail!("worker {i} of {} failed before it was ready", config.label());
            }
        }
        for w in workers.iter_mut() {
            let stdin = w.child.stdin.as_mut().expect("piped");
            stdin.write_all(b"go\n")?;
            stdin.flush()?;
        }
        let deadline = Instant::now() + Duration::from_secs_f64(self.args.seconds) + Duration::from_secs(120);
        let mut out = Measured {
            ops: 0,
            wall: Duration::ZERO,
            hist: new_hist(),
            counts: VerbCounts::default(),
            stats: RangeLockStats::default(),
            ops_by_len: Vec::new(),
        };
        for w in workers.iter_mut() {
            let status = loop {
                if let Some(s) = w.child.try_wait()? {
                    break s;
                }
                if Instant::now() > deadline {
                    bail!("a worker of {} did not finish in time", config.label());
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            if !status.success() {
                bail!("a worker of {} failed: {status}", config.label());
            }
            let bytes = std::fs::read(&w.report).context("worker report")?;
            let r: WorkerReport = bincode::deserialize(&bytes).context("worker report")?;
            if let Some(e) = r.errors.first() {
                bail!(
                    "{} with {clients} clients at L={len}: {e} ({} errors)",
                    config.label(),
                    r.errors.len()
                );
            }
            out.ops += r.ops;
            out.wall = out.wall.max(Duration::from_nanos(r.elapsed_ns));
            out.counts += r.counts;
            out.stats += r.stats;
            for (len, ops) in r.ops_by_len {
                match out.ops_by_len.iter_mut().find(|(l, _)| *l == len) {
                    Some(e) => e.1 += ops,
                    None => out.ops_by_len.push((len, ops)),
                }
            }
            let h: Histogram<u64> =
                Deserializer::new().deserialize(&mut r.hist.as_slice()).map_err(|e| anyhow!("{e:?}"))?;
            out.hist.add(h)?;
        }
        out.ops_by_len.sort();
        Ok(out)
    }
}

/// Whether two covers' nodes conflict on the tree: the same internal node,
/// an ancestor and its descendant, or the same leaf with common bits
/// (masked-CAS locks only the requested bits, §3.4).
fn covers_conflict(shape: TreeShape, a: &[Cover], b: &[Cover]) -> bool {
    a.iter().any(|x| {
        b.iter().any(|y| {
            if x.node == y.node {
                !shape.is_leaf(x.node) || (x.start < y.end && y.start < x.end)
            } else {
                shape.ancestors(x.node).any(|p| p == y.node) || shape.ancestors(y.node).any(|p| p == x.node)
            }
        })
    })
}

/// §4.6: (logical conflicts, tree conflicts, false conflicts) among `trials`
/// pairs of independent uniform ranges of `len` units split into ≤ k nodes.
fn false_conflicts(shape: TreeShape, len: u64, k: usize, trials: u64, seed: u64) -> (u64, u64, u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n = shape.units();
    let (mut logical, mut actual, mut false_) = (0, 0, 0);
    for _ in 0..trials {
        let a = rng.gen_range(0..=n - len);
        let b = rng.gen_range(0..=n - len);
        let overlap = a < b + len && b < a + len;
        let conflict = covers_conflict(shape, &shape.split(a, a + len, k), &shape.split(b, b + len, k));
        logical += u64::from(overlap);
        actual += u64::from(conflict);
        false_ += u64::from(conflict && !overlap);
    }
    (logical, actual, false_)
}

fn per_op(n: u64, ops: u64) -> String {
    if ops == 0 {
        "-".into()
    } else {
        format!("{:.2}", n as f64 / ops as f64)
    }
}

pub fn run(args: RangesArgs) -> Result<()> {
    if args.clients.is_empty() || args.clients.contains(&0) {
        bail!("--clients must be positive numbers");
    }
    if args.processes == 0 {
        bail!("--processes must be at least 1");
    }
    if !(args.seconds > 0.0 && args.seconds <= 3600.0) {
        bail!("--seconds must be in (0, 3600]");
    }
    if !(args.zipf >= 0.0 && args.zipf.is_finite()) {
        bail!("--zipf must be a finite number >= 0");
    }
    if args.citron_t_wait_us.is_some_and(|t| !(t > 0.0 && t < 1e6)) {
        bail!("--citron-t-wait-us must be in (0, 1000000)");
    }
    if args.lens.is_empty() || args.locks.is_empty() {
        bail!("--lens and --locks need at least one entry each");
    }
    let largest = args.lens.iter().map(|l| l.largest()).max().unwrap_or(1);
    if args.units <= largest || args.units > 1 << 40 {
        bail!("--units must exceed the largest range ({largest}) and be at most 2^40");
    }

    // Lock memory: Citron's tree and one segment array per distinct S.
    let mut segment_sizes = BTreeSet::new();
    for len in &args.lens {
        for lock in &args.locks {
            segment_sizes.extend(lock.segment(*len));
        }
    }
    let align = |x: u64| x.next_multiple_of(4096);
    let mut offset = 0u64;
    let citron_at = offset;
    offset += align(RangeLockSite::citron_bytes(args.units));
    let mut segment_at = Vec::new();
    for &s in &segment_sizes {
        segment_at.push((s, offset));
        offset += align(SegmentLayout::bytes_for(args.units, s));
    }
    let region_len = offset.max(4096);
    if region_len > MAX_REGION {
        bail!(
            "the lock memory would take {} MiB (static segmentation with S=1 needs 8 bytes a unit): lower --units",
            region_len >> 20
        );
    }

    // The lock host.
    let (fabric, _shm, _tcp) = match args.backend {
        BackendChoice::Shm => {
            let name = format!("bench-ranges-{}", std::process::id());
            let host = ShmHost::create(&name)?;
            host.add_region(REGION, region_len)?;
            (FabricAddr::Shm(name), Some(host), None)
        }
        BackendChoice::Tcp => {
            let regions = Arc::new(RegionTable::new());
            regions.insert(RegionMemory::anonymous(REGION, region_len)?)?;
            let host = TcpHost::spawn("127.0.0.1:0".parse()?, regions)?;
            (FabricAddr::Tcp(host.local_addr()), None, Some(host))
        }
    };
    let server = spawn_range_server("127.0.0.1:0".parse()?, RangeServerConfig::default())?;
    let backend = match args.backend {
        BackendChoice::Shm => "shm",
        BackendChoice::Tcp => "tcp",
    };
    let rtt = Node::join(&fabric)?.endpoint()?.measure_rtt(RemoteAddr::new(REGION, 0), 50)?;
    let t_wait = args
        .citron_t_wait_us
        .map(|us| Duration::from_secs_f64(us / 1e6))
        .unwrap_or(citron_lock::citron::lock::CitronConfig::from_rtt(rtt).t_wait);
    println!(
        "bench ranges: backend {backend} (rtt {}, Citron T_wait {}), N = {} units, Zipf {} left borders, \
         {} s per configuration, clients {:?} over at most {} processes; rpc server {}",
        fmt_ns(rtt.as_nanos() as f64),
        fmt_ns(t_wait.as_nanos() as f64),
        args.units,
        args.zipf,
        args.seconds,
        args.clients,
        args.processes,
        server.local_addr()
    );

    let site_of = |choice: LockChoice, segment: Option<u64>| -> Result<RangeLockSite> {
        Ok(match (choice, segment) {
            (LockChoice::Citron, _) => RangeLockSite::citron(RemoteAddr::new(REGION, citron_at), args.units),
            (LockChoice::Rpc, _) => RangeLockSite::rpc(server.local_addr(), RangeInstanceId(1)),
            (_, Some(s)) => {
                let at = segment_at.iter().find(|(x, _)| *x == s).expect("allocated").1;
                RangeLockSite::segments(RemoteAddr::new(REGION, at), args.units, s)?
            }
            (_, None) => unreachable!("segment sizes of SS variants"),
        })
    };
    let run = Run { args: &args, fabric: fabric.clone(), tmp: tempfile::tempdir()? };

    let mut table = Table::new(&[
        "L",
        "lock",
        "clients",
        "procs",
        "ops",
        "goodput/s",
        "p50",
        "p99",
        "rt/op",
        "read/op",
        "write/op",
        "cas/op",
        "faa/op",
        "mcas/op",
        "mfaa/op",
        "rpc/op",
        "abort%",
        "restart%",
        "ops by L",
        "p50_ns",
        "p99_ns",
    ]);
    let mut summary = Vec::new();
    let mut seq = 0;
    for &len in &args.lens {
        let configs: Vec<LockConfig> = args
            .locks
            .iter()
            .map(|&choice| {
                let segment = choice.segment(len);
                Ok(LockConfig { choice, segment, site: site_of(choice, segment)? })
            })
            .collect::<Result<_>>()?;
        let mut series: Vec<(String, Vec<(f64, f64)>)> =
            configs.iter().map(|c| (c.label(), Vec::new())).collect();
        for &clients in &args.clients {
            for (ci, config) in configs.iter().enumerate() {
                seq += 1;
                let m = run.measure(config, len, clients, seq)?;
                let goodput = m.ops as f64 / m.wall.as_secs_f64().max(1e-9);
                let c = m.counts;
                let p50 = m.hist.value_at_quantile(0.5) as f64;
                let p99 = m.hist.value_at_quantile(0.99) as f64;
                let pct = |n: u64| {
                    if m.stats.acquisitions == 0 {
                        "-".to_string()
                    } else {
                        format!("{:.3}", 100.0 * n as f64 / m.stats.acquisitions as f64)
                    }
                };
                let citron = config.choice == LockChoice::Citron;
                let by_len = if len == LenSpec::Mixed {
                    m.ops_by_len.iter().map(|(l, o)| format!("{l}:{o}")).collect::<Vec<_>>().join(" ")
                } else {
                    "-".into()
                };
                table.push(vec![
                    len.to_string(),
                    config.label(),
                    clients.to_string(),
                    args.processes.min(clients).to_string(),
                    m.ops.to_string(),
                    format!("{goodput:.0}"),
                    fmt_ns(p50),
                    fmt_ns(p99),
                    per_op(c.round_trips + m.stats.rpc_calls, m.ops),
                    per_op(c.get(VerbKind::Read), m.ops),
                    per_op(c.get(VerbKind::Write), m.ops),
                    per_op(c.get(VerbKind::Cas), m.ops),
                    per_op(c.get(VerbKind::Faa), m.ops),
                    per_op(c.get(VerbKind::MaskedCas), m.ops),
                    per_op(c.get(VerbKind::MaskedFaa), m.ops),
                    per_op(m.stats.rpc_calls, m.ops),
                    if citron { pct(m.stats.aborts) } else { "-".into() },
                    if citron { pct(m.stats.restarts) } else { "-".into() },
                    by_len,
                    format!("{p50:.0}"),
                    format!("{p99:.0}"),
                ]);
                eprintln!("  L={len} {} x{clients}: {goodput:.0}/s", config.label());
                series[ci].1.push((clients as f64, goodput));
                summary.push((len, clients, config.label(), config.choice, goodput, p99));
            }
        }
        std::fs::create_dir_all(&args.out)?;
        let png = args.out.join(format!("ranges-{backend}-L{len}.png"));
        let title = format!("range locks on {backend}: goodput vs clients, L = {len}, Zipf {}", args.zipf);
        match crate::plot::lines(&png, &title, "clients", "acquire+release pairs / s", &series) {
            Ok(()) => println!("wrote {}", png.display()),
            Err(e) => log::warn!("no plot: {e}"),
        }
    }
    println!();
    table.print();
    std::fs::create_dir_all(&args.out)?;
    let csv = args.out.join(format!("ranges-{backend}.csv"));
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());

    // Ratios at the largest client count, as Fig. 6 compares them.
    println!();
    let top = *args.clients.iter().max().expect("non-empty");
    for &len in &args.lens {
        let at = |choice: LockChoice| {
            summary
                .iter()
                .find(|r| r.0 == len && r.1 == top && r.3 == choice)
                .map(|r| (r.2.clone(), r.4, r.5))
        };
        let Some((_, citron, citron_p99)) = at(LockChoice::Citron) else { continue };
        for other in [LockChoice::SsExact, LockChoice::SsOver, LockChoice::SsUnder, LockChoice::Rpc] {
            if let Some((label, g, p99)) = at(other) {
                println!(
                    "L={len}, {top} clients: citron / {label}: goodput {:.3}, p99 latency {:.3}",
                    citron / g.max(1e-9),
                    citron_p99 / p99.max(1.0)
                );
            }
        }
    }

    // §4.6: false conflicts of the split.
    let shape = TreeShape::covering(args.units);
    let mut fc_lens: BTreeSet<u64> = [1, 16, 64, 256].into_iter().collect();
    fc_lens.extend(args.lens.iter().filter_map(|l| match l {
        LenSpec::Fixed(n) => Some(*n),
        LenSpec::Mixed => None,
    }));
    let mut fc = Table::new(&["L", "k", "trials", "logical", "tree", "false", "false/request"]);
    for &len in fc_lens.iter().filter(|&&l| l < shape.units()) {
        for k in [1usize, 2, 5] {
            let (logical, tree, false_) =
                false_conflicts(shape, len, k, args.fc_trials, args.seed + len + k as u64);
            fc.push(vec![
                len.to_string(),
                k.to_string(),
                args.fc_trials.to_string(),
                logical.to_string(),
                tree.to_string(),
                false_.to_string(),
                format!("{:.2e}", false_ as f64 / (2 * args.fc_trials) as f64),
            ]);
        }
    }
    println!(
        "\nfalse conflicts of Citron's split (§4.6): uniform pairs over N = {} (tree depth {})",
        shape.units(),
        shape.depth()
    );
    fc.print();
    let csv = args.out.join("ranges-false-conflicts.csv");
    fc.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());
    let st = server.service().stats();
    println!(
        "rpc server: {} granted at once, {} after waiting, {} refused",
        st.granted_at_once.load(std::sync::atomic::Ordering::Relaxed),
        st.granted_after_wait.load(std::sync::atomic::Ordering::Relaxed),
        st.refused.load(std::sync::atomic::Ordering::Relaxed)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn len_specs_parse() {
        assert_eq!("16".parse::<LenSpec>().unwrap(), LenSpec::Fixed(16));
        assert_eq!("mixed".parse::<LenSpec>().unwrap(), LenSpec::Mixed);
        assert!("0".parse::<LenSpec>().is_err());
        assert!("x".parse::<LenSpec>().is_err());
        assert_eq!(LenSpec::Mixed.of_client(4), 16);
    }

    #[test]
    fn segment_sizes_follow_the_paper() {
        let l = LenSpec::Fixed(16);
        assert_eq!(LockChoice::SsExact.segment(l), Some(16));
        assert_eq!(LockChoice::SsOver.segment(l), Some(128));
        assert_eq!(LockChoice::SsUnder.segment(l), Some(2));
        assert_eq!(LockChoice::SsUnder.segment(LenSpec::Fixed(1)), Some(1));
        assert_eq!(LockChoice::SsOver.segment(LenSpec::Mixed), Some(256));
        assert_eq!(LockChoice::Citron.segment(l), None);
    }

    /// §4.6's claim for L ≤ 64 and k = 2 is structural: such a range splits
    /// into at most two leaves, locked bit by bit.
    #[test]
    fn no_false_conflicts_up_to_64_units_with_k_2() {
        let shape = TreeShape::new(3);
        for len in [1, 16, 64] {
            assert_eq!(false_conflicts(shape, len, 2, 5000, len).2, 0, "L={len}");
        }
        // With k = 1 a range straddling a leaf border locks an internal node.
        assert!(false_conflicts(shape, 16, 1, 5000, 9).2 > 0);
    }

    #[test]
    fn same_leaf_conflicts_only_on_common_bits() {
        let shape = TreeShape::new(1);
        let a = shape.split(0, 10, 2);
        let b = shape.split(10, 20, 2);
        let c = shape.split(5, 15, 2);
        assert!(!covers_conflict(shape, &a, &b));
        assert!(covers_conflict(shape, &a, &c));
        let root = shape.split(32, 96, 1);
        assert!(covers_conflict(shape, &root, &b), "an ancestor conflicts with every descendant");
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(unhex(&hex(&[0, 1, 254, 255])).unwrap(), vec![0, 1, 254, 255]);
        assert!(unhex("abc").is_err());
    }
}
