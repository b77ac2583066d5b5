//! `citronfs bench meta`: metadata rates as mdtest measures them (issue
//! 13), with what each operation costs in FUSE requests and meta-server
//! round trips, beside bindfs over tmpfs and any `--peer` file system, every
//! figure measured in the same run.
//!
//! Phases, in order, each over `--files` files per process ([`worker`]):
//! `create` (open with O_CREAT | O_EXCL, optionally `--payload` bytes
//! written, close), `stat`, `read` (open, read the payload back, close) and
//! `unlink`. N processes (`--processes`, each a worker process of its own,
//! as mdtest's ranks) run each phase at once, spread over the mounts
//! (process i on mount i mod M); files are created through one mount and
//! stat'ed, read and unlinked through the next, so every phase after the
//! first sees on one mount what another did. Two trees (`--trees`):
//! `shared`, one directory for every process (mdtest's default), and
//! `private`, a directory per process (mdtest -u), made through the mount
//! the process creates on, as each mdtest rank makes its own. A phase's
//! rate is the files of all processes over the wall time from the moment
//! the phase was sent to every process until the last one answered.
//!
//! CitronFS runs as an embedded meta-server and data server in this process
//! with `--mounts` mounts of it (as `bench fcntl` starts them); its mounts'
//! counters give RPCs (calls to the meta-server, by kind) and FUSE requests
//! per operation over each phase, and, first, for one system call at a
//! time (the cost table). bindfs over tmpfs is a passthrough FUSE file
//! system on one host (its M "mounts" are one directory); `--peer
//! NAME=DIR_A,DIR_B` adds another file system's two mounts of one volume.
//! `--coherent-ttl SECS` (1 by default, 0 for none) adds a CitronFS
//! cluster whose mounts cache coherently (the meta-server grants lookups,
//! getattrs and READDIRPLUS listings and calls the other mounts back before a change answers;
//! `citronfs mount --cache-ttl`), with its own cost table. `--cached-ttl
//! SECS` adds one whose kernels cache attributes and entries without
//! asking (not coherent across mounts: it bounds what caching could buy,
//! and says so in its name). Ratios are only taken between figures of this
//! run.

pub mod worker;

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use citron_lock::range_lock::RangeAlgorithm;
use citronfs_core::client::FsClient;
use citronfs_core::rpc_counts::RpcCounts;
use citronfs_mount::{FuseCounters, FuseCounts, MountOptions};
use clap::Args;

use super::fcntl::{Caching, Cluster, PeerMounts};
use super::verbs::BackendChoice;
use super::workers::WorkerProcess;
use crate::report::Table;
use crate::size::ByteSize;
use worker::Phase;

#[derive(Args, Debug)]
pub struct MetaArgs {
    /// Files per process in each phase.
    #[arg(long, default_value_t = 1000)]
    files: u32,
    /// Process counts to run, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    processes: Vec<usize>,
    /// Mounts of the CitronFS cluster the processes are spread over (at
    /// least 2: files are created on one and read on the next).
    #[arg(long, default_value_t = 2)]
    mounts: usize,
    /// Trees: shared (one directory for all processes), private (one each).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "shared,private")]
    trees: Vec<Tree>,
    /// Bytes written into each file at create and read back (0: none).
    #[arg(long, default_value = "0")]
    payload: ByteSize,
    /// FUSE worker threads of each CitronFS mount.
    #[arg(long, default_value_t = MountOptions::default().threads)]
    threads: usize,
    /// How the mounts reach the servers' memory: shm or tcp.
    #[arg(long, value_enum, default_value = "shm")]
    backend: BackendChoice,
    /// DRAM of the cluster's data server.
    #[arg(long, default_value = "1GiB")]
    capacity: ByteSize,
    /// System calls of each kind in the cost table.
    #[arg(long, default_value_t = 50)]
    cost_samples: u32,
    /// Also measure a second CitronFS cluster whose mounts let the kernel
    /// cache attributes and entries for this many seconds (`--attr-ttl`):
    /// NOT coherent across mounts, a bound on what coherent caching could
    /// buy. None by default.
    #[arg(long)]
    cached_ttl: Option<f64>,
    /// Also measure a CitronFS cluster whose mounts cache coherently with
    /// grants of this many seconds (`citronfs mount --cache-ttl`); 0: not.
    #[arg(long, default_value_t = 1.0)]
    coherent_ttl: f64,
    /// Skip bindfs over tmpfs.
    #[arg(long)]
    no_bindfs: bool,
    /// Measure no rates on the strictly coherent cluster (its cost tables
    /// are still printed): a shorter run that compares caching mounts.
    #[arg(long)]
    no_strict: bool,
    /// Another file system to measure in this run, as NAME=DIR_A,DIR_B:
    /// two mounts of one volume (e.g. moosefs=/mnt/mfsA,/mnt/mfsB).
    /// Repeatable.
    #[arg(long = "peer", value_name = "NAME=DIR_A,DIR_B")]
    peers: Vec<PeerMounts>,
    /// Directory for meta.csv, meta-costs.csv, meta-latency.csv and meta.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Tree {
    /// One directory for every process.
    Shared,
    /// A directory per process.
    Private,
}

