//! The attribute ALock of a file (its size and mtime words, shared by the
//! meta-server's threads and the clients) after a client died holding it
//! (lock recovery): the meta-server's size change waits for the lock's recovery
//! *outside* its namespace mutex, so every other request goes on meanwhile;
//! the change then succeeds, and so do the next ones.

use std::time::Duration;

use citron_lock::alock::{AlockClient, AlockConfig};
use citron_lock::rdma::{Node, TcpOptions};
use citronfs_core::client::{ClientConfig, FsClient};

use citronfs_core::types::{Caller, Ino, SetAttr};
use citronfs_tests::TestCluster;

fn client(cluster: &TestCluster) -> FsClient {
    let mut config = ClientConfig::new(cluster.meta.local_addr());
    // The size change below waits for the lock's recovery (4.5 s) inside
    // one RPC: a liveness bound far beyond it.
    config.timeout = Duration::from_secs(30);
    FsClient::connect(config).expect("join the cluster")
}

#[test]
fn a_client_dead_holding_the_attribute_lock_blocks_nothing_and_is_recovered() {
    // A lock lease of 1 s and the tests' 2 s client lease: the recovery
    // takes 3/2 of the lock lease plus the fence delay (2 + 0.5 + 0.5 s,
    // `fence_delay_for`), 4.5 s, far longer than the other requests below
    // need. (The clients keep renewing: nobody is fenced.)
    let lease = Duration::from_secs(1);
    let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.lease = citronfs_tests::TEST_LEASE;
    cfg.lock_params.lease_ms = lease.as_millis() as u64;
    let cluster = TestCluster::start_with(cfg, 1, 64 << 20);
    let a = client(&cluster);
    let b = client(&cluster);
    let f = a.create_open(Caller::ROOT, Ino(1), b"f", 0o644).unwrap().ino;
    a.write(f, 0, &[7u8; 10_000], false).unwrap();
    let area = a.lock_area(f).unwrap().expect("an open file has lock memory");
    // A client takes the file's attribute ALock and dies holding it (its
    // node and mailbox go with its process).
    {
        let dead = Node::join_tcp(cluster.meta.nic_addr(), TcpOptions::default()).unwrap();
        let ep = dead.endpoint().unwrap();
        let config = AlockConfig::from_rtt(Duration::from_micros(50)).with_lease(lease);
        let mut alock = AlockClient::new(area.attr_lock(), config);
        alock.lock(&ep).unwrap();
    }
    let truncate = SetAttr { size: Some(100), ..SetAttr::default() };
    std::thread::scope(|s| {
        let t = s.spawn(|| b.setattr(Caller::ROOT, f, truncate.clone()));
        std::thread::sleep(Duration::from_millis(200));
        // Meanwhile the namespace serves everyone else.
        let g = a.create_open(Caller::ROOT, Ino(1), b"g", 0o644).unwrap().ino;
        a.getattr(g).unwrap();
        a.lookup(Caller::ROOT, Ino(1), b"f").unwrap();
        // (Had they waited behind the size change, it would be done now.)
        std::thread::sleep(Duration::from_millis(500));
        assert!(!t.is_finished(), "the other requests waited for the size change, or it did not wait");
        let attr = t.join().unwrap().expect("the size change, once the lock is recovered");
        assert_eq!(attr.size, 100);
    });
    // And from then on size changes just work, from the meta-server and
    // from clients.
    for size in [50, 4000] {
        assert_eq!(
            b.setattr(Caller::ROOT, f, SetAttr { size: Some(size), ..SetAttr::default() }).unwrap().size,
            size
        );
    }
    a.write(f, 0, &[1u8; 8192], false).unwrap();
    assert_eq!(b.getattr(f).unwrap().size, 8192);
}
