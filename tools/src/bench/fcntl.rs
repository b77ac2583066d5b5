//! `citronfs bench fcntl`: POSIX byte-range lock throughput through real
//! FUSE mounts, every figure side by side in one run.
//!
//! Lock + unlock pairs per second (`F_SETLK` write lock, then `F_UNLCK`) of
//! separate processes ([`worker`]: POSIX locks belong to processes), in
//! three scenarios:
//! * `one` — one process on one mount;
//! * `disjoint` — 4 processes on 2 mounts (2 each), each on its own range;
//! * `shared` — 4 processes on 2 mounts on one range, locking with
//!   `F_SETLKW` so they queue behind each other;
//!
//! with `--lock-len` bytes (4 KiB) at `--lock-offset` (16 KiB) + i MiB for
//! process i (`shared`: all at the offset). The default offset keeps each
//! range, widened by the protocol's byte on each side, inside one Citron
//! leaf; offset 0 shows what a range across a leaf boundary costs, and an
//! offset past the file's tree (4 MiB for a small file; SQLite locks at
//! 1 GiB) what the spillover mutex does;
//!
//! for each `--range-lock` of the cluster (`citron` against `rpc`, the
//! centralised range lock server; the choice is per cluster, so one cluster
//! is started per choice) and each backend of the mounts (`shm`: the
//! servers' memory on this host; `tcp`: the software NIC over loopback, as a
//! client on another host would use it). Each cluster is an embedded
//! meta-server and data server in this process with 2 mounts of it, as
//! `bench io` starts them.
//!
//! Beside them, the FUSE ceiling ([`ceiling`]): a trivial fuser daemon whose
//! `setlk` answers at once, mounted the same way, with 1 and 2 FUSE worker
//! threads (scenarios `one` and `disjoint`; its `shared` row is no ceiling
//! but the self-check of the exclusion oracle below: a daemon that excludes
//! nothing must show overlaps).
//!
//! `shared` also checks what it measures: an exclusion oracle (a counter in
//! `/dev/shm` that each process raises inside its write lock, see
//! [`worker`]) counts the locks granted while another process held the
//! range; any overlap on citronfs fails the run.
//!
//! Cost per operation: one process locks and unlocks its range one call at
//! a time (`--steps`), uncontended, at the lock table (lock tokens off: with
//! them a lone process spends no verb, as the `one` rows show), and the
//! mount's client counters
//! ([`FsClient::verb_counts`], [`FsClient::range_lock_calls`]) are read
//! between calls, so lock and unlock are measured apart. Under contention
//! the same counters give verbs per pair over the whole run (those of the
//! lock waiter thread's retries of blocked `F_SETLKW` requests excepted: its
//! endpoint is not in the counters).
//!
//! SQLite ([`sqlite`]): 4 `sqlite3` processes on the 2 mounts insert rows,
//! one per transaction; transactions per second, then every row and
//! `PRAGMA integrity_check` checked.
//!
//! Ratios: citron / rpc, citron / the best FUSE ceiling of the same shape
//! (`shared` is held against the `disjoint` ceiling: the same processes and
//! mounts), and citron / each peer file system given with `--peer` (two
//! mounts of one volume, e.g. MooseFS's from `setup-moosefs.sh`), measured
//! in the same run: every scenario, the exclusion check and SQLite run on
//! the peers' mounts too. A figure of a peer from another run is never
//! compared against.

mod ceiling;
mod distance;
mod sqlite;
pub mod worker;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::rdma::VerbCounts;
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use citronfs_mount::{BackgroundSession, CitronFuse, FuseCounters, MountOptions};
use clap::Args;

use super::verbs::BackendChoice;
use super::workers::WorkerProcess;
use crate::report::Table;
use crate::size::ByteSize;

pub use worker::FcntlWorkerArgs;

/// Distance between the ranges of `disjoint`: process `i` locks at
/// `--lock-offset + i × SPACING` (far apart: no shared lock unit even after
/// the protocol widens a request by a byte each side).
const SPACING: u64 = 1 << 20;
/// The locked file, in the root of every mount.
const LOCK_FILE: &str = ceiling::FILE_NAME;
/// Processes and mounts of the multi-process scenarios and of SQLite.
const PROCESSES: usize = 4;
const MOUNTS: usize = 2;

/// Another file system measured in the same run (`--peer NAME=A,B`): two
/// mounts of one volume.
#[derive(Clone, Debug)]
pub struct PeerMounts {
    pub(super) name: String,
    pub(super) dirs: Vec<PathBuf>,
}

impl std::str::FromStr for PeerMounts {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, dirs) = s.split_once('=').ok_or_else(|| format!("{s:?} is not NAME=DIR_A,DIR_B"))?;
        let dirs: Vec<PathBuf> = dirs.split(',').filter(|d| !d.is_empty()).map(PathBuf::from).collect();
        if name.is_empty() || dirs.len() != MOUNTS {
            return Err(format!("{s:?}: a peer is NAME={MOUNTS} mount directories, comma-separated"));
        }
        Ok(Self { name: name.to_string(), dirs })
    }
}
/// How long each lock of the exclusion check is held: long enough that two
/// holders at once are all but certain to be seen.
const CHECK_HOLD_US: u64 = 50;

