//! Waits on many files do not queue behind one thread (issue #12 g): a
//! retry on one file that blocks (here: held in a test hook, as a retry
//! stuck behind another client's range lock would be) does not delay the
//! grant of a wait on another file of the same client.

use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use citronfs_core::client::{ClientConfig, FsClient, LockCall};
use citronfs_core::locks::waiter::{set_retry_hook, RetryPoint};
use citronfs_core::locks::{ByteRange, LockMode};
use citronfs_core::types::{Caller, Ino};
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

#[test]
fn a_stuck_retry_on_one_file_does_not_hold_up_another_file() {
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

    // From now on a retry on `a` blocks until the gate opens, and says so.
    let gate = Arc::new(Gate::default());
    let (stuck_tx, stuck) = channel();
    let stuck_tx = Mutex::new(stuck_tx);
    {
        let gate = gate.clone();
        set_retry_hook(Some(Arc::new(move |ino, point| {
            if ino == a && point == RetryPoint::Before {
                let _ = stuck_tx.lock().unwrap().send(());
                let mut open = gate.open.lock().unwrap();
                while !*open {
                    open = gate.opened.wait(open).unwrap();
                }
            }
        })));
    }
    holder.setlk(&call(a, 1, None)).unwrap();
    stuck.recv_timeout(LOST_AFTER).expect("a retry on a after its unlock");
    // A waiter thread is now stuck in a retry on `a`.
    holder.setlk(&call(b, 1, None)).unwrap();
    let granted_b = on_b.recv_timeout(LOST_AFTER);
    // Open the gate whatever happened, so the client can shut down.
    *gate.open.lock().unwrap() = true;
    gate.opened.notify_all();
    set_retry_hook(None);
    assert_eq!(granted_b, Ok(Ok(())), "the wait on b was held up behind a's retry");
    assert_eq!(on_a.recv_timeout(LOST_AFTER), Ok(Ok(())));
    waiter.setlk(&call(a, 2, None)).unwrap();
    waiter.setlk(&call(b, 3, None)).unwrap();
}
