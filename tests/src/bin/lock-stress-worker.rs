//! Worker process of the lock stress tests:
//! `lock-stress-worker ALGORITHM FABRIC THREADS ITERATIONS READ_PERCENT SEED`.

use anyhow::{bail, Context, Result};
use citron_lock::dslr::{DslrConfig, DslrLock};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::RwLockClient;
use citronfs_tests::{lock_stress, TEST_REGION};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 7 {
        bail!("usage: lock-stress-worker ALGORITHM FABRIC THREADS ITERATIONS READ_PERCENT SEED");
    }
    let algorithm = args[1].clone();
    let fabric: FabricAddr = args[2].parse().map_err(anyhow::Error::msg)?;
    let threads: u64 = args[3].parse().context("THREADS")?;
    let iterations: u64 = args[4].parse().context("ITERATIONS")?;
    let read_percent: u32 = args[5].parse().context("READ_PERCENT")?;
    let seed: u64 = args[6].parse().context("SEED")?;
    let node = Node::join(&fabric)?;
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let node = node.clone();
                let algorithm = algorithm.clone();
                s.spawn(move || -> Result<()> {
                    let ep = node.endpoint()?;
                    let addr = RemoteAddr::new(TEST_REGION, lock_stress::LOCK_AT);
                    let rtt = ep.measure_rtt(addr, 5)?;
                    let mut lock: Box<dyn RwLockClient> = match algorithm.as_str() {
                        "dslr" => Box::new(DslrLock::new(addr, DslrConfig::from_rtt(rtt))),
                        other => bail!("unknown algorithm {other}"),
                    };
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