#[derive(Args, Debug)]
pub struct FcntlArgs {
    /// Seconds each throughput scenario runs.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Range locks to compare, one cluster each: citron, segments, rpc.
    #[arg(long, value_delimiter = ',', default_value = "citron,rpc")]
    range_locks: Vec<RangeAlgorithm>,
    /// Backends of the mounts: shm, tcp.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "shm,tcp")]
    backends: Vec<BackendChoice>,
    /// FUSE worker threads of each citronfs mount.
    #[arg(long, default_value_t = MountOptions::default().threads)]
    threads: usize,
    /// FUSE worker threads of the ceiling daemon, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    ceiling_threads: Vec<usize>,
    /// Skip the FUSE ceiling.
    #[arg(long)]
    no_ceiling: bool,
    /// First byte that process 0 locks. The default keeps every process's
    /// range, widened by a byte each side, inside one leaf of a Citron tree
    /// (64 units of 4 KiB); an offset of 0 puts the ranges of processes 1–3
    /// across leaf boundaries (at i MiB), which costs Citron more nodes.
    #[arg(long, default_value = "16KiB")]
    lock_offset: ByteSize,
    /// Bytes each process locks.
    #[arg(long, default_value = "4KiB")]
    lock_len: ByteSize,
    /// Scenarios to run: one, disjoint, shared.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "one,disjoint,shared")]
    scenarios: Vec<Scenario>,
    /// Seconds of the exclusion check: `shared` again with each lock held
    /// 50 µs inside the oracle (0: no check).
    #[arg(long, default_value_t = 1.0)]
    check_secs: f64,
    /// Lock and unlock calls counted one at a time for the verbs per
    /// operation.
    #[arg(long, default_value_t = 200)]
    steps: u32,
    /// SQLite transactions per process (0: no SQLite).
    #[arg(long, default_value_t = 100)]
    sqlite_tx: u32,
    /// SQLite's journal mode: delete (its default: a journal file created
    /// and deleted per transaction), truncate or persist.
    #[arg(long, value_enum, default_value = "delete")]
    sqlite_journal: sqlite::JournalMode,
    /// DRAM of each cluster's data server (as `citronfs mount`'s default).
    #[arg(long, default_value = "1GiB")]
    capacity: ByteSize,
    /// Seconds the citronfs mounts' kernels may cache entries and
    /// attributes, granted by the meta-server and called back on change
    /// (the mounts' `--cache-ttl`: coherent); 0, the default, caches
    /// nothing.
    #[arg(long, default_value_t = 0.0)]
    cache_ttl: f64,
    /// Directory for fcntl*.csv and fcntl.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Distances of a far mount in ms added to each of its round trips
    /// (`distance.rs`): for each, a cluster with a near mount
    /// (shm) and a far one (tcp) runs the F_SETLKW counter, the torn-read
    /// check and SQLite across the two. None by default.
    #[arg(long, value_delimiter = ',')]
    far_ms: Vec<f64>,
    /// Seconds of the counter and of the torn-read check at each distance.
    #[arg(long, default_value_t = 3.0)]
    far_secs: f64,
    /// SQLite transactions per process at each distance (a far process's
    /// take tens of its round trips each).
    #[arg(long, default_value_t = 8)]
    far_sqlite_tx: u32,
    /// Refused F_SETLK calls to make through a tcp mount, counting the
    /// connections the NICs accept meanwhile (0: none).
    #[arg(long, default_value_t = 0)]
    refusals: u64,
    /// Only the --far-ms and --refusals sections.
    #[arg(long)]
    far_only: bool,
    /// Another file system to measure in this run, as NAME=DIR_A,DIR_B:
    /// two mounts of one volume (e.g. moosefs=/mnt/mfsA,/mnt/mfsB). Every
    /// scenario, the exclusion check and SQLite run on it too, and the
    /// ratios compare against it. Repeatable.
    #[arg(long = "peer", value_name = "NAME=DIR_A,DIR_B")]
    peers: Vec<PeerMounts>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    One,
    Disjoint,
    Shared,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::One => "one",
            Scenario::Disjoint => "disjoint",
            Scenario::Shared => "shared",
        }
    }

    fn processes(self) -> usize {
        match self {
            Scenario::One => 1,
            Scenario::Disjoint | Scenario::Shared => PROCESSES,
        }
    }

    fn mounts(self) -> usize {
        match self {
            Scenario::One => 1,
            Scenario::Disjoint | Scenario::Shared => MOUNTS,
        }
    }

    /// `F_SETLKW` rather than `F_SETLK`.
    fn waits(self) -> bool {
        self == Scenario::Shared
    }

    /// The first byte process `i` locks.
    fn start(self, i: usize, offset: u64) -> u64 {
        match self {
            Scenario::One | Scenario::Disjoint => offset + i as u64 * SPACING,
            Scenario::Shared => offset,
        }
    }

    /// The ceiling row this scenario is held against.
    fn ceiling_shape(self) -> Scenario {
        match self {
            Scenario::Shared => Scenario::Disjoint,
            s => s,
        }
    }
}

fn backend_name(b: BackendChoice) -> &'static str {
    match b {
        BackendChoice::Shm => "shm",
        BackendChoice::Tcp => "tcp",
    }
}

/// What the clients of a cluster have spent: verbs (with their round trips)
/// and calls to the RPC range lock server (round trips without verbs).
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    verbs: VerbCounts,
    rpc_calls: u64,
}

