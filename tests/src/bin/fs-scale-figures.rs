//! Figures of Citron tree growth inside the file system (DESIGN.md §4
//! "Tree growth"): what an uncontended 4 KiB write costs in verbs, round
//! trips and time inside a file's first tree, past it on a fixed tree (every
//! write through the spillover mutex), and inside the tree once it has
//! grown; and what a scale-up costs (the host's time, verbs and round
//! trips, and the write that triggers it). One in-process cluster per
//! transport (shm: clients map the servers' memory; tcp: the software NIC).
//!
//! `fs-scale-figures [WRITES [SCALE_UPS]]` (defaults 400 and 20; see
//! `--help`) prints tables; nothing is asserted.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use citron_lock::rdma::VerbCounts;
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::types::{Caller, Ino};
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use clap::Parser;

const ME: Caller = Caller { uid: 1000, gid: 1000, pid: 1 };
const PAGE: u64 = 4096;

struct Cluster {
    meta: MetaServer,
    _data: DataServer,
}

fn cluster(grow: bool, tag: &str) -> Result<Cluster> {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse::<SocketAddr>()?);
    cfg.grow_trees = grow;
    cfg.slot_bytes = 4 << 20;
    let shm = format!("figures-{}-{tag}", std::process::id());
    cfg.shm = Some(format!("meta-{shm}"));
    let meta = MetaServer::start(cfg).context("meta-server")?;
    let data =
        DataServer::start("127.0.0.1:0".parse()?, meta.local_addr(), 256 << 20, Some(&format!("data-{shm}")))
            .context("data server")?;
    Ok(Cluster { meta, _data: data })
}

fn client(c: &Cluster, transport: Transport) -> Result<FsClient> {
    let mut config = ClientConfig::new(c.meta.local_addr());
    config.transport = transport;
    Ok(FsClient::connect(config)?)
}

/// Per-write cost of `offsets` (already allocated), as the client counts it.
struct Cost {
    verbs: f64,
    round_trips: f64,
    micros: f64,
}

fn measure(a: &FsClient, ino: Ino, offsets: &[u64]) -> Result<Cost> {
    let data = vec![3u8; PAGE as usize];
    let before = a.verb_counts();
    let t = Instant::now();
    for &o in offsets {
        a.write(ino, o, &data, false)?;
    }
    let elapsed = t.elapsed();
    let d: VerbCounts = a.verb_counts() - before;
    let n = offsets.len() as f64;
    Ok(Cost {
        verbs: d.by_kind.iter().sum::<u64>() as f64 / n,
        round_trips: d.round_trips as f64 / n,
        micros: elapsed.as_secs_f64() * 1e6 / n,
    })
}

