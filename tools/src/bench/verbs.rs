//! `citronfs bench verbs`: latency and throughput of every verb kind on one
//! backend, one at a time and batched, beside the limit it should be compared
//! with, measured in the same run:
//! * tcp: a bare TCP echo of 8 bytes over the same loopback (what any
//!   request/response over tcp costs, with no verbs layer at all). Both ends
//!   poll their socket briefly before blocking, exactly as the software NIC
//!   and its clients do (`wire::poll_readable`), so the comparison is of the
//!   verbs layer, not of the wake-up technique;
//! * shm: a raw `AtomicU64::fetch_add` on the same mapped region;
//! * ib: the rows themselves are the comparison: native CAS/FAA beside the
//!   masked forms the device lacks (emulated by a CAS loop, whose extra
//!   round trips show in the `verbs/rt` column, below 1) and the 16-byte forms the host
//!   executes.
//!
//! On shm a single verb takes nanoseconds, below the clock's resolution, so
//! latency samples there are the mean of a chunk of consecutive operations
//! (the `chunk` column); on tcp every operation is one sample.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use citron_lock::rdma::tcp::rpc::POLL_BUDGET;
use citron_lock::rdma::tcp::wire;
use citron_lock::rdma::{
    Endpoint, FabricAddr, IbDevice, IbFabric, IbHost, Node, RegionId, RegionMemory, RegionTable, RemoteAddr,
    ShmHost, TcpHost, Verb, VerbCounts, VerbKind,
};
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;

use crate::report::{fmt_ns, Table};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    Shm,
    Tcp,
}

/// The backends `bench verbs` measures (the others' [`BackendChoice`], and ib).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VerbsBackend {
    Shm,
    Tcp,
    Ib,
}

#[derive(Args, Debug)]
pub struct VerbsArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value = "shm")]
    backend: VerbsBackend,
    /// With `--backend ib`: the RDMA device of this machine (`mlx5_0`,
    /// `mlx5_0:PORT:GID_INDEX`); default: $CITRONFS_IB_DEVICE.
    #[arg(long, value_name = "DEVICE")]
    ib_device: Option<IbDevice>,
    /// Client threads (one endpoint each) for the multi-threaded rows.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Verbs per batch in the batched rows.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Operations per thread per row (default: 200000 on shm, 4000 on tcp).
    #[arg(long)]
    ops: Option<u64>,
    /// Use a running region host (`citronfs region-host`) instead of an
    /// in-process one; its region 1 must exist. The echo baseline always runs
    /// on this machine's loopback.
    #[arg(long)]
    fabric: Option<FabricAddr>,
    /// With --fabric tcp:...: the key file of the region host (its first
    /// key is proved).
    #[command(flatten)]
    key: crate::keys::KeyArgs,
    /// Directory for verbs-<backend>.csv and verbs-<backend>.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

const REGION: RegionId = RegionId(1);
/// Each thread works on its own 256-byte slot, so "uncontended" means it.
const SLOT: u64 = 256;

/// The host a run measures, kept alive for the run.
enum LocalHost {
    Shm(ShmHost),
    Tcp(TcpHost),
    Ib(IbHost),
    Remote,
}

struct Sample {
    hist: Histogram<u64>,
    ops: u64,
    wall: Duration,
    counts: VerbCounts,
}