impl Cost {
    fn of(clients: &[Arc<FsClient>]) -> Self {
        let mut c = Cost::default();
        for client in clients {
            c.verbs += client.verb_counts();
            c.rpc_calls += client.range_lock_calls();
        }
        c
    }

    fn since(self, earlier: Cost) -> Cost {
        Cost { verbs: self.verbs - earlier.verbs, rpc_calls: self.rpc_calls - earlier.rpc_calls }
    }

    fn add(&mut self, other: Cost) {
        self.verbs += other.verbs;
        self.rpc_calls += other.rpc_calls;
    }

    /// Round trips of verbs and RPC calls together.
    fn round_trips(&self) -> u64 {
        self.verbs.round_trips + self.rpc_calls
    }
}

/// An embedded cluster (meta-server, data server) with its mounts; unmounts
/// and stops in that order when dropped. `bench meta` starts its clusters
/// here too.
pub(super) struct Cluster {
    sessions: Vec<BackgroundSession>,
    pub(super) clients: Vec<Arc<FsClient>>,
    /// The mounts' FUSE request counters.
    pub(super) requests: Vec<FuseCounters>,
    pub(super) dirs: Vec<PathBuf>,
    _data: DataServer,
    _meta: MetaServer,
    _root: tempfile::TempDir,
}

/// How a benchmark cluster's mounts let their kernels cache attributes
/// and entries (the two TTLs of [`MountOptions`]; zero: not at all).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Caching {
    /// Cached without asking anyone: not coherent across mounts.
    pub attr_ttl: Duration,
    /// Granted by the meta-server and invalidated on change: coherent.
    pub cache_ttl: Duration,
}

impl Cluster {
    /// `far`: the last mount is that much farther away (tcp, the test-only
    /// added round-trip time), the others as `backend` says.
    pub(super) fn start(
        range: RangeAlgorithm,
        backend: BackendChoice,
        threads: usize,
        mounts: usize,
        capacity: u64,
        far: Option<Duration>,
    ) -> Result<Self> {
        Self::start_caching(range, backend, threads, mounts, capacity, far, Caching::default())
    }

    /// As [`Cluster::start`], with mounts whose kernel caches attributes and
    /// entries as `caching` says.
    pub(super) fn start_caching(
        range: RangeAlgorithm,
        backend: BackendChoice,
        threads: usize,
        mounts: usize,
        capacity: u64,
        far: Option<Duration>,
        caching: Caching,
    ) -> Result<Self> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let tag = format!("fcntl-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse()?);
        cfg.slot_bytes = 16 << 20;
        cfg.lock_choice.range = range;
        // Published for same-host mounts; the tcp runs' mounts ignore it.
        cfg.shm = Some(format!("{tag}-meta"));
        let meta = MetaServer::start(cfg).context("cannot start the meta-server")?;
        let data = DataServer::start(
            "127.0.0.1:0".parse()?,
            meta.local_addr(),
            capacity,
            Some(&format!("{tag}-data")),
        )
        .context("cannot start the data server")?;
        let root = tempfile::tempdir()?;
        let (mut sessions, mut clients, mut dirs) = (Vec::new(), Vec::new(), Vec::new());
        let mut requests = Vec::new();
        for i in 0..mounts {
            let dir = root.path().join(format!("mnt-{i}"));
            std::fs::create_dir_all(&dir)?;
            let mut config = ClientConfig::new(meta.local_addr());
            config.timeout = Duration::from_secs(10);
            config.transport = match backend {
                BackendChoice::Shm => Transport::Auto,
                BackendChoice::Tcp => Transport::Tcp,
            };
            if let (Some(far), true) = (far, i + 1 == mounts) {
                config.transport = Transport::Tcp;
                config.added_rtt = far;
            }
            let client = FsClient::connect(config).context("cannot join the cluster")?;
            let options = MountOptions { attr_ttl: caching.attr_ttl, cache_ttl: caching.cache_ttl, threads };
            let fs = CitronFuse::new(client, options);
            clients.push(fs.client());
            requests.push(fs.requests());
            sessions.push(
                citronfs_mount::spawn_mount(fs, &dir)
                    .context("cannot mount (needs root, /dev/fuse and fusermount3)")?,
            );
            dirs.push(dir);
        }
        Ok(Self { sessions, clients, requests, dirs, _data: data, _meta: meta, _root: root })
    }

    fn cost(&self) -> Cost {
        Cost::of(&self.clients)
    }

    /// Connections the cluster's NICs have accepted.
    fn nic_connections(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        self._meta.nic_stats().connections.load(Relaxed) + self._data.nic_stats().connections.load(Relaxed)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for s in self.sessions.drain(..) {
            if let Err(e) = s.umount_and_join() {
                log::warn!("unmount failed: {e}");
            }
        }
    }
}

/// The ceiling daemon's mounts.
struct CeilingMounts {
    sessions: Vec<BackgroundSession>,
    dirs: Vec<PathBuf>,
    _root: tempfile::TempDir,
}

impl CeilingMounts {
    fn start(threads: usize, mounts: usize) -> Result<Self> {
        let root = tempfile::tempdir()?;
        let (mut sessions, mut dirs) = (Vec::new(), Vec::new());
        for i in 0..mounts {
            let dir = root.path().join(format!("ceiling-{i}"));
            std::fs::create_dir_all(&dir)?;
            sessions.push(
                ceiling::mount(&dir, threads)
                    .context("cannot mount the ceiling daemon (needs root, /dev/fuse and fusermount3)")?,
            );
            dirs.push(dir);
        }
        Ok(Self { sessions, dirs, _root: root })
    }
}