/// Four writers (two threads on each of two clients) writing disjoint pages
/// of `offsets` (already allocated) at once: writes per second, and verbs
/// and round trips per write.
fn measure_contended(clients: [&FsClient; 2], ino: Ino, offsets: &[u64]) -> Result<Cost> {
    let before = clients[0].verb_counts() + clients[1].verb_counts();
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..4usize)
            .map(|w| {
                let cl = clients[w % 2];
                s.spawn(move || -> Result<()> {
                    let data = vec![w as u8; PAGE as usize];
                    for &o in offsets.iter().skip(w).step_by(4) {
                        cl.write(ino, o, &data, false)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("writer")?;
        }
        Ok(())
    })?;
    let elapsed = t.elapsed();
    let d = clients[0].verb_counts() + clients[1].verb_counts() - before;
    let n = offsets.len() as f64;
    Ok(Cost {
        verbs: d.by_kind.iter().sum::<u64>() as f64 / n,
        round_trips: d.round_trips as f64 / n,
        micros: elapsed.as_secs_f64() * 1e6 / n,
    })
}

/// "median / p90" in µs.
fn quantiles(d: &mut [Duration]) -> String {
    if d.is_empty() {
        return "-".into();
    }
    d.sort();
    let at = |q: f64| d[((d.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    format!("{:.0} / {:.0}", at(0.5), at(0.9))
}

fn new_file(a: &FsClient, name: &str) -> Result<Ino> {
    Ok(a.create_open(ME, Ino::ROOT, name.as_bytes(), 0o644)?.ino)
}

/// Writes every page once so the timed writes allocate nothing.
fn touch(a: &FsClient, ino: Ino, offsets: &[u64]) -> Result<()> {
    for &o in offsets {
        a.write(ino, o, &[1u8; PAGE as usize], false)?;
    }
    Ok(())
}

fn row(transport: &str, case: &str, c: &Cost) {
    println!("{transport:<5} {case:<44} {:>8.1} {:>8.1} {:>9.1}", c.verbs, c.round_trips, c.micros);
}

#[derive(Parser)]
struct Args {
    /// Writes measured per case.
    #[arg(default_value_t = 400)]
    writes: u64,
    /// Scale-ups measured.
    #[arg(default_value_t = 20)]
    scale_ups: u64,
}

fn main() -> Result<()> {
    let Args { writes, scale_ups } = Args::parse();
    // Inside the first tree (4 MiB), and between 64 MiB and 128 MiB: past a
    // fixed first tree, inside a grown one.
    let near: Vec<u64> = (0..writes).map(|i| (i * 7 % 1024) * PAGE).collect();
    let far: Vec<u64> = (0..writes).map(|i| (64 << 20) + (i * 7 % 16384) * PAGE).collect();
    println!("4 KiB writes, per write (client verbs: slot, inode mutex, range lock, data, mtime);");
    println!("one writer unless said (then µs is wall time / writes: the inverse of throughput)");
    println!("{:<5} {:<44} {:>8} {:>8} {:>9}", "", "case", "verbs", "RTs", "µs");
    let mut scale_rows = Vec::new();
    for (name, transport) in [("shm", Transport::Auto), ("tcp", Transport::Tcp)] {
        // A fixed tree: past 4 MiB every write takes the spillover mutex.
        {
            let c = cluster(false, &format!("fixed-{name}"))?;
            let (a, b) = (client(&c, transport)?, client(&c, transport)?);
            let ino = new_file(&a, "f")?;
            b.open(ino)?;
            touch(&a, ino, &near)?;
            touch(&a, ino, &far)?;
            measure(&a, ino, &near)?; // warm-up
            row(name, "fixed tree (depth 2), inside it", &measure(&a, ino, &near)?);
            row(name, "fixed tree (depth 2), 64 MiB+: spillover", &measure(&a, ino, &far)?);
            row(name, "  4 writers at once, 64 MiB+: spillover", &measure_contended([&a, &b], ino, &far)?);
        }
        let c = cluster(true, &format!("grow-{name}"))?;
        let (a, b) = (client(&c, transport)?, client(&c, transport)?);
        let ino = new_file(&a, "f")?;
        b.open(ino)?;
        touch(&a, ino, &near)?;
        measure(&a, ino, &near)?; // warm-up
        row(name, "growing tree (depth 2), inside it", &measure(&a, ino, &near)?);
        let requests = c.meta.tree_host_requests();
        touch(&a, ino, &far)?;
        let depth = c.meta.citron_tree(ino).context("tree")?.geometry.shape().depth();
        let after_far = c.meta.tree_host_requests() - requests;
        row(name, &format!("grown tree (depth {depth}), inside the first 4 MiB"), &measure(&a, ino, &near)?);
        row(name, &format!("grown tree (depth {depth}), 64 MiB+"), &measure(&a, ino, &far)?);
        touch(&b, ino, &far[..1])?; // b follows the grown tree (one RPC)
        let after_far = after_far + 1;
        row(name, "  4 writers at once, 64 MiB+: in the tree", &measure_contended([&a, &b], ino, &far)?);
        assert_eq!(c.meta.tree_host_requests() - requests, after_far, "no RPC once grown");
        // Scale-ups: a fresh file each, its first write at 64 MiB takes the
        // spillover and its release asks the host to grow 2 -> 5.
        let (mut trigger, mut next, mut host) = (Vec::new(), Vec::new(), Vec::new());
        let stats0 = c.meta.tree_scale_stats();
        let (mut host_verbs, mut host_rts) = (0u64, 0u64);
        for i in 0..scale_ups {
            let f = new_file(&a, &format!("s{i}"))?;
            a.write(f, 0, &[1u8; PAGE as usize], false)?;
            // The chunk first (no range lock), so the timed writes allocate nothing.
            a.fallocate(f, 64 << 20, 2 * PAGE, false)?;
            let t = Instant::now();
            a.write(f, 64 << 20, &[2u8; PAGE as usize], false)?;
            trigger.push(t.elapsed());
            if let Some(last) = c.meta.tree_scale_stats().last {
                host_verbs += last.verbs.by_kind.iter().sum::<u64>();
                host_rts += last.verbs.round_trips;
                host.push(last.elapsed);
            }
            let t = Instant::now();
            a.write(f, (64 << 20) + PAGE, &[2u8; PAGE as usize], false)?;
            next.push(t.elapsed());
        }
        let grew = c.meta.tree_scale_stats().grew - stats0.grew;
        let n = scale_ups.max(1) as f64;
        scale_rows.push(format!(
            "{name:<5} {grew:>9} {:>16} {:>10.1} {:>8.1} {:>16} {:>16}",
            quantiles(&mut host),
            host_verbs as f64 / n,
            host_rts as f64 / n,
            quantiles(&mut trigger),
            quantiles(&mut next),
        ));
    }
    println!();
    println!("scale-ups 2 -> 5 run by the meta-server's tree host, per scale-up (times: median / p90 µs)");
    println!(
        "{:<5} {:>9} {:>16} {:>10} {:>8} {:>16} {:>16}",
        "", "scale-ups", "host", "host verbs", "host RTs", "trigger write", "next write"
    );
    for r in scale_rows {
        println!("{r}");
    }
    println!();
    println!("trigger wr: the first write at 64 MiB of a fresh file (spillover, then the scale-up RPC);");
    println!("next wr: the write after it, inside the grown tree. Their difference is what the");
    println!("scale-up costs the writer; host µs is the host's part (spillover mutex included).");
    Ok(())
}