impl Tree {
    fn name(self) -> &'static str {
        match self {
            Tree::Shared => "shared",
            Tree::Private => "private",
        }
    }
}

/// The counters of a CitronFS cluster's mounts.
struct Counters {
    clients: Vec<Arc<FsClient>>,
    requests: Vec<FuseCounters>,
}

/// Calls and requests of every mount at one moment.
#[derive(Clone, Copy, Default)]
struct Spent {
    rpcs: RpcCounts,
    fuse: FuseCounts,
}

impl Counters {
    fn now(&self) -> Spent {
        let mut s = Spent::default();
        for c in &self.clients {
            s.rpcs += c.rpc_counts();
        }
        for r in &self.requests {
            s.fuse += r.snapshot();
        }
        s
    }

    fn since(&self, earlier: Spent) -> Spent {
        let now = self.now();
        Spent { rpcs: now.rpcs - earlier.rpcs, fuse: now.fuse - earlier.fuse }
    }
}

/// A file system under test: its mounts of one volume, and counters when
/// it is CitronFS.
struct Target {
    name: String,
    dirs: Vec<PathBuf>,
    counters: Option<Counters>,
}

impl Target {
    /// The mount process `i` creates on, and the one it reads through.
    fn mounts_of(&self, i: usize) -> (&Path, &Path) {
        let m = self.dirs.len();
        (&self.dirs[i % m], &self.dirs[(i + 1) % m])
    }
}

/// bindfs over a tmpfs, unmounted (both) when dropped.
struct Bindfs {
    backing: PathBuf,
    mnt: PathBuf,
    _root: tempfile::TempDir,
}

impl Bindfs {
    fn start() -> Result<Self> {
        let root = tempfile::tempdir()?;
        let backing = root.path().join("backing");
        super::io::mount_tmpfs(&backing, 256 << 20)?;
        let mnt = root.path().join("bindfs");
        fs::create_dir_all(&mnt)?;
        let b = Self { backing, mnt, _root: root };
        super::io::run_cmd(Command::new("bindfs").arg(&b.backing).arg(&b.mnt))?;
        Ok(b)
    }
}

impl Drop for Bindfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        let _ = Command::new("umount").arg("-l").arg(&self.backing).status();
    }
}

