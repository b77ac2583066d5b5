//! Worker process of the RPC lock server tests (tests/tests/lock_rpc.rs).
//! Arguments are `key=value` after a command:
//!
//! ```text
//! rpc-lock-worker stress server=ADDR fabric=ADDR threads=N iterations=N read=PERCENT seed=N
//!                        lock=ID oracle_at=OFFSET [fifo=0|1]
//! rpc-lock-worker hold   server=ADDR lock=ID mode=shared|exclusive
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
//! nobody, a reader no writer. With `fifo=1` a writer also checks the
//! server's arrival order: when the request that arrived `a`-th is granted
//! to a writer, exactly `a` critical sections have completed (every earlier
//! request, no later one). A violation panics. The worker prints
//! `result key=value ...`.
//!
//! `hold`: prints `acquiring`, acquires, prints `held`, never releases.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rpc_lock::{measure_rtt, RpcLockClient, RpcLockConfig, RpcLockId, RpcLockSession};
use citron_lock::rwlock::Mode;
use citronfs_tests::args::{Args, Totals};
use citronfs_tests::TEST_REGION;
use rand::{Rng, SeedableRng};

const WRITERS: u64 = 0;
const READERS: u64 = 8;
const DONE: u64 = 16;

fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let command = argv.get(1).cloned().unwrap_or_default();
    let args = Args::parse(argv.get(2..).unwrap_or_default())?;
    match command.as_str() {
        "stress" => stress(&args),
        "hold" => hold(&args),
        _ => bail!("usage: rpc-lock-worker stress|hold key=value... (see the source's doc comment)"),
    }
}

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

fn session(args: &Args) -> Result<std::sync::Arc<RpcLockSession>> {
    let server: SocketAddr = args.get("server")?;
    let rtt = measure_rtt(server, 5, Duration::from_secs(10))?;
    Ok(RpcLockSession::connect(server, RpcLockConfig::from_rtt(rtt))?)
}

fn stress(args: &Args) -> Result<()> {
    let fabric: FabricAddr = args.str("fabric")?.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let session = session(args)?;
    let threads: u64 = args.get("threads")?;
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
    args: &Args,
    node: &Node,
    session: &std::sync::Arc<RpcLockSession>,
    thread: u64,
) -> Result<Totals> {
    let ep = node.endpoint()?;
    let oracle_at: u64 = args.get("oracle_at")?;
    let word = |i: u64| RemoteAddr::new(TEST_REGION, oracle_at + i);
    let iterations: u64 = args.get("iterations")?;
    let read_percent: u32 = args.get("read")?;
    let fifo = args.get_or("fifo", 0u64)? == 1;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.get::<u64>("seed")? * 1000 + thread);
    let mut lock = RpcLockClient::with_session(session, RpcLockId(args.get("lock")?));
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

fn hold(args: &Args) -> Result<()> {
    let mode = match args.str("mode")? {
        "shared" => Mode::Shared,
        "exclusive" => Mode::Exclusive,
        other => bail!("mode={other:?}: shared or exclusive"),
    };
    let session = session(args)?;
    let mut lock = RpcLockClient::with_session(&session, RpcLockId(args.get("lock")?));
    say("acquiring");
    lock.lock(mode)?;
    say("held");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