impl Drop for CeilingMounts {
    fn drop(&mut self) {
        for s in self.sessions.drain(..) {
            if let Err(e) = s.umount_and_join() {
                log::warn!("unmount failed: {e}");
            }
        }
    }
}

/// A lock-taking worker process (`bench fcntl-worker`) on the benchmarks'
/// worker harness.
struct Worker(WorkerProcess);

impl std::ops::Deref for Worker {
    type Target = WorkerProcess;
    fn deref(&self) -> &WorkerProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut WorkerProcess {
        &mut self.0
    }
}

impl Worker {
    fn spawn(
        exe: &Path,
        path: &Path,
        (start, len): (u64, u64),
        wait: bool,
        oracle: Option<&Path>,
        counter: bool,
        label: String,
    ) -> Result<Self> {
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "fcntl-worker", "--path"]).arg(path).args([
            "--start",
            &start.to_string(),
            "--len",
            &len.to_string(),
        ]);
        if wait {
            cmd.arg("--wait");
        }
        if let Some(o) = oracle {
            cmd.arg("--oracle").arg(o);
        }
        if counter {
            cmd.arg("--counter");
        }
        Ok(Self(WorkerProcess::spawn(label, &mut cmd, Duration::from_secs(30))?))
    }

    /// `ok NANOS` → nanoseconds.
    fn ask_timed(&mut self, command: &str) -> Result<u64> {
        self.send(command)?;
        let a = self.answer(Duration::from_secs(30))?;
        a.strip_prefix("ok ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow!("{}: bad answer {a:?} to {command}", self.label()))
    }
}

/// Pairs per second of one scenario: the sum of the processes' rates, and
/// the slowest and fastest process.
#[derive(Clone, Debug)]
struct Throughput {
    pairs: u64,
    per_s: f64,
    min: f64,
    max: f64,
    /// `shared`: how often a process found another one inside the write
    /// lock it had just been granted (the exclusion oracle; must be 0).
    overlaps: Option<u64>,
    /// Each process's pairs per second (process i on mount i % mounts).
    rates: Vec<f64>,
}

/// What each process does inside each of its locks.
#[derive(Clone, Copy, Debug)]
struct Inside {
    /// Holds it this long (a busy wait, inside the exclusion oracle).
    hold_us: u64,
    /// Adds one to the counter in the locked bytes (`worker`'s `--counter`).
    counter: bool,
}

impl Inside {
    const NOTHING: Inside = Inside { hold_us: 0, counter: false };
    const HOLD_FOR_CHECK: Inside = Inside { hold_us: CHECK_HOLD_US, counter: false };
    const COUNT: Inside = Inside { hold_us: 0, counter: true };
}

/// Runs `scenario`; every process locks `lock.1` bytes from its start
/// ([`Scenario::start`] with offset `lock.0`).
fn run_pairs(
    exe: &Path,
    dirs: &[PathBuf],
    scenario: Scenario,
    lock: (u64, u64),
    secs: f64,
    inside: Inside,
    label: &str,
) -> Result<Throughput> {
    if dirs.len() < scenario.mounts() {
        bail!("{label}: {} mounts, {} needed", dirs.len(), scenario.mounts());
    }
    // The processes of `shared` lock one range: the oracle checks that
    // they never hold it together.
    let oracle = if scenario == Scenario::Shared {
        let f = tempfile::Builder::new()
            .prefix("citronfs-fcntl-oracle-")
            .tempfile_in("/dev/shm")
            .context("cannot create the exclusion oracle in /dev/shm")?;
        f.as_file().set_len(8)?;
        Some(f)
    } else {
        None
    };
    let mut workers = Vec::new();
    for i in 0..scenario.processes() {
        let path = dirs[i % scenario.mounts()].join(LOCK_FILE);
        let who = format!("{label} worker {i}");
        let range = (scenario.start(i, lock.0), lock.1);
        let o = oracle.as_ref().map(|f| f.path());
        workers.push(Worker::spawn(exe, &path, range, scenario.waits(), o, inside.counter, who)?);
    }
    for w in &mut workers {
        w.send(&format!("run {secs} {}", inside.hold_us))?;
    }
    let within = Duration::from_secs_f64(secs) + Duration::from_secs(60);
    let mut rates = Vec::new();
    let mut pairs = 0;
    let mut overlaps = 0;
    for w in &mut workers {
        let a = w.answer(within)?;
        let parsed = a.strip_prefix("done ").and_then(|rest| {
            let mut it = rest.split(' ').map(|x| x.parse::<u64>().ok());
            Some((it.next()??, it.next()??, it.next()??))
        });
        let (n, ns, o) = parsed.ok_or_else(|| anyhow!("{}: bad answer {a:?}", w.label()))?;
        pairs += n;
        overlaps += o;
        rates.push(n as f64 / (ns as f64 / 1e9));
    }
    drop(workers);
    Ok(Throughput {
        pairs,
        per_s: rates.iter().sum(),
        min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        max: rates.iter().copied().fold(0.0, f64::max),
        overlaps: oracle.map(|_| overlaps),
        rates,
    })
}