fn have_bindfs() -> bool {
    Command::new("bindfs").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

/// A worker process of `bench meta` (`bench meta-worker`).
struct Proc(WorkerProcess);

/// How long one phase of one worker may take.
const PHASE_WITHIN: Duration = Duration::from_secs(600);

impl Proc {
    fn spawn(exe: &Path, args: &worker::MetaWorkerArgs, label: String) -> Result<Self> {
        let mut command = Command::new(exe);
        command
            .args(["bench", "meta-worker", "--create-dir"])
            .arg(&args.create_dir)
            .arg("--other-dir")
            .arg(&args.other_dir)
            .args(["--files", &args.files.to_string(), "--prefix", &args.prefix])
            .args(["--payload", &args.payload.to_string()]);
        Ok(Self(WorkerProcess::spawn(label, &mut command, PHASE_WITHIN)?))
    }

    fn send(&mut self, command: &str) -> Result<()> {
        self.0.send(command)
    }

    fn answer(&mut self) -> Result<String> {
        self.0.answer(PHASE_WITHIN)
    }
}

/// One phase of one configuration.
struct Row {
    fs: String,
    processes: usize,
    tree: Tree,
    phase: Phase,
    ops: u64,
    per_s: f64,
    /// CitronFS only: calls to the meta-server and FUSE requests per file.
    spent: Option<Spent>,
}

fn per_op(x: u64, ops: u64) -> String {
    format!("{:.2}", x as f64 / ops.max(1) as f64)
}

/// Runs every phase with `processes` workers in `tree`.
fn measure(exe: &Path, t: &Target, args: &MetaArgs, processes: usize, tree: Tree) -> Result<Vec<Row>> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let top = format!("bench-meta-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
    fs::create_dir(t.dirs[0].join(&top)).with_context(|| format!("mkdir in {}", t.dirs[0].display()))?;
    let rel = |i: usize| match tree {
        Tree::Shared => PathBuf::from(&top),
        Tree::Private => Path::new(&top).join(format!("p{i}")),
    };
    if tree == Tree::Private {
        // Each through the mount its process creates on, as each of
        // mdtest's ranks makes its own directory with -u.
        for i in 0..processes {
            fs::create_dir(t.mounts_of(i).0.join(rel(i)))?;
        }
    }
    let mut procs = Vec::new();
    for i in 0..processes {
        let (a, b) = t.mounts_of(i);
        let w = worker::MetaWorkerArgs {
            create_dir: a.join(rel(i)),
            other_dir: b.join(rel(i)),
            files: args.files,
            prefix: format!("w{i}"),
            payload: args.payload.0 as usize,
        };
        procs.push(Proc::spawn(exe, &w, format!("{} process {i}", t.name))?);
    }
    let mut rows = Vec::new();
    for phase in Phase::ALL {
        let before = t.counters.as_ref().map(Counters::now);
        let start = Instant::now();
        for p in &mut procs {
            p.send(phase.name())?;
        }
        for p in &mut procs {
            p.answer()?;
        }
        let secs = start.elapsed().as_secs_f64();
        let spent = t.counters.as_ref().zip(before).map(|(c, b)| c.since(b));
        let ops = args.files as u64 * processes as u64;
        rows.push(Row { fs: t.name.clone(), processes, tree, phase, ops, per_s: ops as f64 / secs, spent });
    }
    drop(procs);
    fs::remove_dir_all(t.dirs[0].join(&top))?;
    Ok(rows)
}

/// One system call (or open + close) on a CitronFS mount.
#[derive(Clone, Copy, Debug)]
enum CostOp {
    Create,
    CreateWrite4k,
    StatOther,
    StatSame,
    OpenReadClose,
    ChmodOther,
    ReadDir,
    Unlink,
}

impl CostOp {
    const ALL: [CostOp; 8] = [
        CostOp::Create,
        CostOp::CreateWrite4k,
        CostOp::StatOther,
        CostOp::StatSame,
        CostOp::OpenReadClose,
        CostOp::ChmodOther,
        CostOp::ReadDir,
        CostOp::Unlink,
    ];

    fn name(self) -> &'static str {
        match self {
            CostOp::Create => "create (open O_CREAT|O_EXCL + close), mount A",
            CostOp::CreateWrite4k => "create + write 4 KiB + close, mount A",
            CostOp::StatOther => "stat, mount B",
            CostOp::StatSame => "stat, mount A",
            CostOp::OpenReadClose => "open + read 4 KiB + close, mount B",
            CostOp::ChmodOther => "chmod, mount B",
            CostOp::ReadDir => "readdir of a 1-file directory, mount B",
            CostOp::Unlink => "unlink, mount B",
        }
    }

    /// Does it to file `i` of `a` (mount A) / `b` (the same directory
    /// through mount B).
    fn run(self, a: &Path, b: &Path, i: u32) -> Result<()> {
        let file = |d: &Path, suffix: &str| d.join(format!("f{i}{suffix}"));
        match self {
            CostOp::Create => {
                fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(file(a, ""))?;
            }
            CostOp::CreateWrite4k => {
                let mut f =
                    fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(file(a, ".w"))?;
                f.write_all(&[7u8; 4096])?;
            }
            CostOp::StatOther => {
                fs::metadata(file(b, ""))?;
            }
            CostOp::StatSame => {
                fs::metadata(file(a, ""))?;
            }
            CostOp::OpenReadClose => {
                let mut buf = [0u8; 4096];
                std::io::Read::read_exact(&mut fs::File::open(file(b, ".w"))?, &mut buf)?;
            }
            CostOp::ChmodOther => {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(file(b, ""), fs::Permissions::from_mode(0o600))?
            }
            CostOp::ReadDir => {
                let dir = b.join(format!("d{i}"));
                let n = fs::read_dir(&dir)?.count();
                if n != 1 {
                    bail!("{} lists {n} entries, not 1", dir.display());
                }
            }
            CostOp::Unlink => {
                fs::remove_file(file(b, ""))?;
                fs::remove_file(file(b, ".w"))?;
            }
        }
        Ok(())
    }
}

