//! No fixed cap on waiting POSIX owners: the
//! cluster-wide waits-for table grows by blocks from the meta-server
//! (`GrowWaitsFor`) as more owners wait at once. Below FUSE, 300 owners on
//! three clients wait at once (more than the first block holds; before the
//! chain, the 256th got ENOLCK), a deadlock between two owners published
//! after all of them is still refused with EDEADLK, and every waiter is
//! granted in the end, none refused. Also in a cluster with keys, over
//! tcp, where each NIC lets a client touch only memory granted to it: the
//! new blocks are granted to the clients already admitted, and a client
//! admitted after the growth gets them with the membership.

use std::sync::mpsc::TryRecvError;
use std::time::Duration;

use std::sync::Arc;

use citron_rpc::auth::Keyring;
use citronfs_core::client::{FsClient, LockCall, Transport};
use citronfs_core::locks::{ByteRange, LockMode};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::lock_calls::{posix_call, setlkw};
use citronfs_tests::TestCluster;

/// A failure bound only.
const BOUND: Duration = Duration::from_secs(60);
/// Owners waiting at once: more than one block of the table (256 entries,
/// the link included, by default).
const WAITERS: u64 = 300;

fn call(ino: Ino, owner: u64, mode: Option<LockMode>) -> LockCall {
    posix_call(ino, owner, mode, ByteRange::new(0, 99).unwrap())
}

fn three_hundred_waiters_and_a_deadlock_past_them(cluster: &TestCluster, transport: Transport) {
    let connect = || FsClient::connect(cluster.client_config(None, transport)).unwrap();
    let holder = connect();
    let clients: Vec<FsClient> = (0..3).map(|_| connect()).collect();
    let f = holder.create_open(Caller::ROOT, Ino::ROOT, b"f", 0o644).unwrap().ino;
    let g = holder.create_open(Caller::ROOT, Ino::ROOT, b"g", 0o644).unwrap().ino;
    let h = holder.create_open(Caller::ROOT, Ino::ROOT, b"h", 0o644).unwrap().ino;
    for c in &clients {
        for ino in [f, g, h] {
            c.open(ino).unwrap();
        }
    }
    holder.setlk(&call(f, 1, Some(LockMode::Write))).unwrap();

    // 300 owners wait for f (readers: one unlock grants them all).
    let waits: Vec<_> = (0..WAITERS)
        .map(|n| setlkw(&clients[(n % 3) as usize], call(f, 100 + n, Some(LockMode::Read))))
        .collect();
    for (n, w) in waits.iter().enumerate() {
        assert_eq!(w.try_recv(), Err(TryRecvError::Empty), "owner {} was answered while f is held", 100 + n);
    }

    assert!(cluster.meta.waits_for_blocks() >= 2, "the waits-for table grew");

    // A deadlock between two owners whose entries come after all of them:
    // a holds g and waits for h; b (a client that joined after the table
    // grew) holds h and asks for g.
    let late = connect();
    for ino in [f, g, h] {
        late.open(ino).unwrap();
    }
    let (a, b) = (&clients[0], &late);
    a.setlk(&call(g, 1000, Some(LockMode::Write))).unwrap();
    b.setlk(&call(h, 1001, Some(LockMode::Write))).unwrap();
    let a_waits = setlkw(a, call(h, 1000, Some(LockMode::Write)));
    assert_eq!(a_waits.try_recv(), Err(TryRecvError::Empty), "a waits for h");
    let b_waits = setlkw(b, call(g, 1001, Some(LockMode::Write)));
    assert_eq!(b_waits.recv_timeout(BOUND), Ok(Err(FsError::Deadlock)), "the cycle a-b is refused");
    // b gives up h: a gets it.
    b.setlk(&call(h, 1001, None)).unwrap();
    assert_eq!(a_waits.recv_timeout(BOUND), Ok(Ok(())));

    // f is released: every waiter is granted, none refused.
    holder.setlk(&call(f, 1, None)).unwrap();
    for (n, w) in waits.iter().enumerate() {
        assert_eq!(w.recv_timeout(BOUND), Ok(Ok(())), "owner {}", 100 + n);
    }
    for n in 0..WAITERS {
        clients[(n % 3) as usize].setlk(&call(f, 100 + n, None)).unwrap();
    }
    a.setlk(&call(g, 1000, None)).unwrap();
    a.setlk(&call(h, 1000, None)).unwrap();
    assert_eq!(holder.setlk(&call(f, 1, Some(LockMode::Write))), Ok(()));
}

#[test]
fn three_hundred_owners_wait_at_once_and_a_deadlock_past_them_is_found() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    three_hundred_waiters_and_a_deadlock_past_them(&cluster, Transport::Auto);
}

#[test]
fn the_waits_for_table_grows_for_every_client_of_a_keyed_cluster() {
    let cluster = TestCluster::keyed(Arc::new(Keyring::generate("cluster").unwrap()), 1);
    three_hundred_waiters_and_a_deadlock_past_them(&cluster, Transport::Tcp);
}
