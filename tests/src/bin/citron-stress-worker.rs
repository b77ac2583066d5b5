//! Worker process of the Citron stress tests (see `--help`):
//! `citron-stress-worker FABRIC THREADS ITERATIONS SEED` on a fixed tree, or
//! `citron-stress-worker FABRIC THREADS ITERATIONS SEED scale HOST INSTANCE`
//! on a tree that is scaled up while in use (its configuration from the
//! tree host at HOST, tcp).

use std::net::SocketAddr;

use anyhow::Result;
use citron_lock::citron::host::InstanceId;
use citron_lock::rdma::{FabricAddr, Node};
use citronfs_tests::citron_stress;
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Args {
    /// The fabric to join.
    fabric: String,
    /// Threads, each with its own endpoint.
    threads: u64,
    /// Critical sections per thread.
    iterations: u64,
    /// Seed of the threads' random choices (thread t uses SEED * 1000 + t).
    seed: u64,
    /// Use a tree that is scaled up while in use.
    #[command(subcommand)]
    scale: Option<Scale>,
}

#[derive(Subcommand)]
enum Scale {
    /// The tree is scaled up while in use; its configuration comes from its host.
    Scale {
        /// The tree host's address (tcp).
        host: SocketAddr,
        /// The Citron instance on that host.
        instance: u64,
    },
}

fn main() -> Result<()> {
    let args = Args::parse();
    let scaling = args.scale.map(|Scale::Scale { host, instance }| (host, InstanceId(instance)));
    let fabric: FabricAddr = args.fabric.parse().map_err(anyhow::Error::msg)?;
    let (threads, iterations, seed) = (args.threads, args.iterations, args.seed);
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
