//! Lock tokens (`citronfs_core::locks::token`): a client that is the only
//! one locking a file takes and releases its locks with no verb, and POSIX
//! stays exact across clients — `F_GETLK` from another client sees a lock
//! held under a token, `EDEADLK` is found across two clients when one lock
//! was taken under a token, a lock taken under a token goes at the close,
//! and a holder cut off from the cluster is fenced and its token recovered
//! by lease, after which its lock calls fail instead of granting.
//!
//! Each test checks (with the client's token counters) that the token was
//! held when it matters: without tokens each would pass trivially.

use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use citronfs_core::client::{FsClient, Transport};
use citronfs_core::locks::{ByteRange, LockMode};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::lock_calls::{posix_call, setlkw};
use citronfs_tests::{TestCluster, TEST_LEASE};

/// A failure bound only.
const BOUND: Duration = Duration::from_secs(30);

fn range(first: u64, last: u64) -> ByteRange {
    ByteRange::new(first, last).unwrap()
}

fn two_clients(cluster: &TestCluster, a: Transport, b: Transport) -> (FsClient, FsClient, Ino) {
    let a = FsClient::connect(cluster.client_config(None, a)).unwrap();
    let b = FsClient::connect(cluster.client_config(None, b)).unwrap();
    let ino = a.create_open(Caller::ROOT, Ino::ROOT, b"f", 0o644).unwrap().ino;
    b.open(ino).unwrap();
    (a, b, ino)
}

#[test]
fn an_uncontended_lock_and_unlock_under_a_token_cost_no_round_trip_on_tcp() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let client = FsClient::connect(cluster.client_config(None, Transport::Tcp)).unwrap();
    let ino = client.create_open(Caller::ROOT, Ino::ROOT, b"f", 0o644).unwrap().ino;
    let lock = posix_call(ino, 7, Some(LockMode::Write), range(16 << 10, (20 << 10) - 1));
    let unlock = posix_call(ino, 7, None, range(16 << 10, (20 << 10) - 1));
    client.setlk(&lock).unwrap();
    client.setlk(&unlock).unwrap();
    assert_eq!(client.lock_token_counts().taken, 1, "the first lock took the token");
    let before = client.verb_counts();
    for _ in 0..100 {
        client.setlk(&lock).unwrap();
        client.setlk(&unlock).unwrap();
    }
    let spent = client.verb_counts() - before;
    assert_eq!(spent.round_trips, 0, "100 lock + unlock pairs under a token: {spent:?}");
    // What is held under the token is what the records show.
    client.setlk(&lock).unwrap();
    let records = client.lock_records(ino).unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].range, lock.range);
    client.setlk(&unlock).unwrap();
    assert_eq!(client.lock_records(ino).unwrap(), vec![]);
    assert_eq!(client.lock_token_counts().given_up, 0);
}

fn getlk_sees_a_lock_under_a_token(a: Transport, b: Transport) {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b, ino) = two_clients(&cluster, a, b);
    a.setlk(&posix_call(ino, 1, Some(LockMode::Write), range(0, 9))).unwrap();
    a.setlk(&posix_call(ino, 1, Some(LockMode::Read), range(20, 29))).unwrap();
    assert_eq!(a.lock_token_counts().taken, 1);
    assert_eq!(a.lock_token_counts().given_up, 0);
    let seen = b.getlk(&posix_call(ino, 2, Some(LockMode::Read), range(5, 25))).unwrap().expect("a's lock");
    assert_eq!((seen.range, seen.mode, seen.pid), (range(0, 9), LockMode::Write, 1));
    let seen = b.getlk(&posix_call(ino, 2, Some(LockMode::Write), range(22, 22))).unwrap().expect("a's lock");
    assert_eq!((seen.range, seen.mode), (range(20, 29), LockMode::Read));
    assert_eq!(b.getlk(&posix_call(ino, 2, Some(LockMode::Read), range(22, 22))).unwrap(), None);
    assert_eq!(a.lock_token_counts().given_up, 1, "b's F_GETLK had a's token revoked");
    // And b's lock calls see it too.
    assert_eq!(b.setlk(&posix_call(ino, 2, Some(LockMode::Write), range(9, 9))), Err(FsError::WouldBlock));
    assert_eq!(b.setlk(&posix_call(ino, 2, Some(LockMode::Write), range(10, 19))), Ok(()));
}

#[test]
fn getlk_from_another_client_sees_a_lock_held_under_a_token_on_tcp() {
    getlk_sees_a_lock_under_a_token(Transport::Tcp, Transport::Tcp);
}

/// The holder on shm, the asker on tcp: no message crosses the fabrics,
/// so the holder hears of it through the token's asked word.
#[test]
fn getlk_from_a_tcp_client_sees_a_lock_held_under_a_token_on_shm() {
    getlk_sees_a_lock_under_a_token(Transport::Auto, Transport::Tcp);
}

