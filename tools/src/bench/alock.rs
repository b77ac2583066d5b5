//! `citronfs bench alock`: ALock (alock-spaa24.md §5) beside the naive lock
//! it replaces, measured in one run on one backend:
//!
//! * **naive**: one word that host threads CAS with the CPU and clients CAS
//!   with a verb (retrying after a yield), released by a store / a write. It
//!   is a lock here only because both backends' remote atomics are CPU
//!   atomics by default; on an RNIC (the test mode `RemoteAtomicity::NicOnly`)
//!   it lets two holders in (tests/tests/lock_alock.rs shows it).
//! * **alock**: host threads through `AlockLocal`, clients through
//!   `AlockClient`.
//!
//! Rows: an uncontended remote acquire + release (latency; verbs, round
//! trips and messages per operation), an uncontended local one (ns per
//! operation, the mean of chunks of 256), and mixed contention: host threads
//! and client threads (one endpoint each) on one lock for a fixed time. The
//! critical section increments a counter word (load + store on the host,
//! read + write by a client); the counter is checked at the end, so a lock
//! that let two in would fail the run.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use citron_lock::alock::{AlockClient, AlockConfig, AlockHost, AlockLayout};
use citron_lock::rdma::{
    Endpoint, FabricAddr, Node, RegionId, RegionMemory, RegionTable, RemoteAddr, ShmHost, TcpHost, VerbCounts,
};
use clap::Args;
use hdrhistogram::Histogram;

use super::verbs::BackendChoice;
use crate::report::{fmt_ns, Table};

#[derive(Args, Debug)]
pub struct AlockArgs {
    /// Which backend the clients use.
    #[arg(long, value_enum, default_value = "shm")]
    backend: BackendChoice,
    /// Host threads in the mixed rows.
    #[arg(long, default_value_t = 2)]
    local_threads: usize,
    /// Client threads (one endpoint each) in the mixed rows.
    #[arg(long, default_value_t = 2)]
    remote_threads: usize,
    /// Seconds each mixed row runs.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Uncontended operations per row (default: 200000 on shm, 5000 on tcp).
    #[arg(long)]
    ops: Option<u64>,
    /// ALock budgets K_l and K_r (paper §6.1: 5 and 20).
    #[arg(long, default_value_t = 5)]
    local_budget: u32,
    #[arg(long, default_value_t = 20)]
    remote_budget: u32,
    /// Directory for alock-<backend>.csv and alock-<backend>.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

const REGION: RegionId = RegionId(1);
const ALOCK_AT: u64 = 0;
const NAIVE_AT: u64 = 64;
const COUNTER_AT: u64 = 128;
const POOL_AT: u64 = 4096;
const POOL_SLOTS: u32 = 64;
const REGION_LEN: u64 = POOL_AT + AlockLayout::pool_bytes(POOL_SLOTS);

fn at(off: u64) -> RemoteAddr {
    RemoteAddr::new(REGION, off)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LockKind {
    Naive,
    Alock,
}

impl LockKind {
    fn name(self) -> &'static str {
        match self {
            LockKind::Naive => "naive",
            LockKind::Alock => "alock",
        }
    }
}

/// A client's side of either lock.
enum RemoteLock {
    Naive,
    Alock(Box<AlockClient>),
}

impl RemoteLock {
    fn new(kind: LockKind, config: AlockConfig) -> Self {
        match kind {
            LockKind::Naive => RemoteLock::Naive,
            LockKind::Alock => RemoteLock::Alock(Box::new(AlockClient::new(at(ALOCK_AT), config))),
        }
    }

    fn lock(&mut self, ep: &Endpoint) -> Result<()> {
        match self {
            RemoteLock::Naive => {
                while ep.cas(at(NAIVE_AT), 0, 1)? != 0 {
                    std::thread::yield_now();
                }
            }
            RemoteLock::Alock(c) => c.lock(ep)?,
        }
        Ok(())
    }

    fn unlock(&mut self, ep: &Endpoint) -> Result<()> {
        match self {
            RemoteLock::Naive => ep.write_u64(at(NAIVE_AT), 0)?,
            RemoteLock::Alock(c) => c.unlock(ep)?,
        }
        Ok(())
    }
}

/// A host thread's critical sections on either lock, `n` of them or until `stop`.
fn local_loop(kind: LockKind, host: &AlockHost, n: u64, stop: &AtomicBool) -> Result<u64> {
    let mem = host.memory();
    let counter = mem.word(at(COUNTER_AT))?;
    let mut done = 0;
    match kind {
        LockKind::Naive => {
            let w = mem.word(at(NAIVE_AT))?;
            while done < n && !stop.load(Ordering::Relaxed) {
                while w.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                    std::thread::yield_now();
                }
                counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                w.store(0, Ordering::SeqCst);
                done += 1;
            }
        }
        LockKind::Alock => {
            let mut handle = host.local()?;
            while done < n && !stop.load(Ordering::Relaxed) {
                let guard = handle.lock(at(ALOCK_AT))?;
                counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                guard.unlock()?;
                done += 1;
            }
        }
    }
    Ok(done)
}