pub fn run(args: VerbsArgs) -> Result<()> {
    if args.threads == 0 || args.batch == 0 {
        bail!("--threads and --batch must be at least 1");
    }
    let ops = args.ops.unwrap_or(match args.backend {
        VerbsBackend::Shm => 200_000,
        VerbsBackend::Tcp | VerbsBackend::Ib => 4_000,
    });
    let region_len = (3 * VerbKind::ALL.len() as u64 * SLOT * args.threads as u64).next_multiple_of(4096);
    let (fabric, host) = match (&args.fabric, args.backend) {
        (Some(f), _) => (f.clone(), LocalHost::Remote),
        (None, VerbsBackend::Shm) => {
            let name = format!("bench-{}", std::process::id());
            let host = ShmHost::create(&name)?;
            host.add_region(REGION, region_len)?;
            (FabricAddr::Shm(name), LocalHost::Shm(host))
        }
        (None, VerbsBackend::Ib) => {
            let device = match &args.ib_device {
                Some(d) => d.clone(),
                None => match IbDevice::from_env() {
                    Some(d) => d.map_err(anyhow::Error::msg)?,
                    None => bail!(
                        "--backend ib needs an RDMA device: give --ib-device DEVICE or set {}",
                        citron_lock::rdma::ib::DEVICE_ENV
                    ),
                },
            };
            let regions = Arc::new(RegionTable::new());
            regions.insert(RegionMemory::anonymous(REGION, region_len)?)?;
            let host =
                IbHost::spawn(&device, "127.0.0.1:0".parse()?, regions, citron_rpc::auth::Authority::Open)
                    .with_context(|| format!("cannot measure the ib backend on RDMA device {device}"))?;
            (FabricAddr::Ib(IbFabric { device, host: host.local_addr() }), LocalHost::Ib(host))
        }
        (None, VerbsBackend::Tcp) => {
            let regions = Arc::new(RegionTable::new());
            regions.insert(RegionMemory::anonymous(REGION, region_len)?)?;
            let host = TcpHost::spawn("127.0.0.1:0".parse()?, regions.clone())?;
            (FabricAddr::Tcp(host.local_addr()), LocalHost::Tcp(host))
        }
    };
    let node = match (&fabric, args.key.load()?) {
        (FabricAddr::Tcp(addr), Some(ring)) => {
            let host =
                citron_rpc::auth::Credentials::new(citron_rpc::auth::Credential::Key(ring.first().clone()));
            let creds = citron_lock::rdma::NodeCredentials { host, ..Default::default() };
            Node::join_tcp_as(*addr, citron_lock::rdma::TcpOptions::default(), creds)
        }
        _ => Node::join(&fabric),
    }
    .with_context(|| format!("cannot join {fabric}"))?;
    let backend = node.backend_name();
    let chunk: u64 = if backend == "shm" { 256 } else { 1 };
    println!(
        "bench verbs: backend {backend}, fabric {fabric}, {} threads, batch {}, {ops} ops/thread/row, chunk {chunk}",
        args.threads, args.batch
    );

    let mut table = Table::new(&[
        "backend", "verb", "mode", "threads", "chunk", "ops", "p50", "p99", "Mops/s", "verbs/rt", "p50_ns",
        "p99_ns",
    ]);
    let mut p50_of = std::collections::HashMap::new();
    let mut mops_of = std::collections::HashMap::new();
    let mut add_row = |verb: &str, mode: String, threads: usize, chunk: u64, s: &Sample| {
        let p50 = s.hist.value_at_quantile(0.5) as f64;
        let p99 = s.hist.value_at_quantile(0.99) as f64;
        let mops = s.ops as f64 / s.wall.as_secs_f64() / 1e6;
        let vprt = if s.counts.round_trips > 0 {
            format!("{:.1}", s.counts.verbs() as f64 / s.counts.round_trips as f64)
        } else {
            "-".into()
        };
        p50_of.insert((verb.to_string(), mode.clone(), threads), p50);
        mops_of.insert((verb.to_string(), mode.clone(), threads), mops);
        table.push(vec![
            backend.into(),
            verb.into(),
            mode,
            threads.to_string(),
            chunk.to_string(),
            s.ops.to_string(),
            fmt_ns(p50),
            fmt_ns(p99),
            format!("{mops:.3}"),
            vprt,
            format!("{p50:.0}"),
            format!("{p99:.0}"),
        ]);
    };

    // The comparison limit first, so the machine is in the same state for both.
    match &host {
        LocalHost::Shm(h) => {
            let mem = h.regions().get(REGION)?;
            for t in [1, args.threads] {
                let s = raw_atomic(&mem, t, ops, chunk)?;
                add_row("raw-atomic-faa", "single".into(), t, chunk, &s);
            }
        }
        _ => {
            let echo = EchoServer::start()?;
            for t in [1, args.threads] {
                let s = tcp_echo(echo.addr, t, ops)?;
                add_row("tcp-echo", "single".into(), t, 1, &s);
            }
        }
    }

    // Every row gets fresh slots, so CAS compare values start from zero.
    let row_bytes = SLOT * args.threads as u64;
    for (k, kind) in VerbKind::ALL.into_iter().enumerate() {
        let base = |row: u64| (3 * k as u64 + row) * row_bytes;
        let single = |ep: &Endpoint, addr: RemoteAddr, seq: u64| issue(ep, kind, addr, seq);
        let s = measure(&node, 1, ops, chunk, 1, base(0), &single)?;
        add_row(kind.name(), "single".into(), 1, chunk, &s);
        let s = measure(&node, args.threads, ops, chunk, 1, base(1), &single)?;
        add_row(kind.name(), "single".into(), args.threads, chunk, &s);
        let batch_ops = (ops / args.batch as u64).max(1);
        let s = measure_batched(&node, args.threads, batch_ops, args.batch, kind, base(2))?;
        add_row(kind.name(), format!("batch{}", args.batch), args.threads, 1, &s);
    }

    println!();
    table.print();
    std::fs::create_dir_all(&args.out)?;
    let csv = args.out.join(format!("verbs-{backend}.csv"));
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());
    let png = args.out.join(format!("verbs-{backend}.png"));
    let bars: Vec<(String, f64)> = {
        let mut v: Vec<_> =
            p50_of.iter().map(|((verb, mode, t), p)| (format!("{verb} {mode} x{t}"), *p)).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    match crate::plot::bars(&png, &format!("verbs on {backend}: p50 latency per operation"), "ns", &bars) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => log::warn!("no plot: {e}"),
    }

    // The comparisons the verbs layer is judged by.
    println!();
    let t = args.threads;
    let get =
        |m: &std::collections::HashMap<(String, String, usize), f64>, v: &str, mode: &str, th: usize| {
            m.get(&(v.to_string(), mode.to_string(), th)).copied().unwrap_or(f64::NAN)
        };
    if backend == "tcp" {
        let echo = get(&p50_of, "tcp-echo", "single", 1);
        for v in ["read", "faa", "masked_faa"] {
            println!("ratio {v} p50 / tcp echo p50 (1 thread): {:.2}", get(&p50_of, v, "single", 1) / echo);
        }
        let one = get(&mops_of, "faa", "single", 1);
        let piped = get(&mops_of, "faa", &format!("batch{}", args.batch), t);
        println!(
            "ratio faa throughput, {t} threads batch{} / 1 thread one at a time: {:.2}",
            args.batch,
            piped / one
        );
        let piped1 = get(&mops_of, "faa", "single", t);
        println!("ratio faa throughput, {t} threads one at a time / 1 thread: {:.2}", piped1 / one);
    } else if backend == "ib" {
        // Emulated and host-executed verbs beside the native ones, same run.
        let cas = get(&p50_of, "cas", "single", 1);
        for v in ["masked_cas", "masked_faa", "ext_cas", "ext_faa"] {
            println!("ratio {v} p50 / native cas p50 (1 thread): {:.2}", get(&p50_of, v, "single", 1) / cas);
        }
    } else {
        let raw = get(&p50_of, "raw-atomic-faa", "single", 1);
        for v in ["faa", "masked_faa", "masked_cas"] {
            println!(
                "ratio {v} p50 / raw AtomicU64 fetch_add p50 (1 thread): {:.2}",
                get(&p50_of, v, "single", 1) / raw
            );
        }
    }
    if let LocalHost::Ib(h) = &host {
        println!("host: RDMA device {}, control channel {}", h.device(), h.local_addr());
    }
    if let LocalHost::Tcp(h) = &host {
        let st = h.stats();
        println!(
            "host: {} connections, {} verbs executed, {} frames refused",
            st.connections.load(Ordering::Relaxed),
            h.verbs_executed(),
            st.refused_frames.load(Ordering::Relaxed)
        );
    }
    drop(host);
    Ok(())
}

