//! Worker process of the lock factory tests (tests/tests/lock_factory.rs):
//!
//! ```text
//! lock-stress-worker ALGORITHM FABRIC LOCK_HOST LOCK_OFFSET THREADS ITERATIONS READ_PERCENT SEED
//! ```
//!
//! `--help` describes the arguments.
//! Opens the lock at `LOCK_OFFSET` of the test region through the factory
//! (`open_lock` with the lock host's info, `LOCK_HOST` as hex), one handle
//! per thread, and runs `lock_stress::run` on it: the oracle panics the
//! thread (and the worker exits non-zero) on any overlap it forbids.

use anyhow::Result;
use citron_lock::lock_host::{open_lock, LockContext, LockHostInfo, LockTiming};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::Algorithm;
use citronfs_tests::{lock_stress, TEST_REGION};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// The lock algorithm, as `Algorithm` parses it.
    algorithm: String,
    /// The fabric to join.
    fabric: String,
    /// The lock host's info, as hex.
    lock_host: String,
    /// Byte offset of the lock in the test region.
    lock_offset: u64,
    /// Threads, each with its own endpoint and lock handle.
    threads: u64,
    /// Critical sections per thread.
    iterations: u64,
    /// Percent of the critical sections that are shared.
    read_percent: u32,
    /// Seed of the threads' random choices (thread t uses SEED * 100 + t).
    seed: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let algorithm: Algorithm = args.algorithm.parse().map_err(anyhow::Error::msg)?;
    let fabric: FabricAddr = args.fabric.parse().map_err(anyhow::Error::msg)?;
    let host = LockHostInfo::from_hex(&args.lock_host)?;
    let addr = RemoteAddr::new(TEST_REGION, args.lock_offset);
    let (threads, iterations, read_percent, seed) =
        (args.threads, args.iterations, args.read_percent, args.seed);
    let node = Node::join(&fabric)?;
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (node, host) = (&node, &host);
                s.spawn(move || -> Result<()> {
                    let ep = node.endpoint()?;
                    let timing = LockTiming::measure(&ep, host)?;
                    let ctx = LockContext::new(&ep);
                    let mut lock = open_lock(algorithm, &ep, host, addr, timing, &ctx)?;
                    lock_stress::run(&ep, lock.as_mut(), iterations, read_percent, seed * 100 + t);
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("worker thread panicked"))??;
        }
        Ok(())
    })
}