/// Lock and unlock of one process, uncontended, at the lock table (no
/// lock token), counted one call at a time.
struct StepCosts {
    steps: u32,
    lock: Cost,
    unlock: Cost,
    lock_ns: Vec<u64>,
    unlock_ns: Vec<u64>,
}

fn measure_steps(
    exe: &Path,
    cluster: &Cluster,
    lock: (u64, u64),
    steps: u32,
    label: &str,
) -> Result<StepCosts> {
    // The lock table's protocol: a lone process would otherwise lock under
    // a lock token, with no verb at all (the `one` rows show that).
    cluster.clients.iter().for_each(|c| c.set_lock_tokens(false));
    let costs = measure_table_steps(exe, cluster, lock, steps, label);
    cluster.clients.iter().for_each(|c| c.set_lock_tokens(true));
    costs
}

fn measure_table_steps(
    exe: &Path,
    cluster: &Cluster,
    lock: (u64, u64),
    steps: u32,
    label: &str,
) -> Result<StepCosts> {
    let path = cluster.dirs[0].join(LOCK_FILE);
    let mut w = Worker::spawn(exe, &path, lock, false, None, false, format!("{label} steps"))?;
    // The first lock of a file creates its lock table: not a steady cost.
    w.ask_timed("lock")?;
    w.ask_timed("unlock")?;
    let mut s = StepCosts {
        steps,
        lock: Cost::default(),
        unlock: Cost::default(),
        lock_ns: Vec::new(),
        unlock_ns: Vec::new(),
    };
    for _ in 0..steps {
        let c0 = cluster.cost();
        s.lock_ns.push(w.ask_timed("lock")?);
        let c1 = cluster.cost();
        s.unlock_ns.push(w.ask_timed("unlock")?);
        let c2 = cluster.cost();
        s.lock.add(c1.since(c0));
        s.unlock.add(c2.since(c1));
    }
    Ok(s)
}

/// One row of the throughput table.
struct PairsRow {
    system: String,
    backend: &'static str,
    scenario: Scenario,
    threads: usize,
    t: Throughput,
    /// Spent by the clients over the run (citronfs only).
    cost: Option<Cost>,
}

/// One run of the exclusion check.
struct CheckRow {
    system: String,
    backend: &'static str,
    t: Throughput,
}

struct VerbsRow {
    range: RangeAlgorithm,
    backend: &'static str,
    steps: StepCosts,
}

struct SqliteRow {
    system: String,
    backend: &'static str,
    run: sqlite::SqliteRun,
}

fn per(x: u64, n: u64) -> String {
    format!("{:.2}", x as f64 / n.max(1) as f64)
}

fn median_us(ns: &[u64]) -> f64 {
    let mut v = ns.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).map_or(0.0, |&n| n as f64 / 1e3)
}

fn mean_us(ns: &[u64]) -> f64 {
    ns.iter().sum::<u64>() as f64 / ns.len().max(1) as f64 / 1e3
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.0}"))
}

fn validate(args: &FcntlArgs) -> Result<()> {
    if !(args.secs.is_finite() && args.secs > 0.0) {
        bail!("--secs must be a positive number of seconds");
    }
    if !(args.check_secs.is_finite() && args.check_secs >= 0.0) {
        bail!("--check-secs must be a number of seconds (0: no exclusion check)");
    }
    if args.range_locks.is_empty() || args.backends.is_empty() || args.scenarios.is_empty() {
        bail!("--range-locks, --backends and --scenarios need at least one value");
    }
    if args.threads == 0 || args.ceiling_threads.contains(&0) {
        bail!("FUSE thread counts must be 1 or more");
    }
    if args.capacity.0 < 64 << 20 {
        bail!("--capacity must be at least 64MiB");
    }
    if args.lock_len.0 == 0 || args.lock_len.0 >= SPACING || args.lock_offset.0 > 1 << 60 {
        bail!(
            "--lock-len must be from 1 byte to below 1MiB (the disjoint spacing), --lock-offset at most 1EiB"
        );
    }
    if args.steps == 0 {
        bail!("--steps must be 1 or more");
    }
    if args.sqlite_tx > 0 {
        sqlite::check_installed()?;
    }
    Ok(())
}

/// The sections of `distance.rs`: a far mount at each `--far-ms`, and
/// `--refusals`.
fn far_sections(exe: &Path, args: &FcntlArgs) -> Result<()> {
    println!("bench fcntl, distance: a far mount at +{:?} ms, {} refusals", args.far_ms, args.refusals);
    let mut rows = Vec::new();
    for &ms in &args.far_ms {
        rows.push(distance::measure(exe, args, ms)?);
    }
    let refusal = if args.refusals > 0 { Some(distance::refusals(exe, args)?) } else { None };
    std::fs::create_dir_all(&args.out)?;
    for p in distance::report(&rows, refusal.as_ref(), &args.out)? {
        println!("wrote {}", p.display());
    }
    distance::check(&rows)
}

