//! Worker process for the failure tests: joins FABRIC, acquires, says so on
//! stdout, and then waits to be killed without ever releasing.
//!
//! `lock-hold-worker dslr FABRIC shared|exclusive LEASE_MS`
//! `lock-hold-worker citron FABRIC L R LEASE_MS`
//! `lock-hold-worker citron-scale FABRIC HOST INSTANCE AT_LEAST`
//! `lock-hold-worker alock FABRIC OFFSET LEASE_MS` (a remote client)
//!
//! `--help` describes the arguments.
//!
//! It prints `acquiring` right before it asks for the lock (so a test can kill
//! it while it is queued) and `held` once it holds it. `citron-scale` asks
//! the tree host at HOST to scale INSTANCE up (a host that runs scale-ups),
//! printing `asking` first, and waits to be killed while the host works.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use citron_lock::citron::lock::{CitronClient, CitronConfig};
use citron_lock::dslr::{DslrConfig, DslrLock};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::args::HoldMode;
use citronfs_tests::{citron_stress, lock_stress, TEST_REGION};
use clap::Parser;

fn say(what: &str) {
    println!("{what}");
    let _ = std::io::stdout().flush();
}

#[derive(Parser)]
enum Args {
    /// Holds the DSLR lock at `lock_stress::LOCK_AT`.
    Dslr {
        /// The fabric to join.
        fabric: String,
        /// The mode to hold it in.
        mode: HoldMode,
        /// The lock's lease, in milliseconds.
        lease_ms: u64,
    },
    /// Holds `[L, R)` of the Citron tree of `citron_stress`.
    Citron {
        /// The fabric to join.
        fabric: String,
        /// Left end of the range (inclusive).
        l: u64,
        /// Right end of the range (exclusive).
        r: u64,
        /// The lock's lease, in milliseconds.
        lease_ms: u64,
    },
    /// Asks the tree host at HOST to scale INSTANCE up to at least AT_LEAST units.
    CitronScale {
        /// The fabric to join.
        fabric: String,
        /// The tree host's address (tcp).
        host: SocketAddr,
        /// The Citron instance on that host.
        instance: u64,
        /// The units the tree must cover at least.
        at_least: u64,
    },
    /// Holds the ALock at OFFSET as a remote client.
    Alock {
        /// The fabric to join.
        fabric: String,
        /// Byte offset of the lock in the test region.
        offset: u64,
        /// The lock's lease, in milliseconds.
        lease_ms: u64,
    },
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (Args::Dslr { fabric, .. }
    | Args::Citron { fabric, .. }
    | Args::CitronScale { fabric, .. }
    | Args::Alock { fabric, .. }) = &args;
    let fabric: FabricAddr = fabric.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let ep = node.endpoint()?;
    match args {
        Args::Dslr { mode, lease_ms, .. } => {
            let mode = Mode::from(mode);
            let lease = Duration::from_millis(lease_ms);
            let config = DslrConfig { omega: Duration::from_micros(5), lease, fence_delay: Duration::ZERO };
            let mut lock = DslrLock::new(RemoteAddr::new(TEST_REGION, lock_stress::LOCK_AT), config);
            say("acquiring");
            lock.acquire(&ep, mode)?;
        }
        Args::Citron { l, r, lease_ms, .. } => {
            let mut config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5)?);
            config.lease = Duration::from_millis(lease_ms);
            let mut client =
                CitronClient::new(citron_stress::layout(), config, Box::new(citron_stress::spillover(&ep)));
            say("acquiring");
            std::mem::forget(client.acquire(&ep, l, r)?);
        }
        Args::Alock { offset, lease_ms, .. } => {
            let at = RemoteAddr::new(TEST_REGION, offset);
            let lease = Duration::from_millis(lease_ms);
            let rtt = ep.measure_rtt(at, 5)?;
            let config = citron_lock::alock::AlockConfig::from_rtt(rtt).with_lease(lease);
            let mut client = citron_lock::alock::AlockClient::new(at, config);
            say("acquiring");
            client.lock(&ep)?;
        }
        Args::CitronScale { host, instance, at_least, .. } => {
            let instance = citron_lock::citron::host::InstanceId(instance);
            let mut client = citron_stress::scaling_client(&ep, host, instance);
            say("asking");
            client.scale_up(&ep, at_least)?;
            say("scaled");
        }
    }
    say("held");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