/// One verb of `kind` on the thread's slot.
///
/// `seq` counts this thread's operations on the slot, so CAS and masked-CAS
/// can be given a compare value that succeeds (they change the word every
/// time, as a lock's acquire and release do) without an extra read.
fn issue(ep: &Endpoint, kind: VerbKind, addr: RemoteAddr, seq: u64) -> Result<()> {
    match kind {
        VerbKind::Read => {
            ep.read_u64(addr)?;
        }
        VerbKind::Write => ep.write_u64(addr, 1)?,
        VerbKind::Cas => {
            ep.cas(addr + 8, seq, seq + 1)?;
        }
        VerbKind::Faa => {
            ep.faa(addr, 1)?;
        }
        VerbKind::MaskedCas => {
            // Set bit 0 on even operations, clear it on odd ones.
            let bit = seq & 1;
            ep.masked_cas(addr, bit, 1, bit ^ 1, 1)?;
        }
        VerbKind::MaskedFaa => {
            ep.masked_faa(addr, 1 | 1 << 32, 1 << 31 | 1 << 63)?;
        }
        VerbKind::ExtCas => {
            let bit = u128::from(seq & 1);
            ep.ext_cas(addr + 16, bit, 1, bit ^ 1, 1)?;
        }
        VerbKind::ExtFaa => {
            ep.ext_faa(addr + 16, 1 | 1 << 64, 1 << 63 | 1 << 127)?;
        }
        VerbKind::Flush => ep.flush(addr, 8)?,
    }
    Ok(())
}

