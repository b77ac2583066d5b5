//! `citronfs bench citron-scale`: what a Citron scale-up costs (Algorithm 4,
//! citron-fast23.md §3.9.1) on each backend, in one run: its verbs, round
//! trips and RPCs to the lock host (figures that do not drift), and its
//! wall time (median and p90 over `--reps`), for 4×, 16× and 256× steps of a
//! small and a larger tree, with the tree idle or with three ranges held
//! (whose units the scale-up carries to the new levels). The lock host is
//! reached over its tcp RPC (as across machines) and in-process (to show
//! what the RPCs cost). Then the round trips of an uncontended acquisition
//! before and after scale-ups (§3.8: two).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::citron::host::{LockMemoryHost, RemoteTreeHost, TreeHost};
use citron_lock::citron::lock::{CitronClient, CitronConfig, ScalePolicy, ScaleUp};
use citron_lock::citron::tree::TreeShape;
use citron_lock::dslr::{DslrConfig, DslrLock};
use citron_lock::rdma::{
    Endpoint, FabricAddr, Node, RegionId, RegionMemory, RegionTable, RemoteAddr, ShmHost, TcpHost, VerbCounts,
};
use clap::{Args, ValueEnum};

use crate::report::{fmt_ns, Table};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backends {
    Shm,
    Tcp,
    Both,
}

