//! Waits on many files do not queue behind one thread: a
//! retry on one file that blocks (here: held in a test hook, as a retry
//! stuck behind another client's range lock would be) does not delay the
//! grant of a wait on another file of the same client, nor the last close
//! of a file nobody waits on.

use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use citronfs_core::client::{ClientConfig, FsClient, LockCall};
use citronfs_core::locks::waiter::{set_retry_hook, shard_of, RetryPoint, WAITER_THREADS};
use citronfs_core::locks::{ByteRange, LockMode};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::lock_calls::{posix_call, setlkw};
use citronfs_tests::TestCluster;

/// A failure bound only: a grant that should come long before.
const LOST_AFTER: Duration = Duration::from_secs(30);

fn call(ino: Ino, owner: u64, mode: Option<LockMode>) -> LockCall {
    posix_call(ino, owner, mode, ByteRange::new(0, 0).unwrap())
}

/// A gate the hook waits at while it is closed.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    /// From now on a retry on `ino` blocks until the gate opens, and says
    /// so on the returned channel.
    fn hold_retries_on(self: &Arc<Self>, ino: Ino) -> std::sync::mpsc::Receiver<()> {
        let (stuck_tx, stuck) = channel();
        let stuck_tx = Mutex::new(stuck_tx);
        let gate = self.clone();
        set_retry_hook(Some(Arc::new(move |file, point| {
            if file == ino && point == RetryPoint::Before {
                let _ = stuck_tx.lock().unwrap().send(());
                let mut open = gate.open.lock().unwrap();
                while !*open {
                    open = gate.opened.wait(open).unwrap();
                }
            }
        })));
        stuck
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
        set_retry_hook(None);
    }
}

/// The retry hook is one per process and names files by inode number,
/// which each test's own cluster numbers alike: one test at a time runs,
/// from its first lock call on (a retry of one test's wait on its `a`
/// would stop at the other's hook).
static HOOK: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    HOOK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Holds the next retry of the wait `on_a` in the hook (the periodic retry
/// comes within [`RETRY_EVERY`](citronfs_core::locks::waiter::RETRY_EVERY))
/// until the returned gate opens, and then unlocks `holder`'s write lock (owner 1) on `a`, so that the retry
/// is granted once it goes on; returns once the retry is held. (The unlock
/// comes second: a retry that began before the hook was in place did not
/// stop in it, and once CI saw such a retry read the table after the
/// unlock, be granted, and leave no retry to hold.)
fn stick_a_retry(holder: &FsClient, a: Ino, on_a: &Receiver<Result<(), FsError>>) -> Arc<Gate> {
    let gate = Arc::new(Gate::default());
    let stuck = gate.hold_retries_on(a);
    if let Err(e) = stuck.recv_timeout(LOST_AFTER) {
        gate.open();
        panic!("no retry on a ({e}); the wait on a: {:?}", on_a.try_recv());
    }
    holder.setlk(&call(a, 1, None)).unwrap();
    gate
}

#[test]
fn a_stuck_retry_on_one_file_does_not_hold_up_another_file() {
    let _turn = one_at_a_time();
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let holder = FsClient::connect(ClientConfig::new(meta)).unwrap();
    let waiter = FsClient::connect(ClientConfig::new(meta)).unwrap();
    // Two files with consecutive inode numbers (different shards).
    let a = holder.create_open(Caller::ROOT, Ino::ROOT, b"a", 0o644).unwrap().ino;
    let b = holder.create_open(Caller::ROOT, Ino::ROOT, b"b", 0o644).unwrap().ino;
    waiter.open(a).unwrap();
    waiter.open(b).unwrap();
    holder.setlk(&call(a, 1, Some(LockMode::Write))).unwrap();
    holder.setlk(&call(b, 1, Some(LockMode::Write))).unwrap();
    let on_a = setlkw(&waiter, call(a, 2, Some(LockMode::Write)));
    let on_b = setlkw(&waiter, call(b, 3, Some(LockMode::Write)));

    let gate = stick_a_retry(&holder, a, &on_a);
    // A waiter thread is now stuck in a retry on `a`.
    holder.setlk(&call(b, 1, None)).unwrap();
    let granted_b = on_b.recv_timeout(LOST_AFTER);
    // Open the gate whatever happened, so the client can shut down.
    gate.open();
    assert_eq!(granted_b, Ok(Ok(())), "the wait on b was held up behind a's retry");
    assert_eq!(on_a.recv_timeout(LOST_AFTER), Ok(Ok(())));
    waiter.setlk(&call(a, 2, None)).unwrap();
    waiter.setlk(&call(b, 3, None)).unwrap();
}

/// While a waiter thread is stuck in a retry on `a`, the client's last
/// close of another file of the same shard, which nobody waits on, goes
/// through: it has no request to withdraw, so it asks nothing of the
/// stuck thread (before, every such close waited for the thread's
/// acknowledgement, up to 30 s, and each close in a quarter of a mount's
/// files paid a round trip to the thread even when it was idle).
#[test]
fn a_stuck_retry_does_not_hold_up_the_close_of_a_file_nobody_waits_on() {
    let _turn = one_at_a_time();
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let holder = FsClient::connect(ClientConfig::new(meta)).unwrap();
    let waiter = Arc::new(FsClient::connect(ClientConfig::new(meta)).unwrap());
    let a = holder.create_open(Caller::ROOT, Ino::ROOT, b"a", 0o644).unwrap().ino;
    // A file whose waits the same thread would serve.
    let c = (0..)
        .map(|i| holder.create_open(Caller::ROOT, Ino::ROOT, format!("c{i}").as_bytes(), 0o644).unwrap().ino)
        .find(|&c| shard_of(c, WAITER_THREADS) == shard_of(a, WAITER_THREADS))
        .unwrap();
    waiter.open(a).unwrap();
    waiter.open(c).unwrap();
    holder.setlk(&call(a, 1, Some(LockMode::Write))).unwrap();
    let on_a = setlkw(&waiter, call(a, 2, Some(LockMode::Write)));

    let gate = stick_a_retry(&holder, a, &on_a);
    let (closed_tx, closed) = channel();
    {
        let waiter = waiter.clone();
        std::thread::spawn(move || closed_tx.send(waiter.release(c)));
    }
    let closed_c = closed.recv_timeout(LOST_AFTER);
    gate.open();
    assert!(matches!(closed_c, Ok(Ok(()))), "the close of c waited for a's stuck retry: {closed_c:?}");
    assert_eq!(on_a.recv_timeout(LOST_AFTER), Ok(Ok(())));
    waiter.setlk(&call(a, 2, None)).unwrap();
}
