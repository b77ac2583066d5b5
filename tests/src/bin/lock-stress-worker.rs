//! Worker process of the lock factory tests (tests/tests/lock_factory.rs):
//!
//! ```text
//! lock-stress-worker ALGORITHM FABRIC LOCK_HOST LOCK_OFFSET THREADS ITERATIONS READ_PERCENT SEED
//! ```
//!
//! Opens the lock at `LOCK_OFFSET` of the test region through the factory
//! (`open_lock` with the lock host's info, `LOCK_HOST` as hex), one handle
//! per thread, and runs `lock_stress::run` on it: the oracle panics the
//! thread (and the worker exits non-zero) on any overlap it forbids.

use anyhow::{bail, Context, Result};
use citron_lock::lock_host::{open_lock, LockContext, LockHostInfo, LockTiming};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::Algorithm;
use citronfs_tests::{lock_stress, TEST_REGION};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, algorithm, fabric, host, lock_at, threads, iterations, read_percent, seed] = &args[..] else {
        bail!(
            "usage: lock-stress-worker ALGORITHM FABRIC LOCK_HOST LOCK_OFFSET THREADS ITERATIONS READ_PERCENT SEED"
        );
    };
    let algorithm: Algorithm = algorithm.parse().map_err(anyhow::Error::msg)?;
    let fabric: FabricAddr = fabric.parse().map_err(anyhow::Error::msg)?;
    let host = LockHostInfo::from_hex(host)?;
    let addr = RemoteAddr::new(TEST_REGION, lock_at.parse().context("LOCK_OFFSET")?);
    let threads: u64 = threads.parse().context("THREADS")?;
    let iterations: u64 = iterations.parse().context("ITERATIONS")?;
    let read_percent: u32 = read_percent.parse().context("READ_PERCENT")?;
    let seed: u64 = seed.parse().context("SEED")?;
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
