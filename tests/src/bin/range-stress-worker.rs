//! Worker process of the range lock tests (tests/tests/range_locks.rs):
//!
//! ```text
//! range-stress-worker stress SITE FABRIC THREADS ITERATIONS SEED
//! range-stress-worker hold   SITE FABRIC L R|inf LEASE_MS
//! ```
//!
//! (`--help` describes the arguments.) SITE is `citron`, `segments:S` or
//! `rpc:HOST:PORT` (see `citronfs_tests::range_stress::site`). `stress`:
//! each of THREADS threads
//! (own endpoint, own client) runs ITERATIONS random critical sections under
//! the oracle of `range_stress`; a violation panics, so the process exits
//! with failure. `hold`: acquires `[L, R)`, prints `held`, and never
//! releases (the failure tests SIGKILL it); it prints `acquiring` first.

use std::io::Write;
use std::time::Duration;

use anyhow::Result;
use citron_lock::rdma::{FabricAddr, Node};
use citronfs_tests::range_stress;
use clap::Parser;

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

#[derive(Parser)]
enum Args {
    /// Runs random critical sections under the oracle of `range_stress`.
    Stress {
        /// Where the range lock is (see `range_stress::site`).
        site: String,
        /// The fabric to join.
        fabric: String,
        /// Threads, each with its own endpoint and client.
        threads: u64,
        /// Critical sections per thread.
        iterations: u64,
        /// Seed of the threads' random choices (thread t uses SEED * 1000 + t).
        seed: u64,
    },
    /// Acquires `[L, R)` and never releases it.
    Hold {
        /// Where the range lock is (see `range_stress::site`).
        site: String,
        /// The fabric to join.
        fabric: String,
        /// Left end of the range (inclusive).
        l: u64,
        /// Right end of the range (exclusive), or `inf`.
        #[arg(value_parser = bound)]
        r: u64,
        /// The lock's lease, in milliseconds.
        lease_ms: u64,
    },
}

/// A right end: a number, or `inf` for `u64::MAX`.
fn bound(s: &str) -> Result<u64, std::num::ParseIntError> {
    if s == "inf" {
        Ok(u64::MAX)
    } else {
        s.parse()
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (Args::Stress { site, fabric, .. } | Args::Hold { site, fabric, .. }) = &args;
    let site = range_stress::site(site);
    let fabric: FabricAddr = fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    match args {
        Args::Stress { threads, iterations, seed, .. } => {
            std::thread::scope(|s| {
                for t in 0..threads {
                    let node = node.clone();
                    s.spawn(move || {
                        let ep = node.endpoint().expect("endpoint");
                        let ctx = range_stress::context(&ep, None);
                        let mut lock = ctx.client(&site).expect("client");
                        let stats = range_stress::run(&ep, &mut *lock, iterations, seed * 1000 + t);
                        println!("thread {t}: {stats:?}");
                    });
                }
            });
        }
        Args::Hold { l, r, lease_ms, .. } => {
            let ep = node.endpoint()?;
            let ctx = range_stress::context(&ep, Some(lease_ms));
            let mut lock = ctx.client(&site)?;
            say("acquiring");
            std::mem::forget(lock.acquire(&ep, l, r)?);
            say("held");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    Ok(())
}
