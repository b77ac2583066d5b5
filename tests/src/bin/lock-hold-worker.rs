//! Worker process for the failure tests: joins FABRIC, acquires, says so on
//! stdout, and then waits to be killed without ever releasing.
//!
//! `lock-hold-worker dslr FABRIC shared|exclusive LEASE_MS`
//! `lock-hold-worker citron FABRIC L R LEASE_MS`
//! `lock-hold-worker citron-scale FABRIC HOST INSTANCE AT_LEAST`
//! `lock-hold-worker alock FABRIC OFFSET LEASE_MS` (a remote client)
//!
//! It prints `acquiring` right before it asks for the lock (so a test can kill
//! it while it is queued) and `held` once it holds it. `citron-scale` asks
//! the tree host at HOST to scale INSTANCE up (a host that runs scale-ups),
//! printing `asking` first, and waits to be killed while the host works.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::citron::lock::{CitronClient, CitronConfig};
use citron_lock::dslr::{DslrConfig, DslrLock};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::{citron_stress, lock_stress, TEST_REGION};

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let fabric: FabricAddr = args.get(2).context("FABRIC")?.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let ep = node.endpoint()?;
    match args.get(1).map(String::as_str) {
        Some("dslr") if args.len() == 5 => {
            let mode = if args[3] == "shared" { Mode::Shared } else { Mode::Exclusive };
            let lease = Duration::from_millis(args[4].parse().context("LEASE_MS")?);
            let config = DslrConfig { omega: Duration::from_micros(5), lease, fence_delay: Duration::ZERO };
            let mut lock = DslrLock::new(RemoteAddr::new(TEST_REGION, lock_stress::LOCK_AT), config);
            say("acquiring");
            lock.acquire(&ep, mode)?;
        }
        Some("citron") if args.len() == 6 => {
            let (l, r): (u64, u64) = (args[3].parse()?, args[4].parse()?);
            let mut config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5)?);
            config.lease = Duration::from_millis(args[5].parse().context("LEASE_MS")?);
            let mut client =
                CitronClient::new(citron_stress::layout(), config, Box::new(citron_stress::spillover(&ep)));
            say("acquiring");
            std::mem::forget(client.acquire(&ep, l, r)?);
        }
        Some("alock") if args.len() == 5 => {
            let at = RemoteAddr::new(TEST_REGION, args[3].parse().context("OFFSET")?);
            let lease = Duration::from_millis(args[4].parse().context("LEASE_MS")?);
            let rtt = ep.measure_rtt(at, 5)?;
            let config = citron_lock::alock::AlockConfig::from_rtt(rtt).with_lease(lease);
            let mut client = citron_lock::alock::AlockClient::new(at, config);
            say("acquiring");
            client.lock(&ep)?;
        }
        Some("citron-scale") if args.len() == 6 => {
            let host: std::net::SocketAddr = args[3].parse().context("HOST")?;
            let instance = citron_lock::citron::host::InstanceId(args[4].parse().context("INSTANCE")?);
            let at_least: u64 = args[5].parse().context("AT_LEAST")?;
            let mut client = citron_stress::scaling_client(&ep, host, instance);
            say("asking");
            client.scale_up(&ep, at_least)?;
            say("scaled");
        }
        _ => bail!(
            "usage: lock-hold-worker dslr FABRIC MODE LEASE_MS | citron FABRIC L R LEASE_MS | \
             citron-scale FABRIC HOST INSTANCE AT_LEAST | alock FABRIC OFFSET LEASE_MS"
        ),
    }
    say("held");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