/// A client's critical sections, `n` of them or until `stop`; the latency
/// of each in `hist` (when given) and the verbs counted.
fn remote_loop(
    kind: LockKind,
    node: &Node,
    config: AlockConfig,
    n: u64,
    stop: &AtomicBool,
    mut hist: Option<&mut Histogram<u64>>,
) -> Result<(u64, VerbCounts)> {
    let ep = node.endpoint()?;
    let mut lock = RemoteLock::new(kind, config);
    // Warm up: map the region, open the connection.
    lock.lock(&ep)?;
    lock.unlock(&ep)?;
    ep.reset_counts();
    let mut done = 0;
    while done < n && !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        lock.lock(&ep)?;
        let v = ep.read_u64(at(COUNTER_AT))?;
        ep.write_u64(at(COUNTER_AT), v + 1)?;
        lock.unlock(&ep)?;
        if let Some(h) = hist.as_deref_mut() {
            h.record(t.elapsed().as_nanos() as u64)?;
        }
        done += 1;
    }
    // The counter's read and write are the critical section, not the lock.
    let mut c = ep.counts();
    c.by_kind[citron_lock::rdma::VerbKind::Read as usize] -= done;
    c.by_kind[citron_lock::rdma::VerbKind::Write as usize] -= done;
    c.round_trips -= 2 * done;
    Ok((done, c))
}

