//! Worker process of the Citron stress test:
//! `citron-stress-worker FABRIC THREADS ITERATIONS SEED`.

use anyhow::{bail, Context, Result};
use citron_lock::rdma::{FabricAddr, Node};
use citronfs_tests::citron_stress;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        bail!("usage: citron-stress-worker FABRIC THREADS ITERATIONS SEED");
    }
    let fabric: FabricAddr = args[1].parse().map_err(anyhow::Error::msg)?;
    let threads: u64 = args[2].parse().context("THREADS")?;
    let iterations: u64 = args[3].parse().context("ITERATIONS")?;
    let seed: u64 = args[4].parse().context("SEED")?;
    let node = Node::join(&fabric)?;
    std::thread::scope(|s| {
        for t in 0..threads {
            let node = node.clone();
            s.spawn(move || {
                let ep = node.endpoint().expect("endpoint");
                let stats = citron_stress::run(&ep, iterations, seed * 1000 + t);
                println!("thread {t}: {stats:?}");
            });
        }
    });
    Ok(())
}