/// Where the time of a call goes: one metadata RPC made by the mount's
/// client directly (no FUSE, no kernel), against `stat(2)` of the same file
/// through the mount (its FUSE requests and their RPCs), each `calls` times
/// one after another; mean µs.
fn latencies(c: &Cluster, calls: u32) -> Result<Table> {
    use std::os::unix::fs::MetadataExt;
    let name = format!("bench-meta-latency-{}", std::process::id());
    let path = c.dirs[0].join(&name);
    fs::write(&path, b"")?;
    let ino = citronfs_core::types::Ino(fs::metadata(&path)?.ino());
    let root = citronfs_core::types::Ino(fs::metadata(&c.dirs[0])?.ino());
    let client = &c.clients[0];
    let caller = citronfs_core::types::Caller::ROOT;
    let mean_us = |f: &mut dyn FnMut() -> Result<()>| -> Result<String> {
        let t = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        Ok(format!("{:.1}", t.elapsed().as_secs_f64() * 1e6 / calls as f64))
    };
    let mut table = Table::new(&["call", "mean_us"]);
    let getattr = mean_us(&mut || Ok(client.getattr(ino).map(drop)?))?;
    table.push(vec!["GetAttr RPC (client, no FUSE)".into(), getattr]);
    let lookup = mean_us(&mut || Ok(client.lookup(caller, root, name.as_bytes()).map(drop)?))?;
    table.push(vec!["Lookup RPC (client, no FUSE)".into(), lookup]);
    let stat = mean_us(&mut || Ok(fs::metadata(&path).map(drop)?))?;
    table.push(vec!["stat(2) of a file in the mount's root".into(), stat]);
    fs::remove_file(&path)?;
    Ok(table)
}

/// The cost table: each operation `samples` times, one at a time, with the
/// mounts' counters read around each.
fn costs(c: &Cluster, counters: &Counters, samples: u32) -> Result<Table> {
    let top = format!("bench-meta-costs-{}", std::process::id());
    let (a, b) = (c.dirs[0].join(&top), c.dirs[1].join(&top));
    fs::create_dir(&a)?;
    for i in 0..samples {
        let d = a.join(format!("d{i}"));
        fs::create_dir(&d)?;
        fs::write(d.join("x"), b"")?;
    }
    let mut table = Table::new(&["operation", "fuse_requests", "rpcs", "fuse_per_call", "rpcs_per_call"]);
    for op in CostOp::ALL {
        let mut total = Spent::default();
        for i in 0..samples {
            let before = counters.now();
            op.run(&a, &b, i).with_context(|| op.name())?;
            let s = counters.since(before);
            total.rpcs += s.rpcs;
            total.fuse += s.fuse;
        }
        // Unlink removes two files a call.
        let calls = samples as u64 * if matches!(op, CostOp::Unlink) { 2 } else { 1 };
        table.push(vec![
            op.name().into(),
            per_op(total.fuse.total(), calls),
            per_op(total.rpcs.operations(), calls),
            scaled(&total.fuse.describe(), calls),
            scaled(&total.rpcs.describe(), calls),
        ]);
    }
    fs::remove_dir_all(&a)?;
    Ok(table)
}