#[test]
fn edeadlk_across_two_clients_where_one_lock_was_taken_under_a_token() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b, ino) = two_clients(&cluster, Transport::Tcp, Transport::Tcp);
    a.setlk(&posix_call(ino, 1, Some(LockMode::Write), range(0, 0))).unwrap();
    assert_eq!((a.lock_token_counts().taken, a.lock_token_counts().given_up), (1, 0), "1's lock is local");
    b.setlk(&posix_call(ino, 2, Some(LockMode::Write), range(10, 10))).unwrap();
    let waiting = setlkw(&a, posix_call(ino, 1, Some(LockMode::Write), range(10, 10)));
    assert_eq!(waiting.try_recv(), Err(TryRecvError::Empty), "1 waits for 2");
    let closing = setlkw(&b, posix_call(ino, 2, Some(LockMode::Write), range(0, 0)));
    assert_eq!(closing.recv_timeout(BOUND), Ok(Err(FsError::Deadlock)), "2 closes the cycle");
    b.setlk(&posix_call(ino, 2, None, range(10, 10))).unwrap();
    assert_eq!(waiting.recv_timeout(BOUND), Ok(Ok(())), "1 gets 2's byte");
}

#[test]
fn a_lock_taken_under_a_token_goes_at_the_close() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b, ino) = two_clients(&cluster, Transport::Tcp, Transport::Tcp);
    a.setlk(&posix_call(ino, 1, Some(LockMode::Write), range(0, 99))).unwrap();
    assert_eq!(a.lock_token_counts().taken, 1);
    // The owner's close (FUSE's flush) and the file's last release.
    a.release_owner_locks(ino, citronfs_core::locks::LockOwner(1)).unwrap();
    a.release(ino).unwrap();
    assert_eq!(a.lock_token_counts().given_up, 1, "the last close gave the token up");
    assert_eq!(b.lock_records(ino).unwrap(), vec![]);
    b.setlk(&posix_call(ino, 2, Some(LockMode::Write), range(0, 99))).unwrap();
    // A lock still held under the token at the last release goes to the
    // table with it (a flock's owner is the open file: released at its
    // last close, but published if the close came first).
    a.open(ino).unwrap();
    a.setlk(&posix_call(ino, 3, Some(LockMode::Read), range(200, 299))).unwrap();
    a.release(ino).unwrap();
    let left: Vec<_> = b.lock_records(ino).unwrap().into_iter().map(|r| (r.owner.client, r.range)).collect();
    assert!(left.contains(&(a.client_id(), range(200, 299))), "published at the close: {left:?}");
}

/// A holder cut off from the cluster (no renewal, no revocation heard):
/// another client's lock waits for it to be fenced, then gets the bytes;
/// the cut-off client's lock calls then fail rather than grant locally.
#[test]
fn a_cut_off_token_holder_is_fenced_and_the_other_client_gets_the_lock() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b, ino) = two_clients(&cluster, Transport::Tcp, Transport::Tcp);
    a.setlk(&posix_call(ino, 1, Some(LockMode::Write), range(0, 9))).unwrap();
    assert_eq!(a.lock_token_counts().taken, 1);
    a.pause_lease_renewal(true);
    let cut = Instant::now();
    let got = setlkw(&b, posix_call(ino, 2, Some(LockMode::Write), range(0, 9)));
    assert_eq!(got.recv_timeout(BOUND), Ok(Ok(())), "b gets the bytes once a is fenced");
    let waited = cut.elapsed();
    eprintln!("b got the bytes {waited:?} after a was cut off");
    assert!(waited >= TEST_LEASE / 2, "b got a's bytes after {waited:?}, before a could be fenced");
    assert_eq!(a.lock_token_counts().given_up, 0, "a never gave its token up");
    // a comes back: its calls under the lost token fail, and grant nothing
    // (the first one waits until a has registered again).
    a.pause_lease_renewal(false);
    let relock = a.setlk(&posix_call(ino, 1, Some(LockMode::Write), range(0, 9)));
    assert!(relock.is_err(), "a granted itself bytes b holds: {relock:?}");
    let t = Instant::now();
    while a.is_fenced() && t.elapsed() < BOUND {
        std::thread::sleep(Duration::from_millis(20));
    }
    let relock = a.setlk(&posix_call(ino, 1, Some(LockMode::Write), range(0, 9)));
    assert!(relock.is_err(), "a granted itself bytes b holds after it came back: {relock:?}");
    let holders: Vec<_> = b.lock_records(ino).unwrap().into_iter().map(|r| r.owner.client).collect();
    assert_eq!(holders, vec![b.client_id()], "only b's lock is left");
}
