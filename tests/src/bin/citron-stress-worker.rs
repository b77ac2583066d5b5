//! Worker process of the Citron stress tests:
//! `citron-stress-worker FABRIC THREADS ITERATIONS SEED` on a fixed tree, or
//! `citron-stress-worker FABRIC THREADS ITERATIONS SEED scale HOST INSTANCE`
//! on a tree that is scaled up while in use (its configuration from the
//! tree host at HOST, tcp).

use anyhow::{bail, Context, Result};
use citron_lock::citron::host::InstanceId;
use citron_lock::rdma::{FabricAddr, Node};
use citronfs_tests::citron_stress;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let scaling = match args.len() {
        5 => None,
        8 if args[5] == "scale" => {
            let host: std::net::SocketAddr = args[6].parse().context("HOST")?;
            Some((host, InstanceId(args[7].parse().context("INSTANCE")?)))
        }
        _ => bail!("usage: citron-stress-worker FABRIC THREADS ITERATIONS SEED [scale HOST INSTANCE]"),
    };
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
                let seed = seed * 1000 + t;
                let stats = match scaling {
                    None => citron_stress::run(&ep, iterations, seed),
                    Some((host, instance)) => {
                        citron_stress::run_scaling(&ep, host, instance, iterations, seed)
                    }
                };
                println!("thread {t}: {stats:?}");
            });
        }
    });
    Ok(())
}
