//! Worker process of the DQL tests (tests/tests/lock_dql.rs). Arguments are
//! options after a command (see `--help`):
//!
//! ```text
//! dql-stress-worker stress --fabric=ADDR --variant=sf|distributed --threads=N --iterations=N
//!                          --seed=N --lock-at=OFFSET --oracle-at=OFFSET [--lease-ms=N]
//!                          [--locks=N] [--nested=0|1] [--fifo=0|1]
//! dql-stress-worker hold   --fabric=ADDR --variant=... --lock-at=OFFSET [--lease-ms=N]
//! dql-stress-worker queue  --fabric=ADDR --variant=... --lock-at=OFFSET [--lease-ms=N]
//! ```
//!
//! `stress`: each of `threads` threads (own endpoint) runs `iterations`
//! critical sections on `locks` DQL locks (16 bytes each, 64 apart from
//! `lock_at` in region 1); its handles share one postbox. With `--nested=1`
//! half of the iterations take lock 0 and then, inside, lock 1 (always in
//! that order), so alerts for lock 0 arrive while the thread waits on lock
//! 1 and the postbox must keep them. Each lock `i` has an oracle of three
//! words at `oracle_at + 64 i`, updated with verbs by every process:
//!
//! | word | meaning |
//! |---|---|
//! | `+0`  | clients inside: the one entering must see 0 (mutual exclusion) |
//! | `+8`  | critical sections completed |
//! | `+16` | the token of the last client to enter |
//!
//! On entry a client that was handed the lock checks that the last to enter
//! was its predecessor (the handover followed the queue: nobody in between,
//! none lost); with `--variant=sf` every client checks that exactly as many
//! critical sections completed as tickets were taken before its own (the
//! FIFO order of §4.4; valid from a zeroed lock only: `--fifo=0` turns it
//! off). A violation panics, so the process fails. The worker
//! prints `result key=value ...` with its totals and the locks' statistics.
//!
//! `hold`: acquires, prints `held`, never releases (the failure tests kill
//! it). `queue`: joins the queue, prints `queued` (or `held` if the lock was
//! free), waits for the lock, prints `held`, never releases.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use citron_lock::dql::{DqlConfig, DqlLock, DqlPostbox, DqlStats, DqlVariant};
use citron_lock::rdma::{Endpoint, FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::args::StressShape;
use citronfs_tests::args::Totals;
use citronfs_tests::TEST_REGION;
use clap::{Parser, ValueEnum};
use rand::{Rng, SeedableRng};

const INSIDE: u64 = 0;
const DONE: u64 = 8;
const LAST: u64 = 16;
/// Spacing of the locks and of their oracles.
pub const STRIDE: u64 = 64;

#[derive(Parser)]
enum Command {
    /// Runs critical sections under the oracle; prints `result key=value ...`.
    Stress(StressArgs),
    /// Acquires, prints `held`, never releases.
    Hold(LockArgs),
    /// Joins the queue, prints `queued` (or `held` if the lock was free),
    /// waits for the lock, prints `held`, never releases.
    Queue(LockArgs),
}

/// The lock every command takes.
#[derive(clap::Args)]
struct LockArgs {
    /// The fabric to join.
    #[arg(long)]
    fabric: String,
    /// The DQL variant.
    #[arg(long, value_enum)]
    variant: Variant,
    /// Byte offset of the (first) lock in the test region.
    #[arg(long)]
    lock_at: u64,
    /// The lock's lease in milliseconds (default: the configuration's).
    #[arg(long)]
    lease_ms: Option<u64>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Variant {
    /// Starvation-free (§4.4).
    #[value(name = "sf")]
    StarvationFree,
    /// Distributed.
    Distributed,
}

#[derive(clap::Args)]
struct StressArgs {
    #[command(flatten)]
    lock: LockArgs,
    #[command(flatten)]
    shape: StressShape,
    /// Locks, `STRIDE` bytes apart (and their oracles too).
    #[arg(long, default_value_t = 1)]
    locks: u64,
    /// 1: half of the iterations take lock 0 and, inside, lock 1.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    nested: u8,
    /// 0: do not check the FIFO order (with `--variant=sf`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    fifo: u8,
}

fn main() -> Result<()> {
    match Command::parse() {
        Command::Stress(args) => stress(&args),
        Command::Hold(args) => hold(&args, false),
        Command::Queue(args) => hold(&args, true),
    }
}

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

fn config(args: &LockArgs, ep: &Endpoint, probe: RemoteAddr) -> Result<DqlConfig> {
    let variant = match args.variant {
        Variant::StarvationFree => DqlVariant::StarvationFree,
        Variant::Distributed => DqlVariant::Distributed,
    };
    let mut c = DqlConfig::from_rtt(ep.measure_rtt(probe, 5)?).with_variant(variant);
    if let Some(lease_ms) = args.lease_ms {
        c = c.with_lease(Duration::from_millis(lease_ms));
    }
    Ok(c)
}

fn stress(args: &StressArgs) -> Result<()> {
    let fabric: FabricAddr = args.lock.fabric.parse().map_err(anyhow::Error::msg)?;
    let threads = args.shape.threads;
    let node = Node::join(&fabric)?;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let node = node.clone();
                s.spawn(move || stress_thread(args, &node, t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a thread panicked"))?)
            .collect::<Vec<_>>()
    });
    let mut totals = Totals::default();
    for r in results {
        totals.merge(&r?);
    }
    say(&totals.line());
    Ok(())
}

fn stress_thread(args: &StressArgs, node: &Node, thread: u64) -> Result<Totals> {
    // The lock's endpoint, and another for the oracle, so the lock's verb
    // and message counts are its own.
    let ep = node.endpoint()?;
    let oracle_ep = node.endpoint()?;
    let lock_at = args.lock.lock_at;
    let oracle_at = args.shape.oracle_at;
    let locks = args.locks;
    let nested = args.nested == 1;
    ensure!(!nested || locks >= 2, "--nested=1 needs --locks >= 2");
    let iterations = args.shape.iterations;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.shape.seed * 1000 + thread);
    let config = config(&args.lock, &ep, RemoteAddr::new(TEST_REGION, lock_at))?;
    let fifo = config.variant == DqlVariant::StarvationFree && args.fifo == 1;
    let postbox = Arc::new(DqlPostbox::new());
    let mut handles = (0..locks)
        .map(|i| {
            DqlLock::with_postbox(RemoteAddr::new(TEST_REGION, lock_at + STRIDE * i), config, postbox.clone())
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Count from here on: the RTT probe is not the lock's.
    ep.reset_counts();
    let mut out = Totals::default();
    for i in 0..iterations {
        let order: Vec<usize> = if nested {
            if rng.gen_bool(0.5) {
                vec![0, 1]
            } else {
                vec![1]
            }
        } else {
            vec![rng.gen_range(0..locks as usize)]
        };
        for &l in &order {
            let oracle = |w: u64| RemoteAddr::new(TEST_REGION, oracle_at + STRIDE * l as u64 + w);
            let lock = &mut handles[l];
            lock.acquire(&ep, Mode::Exclusive).with_context(|| format!("acquire #{i} of lock {l}"))?;
            let inside = oracle_ep.faa(oracle(INSIDE), 1)?;
            assert_eq!(inside, 0, "lock {l}: entered with {inside} inside");
            if let Some(pred) = lock.predecessor() {
                let last = oracle_ep.read_u64(oracle(LAST))?;
                assert_eq!(
                    last, pred.0,
                    "lock {l}: handed over by {pred:?}, but the last to enter was {last:#x}"
                );
                out.add("handovers_checked", 1);
            }
            if fifo {
                let done = oracle_ep.read_u64(oracle(DONE))?;
                let position = lock.position().context("a starvation-free holder has a position")?;
                assert_eq!(
                    done, position,
                    "lock {l}: the ticket at position {position} entered after {done} sections"
                );
                out.add("fifo_checked", 1);
            }
            oracle_ep.write_u64(oracle(LAST), lock.token().context("a holder has a token")?.0)?;
            if rng.gen_bool(0.25) {
                std::thread::yield_now();
            }
            oracle_ep.faa(oracle(INSIDE), u64::MAX)?;
            oracle_ep.faa(oracle(DONE), 1)?;
        }
        for &l in order.iter().rev() {
            handles[l].release(&ep).with_context(|| format!("release #{i} of lock {l}"))?;
            out.add("done", 1);
        }
    }
    let c = ep.counts();
    out.add("lock_verbs", c.verbs());
    out.add("lock_round_trips", c.round_trips);
    out.add("lock_messages", c.messages_sent);
    let mut stats = DqlStats::default();
    for h in &handles {
        stats += h.stats();
    }
    report(&stats, &mut out);
    out.add("foreign_messages", postbox.take_foreign().len() as u64);
    Ok(out)
}

fn report(s: &DqlStats, out: &mut Totals) {
    for (k, v) in [
        ("acquisitions", s.acquisitions),
        ("immediate", s.immediate),
        ("queued", s.queued),
        ("cas_failures", s.cas_failures),
        ("turn_polls", s.turn_polls),
        ("passed", s.passed),
        ("skips", s.skips),
        ("alerts_sent", s.alerts_sent),
        ("grants_sent", s.grants_sent),
        ("grants_received", s.grants_received),
        ("transient", s.transient),
        ("dropped", s.dropped),
        ("alive_sent", s.alive_sent),
        ("tail_polls", s.tail_polls),
        ("freshness_reads", s.freshness_reads),
        ("resets", s.resets),
        ("takeovers", s.takeovers),
        ("restarts", s.restarts),
        ("late_releases", s.late_releases),
        ("fenced", s.fenced),
        ("stale_messages", s.stale_messages),
    ] {
        out.add(k, v);
    }
}

fn hold(args: &LockArgs, announce_queued: bool) -> Result<()> {
    let fabric: FabricAddr = args.fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let ep = node.endpoint()?;
    let addr = RemoteAddr::new(TEST_REGION, args.lock_at);
    let mut lock = DqlLock::new(addr, config(args, &ep, addr)?)?;
    if lock.begin(&ep)? {
        say("held");
    } else {
        if announce_queued {
            say("queued");
        }
        lock.complete(&ep)?;
        say("held");
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