#[derive(Args, Debug)]
pub struct CitronScaleArgs {
    #[arg(long, value_enum, default_value = "both")]
    backend: Backends,
    /// Scale-ups measured per row.
    #[arg(long, default_value_t = 30)]
    reps: usize,
    /// Directory for citron-scale.csv and citron-scale.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

const REGION: RegionId = RegionId(1);
const REGION_LEN: u64 = 32 << 20;
const SPILLOVER: RemoteAddr = RemoteAddr::new(REGION, 0);
const ARENA: u64 = 1 << 20;

/// (from depth, to depth) of the measured scale-ups.
const STEPS: [(u32, u32); 4] = [(2, 3), (2, 4), (5, 6), (5, 9)];

fn client(ep: &Endpoint, host: Arc<dyn TreeHost>) -> Result<CitronClient> {
    let rtt = ep.measure_rtt(SPILLOVER, 9)?;
    let mut c = CitronClient::with_host(
        host,
        CitronConfig::from_rtt(rtt),
        Box::new(DslrLock::new(SPILLOVER, DslrConfig::from_rtt(rtt))),
    )?;
    c.set_scale_policy(ScalePolicy::Manual);
    Ok(c)
}

struct Row {
    from: u32,
    to: u32,
    held: bool,
    rpc: bool,
    report: ScaleUp,
    times: Vec<Duration>,
}

pub fn run(args: CitronScaleArgs) -> Result<()> {
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let backends: &[&str] = match args.backend {
        Backends::Shm => &["shm"],
        Backends::Tcp => &["tcp"],
        Backends::Both => &["shm", "tcp"],
    };
    let mut table = Table::new(&[
        "backend",
        "step",
        "from",
        "to",
        "held",
        "host",
        "marked",
        "carried",
        "atomics",
        "reads",
        "writes",
        "round_trips",
        "rpcs",
        "p50",
        "p90",
        "p50_ns",
        "p90_ns",
    ]);
    let mut bars = Vec::new();
    let mut after = Table::new(&["backend", "tree", "range", "acquire_rts", "acquire_verbs", "release_rts"]);
    for &backend in backends {
        let regions = Arc::new(RegionTable::new());
        let (_shm, _tcp, fabric) = if backend == "shm" {
            let name = format!("bench-scale-{}", std::process::id());
            let host = ShmHost::create(&name)?;
            host.add_region(REGION, REGION_LEN)?;
            let regions = host.regions().clone();
            (Some((host, regions)), None, FabricAddr::Shm(name))
        } else {
            regions.insert(RegionMemory::anonymous(REGION, REGION_LEN)?)?;
            let host = TcpHost::spawn("127.0.0.1:0".parse()?, regions.clone())?;
            let addr = host.local_addr();
            (None, Some(host), FabricAddr::Tcp(addr))
        };
        let regions = _shm.as_ref().map_or(regions.clone(), |(_, r)| r.clone());
        let lock_host = Arc::new(LockMemoryHost::new(regions, REGION, ARENA, REGION_LEN));
        let server = lock_host.serve("127.0.0.1:0".parse()?)?;
        let rpc = RemoteTreeHost::connect(server.local_addr(), Duration::from_secs(10));
        let node = Node::join(&fabric).with_context(|| format!("cannot join {fabric}"))?;
        let (ep, ep_holder) = (node.endpoint()?, node.endpoint()?);
        for (from, to) in STEPS {
            for held in [false, true] {
                for over_rpc in [true, false] {
                    let mut times = Vec::with_capacity(args.reps);
                    let mut last = None;
                    for _ in 0..args.reps {
                        let (id, _) = lock_host.create(TreeShape::new(from))?;
                        let th: Arc<dyn TreeHost> = if over_rpc {
                            Arc::new(RemoteTreeHost::new(rpc.clone(), id))
                        } else {
                            Arc::new(lock_host.instance(id))
                        };
                        let mut scaler = client(&ep, th.clone())?;
                        let mut holder = client(&ep_holder, th)?;
                        let n = TreeShape::new(from).units();
                        let ranges = if held {
                            // A leaf, a node with leaf children, the whole right quarter.
                            vec![
                                holder.acquire(&ep_holder, 5, 9)?,
                                holder.acquire(&ep_holder, 256, 512)?,
                                holder.acquire(&ep_holder, n - n / 4, n)?,
                            ]
                        } else {
                            Vec::new()
                        };
                        let up =
                            scaler.scale_up(&ep, TreeShape::new(to).units())?.context("the tree grows")?;
                        times.push(up.elapsed);
                        last = Some(up);
                        for h in ranges {
                            holder.release(&ep_holder, h)?;
                        }
                        drop((scaler, holder));
                        lock_host.destroy(id)?;
                    }
                    times.sort();
                    let report = last.expect("reps >= 1");
                    let row = Row { from, to, held, rpc: over_rpc, report, times };
                    push_row(&mut table, &mut bars, backend, &row);
                }
            }
        }
        // §3.8 after scale-ups: uncontended acquisitions, in the oldest and
        // in the newest segment.
        let (id, _) = lock_host.create(TreeShape::new(2))?;
        let mut c = client(&ep, Arc::new(RemoteTreeHost::new(rpc.clone(), id)))?;
        let mut measure = |c: &mut CitronClient, label: &str, l: u64, r: u64| -> Result<()> {
            let mut best: Option<(VerbCounts, VerbCounts)> = None;
            for _ in 0..20 {
                let before = ep.counts();
                let h = c.acquire(&ep, l, r)?;
                let acquire = ep.counts() - before;
                let before = ep.counts();
                c.release(&ep, h)?;
                let release = ep.counts() - before;
                if best.is_none_or(|(a, _)| acquire.round_trips < a.round_trips) {
                    best = Some((acquire, release));
                }
            }
            let (a, rl) = best.expect("20 samples");
            after.push(vec![
                backend.to_string(),
                label.to_string(),
                format!("[{l}, {r})"),
                a.round_trips.to_string(),
                a.verbs().to_string(),
                rl.round_trips.to_string(),
            ]);
            Ok(())
        };
        measure(&mut c, "depth 2", 100, 116)?;
        measure(&mut c, "depth 2", 256, 512)?;
        c.scale_up(&ep, TreeShape::new(3).units())?;
        c.scale_up(&ep, TreeShape::new(5).units())?;
        let n = c.layout().shape.units();
        for (l, r) in [(100, 116), (256, 512), (n - 192, n - 176), (n - 512, n - 256)] {
            measure(&mut c, "depth 2->3->5", l, r)?;
        }
        lock_host.destroy(id)?;
    }
    println!(
        "bench citron-scale: {} scale-ups per row; time is the whole Algorithm 4 incl. the spillover mutex",
        args.reps
    );
    table.print();
    println!();
    println!("uncontended acquisitions (best of 20; §3.8 fast path):");
    after.print();
    std::fs::create_dir_all(&args.out)?;
    let csv = args.out.join("citron-scale.csv");
    table.write_csv(&csv)?;
    after.write_csv(&args.out.join("citron-scale-acquire.csv"))?;
    let png = args.out.join("citron-scale.png");
    if let Err(e) =
        crate::plot::bars(&png, "Citron scale-up of an idle tree, median time", "microseconds", &bars)
    {
        log::warn!("no chart: {e}");
    }
    println!("wrote {}, {}", csv.display(), png.display());
    Ok(())
}

fn push_row(table: &mut Table, bars: &mut Vec<(String, f64)>, backend: &str, row: &Row) {
    let q = |p: f64| row.times[((row.times.len() - 1) as f64 * p).round() as usize].as_nanos() as f64;
    let (p50, p90) = (q(0.5), q(0.9));
    let v = row.report.verbs;
    let step = format!("{}x", 1u64 << (2 * (row.to - row.from)));
    let host = if row.rpc { "rpc" } else { "local" };
    table.push(vec![
        backend.to_string(),
        step.clone(),
        row.from.to_string(),
        row.to.to_string(),
        if row.held { "3" } else { "0" }.to_string(),
        host.to_string(),
        row.report.marked.to_string(),
        row.report.carried.to_string(),
        v.atomics().to_string(),
        v.reads().to_string(),
        v.writes().to_string(),
        v.round_trips.to_string(),
        row.report.host_calls.to_string(),
        fmt_ns(p50),
        fmt_ns(p90),
        format!("{p50:.0}"),
        format!("{p90:.0}"),
    ]);
    // The chart shows the idle-tree rows (the held ones differ by a round trip).
    if !row.held {
        bars.push((format!("{backend} {}->{} {host}", row.from, row.to), p50 / 1e3));
    }
}