pub fn run(args: AlockArgs) -> Result<()> {
    if args.seconds <= 0.0 {
        bail!("--seconds must be positive");
    }
    let ops = args.ops.unwrap_or(match args.backend {
        BackendChoice::Shm => 200_000,
        BackendChoice::Tcp => 5_000,
    });
    // Keep the host alive for the run.
    let (fabric, regions, _shm, _tcp) = match args.backend {
        BackendChoice::Shm => {
            let name = format!("bench-alock-{}", std::process::id());
            let host = ShmHost::create(&name)?;
            host.add_region(REGION, REGION_LEN)?;
            let regions = host.regions().clone();
            (FabricAddr::Shm(name), regions, Some(host), None)
        }
        BackendChoice::Tcp => {
            let regions = Arc::new(RegionTable::new());
            regions.insert(RegionMemory::anonymous(REGION, REGION_LEN)?)?;
            let host = TcpHost::spawn("127.0.0.1:0".parse()?, regions.clone())?;
            (FabricAddr::Tcp(host.local_addr()), regions, None, Some(host))
        }
    };
    let memory = regions.get(REGION)?;
    let node = Node::join(&fabric).with_context(|| format!("cannot join {fabric}"))?;
    let rtt = node.endpoint()?.measure_rtt(at(ALOCK_AT), 9)?;
    let config = AlockConfig::from_rtt(rtt).with_budgets(args.local_budget, args.remote_budget);
    let host = AlockHost::new(memory.clone(), at(POOL_AT), POOL_SLOTS, config)?;
    let counter = memory.word(at(COUNTER_AT))?;
    let backend = node.backend_name();
    println!(
        "bench alock: backend {backend}, rtt {}, budgets {}/{}, {ops} uncontended ops, mixed {}+{} threads for {}s",
        fmt_ns(rtt.as_nanos() as f64),
        config.local_budget,
        config.remote_budget,
        args.local_threads,
        args.remote_threads,
        args.seconds
    );

    let mut table = Table::new(&[
        "lock",
        "row",
        "threads",
        "ops",
        "Mops/s",
        "local_Mops/s",
        "remote_Mops/s",
        "ns/op",
        "p50",
        "p99",
        "verbs/rop",
        "rts/rop",
        "msgs/rop",
    ]);
    let mut bars = Vec::new();
    let per =
        |n: u64, ops: u64| if ops == 0 { "-".to_string() } else { format!("{:.2}", n as f64 / ops as f64) };
    let never = AtomicBool::new(false);
    for kind in [LockKind::Naive, LockKind::Alock] {
        // Uncontended remote: one client, each operation timed.
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
        let t = Instant::now();
        let (n, c) = remote_loop(kind, &node, config, ops, &never, Some(&mut hist))?;
        let wall = t.elapsed();
        table.push(vec![
            kind.name().into(),
            "remote uncontended".into(),
            "0+1".into(),
            n.to_string(),
            format!("{:.3}", n as f64 / wall.as_secs_f64() / 1e6),
            "-".into(),
            "-".into(),
            format!("{:.0}", wall.as_nanos() as f64 / n as f64),
            fmt_ns(hist.value_at_quantile(0.5) as f64),
            fmt_ns(hist.value_at_quantile(0.99) as f64),
            per(c.verbs(), n),
            per(c.round_trips, n),
            per(c.messages_sent + c.messages_received, n),
        ]);
        bars.push((format!("{} remote p50 (ns)", kind.name()), hist.value_at_quantile(0.5) as f64));

        // Uncontended local: one host thread, mean per operation.
        let local_ops = ops * 10;
        let t = Instant::now();
        let n = local_loop(kind, &host, local_ops, &never)?;
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        table.push(vec![
            kind.name().into(),
            "local uncontended".into(),
            "1+0".into(),
            n.to_string(),
            format!("{:.3}", 1e3 / ns),
            "-".into(),
            "-".into(),
            format!("{ns:.1}"),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
        bars.push((format!("{} local (ns)", kind.name()), ns));

        // Mixed contention for a fixed time.
        let before = counter.load(Ordering::SeqCst);
        let stop = AtomicBool::new(false);
        let local_done = AtomicU64::new(0);
        let t = Instant::now();
        let (remote_done, counts) = std::thread::scope(|s| -> Result<(u64, VerbCounts)> {
            let locals: Vec<_> = (0..args.local_threads)
                .map(|_| s.spawn(|| local_loop(kind, &host, u64::MAX, &stop)))
                .collect();
            let remotes: Vec<_> = (0..args.remote_threads)
                .map(|_| s.spawn(|| remote_loop(kind, &node, config, u64::MAX, &stop, None)))
                .collect();
            std::thread::sleep(Duration::from_secs_f64(args.seconds));
            stop.store(true, Ordering::SeqCst);
            let mut remote = (0, VerbCounts::default());
            for h in remotes {
                let (n, c) = h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
                remote.0 += n;
                remote.1 += c;
            }
            for h in locals {
                local_done.fetch_add(
                    h.join().map_err(|_| anyhow::anyhow!("a host thread panicked"))??,
                    Ordering::SeqCst,
                );
            }
            Ok(remote)
        })?;
        let wall = t.elapsed().as_secs_f64();
        let local_done = local_done.load(Ordering::SeqCst);
        let total = local_done + remote_done;
        let counted = counter.load(Ordering::SeqCst) - before;
        if counted != total {
            bail!(
                "{}: the counter moved by {counted} in {total} critical sections: two holders were inside",
                kind.name()
            );
        }
        table.push(vec![
            kind.name().into(),
            "mixed".into(),
            format!("{}+{}", args.local_threads, args.remote_threads),
            total.to_string(),
            format!("{:.3}", total as f64 / wall / 1e6),
            format!("{:.3}", local_done as f64 / wall / 1e6),
            format!("{:.3}", remote_done as f64 / wall / 1e6),
            format!("{:.0}", wall * 1e9 / total as f64),
            "-".into(),
            "-".into(),
            per(counts.verbs(), remote_done),
            per(counts.round_trips, remote_done),
            per(counts.messages_sent + counts.messages_received, remote_done),
        ]);
        bars.push((format!("{} mixed (ns/op)", kind.name()), wall * 1e9 / total as f64));
    }

    println!();
    table.print();
    std::fs::create_dir_all(&args.out)?;
    let csv = args.out.join(format!("alock-{backend}.csv"));
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());
    let png = args.out.join(format!("alock-{backend}.png"));
    match crate::plot::bars(&png, &format!("ALock vs naive mixed CAS lock on {backend}"), "ns", &bars) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => log::warn!("no plot: {e}"),
    }
    let ratio = |row: &str| {
        let get = |k: &str| bars.iter().find(|b| b.0 == format!("{k} {row}")).map_or(f64::NAN, |b| b.1);
        get("alock") / get("naive")
    };
    println!();
    println!("ratio alock / naive, remote uncontended p50: {:.2}", ratio("remote p50 (ns)"));
    println!("ratio alock / naive, local uncontended ns/op: {:.2}", ratio("local (ns)"));
    println!("ratio alock / naive, mixed ns/op (lower is better): {:.2}", ratio("mixed (ns/op)"));
    Ok(())
}
