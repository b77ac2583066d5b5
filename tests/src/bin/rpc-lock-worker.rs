//! Worker process of the RPC lock server tests (tests/tests/lock_rpc.rs).
//! Arguments are options after a command (see `--help`):
//!
//! ```text
//! rpc-lock-worker stress --server=ADDR --fabric=ADDR --threads=N --iterations=N --read=PERCENT
//!                        --seed=N --lock=ID --oracle-at=OFFSET [--fifo=0|1]
//! rpc-lock-worker hold   --server=ADDR --lock=ID --mode=shared|exclusive
//! ```
//!
//! `stress`: the process opens one session with the lock server at
//! `server`; each of `threads` threads has its own handle on lock `lock`
//! in it (their calls share the session's connection) and runs
//! `iterations` critical sections, `read` percent of them shared. The
//! oracle is three words at `oracle_at` in region 1 of `fabric`, updated
//! with verbs by every process:
//!
//! | word | meaning |
//! |---|---|
//! | `+0`  | writers inside |
//! | `+8`  | readers inside |
//! | `+16` | critical sections completed |
//!
//! A writer adds itself to the writers and then reads the readers; a reader
//! adds itself to the readers and then reads the writers: a writer must see
//! nobody, a reader no writer. With `--fifo=1` a writer also checks the
//! server's arrival order: when the request that arrived `a`-th is granted
//! to a writer, exactly `a` critical sections have completed (every earlier
//! request, no later one). A violation panics. The worker prints
//! `result key=value ...`.
//!
//! `hold`: prints `acquiring`, acquires, prints `held`, never releases.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rpc_lock::{measure_rtt, RpcLockClient, RpcLockConfig, RpcLockId, RpcLockSession};
use citron_lock::rwlock::Mode;
use citronfs_tests::args::Totals;
use citronfs_tests::args::{HoldMode, StressShape};
use citronfs_tests::TEST_REGION;
use clap::Parser;
use rand::{Rng, SeedableRng};

const WRITERS: u64 = 0;
const READERS: u64 = 8;
const DONE: u64 = 16;

#[derive(Parser)]
enum Command {
    /// Runs critical sections under the oracle; prints `result key=value ...`.
    Stress(StressArgs),
    /// Prints `acquiring`, acquires, prints `held`, never releases.
    Hold(HoldArgs),
}

/// The lock every command takes.
#[derive(clap::Args)]
struct LockArgs {
    /// The lock server's address.
    #[arg(long)]
    server: SocketAddr,
    /// The lock's id on the server.
    #[arg(long)]
    lock: u64,
}

#[derive(clap::Args)]
struct StressArgs {
    #[command(flatten)]
    lock: LockArgs,
    /// The fabric of the oracle.
    #[arg(long)]
    fabric: String,
    #[command(flatten)]
    shape: StressShape,
    /// Percent of the critical sections that are shared.
    #[arg(long)]
    read: u32,
    /// 1: writers also check the server's arrival order.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    fifo: u8,
}

#[derive(clap::Args)]
struct HoldArgs {
    #[command(flatten)]
    lock: LockArgs,
    /// The mode to hold the lock in.
    #[arg(long, value_enum)]
    mode: HoldMode,
}

fn main() -> Result<()> {
    match Command::parse() {
        Command::Stress(args) => stress(&args),
        Command::Hold(args) => hold(&args),
    }
}

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

fn session(args: &LockArgs) -> Result<std::sync::Arc<RpcLockSession>> {
    let server = args.server;
    let rtt = measure_rtt(server, 5, Duration::from_secs(10))?;
    Ok(RpcLockSession::connect(server, RpcLockConfig::from_rtt(rtt))?)
}

fn stress(args: &StressArgs) -> Result<()> {
    let fabric: FabricAddr = args.fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let session = session(&args.lock)?;
    let threads = args.shape.threads;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (node, session) = (node.clone(), session.clone());
                s.spawn(move || stress_thread(args, &node, &session, t))
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
    totals.add("session_calls", session.calls());
    say(&totals.line());
    Ok(())
}

fn stress_thread(
    args: &StressArgs,
    node: &Node,
    session: &std::sync::Arc<RpcLockSession>,
    thread: u64,
) -> Result<Totals> {
    let ep = node.endpoint()?;
    let oracle_at = args.shape.oracle_at;
    let word = |i: u64| RemoteAddr::new(TEST_REGION, oracle_at + i);
    let iterations = args.shape.iterations;
    let read_percent = args.read;
    let fifo = args.fifo == 1;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.shape.seed * 1000 + thread);
    let mut lock = RpcLockClient::with_session(session, RpcLockId(args.lock.lock));
    let mut out = Totals::default();
    for i in 0..iterations {
        let mode = if rng.gen_range(0..100) < read_percent { Mode::Shared } else { Mode::Exclusive };
        lock.lock(mode).with_context(|| format!("acquire #{i} ({mode:?})"))?;
        match mode {
            Mode::Exclusive => {
                let w = ep.faa(word(WRITERS), 1)?;
                let r = ep.read_u64(word(READERS))?;
                assert_eq!((w, r), (0, 0), "a writer entered with {w} writers and {r} readers inside");
                if fifo {
                    let done = ep.read_u64(word(DONE))?;
                    let arrival = lock.arrival().context("a holder has an arrival number")?;
                    assert_eq!(
                        done, arrival,
                        "the writer that arrived {arrival}-th entered after {done} sections"
                    );
                    out.add("fifo_checked", 1);
                }
                linger(&mut rng);
                ep.faa(word(WRITERS), u64::MAX)?;
                out.add("exclusive", 1);
            }
            Mode::Shared => {
                let r = ep.faa(word(READERS), 1)?;
                let w = ep.read_u64(word(WRITERS))?;
                assert_eq!(w, 0, "a reader entered with {w} writers inside");
                out.add("overlaps", u64::from(r > 0));
                linger(&mut rng);
                ep.faa(word(READERS), u64::MAX)?;
                out.add("shared", 1);
            }
        }
        ep.faa(word(DONE), 1)?;
        lock.unlock().with_context(|| format!("release #{i}"))?;
        out.add("done", 1);
    }
    let s = lock.stats();
    for (k, v) in [
        ("acquisitions", s.acquisitions),
        ("queued", s.queued),
        ("calls", s.calls),
        ("timeouts", s.timeouts),
        ("fenced", s.fenced),
    ] {
        out.add(k, v);
    }
    Ok(out)
}

/// Stays in the critical section a little, sometimes giving the core away.
fn linger(rng: &mut impl Rng) {
    if rng.gen_bool(0.25) {
        std::thread::yield_now();
    }
}

fn hold(args: &HoldArgs) -> Result<()> {
    let mode = Mode::from(args.mode);
    let session = session(&args.lock)?;
    let mut lock = RpcLockClient::with_session(&session, RpcLockId(args.lock.lock));
    say("acquiring");
    lock.lock(mode)?;
    say("held");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
