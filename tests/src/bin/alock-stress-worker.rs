//! Worker process of the ALock tests (tests/tests/lock_alock.rs): remote
//! clients of an ALock whose host's threads take it locally in the test
//! process. Arguments are options after the command (see `--help`):
//!
//! ```text
//! alock-stress-worker stress --fabric=ADDR --threads=N --iterations=N --lock-at=OFFSET
//!                            --oracle-at=OFFSET --seed=N [--local-budget=N] [--remote-budget=N]
//! ```
//!
//! Each of `threads` threads (own endpoint, own [`AlockClient`]) runs
//! `iterations` critical sections on the ALock at `lock_at` of region 1,
//! checked by the oracle at `oracle_at` ([`citronfs_tests::alock_oracle`]):
//! nobody else may be inside, and every entry books whether the local
//! cohort was waiting. A violation panics, so the process fails. At the end
//! it prints `result key=value ...` with the handles' statistics added up.

use anyhow::{anyhow, Context, Result};
use citron_lock::alock::{AlockClient, AlockConfig};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citronfs_tests::alock_oracle::{self, Access, Oracle};
use citronfs_tests::args::StressShape;
use citronfs_tests::TEST_REGION;
use clap::Parser;
use rand::{Rng, SeedableRng};

#[derive(Parser)]
enum Command {
    /// Runs critical sections as remote clients; prints `result key=value ...`.
    Stress(Args),
}

#[derive(clap::Args)]
struct Args {
    /// The fabric to join.
    #[arg(long)]
    fabric: String,
    #[command(flatten)]
    shape: StressShape,
    /// Byte offset of the ALock in the test region.
    #[arg(long)]
    lock_at: u64,
    /// The local cohort's budget.
    #[arg(long, default_value_t = 5)]
    local_budget: u32,
    /// The remote cohort's budget.
    #[arg(long, default_value_t = 20)]
    remote_budget: u32,
}

fn main() -> Result<()> {
    match Command::parse() {
        Command::Stress(args) => stress(&args),
    }
}

fn stress(args: &Args) -> Result<()> {
    let fabric: FabricAddr = args.fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let threads = args.shape.threads;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let node = node.clone();
                s.spawn(move || stress_thread(args, &node, t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a stress thread panicked"))?)
            .collect::<Vec<_>>()
    });
    let mut totals: Vec<(&'static str, u64)> = Vec::new();
    for r in results {
        for (k, v) in r? {
            match totals.iter_mut().find(|(key, _)| *key == k) {
                Some((_, t)) => *t += v,
                None => totals.push((k, v)),
            }
        }
    }
    let line: Vec<String> = totals.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("result {}", line.join(" "));
    Ok(())
}

fn stress_thread(args: &Args, node: &Node, thread: u64) -> Result<Vec<(&'static str, u64)>> {
    let ep = node.endpoint()?;
    let lock_at = args.lock_at;
    let lock = RemoteAddr::new(TEST_REGION, lock_at);
    let rtt = ep.measure_rtt(lock, 5)?;
    let config = AlockConfig::from_rtt(rtt).with_budgets(args.local_budget, args.remote_budget);
    let mut alock = AlockClient::new(lock, config);
    let oracle = Oracle { access: Access::Remote(&ep), base: args.shape.oracle_at };
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.shape.seed * 1000 + thread);
    for i in 0..args.shape.iterations {
        alock.lock(&ep).with_context(|| format!("acquire #{i}"))?;
        let others = oracle.enter();
        assert_eq!(others, 0, "a remote client entered with {others} other holders inside");
        let waiting = oracle.access.other_tail(lock_at) != 0;
        oracle.book(waiting);
        if rng.gen_bool(0.25) {
            std::thread::yield_now();
        }
        oracle.leave();
        alock.unlock(&ep).with_context(|| format!("release #{i}"))?;
        alock_oracle::think(i + thread);
    }
    let s = alock.stats();
    Ok(vec![
        ("acquisitions", s.acquisitions),
        ("uncontended", s.uncontended),
        ("passed", s.passed),
        ("peterson", s.peterson),
        ("reacquires", s.reacquires),
        ("polls", s.polls),
        ("handovers", s.handovers),
        ("timeouts", s.timeouts),
    ])
}
