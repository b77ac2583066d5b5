//! How long one meta-server RPC takes from a client (getattr of the root).
use std::time::Instant;

use citronfs_core::client::{ClientConfig, FsClient};
use citronfs_core::types::Ino;
use citronfs_tests::TestCluster;

fn main() {
    let cluster = TestCluster::start(1, 16 << 20, 1 << 20);
    let c = FsClient::connect(ClientConfig::new(cluster.meta.local_addr())).unwrap();
    for _ in 0..1000 {
        c.getattr(Ino::ROOT).unwrap();
    }
    let n = 20_000;
    let t = Instant::now();
    for _ in 0..n {
        c.getattr(Ino::ROOT).unwrap();
    }
    println!("getattr RPC: {:.1} us", t.elapsed().as_secs_f64() * 1e6 / n as f64);
}