fn verb_of(kind: VerbKind, addr: RemoteAddr) -> Verb {
    match kind {
        VerbKind::Read => Verb::Read { addr, len: 8 },
        VerbKind::Write => Verb::Write { addr, data: 1u64.to_le_bytes().to_vec() },
        VerbKind::Cas => Verb::Cas { addr: (addr + 8), expect: 0, new: 0 },
        VerbKind::Faa => Verb::Faa { addr, add: 1 },
        VerbKind::MaskedCas => Verb::MaskedCas { addr, cmp: 0, cmp_mask: 0, swap: 1, swap_mask: 1 },
        VerbKind::MaskedFaa => Verb::MaskedFaa { addr, add: 1 | 1 << 32, boundary_mask: 1 << 31 | 1 << 63 },
        VerbKind::ExtCas => Verb::ExtCas { addr: (addr + 16), cmp: 0, cmp_mask: 0, swap: 1, swap_mask: 1 },
        VerbKind::ExtFaa => {
            Verb::ExtFaa { addr: (addr + 16), add: 1 | 1 << 64, boundary_mask: 1 << 63 | 1 << 127 }
        }
        VerbKind::Flush => Verb::Flush { addr, len: 8 },
    }
}

/// The time from the first thread's start to the last thread's end: each
/// thread stamps its own, because on a busy machine the coordinating thread
/// may not run while the workers do.
#[derive(Default)]
struct Span(Option<(Instant, Instant)>);

impl Span {
    fn cover(&mut self, start: Instant, end: Instant) {
        self.0 = Some(match self.0 {
            None => (start, end),
            Some((s, e)) => (s.min(start), e.max(end)),
        });
    }

    fn len(&self) -> Duration {
        self.0.map(|(s, e)| e - s).unwrap_or_default()
    }
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Runs `op` `ops` times on each of `threads` threads (each with its own
/// endpoint and slot), sampling the mean of every `chunk` consecutive calls.
/// `verbs_per_op` scales the operation count for batched calls.
/// What one benchmark thread measured.
struct ThreadRun {
    hist: Histogram<u64>,
    counts: VerbCounts,
    start: Instant,
    end: Instant,
}

/// Runs `body(i, barrier)` on `threads` threads; each sets up, waits on the
/// barrier, measures, and reports. The samples are merged and the wall time
/// is the span from the first thread's start to the last one's end (each
/// thread stamps its own: on a busy machine the coordinating thread may not
/// run while the workers do).
fn run_threads(
    threads: usize,
    ops: u64,
    body: &(dyn Fn(usize, &Barrier) -> Result<ThreadRun> + Sync),
) -> Result<Sample> {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| -> Result<Sample> {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                s.spawn({
                    let barrier = &barrier;
                    move || body(i, barrier)
                })
            })
            .collect();
        barrier.wait();
        let mut hist = new_hist();
        let mut counts = VerbCounts::default();
        let mut span = Span::default();
        for h in handles {
            let run = h.join().map_err(|_| anyhow::anyhow!("bench thread panicked"))??;
            hist.add(run.hist)?;
            counts += run.counts;
            span.cover(run.start, run.end);
        }
        Ok(Sample { hist, ops, wall: span.len(), counts })
    })
}