/// `Kind=N Kind=M` with each N divided by `calls`.
fn scaled(described: &str, calls: u64) -> String {
    described
        .split(' ')
        .map(|part| match part.split_once('=') {
            Some((k, n)) => format!("{k}={}", per_op(n.parse().unwrap_or(0), calls)),
            None => part.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn run(args: MetaArgs) -> Result<()> {
    if args.mounts < 2 {
        bail!("--mounts must be at least 2 (files are created on one mount and read on another)");
    }
    if args.files == 0 || args.processes.contains(&0) {
        bail!("--files and every --processes must be positive");
    }
    let exe = std::env::current_exe().context("cannot find the citronfs binary")?;
    // A cluster of this run's shape whose mounts let the kernel cache for
    // `ttl` (zero: strictly coherent), and its counters.
    let start = |caching: Caching| -> Result<(Cluster, Counters)> {
        let c = Cluster::start_caching(
            RangeAlgorithm::Citron,
            args.backend,
            args.threads,
            args.mounts,
            args.capacity.0,
            None,
            caching,
        )?;
        let counters = Counters { clients: c.clients.clone(), requests: c.requests.clone() };
        Ok((c, counters))
    };
    let (cluster, counters) = start(Caching::default())?;
    let backend = match args.backend {
        BackendChoice::Shm => "shm",
        BackendChoice::Tcp => "tcp",
    };
    let citron = format!("citronfs({backend})");
    println!(
        "bench meta: {} files per process, processes {:?} over {} mounts, trees {:?}, payload {}, \
         {} FUSE threads per mount",
        args.files, args.processes, args.mounts, args.trees, args.payload, args.threads
    );

    println!("\nwhat one call costs on {citron} (mean of {} calls each):", args.cost_samples);
    let cost_table = costs(&cluster, &counters, args.cost_samples.max(1))?;
    cost_table.print();
    println!("\nwhere a call's time goes ({} calls each, one at a time):", args.cost_samples * 20);
    let latency_table = latencies(&cluster, args.cost_samples.max(1) * 20)?;
    latency_table.print();

    let mut targets = Vec::new();
    if !args.no_strict {
        targets.push(Target { name: citron.clone(), dirs: cluster.dirs.clone(), counters: Some(counters) });
    }
    let coherent_ttl = Duration::try_from_secs_f64(args.coherent_ttl).context("--coherent-ttl")?;
    let coherent = match coherent_ttl.is_zero() {
        true => None,
        false => {
            let (c, counters) = start(Caching { cache_ttl: coherent_ttl, ..Caching::default() })?;
            let secs = args.coherent_ttl;
            println!(
                "
what one call costs on {citron}-coherent{secs}s:"
            );
            costs(&c, &counters, args.cost_samples.max(1))?.print();
            targets.push(Target {
                name: format!("{citron}-coherent{secs}s"),
                dirs: c.dirs.clone(),
                counters: Some(counters),
            });
            Some(c)
        }
    };
    let cached = match args.cached_ttl {
        Some(secs) => {
            let ttl = Duration::try_from_secs_f64(secs).context("--cached-ttl")?;
            let (c, counters) = start(Caching { attr_ttl: ttl, ..Caching::default() })?;
            targets.push(Target {
                name: format!("{citron}-ttl{secs}s-incoherent"),
                dirs: c.dirs.clone(),
                counters: Some(counters),
            });
            Some(c)
        }
        None => None,
    };
    let bindfs = if args.no_bindfs {
        None
    } else if !have_bindfs() {
        println!("\nbindfs is not installed: no bindfs row (apt-get install bindfs)");
        None
    } else {
        let b = Bindfs::start().context("cannot mount bindfs over tmpfs")?;
        targets.push(Target { name: "bindfs(tmpfs)".into(), dirs: vec![b.mnt.clone()], counters: None });
        Some(b)
    };
    for p in &args.peers {
        targets.push(Target { name: p.name.clone(), dirs: p.dirs.clone(), counters: None });
    }

    let mut rows = Vec::new();
    for t in &targets {
        for &processes in &args.processes {
            for &tree in &args.trees {
                let r = measure(&exe, t, &args, processes, tree)
                    .with_context(|| format!("{}: {processes} processes, {} tree", t.name, tree.name()))?;
                rows.extend(r);
            }
        }
    }
    drop(bindfs);
    drop(cached);
    drop(coherent);
    let table = rows_table(&rows);
    println!();
    table.print();
    println!("\nwhat each CitronFS phase's calls were, per file:");
    calls_table(&rows).print();
    // Each CitronFS configuration (the ones with counters) against every
    // other file system of the run.
    let peers: Vec<&str> = targets.iter().filter(|t| t.counters.is_none()).map(|t| t.name.as_str()).collect();
    for t in targets.iter().filter(|t| t.counters.is_some()) {
        ratios(&rows, &t.name, &peers);
    }

    fs::create_dir_all(&args.out)?;
    let csv = args.out.join("meta.csv");
    table.write_csv(&csv)?;
    let costs_csv = args.out.join("meta-costs.csv");
    cost_table.write_csv(&costs_csv)?;
    let latency_csv = args.out.join("meta-latency.csv");
    latency_table.write_csv(&latency_csv)?;
    println!("\nwrote {}, {} and {}", csv.display(), costs_csv.display(), latency_csv.display());
    let bars: Vec<(String, f64)> = rows
        .iter()
        .map(|r| (format!("{} {}p {} {}", r.fs, r.processes, r.tree.name(), r.phase.name()), r.per_s))
        .collect();
    let png = args.out.join("meta.png");
    match crate::plot::bars(&png, "metadata operations per second", "ops/s", &bars) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => log::warn!("no plot: {e}"),
    }
    drop(cluster);
    Ok(())
}

fn rows_table(rows: &[Row]) -> Table {
    let mut table =
        Table::new(&["fs", "processes", "tree", "phase", "ops", "ops_per_s", "rpcs_per_op", "fuse_per_op"]);
    for r in rows {
        let (rpcs, fuse) = match &r.spent {
            Some(s) => (per_op(s.rpcs.operations(), r.ops), per_op(s.fuse.total(), r.ops)),
            None => ("-".into(), "-".into()),
        };
        table.push(vec![
            r.fs.clone(),
            r.processes.to_string(),
            r.tree.name().into(),
            r.phase.name().into(),
            r.ops.to_string(),
            format!("{:.0}", r.per_s),
            rpcs,
            fuse,
        ]);
    }
    table
}

/// The meta-server calls and FUSE requests of each CitronFS row, by kind.
fn calls_table(rows: &[Row]) -> Table {
    let mut table = Table::new(&["fs", "processes", "tree", "phase", "rpcs_per_op", "fuse_per_op"]);
    for r in rows {
        if let Some(s) = &r.spent {
            table.push(vec![
                r.fs.clone(),
                r.processes.to_string(),
                r.tree.name().into(),
                r.phase.name().into(),
                scaled(&s.rpcs.describe(), r.ops),
                scaled(&s.fuse.describe(), r.ops),
            ]);
        }
    }
    table
}

/// One CitronFS configuration against each of `others`, row by row.
fn ratios(rows: &[Row], citron: &str, others: &[&str]) {
    if others.is_empty() {
        return;
    }
    println!("\nratio {citron} / each file system of this run (same processes, tree, phase):");
    let mut headers = vec!["processes".to_string(), "tree".into(), "phase".into()];
    headers.extend(others.iter().map(|o| format!("vs {o}")));
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut table = Table::new(&headers);
    for r in rows.iter().filter(|r| r.fs == citron) {
        let mut cells = vec![r.processes.to_string(), r.tree.name().into(), r.phase.name().into()];
        for o in others {
            let peer = rows
                .iter()
                .find(|x| x.fs == *o && x.processes == r.processes && x.tree == r.tree && x.phase == r.phase);
            cells.push(peer.map_or("-".into(), |p| format!("{:.2}", r.per_s / p.per_s)));
        }
        table.push(cells);
    }
    table.print();
}
