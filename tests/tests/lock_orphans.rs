//! No orphaned POSIX locks across a fence, below FUSE: the races are
//! made with the waiter threads' retry hook, which holds one retry at a
//! chosen point while the test fences the client or closes a descriptor.
//!
//! * A wait pending across a fence and a new registration is answered EIO
//!   and leaves no lock under the client's old identity (before the fix
//!   its retry granted the lock to the old identity, which nothing ever
//!   released).
//! * A close (FUSE's flush) of another descriptor while a thread of the
//!   same process waits in `F_SETLKW` does not lose the later grant: the
//!   process's next close releases it (before the fix the close forgot the
//!   owner, so no later close released the lock).

use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use citronfs_core::client::{ClientConfig, FsClient, LockCall};
use citronfs_core::locks::waiter::{set_retry_hook, RetryPoint};
use citronfs_core::locks::{ByteRange, LockMode, LockOwner};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::lock_calls::{posix_call, setlkw};
use citronfs_tests::{TestCluster, TEST_LEASE};

/// A failure bound only: what should come long before.
const BOUND: Duration = Duration::from_secs(30);

/// The retry hook is one per process: the tests of this binary take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn call(ino: Ino, owner: u64, mode: Option<LockMode>) -> LockCall {
    posix_call(ino, owner, mode, ByteRange::new(0, 0).unwrap())
}

/// Holds every retry on one file at one [`RetryPoint`] until opened; each
/// stop is reported on `stopped`. Removed (and opened) on drop.
struct Gate {
    state: Arc<(Mutex<bool>, Condvar)>,
    stopped: Receiver<()>,
}

impl Gate {
    fn install(ino: Ino, at: RetryPoint) -> Self {
        let state = Arc::new((Mutex::new(false), Condvar::new()));
        let (tx, stopped) = channel();
        let tx = Mutex::new(tx);
        let s = state.clone();
        set_retry_hook(Some(Arc::new(move |file, point| {
            if file == ino && point == at {
                let _ = tx.lock().unwrap().send(());
                let mut open = s.0.lock().unwrap();
                while !*open {
                    open = s.1.wait(open).unwrap();
                }
            }
        })));
        Self { state, stopped }
    }

    /// Waits until a retry is held at the gate.
    fn wait_stopped(&self) {
        self.stopped.recv_timeout(BOUND).expect("a retry reached the gate");
    }

    fn open(&self) {
        *self.state.0.lock().unwrap() = true;
        self.state.1.notify_all();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        set_retry_hook(None);
        self.open();
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + BOUND;
    while !done() {
        assert!(Instant::now() < end, "{what}: not within {BOUND:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_wait_pending_across_a_fence_is_answered_eio_and_leaves_no_lock_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let holder = FsClient::connect(ClientConfig::new(meta)).unwrap();
    let waiter = FsClient::connect(ClientConfig::new(meta)).unwrap();
    let f = holder.create_open(Caller::ROOT, Ino::ROOT, b"f", 0o644).unwrap().ino;
    waiter.open(f).unwrap();
    holder.setlk(&call(f, 1, Some(LockMode::Write))).unwrap();
    let old = waiter.client_id();

    // The waiter's retries stop before touching lock memory; its first one
    // (at the hand-over) is held there.
    let gate = Gate::install(f, RetryPoint::Before);
    let answer = setlkw(&waiter, call(f, 2, Some(LockMode::Write)));
    gate.wait_stopped();
    // The waiter is cut off long enough to be fenced (the meta-server
    // removes its records), the lock is freed meanwhile, and the waiter
    // comes back and registers anew, all while its retry is in flight.
    waiter.pause_lease_renewal(true);
    holder.setlk(&call(f, 1, None)).unwrap();
    wait_until("the meta-server fences the waiter", || holder.clients().unwrap().iter().all(|c| c.id != old));
    waiter.pause_lease_renewal(false);
    wait_until("the waiter registers again", || waiter.client_id() != old && !waiter.is_fenced());
    gate.open();
    let answered = answer.recv_timeout(BOUND);
    drop(gate);

    let left: Vec<_> =
        holder.lock_records(f).unwrap().into_iter().filter(|r| r.owner.client == old).collect();
    assert!(left.is_empty(), "records of the fenced identity are left: {left:?}");
    assert_eq!(holder.setlk(&call(f, 3, Some(LockMode::Write))), Ok(()), "the file stays locked");
    assert!(
        matches!(answered, Ok(Err(FsError::Io(_)))),
        "a wait pending across a fence must be answered EIO, got {answered:?}"
    );
    eprintln!("fenced and registered again as {} (lease {TEST_LEASE:?})", waiter.client_id().0);
}

/// Thread 1 of process 7 waits in `F_SETLKW` through one descriptor; its
/// thread 2 closes another descriptor of the same file while the retry that
/// grants the lock is held at `at`. Then the process closes the first
/// descriptor: no lock of it may be left.
fn close_during_a_grant(at: RetryPoint) {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let holder = FsClient::connect(ClientConfig::new(meta)).unwrap();
    let process = FsClient::connect(ClientConfig::new(meta)).unwrap();
    let f = holder.create_open(Caller::ROOT, Ino::ROOT, b"f", 0o644).unwrap().ino;
    // Two descriptors of the file in the waiting process.
    process.open(f).unwrap();
    process.open(f).unwrap();
    holder.setlk(&call(f, 1, Some(LockMode::Write))).unwrap();

    let gate = Gate::install(f, at);
    let answer = setlkw(&process, call(f, 7, Some(LockMode::Write)));
    if at == RetryPoint::Before {
        // The retry at the hand-over is held before it looks; the lock is
        // freed, so once let go that retry grants.
        gate.wait_stopped();
        holder.setlk(&call(f, 1, None)).unwrap();
    } else {
        // Freed; the retry that grants is held with the record written.
        holder.setlk(&call(f, 1, None)).unwrap();
        gate.wait_stopped();
    }
    // Thread 2 closes the other descriptor (FUSE's flush).
    let closed = process.release_owner_locks(f, LockOwner(7));
    gate.open();
    let granted = answer.recv_timeout(BOUND);
    drop(gate);
    assert_eq!(closed, Ok(()));
    assert_eq!(granted, Ok(Ok(())), "thread 1's wait at {at:?}");
    // The process closes the first descriptor: it holds no lock any more.
    assert_eq!(process.release_owner_locks(f, LockOwner(7)), Ok(()));
    let left: Vec<_> =
        holder.lock_records(f).unwrap().into_iter().filter(|r| r.owner.owner == LockOwner(7)).collect();
    assert!(left.is_empty(), "grant at {at:?}: the process's lock outlived its closes: {left:?}");
    assert_eq!(holder.setlk(&call(f, 1, Some(LockMode::Write))), Ok(()), "grant at {at:?}: still locked");
}

#[test]
fn a_close_while_a_thread_waits_does_not_lose_a_grant_that_lands_after_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    close_during_a_grant(RetryPoint::Before);
}

#[test]
fn a_close_while_a_grant_is_being_answered_releases_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    close_during_a_grant(RetryPoint::Granted);
}
