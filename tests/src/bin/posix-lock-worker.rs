//! A client process of the POSIX lock stress test:
//! `posix-lock-worker META ORACLE INO THREADS MILLIS SEED [--tcp]`.
//! Joins the cluster without FUSE, runs THREADS owners (every third an OFD
//! owner) for MILLIS ms, and prints `stats GRANTED REFUSED WAITED DEADLOCKS
//! UNLOCKS`. Any oracle violation panics, and the test sees the exit status.

use std::time::Duration;

use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::locks::LockFlavor;
use citronfs_core::types::Ino;
use citronfs_tests::posix_stress::{map_oracle, run_owner, Stats};

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(a.len() >= 7, "usage: posix-lock-worker META ORACLE INO THREADS MILLIS SEED [--tcp]");
    let mut config = ClientConfig::new(a[1].parse()?);
    if a.iter().any(|x| x == "--tcp") {
        config.transport = Transport::Tcp;
    }
    let oracle = map_oracle(std::path::Path::new(&a[2]));
    let ino = Ino(a[3].parse()?);
    let threads: u64 = a[4].parse()?;
    let duration = Duration::from_millis(a[5].parse()?);
    let seed: u64 = a[6].parse()?;
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
