//! A client process of the POSIX lock stress test:
//! `posix-lock-worker META ORACLE INO THREADS MILLIS SEED [--tcp]` (see `--help`).
//! Joins the cluster without FUSE, runs THREADS owners (every third an OFD
//! owner) for MILLIS ms, and prints `stats GRANTED REFUSED WAITED DEADLOCKS
//! UNLOCKS`. Any oracle violation panics, and the test sees the exit status.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::locks::LockFlavor;
use citronfs_core::types::Ino;
use citronfs_tests::posix_stress::{map_oracle, run_owner, Stats};

#[derive(Parser)]
struct Args {
    /// The meta-server's RPC address.
    meta: SocketAddr,
    /// The oracle's file (shared memory).
    oracle: PathBuf,
    /// The locked file's inode number.
    ino: u64,
    /// Lock owners, each on a thread of its own.
    threads: u64,
    /// How long the owners run, in milliseconds.
    millis: u64,
    /// Seed of the owners' random choices (owner t uses SEED * 100 + t).
    seed: u64,
    /// Reach server memory over tcp even where shm is present.
    #[arg(long)]
    tcp: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut config = ClientConfig::new(args.meta);
    if args.tcp {
        config.transport = Transport::Tcp;
    }
    let oracle = map_oracle(&args.oracle);
    let ino = Ino(args.ino);
    let threads = args.threads;
    let duration = Duration::from_millis(args.millis);
    let seed = args.seed;
    let client = FsClient::connect(config)?;
    client.open(ino)?;
    let mut total = Stats::default();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (client, oracle) = (&client, &oracle);
                let flavor = if t % 3 == 2 { LockFlavor::Ofd } else { LockFlavor::Posix };
                s.spawn(move || run_owner(client, ino, oracle, flavor, 1000 + t, duration, seed * 100 + t))
            })
            .collect();
        for h in handles {
            total += h.join().expect("owner thread");
        }
    });
    client.release(ino)?;
    println!(
        "stats {} {} {} {} {}",
        total.granted, total.refused, total.waited, total.deadlocks, total.unlocks
    );
    Ok(())
}
