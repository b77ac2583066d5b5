//! Worker process of the range lock tests (tests/tests/range_locks.rs):
//!
//! ```text
//! range-stress-worker stress SITE FABRIC THREADS ITERATIONS SEED
//! range-stress-worker hold   SITE FABRIC L R|inf LEASE_MS
//! ```
//!
//! SITE is `citron`, `segments:S` or `rpc:HOST:PORT` (see
//! `citronfs_tests::range_stress::site`). `stress`: each of THREADS threads
//! (own endpoint, own client) runs ITERATIONS random critical sections under
//! the oracle of `range_stress`; a violation panics, so the process exits
//! with failure. `hold`: acquires `[L, R)`, prints `held`, and never
//! releases (the failure tests SIGKILL it); it prints `acquiring` first.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::rdma::{FabricAddr, Node};
use citronfs_tests::range_stress;

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: range-stress-worker stress SITE FABRIC THREADS ITERATIONS SEED | hold SITE FABRIC L R|inf LEASE_MS";
    if args.len() != 7 {
        bail!(usage);
    }
    let site = range_stress::site(&args[2]);
    let fabric: FabricAddr = args[3].parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    match args[1].as_str() {
        "stress" => {
            let threads: u64 = args[4].parse().context("THREADS")?;
            let iterations: u64 = args[5].parse().context("ITERATIONS")?;
            let seed: u64 = args[6].parse().context("SEED")?;
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
        "hold" => {
            let l: u64 = args[4].parse().context("L")?;
            let r: u64 = if args[5] == "inf" { u64::MAX } else { args[5].parse().context("R")? };
            let lease: u64 = args[6].parse().context("LEASE_MS")?;
            let ep = node.endpoint()?;
            let ctx = range_stress::context(&ep, Some(lease));
            let mut lock = ctx.client(&site)?;
            say("acquiring");
            std::mem::forget(lock.acquire(&ep, l, r)?);
            say("held");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        _ => bail!(usage),
    }
    Ok(())
}