/// Calls `op` `ops` times, recording the mean time of every `chunk`
/// consecutive calls; returns the histogram and the loop's start and end.
fn timed_loop(
    ops: u64,
    chunk: u64,
    mut op: impl FnMut() -> Result<()>,
) -> Result<(Histogram<u64>, Instant, Instant)> {
    let mut hist = new_hist();
    let start = Instant::now();
    let mut done = 0;
    while done < ops {
        let n = chunk.min(ops - done);
        let t = Instant::now();
        for _ in 0..n {
            op()?;
        }
        hist.record((t.elapsed().as_nanos() as u64 / n).max(1))?;
        done += n;
    }
    Ok((hist, start, Instant::now()))
}

/// Runs `op` `ops` times on each of `threads` threads (each with its own
/// endpoint and slot), sampling the mean of every `chunk` consecutive calls.
/// `verbs_per_op` scales the operation count for batched calls.
fn measure(
    node: &Node,
    threads: usize,
    ops: u64,
    chunk: u64,
    verbs_per_op: u64,
    base: u64,
    op: &(dyn Fn(&Endpoint, RemoteAddr, u64) -> Result<()> + Sync),
) -> Result<Sample> {
    run_threads(threads, ops * threads as u64 * verbs_per_op, &|i, barrier| {
        let ep = node.endpoint()?;
        let addr = RemoteAddr::new(REGION, base + i as u64 * SLOT);
        let mut seq = 0u64;
        // Warm up: map the region, open the connection's buffers.
        for _ in 0..chunk.min(64) {
            op(&ep, addr, seq)?;
            seq += 1;
        }
        ep.reset_counts();
        barrier.wait();
        let (hist, start, end) = timed_loop(ops, chunk, || {
            seq += 1;
            op(&ep, addr, seq - 1)
        })?;
        Ok(ThreadRun { hist, counts: ep.counts(), start, end })
    })
}

fn measure_batched(
    node: &Node,
    threads: usize,
    batches: u64,
    batch: usize,
    kind: VerbKind,
    base: u64,
) -> Result<Sample> {
    let op = move |ep: &Endpoint, addr: RemoteAddr, _seq: u64| -> Result<()> {
        let verbs: Vec<Verb> = (0..batch).map(|_| verb_of(kind, addr)).collect();
        let replies = ep.execute(&verbs)?;
        if let Some(Err(e)) = replies.into_iter().find(Result::is_err) {
            return Err(e.into());
        }
        Ok(())
    };
    measure(node, threads, batches, 1, batch as u64, base, &op)
}

fn raw_atomic(mem: &RegionMemory, threads: usize, ops: u64, chunk: u64) -> Result<Sample> {
    run_threads(threads, ops * threads as u64, &|i, barrier| {
        let w = mem.word(RemoteAddr::new(REGION, i as u64 * SLOT))?;
        barrier.wait();
        let (hist, start, end) = timed_loop(ops, chunk, || {
            // SeqCst, as every verb of the shm backend.
            std::hint::black_box(w.fetch_add(1, Ordering::SeqCst));
            Ok(())
        })?;
        Ok(ThreadRun { hist, counts: VerbCounts::default(), start, end })
    })
}

/// A loopback echo server: 8 bytes in, 8 bytes out, one thread a connection.
struct EchoServer {
    addr: SocketAddr,
}

impl EchoServer {
    fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                std::thread::spawn(move || {
                    let _ = s.set_nodelay(true);
                    let mut b = [0u8; 8];
                    loop {
                        wire::poll_readable(&s, POLL_BUDGET);
                        if s.read_exact(&mut b).is_err() {
                            return;
                        }
                        if s.write_all(&b).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(Self { addr })
    }
}

fn tcp_echo(addr: SocketAddr, threads: usize, ops: u64) -> Result<Sample> {
    run_threads(threads, ops * threads as u64, &|_, barrier| {
        let mut c = TcpStream::connect(addr)?;
        c.set_nodelay(true)?;
        let mut b = [7u8; 8];
        barrier.wait();
        let (hist, start, end) = timed_loop(ops, 1, || {
            c.write_all(&b)?;
            wire::poll_readable(&c, POLL_BUDGET);
            c.read_exact(&mut b)?;
            Ok(())
        })?;
        Ok(ThreadRun { hist, counts: VerbCounts::default(), start, end })
    })
}
