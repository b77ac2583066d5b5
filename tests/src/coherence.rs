//! Helpers of the coherence tests (`mount_coherence`, `mount_delegation`,
//! `late_creates`, `late_unlinks`): what one `stat` or `close` on a mount
//! costs, waiting for the kernel's asynchronous releases, and a race of
//! one mount's changes against another's looks.

use std::fs;
use std::time::{Duration, Instant};

use citronfs_core::rpc_counts::{MetaKind, RpcCounts};
use citronfs_mount::FuseOp;

use crate::TestMount;

/// Whether `rel` is missing on mount `m` (a `stat` answers ENOENT).
pub fn missing(m: &TestMount, rel: &str) -> bool {
    match fs::metadata(m.path(rel)) {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(_) => false,
    }
}

/// Waits until `done` holds: FUSE sends a release after close(2) has
/// returned. Only a hang takes the bound.
pub fn eventually(what: &str, done: impl Fn() -> bool) {
    let hang = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < hang, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Closes `f` (opened on mount `m`), waits until the mount has answered
/// the release that follows and sends the release it queued for the
/// meta-server (`FsClient::release_later`); returns the meta-server calls
/// they made.
pub fn close(m: &TestMount, f: fs::File) -> RpcCounts {
    let (calls, releases) = (m.client.rpc_counts(), m.requests.snapshot().get(FuseOp::Release));
    drop(f);
    eventually("the release of a closed file", || m.requests.snapshot().get(FuseOp::Release) > releases);
    m.client.flush_releases();
    m.client.rpc_counts() - calls
}

/// Releases among `calls`: sent one by one or queued and sent together.
pub fn releases(calls: &RpcCounts) -> u64 {
    calls.get(MetaKind::Release) + calls.get(MetaKind::ReleaseMany)
}

/// Creates `rel` on mount `m` (an exclusive open for writing, then its
/// close): the meta-server calls the open made, and those the close's
/// release made.
pub fn create_counted(m: &TestMount, rel: &str) -> (RpcCounts, RpcCounts) {
    let calls = m.client.rpc_counts();
    let f = fs::OpenOptions::new().write(true).create_new(true).open(m.path(rel)).unwrap();
    let opened = m.client.rpc_counts() - calls;
    (opened, close(m, f))
}

/// Whether `rel` is missing on mount `m`, with the calls to the
/// meta-server and the FUSE requests that `stat` cost.
pub fn missing_cost(m: &TestMount, rel: &str) -> (bool, RpcCounts, u64) {
    let (calls, requests) = (m.client.rpc_counts(), m.requests.snapshot().total());
    let gone = missing(m, rel);
    (gone, m.client.rpc_counts() - calls, m.requests.snapshot().total() - requests)
}

/// The calls to the meta-server and the FUSE requests one `stat` on `m`
/// costs.
pub fn stat_cost(m: &TestMount, rel: &str) -> (fs::Metadata, RpcCounts, u64) {
    let (calls, requests) = (m.client.rpc_counts(), m.requests.snapshot().total());
    let meta = fs::metadata(m.path(rel)).unwrap();
    (meta, m.client.rpc_counts() - calls, m.requests.snapshot().total() - requests)
}

/// A race oracle: one thread makes `changes` changes in order
/// (`change(i)`, on one mount) while this one, each time it finds a new
/// change returned, checks with `seen(i)` that the last one returned is
/// seen (on another mount). Answers how many looks it made.
pub fn race_looks(changes: usize, change: impl Fn(usize) + Sync, seen: impl Fn(usize) -> bool) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let returned = AtomicUsize::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..changes {
                change(i);
                // SeqCst: the looks read the count after this change returned.
                returned.store(i + 1, Ordering::SeqCst);
            }
        });
        let mut looks = 0;
        loop {
            let done = returned.load(Ordering::SeqCst);
            if done == changes {
                break looks;
            }
            if done > 0 {
                assert!(seen(done - 1), "change {} was not seen after it returned", done - 1);
                looks += 1;
            }
        }
    })
}

/// [`race_looks`] over mount `a`'s late changes (`fs::client::late_changes`):
/// `dirs` directories `d0 ..` that `a` made, `files` names `f0 ..` in each,
/// changed in order by `change(rel)` on `a` while `seen(rel)` checks on
/// `b` that the last change that returned is seen. Checks that `b` looked
/// during the race, that `a` answered changes first and that none was
/// refused.
pub fn race_late_changes(
    (a, b): (&TestMount, &TestMount),
    (dirs, files): (usize, usize),
    change: impl Fn(&str) + Sync,
    seen: impl Fn(&str) -> bool,
) {
    let name = |i: usize| format!("d{}/f{}", i / files, i % files);
    let _hang = b.watchdog(Duration::from_secs(120));
    let looks = race_looks(dirs * files, |i| change(&name(i)), |i| seen(&name(i)));
    assert!(looks > 0, "B never looked while A changed the directories");
    assert!(a.client.rpc_counts().get(MetaKind::LateChanges) > 0, "no change was answered first");
    assert_eq!(a.client.late_change_failures(), 0);
}
