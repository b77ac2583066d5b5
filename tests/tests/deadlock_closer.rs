//! Only the request that closes a wait-for cycle is refused with `EDEADLK`,
//! not the owner that was already waiting (as in Linux, where the check
//! runs under one lock). Between publishing its waits-for entry and
//! withdrawing it after finding the cycle, the closer's entry is visible to
//! everyone, and the established waiter's retries must not take it for a
//! cycle of their own. The closer is a far client (every round trip 50 ms
//! longer), so that window lasts hundreds of milliseconds, and a third
//! owner takes and drops a lock next to the waiter's blocker all the time,
//! so each drop wakes the waiter into a retry: its retries land in the
//! window every run.
//!
//! (That a cycle nobody was refused for at its closing is still refused in
//! the end, by a waiter whose retries keep seeing it, is what
//! `posix_deadlock_oracle` checks: every wait there must end.)

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::TryRecvError;
use std::time::Duration;

use citronfs_core::client::{FsClient, LockCall, Transport};
use citronfs_core::locks::{ByteRange, LockMode};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::lock_calls::{posix_call, setlkw};
use citronfs_tests::TestCluster;

/// A failure bound only.
const BOUND: Duration = Duration::from_secs(60);
/// How much longer each round trip of the far client takes.
const FAR: Duration = Duration::from_millis(50);

fn call(ino: Ino, owner: u64, mode: Option<LockMode>, first: u64, last: u64) -> LockCall {
    posix_call(ino, owner, mode, ByteRange::new(first, last).unwrap())
}

#[test]
fn the_owner_already_waiting_is_not_refused_when_another_closes_the_cycle() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let near = FsClient::connect(cluster.client_config(None, Transport::Auto)).unwrap();
    let mut far_config = cluster.client_config(None, Transport::Tcp);
    far_config.added_rtt = FAR;
    let far = FsClient::connect(far_config).unwrap();
    let g = near.create_open(Caller::ROOT, Ino::ROOT, b"g", 0o644).unwrap().ino;
    let h = near.create_open(Caller::ROOT, Ino::ROOT, b"h", 0o644).unwrap().ino;
    for ino in [g, h] {
        far.open(ino).unwrap();
    }
    // Owner 1 holds g and waits for all of [0, 99] of h; owner 2 (far)
    // holds [0, 49] of h. Two files, so the closer's check (under its
    // range lock on g) does not hold up the waiter's retries (on h).
    near.setlk(&call(g, 1, Some(LockMode::Write), 0, 99)).unwrap();
    far.setlk(&call(h, 2, Some(LockMode::Write), 0, 49)).unwrap();
    let waiting = setlkw(&near, call(h, 1, Some(LockMode::Write), 0, 99));
    assert_eq!(waiting.try_recv(), Err(TryRecvError::Empty), "1 waits for h");

    // Owner 3 takes and drops [50, 99] of h: every drop wakes owner 1.
    let stop = AtomicBool::new(false);
    let drops = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if near.setlk(&call(h, 3, Some(LockMode::Read), 50, 99)).is_ok() {
                    near.setlk(&call(h, 3, None, 50, 99)).unwrap();
                    drops.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let closing = setlkw(&far, call(g, 2, Some(LockMode::Write), 0, 99));
        let closed = closing.recv_timeout(BOUND);
        stop.store(true, Ordering::Relaxed);
        assert_eq!(
            closed,
            Ok(Err(FsError::Deadlock)),
            "the closer is refused (the waiter's answer: {:?})",
            waiting.try_recv()
        );
    });
    assert!(drops.load(Ordering::Relaxed) > 0, "owner 3 woke the waiter");
    assert_eq!(waiting.try_recv(), Err(TryRecvError::Empty), "the owner already waiting still waits");
    // The closer gives way: the waiter gets h.
    far.setlk(&call(h, 2, None, 0, 99)).unwrap();
    assert_eq!(waiting.recv_timeout(BOUND), Ok(Ok(())));
}