pub fn run(args: FcntlArgs) -> Result<()> {
    validate(&args)?;
    let exe = std::env::current_exe().context("cannot find the citronfs binary")?;
    println!(
        "bench fcntl: {}-byte write locks, {}s per scenario, citronfs mounts with {} FUSE threads; \
         range locks {:?}, backends {:?}",
        args.lock_len.0,
        args.secs,
        args.threads,
        args.range_locks.iter().map(|r| r.name()).collect::<Vec<_>>(),
        args.backends.iter().map(|b| backend_name(*b)).collect::<Vec<_>>(),
    );
    if !args.far_ms.is_empty() || args.refusals > 0 {
        far_sections(&exe, &args)?;
        if args.far_only {
            return Ok(());
        }
    }
    let lock = (args.lock_offset.0, args.lock_len.0);
    let mut checks = Vec::new();
    let mut pairs_rows = Vec::new();
    let mut verbs_rows = Vec::new();
    let mut sqlite_rows = Vec::new();

    for &backend in &args.backends {
        for &range in &args.range_locks {
            let label = format!("{range}/{}", backend_name(backend));
            let caching = Caching {
                cache_ttl: Duration::try_from_secs_f64(args.cache_ttl).context("--cache-ttl")?,
                ..Caching::default()
            };
            let cluster =
                Cluster::start_caching(range, backend, args.threads, MOUNTS, args.capacity.0, None, caching)
                    .with_context(|| format!("starting the {label} cluster"))?;
            std::fs::write(cluster.dirs[0].join(LOCK_FILE), b"")
                .with_context(|| format!("{label}: creating {LOCK_FILE}"))?;
            let steps = measure_steps(&exe, &cluster, lock, args.steps, &label)?;
            println!(
                "  {label}: lock {} verbs {} rtts, unlock {} verbs {} rtts (uncontended)",
                per(steps.lock.verbs.verbs(), steps.steps.into()),
                per(steps.lock.round_trips(), steps.steps.into()),
                per(steps.unlock.verbs.verbs(), steps.steps.into()),
                per(steps.unlock.round_trips(), steps.steps.into()),
            );
            verbs_rows.push(VerbsRow { range, backend: backend_name(backend), steps });
            for &scenario in &args.scenarios {
                let before = cluster.cost();
                let t = run_pairs(
                    &exe,
                    &cluster.dirs,
                    scenario,
                    lock,
                    args.secs,
                    Inside::NOTHING,
                    &format!("{label} {}", scenario.name()),
                )?;
                let cost = cluster.cost().since(before);
                println!("  {label} {}: {:.0} pairs/s", scenario.name(), t.per_s);
                pairs_rows.push(PairsRow {
                    system: range.name().into(),
                    backend: backend_name(backend),
                    scenario,
                    threads: args.threads,
                    t,
                    cost: Some(cost),
                });
            }
            if args.check_secs > 0.0 {
                let t = run_pairs(
                    &exe,
                    &cluster.dirs,
                    Scenario::Shared,
                    lock,
                    args.check_secs,
                    Inside::HOLD_FOR_CHECK,
                    &format!("{label} exclusion check"),
                )?;
                println!(
                    "  {label} exclusion check: {} overlaps in {} locks",
                    t.overlaps.unwrap_or(0),
                    t.pairs
                );
                checks.push(CheckRow { system: range.name().into(), backend: backend_name(backend), t });
            }
            if args.sqlite_tx > 0 {
                let run =
                    sqlite::run(&cluster.dirs, "bench.db", PROCESSES, args.sqlite_tx, args.sqlite_journal)
                        .with_context(|| format!("{label}: SQLite"))?;
                println!("  {label} sqlite: {:.0} tx/s", run.tx_per_s());
                sqlite_rows.push(SqliteRow {
                    system: range.name().into(),
                    backend: backend_name(backend),
                    run,
                });
            }
            drop(cluster);
        }
    }
    let ceiling_threads: &[usize] = if args.no_ceiling { &[] } else { &args.ceiling_threads };
    for (i, &threads) in ceiling_threads.iter().enumerate() {
        let mounts = CeilingMounts::start(threads, MOUNTS)?;
        if i == 0 && args.check_secs > 0.0 {
            // The oracle's self-check: a daemon that excludes nothing.
            let label = format!("fuse-ceiling-{threads}t exclusion check");
            let t = run_pairs(
                &exe,
                &mounts.dirs,
                Scenario::Shared,
                lock,
                args.check_secs,
                Inside::HOLD_FOR_CHECK,
                &label,
            )?;
            println!("  {label}: {} overlaps in {} locks", t.overlaps.unwrap_or(0), t.pairs);
            checks.push(CheckRow { system: format!("fuse-ceiling-{threads}t"), backend: "-", t });
        }
        let shapes: Vec<Scenario> = [Scenario::One, Scenario::Disjoint]
            .into_iter()
            .filter(|s| args.scenarios.iter().any(|a| a.ceiling_shape() == *s))
            .collect();
        for scenario in shapes {
            let label = format!("fuse-ceiling-{threads}t {}", scenario.name());
            let t = run_pairs(&exe, &mounts.dirs, scenario, lock, args.secs, Inside::NOTHING, &label)?;
            println!("  {label}: {:.0} pairs/s", t.per_s);
            pairs_rows.push(PairsRow {
                system: format!("fuse-ceiling-{threads}t"),
                backend: "-",
                scenario,
                threads,
                t,
                cost: None,
            });
        }
    }

    for peer in &args.peers {
        let label = &peer.name;
        std::fs::write(peer.dirs[0].join(LOCK_FILE), b"")
            .with_context(|| format!("{label}: creating {LOCK_FILE} in {}", peer.dirs[0].display()))?;
        if args.check_secs > 0.0 {
            let check = format!("{label} exclusion check");
            let t = run_pairs(
                &exe,
                &peer.dirs,
                Scenario::Shared,
                lock,
                args.check_secs,
                Inside::HOLD_FOR_CHECK,
                &check,
            )?;
            println!("  {check}: {} overlaps in {} locks", t.overlaps.unwrap_or(0), t.pairs);
            checks.push(CheckRow { system: label.clone(), backend: "-", t });
        }
        for &scenario in &args.scenarios {
            let run = format!("{label} {}", scenario.name());
            let t = run_pairs(&exe, &peer.dirs, scenario, lock, args.secs, Inside::NOTHING, &run)?;
            println!("  {run}: {:.0} pairs/s", t.per_s);
            pairs_rows.push(PairsRow {
                system: label.clone(),
                backend: "-",
                scenario,
                threads: 0,
                t,
                cost: None,
            });
        }
        if args.sqlite_tx > 0 {
            let run = sqlite::run(&peer.dirs, "bench.db", PROCESSES, args.sqlite_tx, args.sqlite_journal)
                .with_context(|| format!("{label}: SQLite"))?;
            println!("  {label} sqlite: {:.0} tx/s", run.tx_per_s());
            sqlite_rows.push(SqliteRow { system: label.clone(), backend: "-", run });
        }
    }

    std::fs::create_dir_all(&args.out)?;
    let mut written = Vec::new();

    println!(
        "\nlock + unlock pairs per second (verbs, round trips and messages per pair over the whole run):"
    );
    let mut table = Table::new(&[
        "system",
        "backend",
        "scenario",
        "processes",
        "mounts",
        "fuse_threads",
        "pairs_per_s",
        "proc_min_per_s",
        "proc_max_per_s",
        "overlaps",
        "verbs_per_pair",
        "atomics_per_pair",
        "reads_per_pair",
        "writes_per_pair",
        "rtts_per_pair",
        "rpc_calls_per_pair",
        "msgs_per_pair",
    ]);
    for r in &pairs_rows {
        let cost_cells = match r.cost {
            Some(c) => vec![
                per(c.verbs.verbs(), r.t.pairs),
                per(c.verbs.atomics(), r.t.pairs),
                per(c.verbs.reads(), r.t.pairs),
                per(c.verbs.writes(), r.t.pairs),
                per(c.round_trips(), r.t.pairs),
                per(c.rpc_calls, r.t.pairs),
                per(c.verbs.messages_sent, r.t.pairs),
            ],
            None => vec!["-".into(); 7],
        };
        let mut row = vec![
            r.system.clone(),
            r.backend.into(),
            r.scenario.name().into(),
            r.scenario.processes().to_string(),
            r.scenario.mounts().to_string(),
            r.threads.to_string(),
            format!("{:.0}", r.t.per_s),
            format!("{:.0}", r.t.min),
            format!("{:.0}", r.t.max),
            r.t.overlaps.map_or("-".into(), |o| o.to_string()),
        ];
        row.extend(cost_cells);
        table.push(row);
    }
    table.print();
    let path = args.out.join("fcntl.csv");
    table.write_csv(&path)?;
    written.push(path);

    println!(
        "\nverbs per lock and per unlock at the lock table (no lock token), one process, uncontended ({} calls each):",
        args.steps
    );
    let mut table = Table::new(&[
        "range_lock",
        "backend",
        "op",
        "verbs",
        "atomics",
        "reads",
        "writes",
        "rtts",
        "rpc_calls",
        "msgs",
        "p50_us",
        "mean_us",
    ]);
    for r in &verbs_rows {
        let n = u64::from(r.steps.steps);
        for (op, c, ns) in
            [("lock", r.steps.lock, &r.steps.lock_ns), ("unlock", r.steps.unlock, &r.steps.unlock_ns)]
        {
            table.push(vec![
                r.range.name().into(),
                r.backend.into(),
                op.into(),
                per(c.verbs.verbs(), n),
                per(c.verbs.atomics(), n),
                per(c.verbs.reads(), n),
                per(c.verbs.writes(), n),
                per(c.round_trips(), n),
                per(c.rpc_calls, n),
                per(c.verbs.messages_sent, n),
                format!("{:.1}", median_us(ns)),
                format!("{:.1}", mean_us(ns)),
            ]);
        }
    }
    table.print();
    let path = args.out.join("fcntl-verbs.csv");
    table.write_csv(&path)?;
    written.push(path);

    if !sqlite_rows.is_empty() {
        println!(
            "\nSQLite (sqlite3 shell, journal_mode={}): {PROCESSES} processes on {MOUNTS} mounts, one row per transaction:",
            args.sqlite_journal.pragma()
        );
        let mut table = Table::new(&[
            "system",
            "backend",
            "processes",
            "mounts",
            "transactions",
            "secs",
            "tx_per_s",
            "rows",
            "expected_rows",
            "integrity",
        ]);
        for r in &sqlite_rows {
            table.push(vec![
                r.system.clone(),
                r.backend.into(),
                r.run.processes.to_string(),
                r.run.mounts.to_string(),
                r.run.transactions.to_string(),
                format!("{:.2}", r.run.elapsed.as_secs_f64()),
                format!("{:.0}", r.run.tx_per_s()),
                r.run.rows.to_string(),
                r.run.expected_rows.to_string(),
                r.run.integrity.replace('\n', " "),
            ]);
        }
        table.print();
        let path = args.out.join("fcntl-sqlite.csv");
        table.write_csv(&path)?;
        written.push(path);
    }

    if !checks.is_empty() {
        println!(
            "\nexclusion check: `shared` for {}s, each write lock held {CHECK_HOLD_US}us while a counter in \
             /dev/shm counts its holders (citronfs must show 0 overlaps; the no-lock daemon must not):",
            args.check_secs
        );
        let mut table = Table::new(&["system", "backend", "hold_us", "locks", "overlaps"]);
        for c in &checks {
            table.push(vec![
                c.system.clone(),
                c.backend.into(),
                CHECK_HOLD_US.to_string(),
                c.t.pairs.to_string(),
                c.t.overlaps.unwrap_or(0).to_string(),
            ]);
        }
        table.print();
        let path = args.out.join("fcntl-exclusion.csv");
        table.write_csv(&path)?;
        written.push(path);
    }

    println!(
        "\nratios (ceiling: the best FUSE ceiling of the same processes and mounts; peers: measured in this run):"
    );
    let find = |system: &str, backend: &str, s: Scenario| {
        pairs_rows
            .iter()
            .find(|r| r.system == system && r.backend == backend && r.scenario == s)
            .map(|r| r.t.per_s)
    };
    let ceiling = |s: Scenario| {
        pairs_rows
            .iter()
            .filter(|r| r.system.starts_with("fuse-ceiling") && r.scenario == s.ceiling_shape())
            .map(|r| r.t.per_s)
            .reduce(f64::max)
    };
    let mut headers: Vec<String> = [
        "backend",
        "scenario",
        "citron_per_s",
        "rpc_per_s",
        "citron_over_rpc",
        "ceiling_per_s",
        "citron_over_ceiling",
    ]
    .map(String::from)
    .to_vec();
    for p in &args.peers {
        headers.push(format!("{}_per_s", p.name));
        headers.push(format!("citron_over_{}", p.name));
    }
    let mut table = Table::new(&headers.iter().map(String::as_str).collect::<Vec<_>>());
    for &backend in &args.backends {
        let b = backend_name(backend);
        for &s in &args.scenarios {
            let citron = find("citron", b, s);
            let rpc = find("rpc", b, s);
            let ceil = ceiling(s);
            let mut row = vec![
                b.into(),
                s.name().into(),
                opt(citron),
                opt(rpc),
                ratio(citron, rpc),
                opt(ceil),
                ratio(citron, ceil),
            ];
            for p in &args.peers {
                let peer = find(&p.name, "-", s);
                row.push(opt(peer));
                row.push(ratio(citron, peer));
            }
            table.push(row);
        }
    }
    table.print();
    let path = args.out.join("fcntl-ratios.csv");
    table.write_csv(&path)?;
    written.push(path);
    let citron_sqlite = |backend: &str| {
        sqlite_rows.iter().find(|r| r.system == "citron" && r.backend == backend).map(|r| r.run.tx_per_s())
    };
    for r in sqlite_rows.iter().filter(|r| r.backend == "-") {
        for &backend in &args.backends {
            let b = backend_name(backend);
            println!(
                "SQLite: citron/{b} {} tx/s, {} {:.0} tx/s: {}x",
                opt(citron_sqlite(b)),
                r.system,
                r.run.tx_per_s(),
                ratio(citron_sqlite(b), Some(r.run.tx_per_s()))
            );
        }
    }

    println!();
    for p in &written {
        println!("wrote {}", p.display());
    }
    let bars: Vec<(String, f64)> = pairs_rows
        .iter()
        .map(|r| {
            let who = if r.backend == "-" { r.system.clone() } else { format!("{} {}", r.system, r.backend) };
            (format!("{who} {}", r.scenario.name()), r.t.per_s)
        })
        .collect();
    let png = args.out.join("fcntl.png");
    match crate::plot::bars(&png, "fcntl lock + unlock pairs per second", "pairs/s", &bars) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => log::warn!("no plot: {e}"),
    }
    let overlapped = |t: &Throughput| t.overlaps.unwrap_or(0);
    if let Some(bad) = pairs_rows.iter().find(|r| r.cost.is_some() && overlapped(&r.t) > 0) {
        bail!(
            "mutual exclusion violated: {} of {} write locks of {}/{} {} overlapped another process's",
            overlapped(&bad.t),
            bad.t.pairs,
            bad.system,
            bad.backend,
            bad.scenario.name()
        );
    }
    if let Some(bad) = checks.iter().find(|c| c.backend != "-" && overlapped(&c.t) > 0) {
        bail!(
            "mutual exclusion violated: {} of {} write locks of the {}/{} exclusion check overlapped another \
             process's",
            overlapped(&bad.t),
            bad.t.pairs,
            bad.system,
            bad.backend
        );
    }
    if let Some(bad) = sqlite_rows.iter().find(|r| !r.run.is_intact()) {
        bail!(
            "SQLite on {}/{} lost data: {} rows of {} (processes incomplete: {:?}), integrity_check {:?}",
            bad.system,
            bad.backend,
            bad.run.rows,
            bad.run.expected_rows,
            bad.run.incomplete,
            bad.run.integrity
        );
    }
    Ok(())
}
