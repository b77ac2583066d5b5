//! Directory delegations (meta-server `grants`, "Delegations"):
//! a caching mount that made a directory answers every lookup and stat in
//! it — of names that are there and of names that are not — without a
//! round trip, and still sees at once every change another mount makes
//! there: each kind of change is the first in a directory of its own, so
//! each is the one that must revoke the delegation.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use citronfs_core::rpc_counts::{MetaKind, RpcCounts};

use citronfs_mount::{FuseOp, MountOptions};
use citronfs_tests::coherence::{close, create_counted, eventually, missing, stat_cost};
use citronfs_tests::{TestCluster, TestMount};

/// Long enough that nothing expires during a test: whatever the holder
/// sees after another mount's change, it sees because it was called back.
const LONG_TTL: Duration = Duration::from_secs(60);

fn cluster(ttl: Duration) -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let options = MountOptions { cache_ttl: ttl, ..MountOptions::default() };
    let a = c.mount_with(options.clone());
    let b = c.mount_with(options);
    (c, a, b)
}

/// Asserts that a `stat` of `rel` on `m` costs no call, and answers it.
fn free_stat(m: &TestMount, rel: &str) -> Option<fs::Metadata> {
    let calls = m.client.rpc_counts();
    let meta = fs::metadata(m.path(rel)).ok();
    let spent = m.client.rpc_counts() - calls;
    assert_eq!(spent.operations(), 0, "a stat of {rel} in a delegated directory sent {}", spent.describe());
    meta
}

#[test]
fn a_directory_made_here_answers_its_lookups_and_stats_without_a_round_trip() {
    let (_c, a, b) = cluster(LONG_TTL);
    fs::create_dir(a.path("d")).unwrap();
    assert_eq!(a.invalidations.delegated_dirs(), 1);
    // The root is not delegated: its entry of d is looked up once.
    fs::metadata(a.path("d")).unwrap();
    for i in 0..20 {
        let name = format!("d/f{i}");
        // The lookup before the create finds nothing, here, and the create
        // is answered here too (`late_creates`): the only calls are the
        // create sent with the close's release (a `LateChanges` and a
        // `ReleaseMany`), and at the first a loan of inodes.
        let (opened, released) = create_counted(&a, &name);
        let loan = u64::from(i == 0);
        assert_eq!(opened.get(MetaKind::CreateOpen), 0, "round {i}: the create was sent at once");
        let calls = opened.operations() + released.operations();
        assert!(
            calls <= 2 + loan,
            "round {i}: the create sent {}, the close {}",
            opened.describe(),
            released.describe()
        );
        let meta = free_stat(&a, &name).expect("the new file");
        assert_eq!(meta.len(), 0);
        assert!(free_stat(&a, &format!("d/missing{i}")).is_none());
    }
    // d's attributes follow A's own changes of it.
    assert_eq!(
        fs::metadata(a.path("d")).unwrap().mtime_nsec(),
        fs::metadata(b.path("d")).unwrap().mtime_nsec()
    );

    // An own write changes the size one-sidedly: the attributes are
    // dropped at the write and held again, as they are after it, by the
    // last close's answer.
    let mut w = fs::OpenOptions::new().write(true).open(a.path("d/f0")).unwrap();
    w.write_all(b"12345").unwrap();
    let (meta, _, _) = stat_cost(&a, "d/f0");
    assert_eq!(meta.len(), 5, "the size while the writer has it open");
    close(&a, w);
    assert_eq!(free_stat(&a, "d/f0").unwrap().len(), 5);
    // Its attributes are cached by the kernel too: an fstat is no request.
    let f0 = fs::File::open(a.path("d/f0")).unwrap();
    let requests = a.requests.snapshot().total();
    assert_eq!(f0.metadata().unwrap().len(), 5);
    assert_eq!(a.requests.snapshot().total(), requests, "an fstat of a held file reached the daemon");
    close(&a, f0);

    // Own unlinks, renames, mkdirs and rmdirs keep the listing exact.
    fs::remove_file(a.path("d/f1")).unwrap();
    assert!(free_stat(&a, "d/f1").is_none());
    fs::rename(a.path("d/f2"), a.path("d/g2")).unwrap();
    assert!(missing(&a, "d/f2") && !missing(&a, "d/g2"));
    fs::rename(a.path("d/f3"), a.path("d/f4")).unwrap();
    assert!(missing(&a, "d/f3"));
    assert_eq!(fs::metadata(a.path("d/f4")).unwrap().ino(), fs::metadata(b.path("d/f4")).unwrap().ino());
    fs::create_dir(a.path("d/sub")).unwrap();
    assert!(free_stat(&a, "d/sub/x").is_none());
    close(&a, fs::File::create(a.path("d/sub/x")).unwrap());
    assert_eq!(free_stat(&a, "d/sub").unwrap().nlink(), fs::metadata(b.path("d/sub")).unwrap().nlink());
    fs::remove_file(a.path("d/sub/x")).unwrap();
    fs::remove_dir(a.path("d/sub")).unwrap();
    assert!(missing(&a, "d/sub"));
    // None of it was another mount's change: nothing was called back.
    assert_eq!(a.invalidations.delegated_dirs(), 1, "A lost its delegation of d");
    let mut on_a: Vec<_> = fs::read_dir(a.path("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    let mut on_b: Vec<_> = fs::read_dir(b.path("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    on_a.sort();
    on_b.sort();
    assert_eq!(on_a, on_b);
}

/// `ls -l` of `rel` on `m`: each name with its inode, size and mode,
/// sorted, and the calls it cost.
fn long_listing(m: &TestMount, rel: &str) -> (Vec<(String, u64, u64, u32)>, RpcCounts) {
    let calls = m.client.rpc_counts();
    let mut listed: Vec<_> = fs::read_dir(m.path(rel))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = fs::symlink_metadata(e.path()).unwrap();
            (e.file_name().into_string().unwrap(), meta.ino(), meta.len(), meta.mode())
        })
        .collect();
    listed.sort();
    (listed, m.client.rpc_counts() - calls)
}

/// A mount lists a directory it made from its delegation, in the
/// meta-server's order and with its cookies, over several kernel buffers
/// (`delegation::page`); it asks the meta-server for what it does not
/// hold, and lists at the meta-server once another mount's change revoked
/// the delegation or an own rename left a name without its cookie.
#[test]
fn a_directory_made_here_is_listed_without_a_round_trip_until_it_cannot_be() {
    let (_c, a, b) = cluster(LONG_TTL);
    fs::create_dir(a.path("d")).unwrap();
    fs::create_dir(a.path("d/sub")).unwrap();
    // Names of 40 bytes: 300 take two 32 KiB READDIRPLUS buffers.
    for i in 0..300 {
        close(&a, fs::File::create(a.path(&format!("d/{i:040}"))).unwrap());
    }
    let mut w = fs::OpenOptions::new().write(true).open(a.path(&format!("d/{:040}", 7))).unwrap();
    w.write_all(b"written").unwrap();
    close(&a, w);
    let requests = a.requests.snapshot().get(FuseOp::ReadDirPlus);
    let (listed, spent) = long_listing(&a, "d");
    assert!(a.requests.snapshot().get(FuseOp::ReadDirPlus) - requests >= 2, "one kernel buffer held it all");
    assert_eq!(spent.operations(), 0, "A's listing of its own directory sent {}", spent.describe());
    assert_eq!(listed.len(), 301);
    assert_eq!(listed, long_listing(&b, "d").0, "A lists what B does not");
    assert_eq!(listed.iter().find(|l| l.0.ends_with("07")).map(|l| l.2), Some(7));

    // Written and open: its attributes are not held, so the meta-server
    // lists from it on (granting nothing of it), and the size is right.
    let mut w = fs::OpenOptions::new().append(true).open(a.path(&format!("d/{:040}", 9))).unwrap();
    w.write_all(b"nine").unwrap();
    let (listed, spent) = long_listing(&a, "d");
    assert!(
        spent.get(MetaKind::ReadDirPlus) >= 1,
        "listed attributes it does not hold: {}",
        spent.describe()
    );
    assert_eq!(listed.iter().find(|l| l.0.ends_with("09")).map(|l| l.2), Some(4));
    close(&a, w);
    assert_eq!(long_listing(&a, "d").1.operations(), 0, "the release held the attributes again");

    // An own rename: the new name's cookie is not known here.
    fs::rename(a.path(&format!("d/{:040}", 1)), a.path("d/renamed")).unwrap();
    let (listed, spent) = long_listing(&a, "d");
    assert!(spent.get(MetaKind::ReadDirPlus) >= 1, "listed a name without its cookie here");
    assert_eq!(listed, long_listing(&b, "d").0);

    // Another mount's create revokes A's delegation of d2 before it
    // answers; A's next listing has it.
    fs::create_dir(a.path("d2")).unwrap();
    close(&a, fs::File::create(a.path("d2/mine")).unwrap());
    assert_eq!(long_listing(&a, "d2").1.operations(), 0);
    close(&b, fs::File::create(b.path("d2/theirs")).unwrap());
    let names: Vec<_> = long_listing(&a, "d2").0.into_iter().map(|l| l.0).collect();
    assert_eq!(names, ["mine", "theirs"], "A listed d2 from a revoked delegation");
}

/// What another mount does in a directory A made, and how A sees it.
#[derive(Clone, Copy, Debug)]
enum Change {
    Create,
    Unlink,
    Chmod,
    Rename,
    Write,
    Truncate,
    ChmodDir,
    Mkdir,
}

#[test]
fn every_change_on_another_mount_in_a_delegated_directory_is_seen_at_once() {
    let (_c, a, b) = cluster(LONG_TTL);
    use Change::*;
    for (i, change) in
        [Create, Unlink, Chmod, Rename, Write, Truncate, ChmodDir, Mkdir].into_iter().enumerate()
    {
        let d = format!("d{i}");
        fs::create_dir(a.path(&d)).unwrap();
        let f = format!("{d}/f");
        close(&a, fs::File::create(a.path(&f)).unwrap());
        // A answers from its delegation: the state before the change.
        let before = free_stat(&a, &f).expect("A's new file");
        assert!(free_stat(&a, &format!("{d}/new")).is_none());
        let held = a.invalidations.delegated_dirs();
        let delivered = a.invalidations.delivered();

        match change {
            Create => drop(close(&b, fs::File::create(b.path(&format!("{d}/new"))).unwrap())),
            Unlink => fs::remove_file(b.path(&f)).unwrap(),
            Chmod => fs::set_permissions(b.path(&f), fs::Permissions::from_mode(0o600)).unwrap(),
            Rename => fs::rename(b.path(&f), b.path(&format!("{d}/new"))).unwrap(),
            Write => {
                let mut w = fs::OpenOptions::new().write(true).open(b.path(&f)).unwrap();
                w.write_all(b"seven b").unwrap();
                close(&b, w);
            }
            Truncate => fs::OpenOptions::new().write(true).open(b.path(&f)).unwrap().set_len(100).unwrap(),
            ChmodDir => fs::set_permissions(b.path(&d), fs::Permissions::from_mode(0o700)).unwrap(),
            Mkdir => fs::create_dir(b.path(&format!("{d}/new"))).unwrap(),
        }
        // B's change answered only after A dropped what it held.
        assert!(a.invalidations.delivered() > delivered, "{change:?}: A was not called back");
        assert_eq!(a.invalidations.delegated_dirs(), held - 1, "{change:?}: A kept its delegation of {d}");

        let now = fs::metadata(a.path(&f));
        let new = fs::metadata(a.path(&format!("{d}/new")));
        match change {
            Create => assert!(new.as_ref().is_ok_and(|m| m.is_file()), "{change:?}: A misses {d}/new"),
            Unlink => assert!(now.is_err(), "{change:?}: A still sees {f}"),
            Chmod => assert_eq!(now.unwrap().permissions().mode() & 0o777, 0o600, "{change:?}"),
            Rename => {
                assert!(now.is_err(), "{change:?}: A still sees {f}");
                assert_eq!(new.unwrap().ino(), before.ino(), "{change:?}");
            }
            Write => assert_eq!(now.unwrap().len(), 7, "{change:?}"),
            Truncate => assert_eq!(now.unwrap().len(), 100, "{change:?}"),
            ChmodDir => {
                assert_eq!(fs::metadata(a.path(&d)).unwrap().permissions().mode() & 0o777, 0o700)
            }
            Mkdir => assert!(new.unwrap().is_dir(), "{change:?}"),
        }
        let (on_a, on_b) = (fs::metadata(a.path(&d)).unwrap(), fs::metadata(b.path(&d)).unwrap());
        assert_eq!(
            (on_a.mtime(), on_a.mtime_nsec(), on_a.ctime(), on_a.ctime_nsec(), on_a.nlink()),
            (on_b.mtime(), on_b.mtime_nsec(), on_b.ctime(), on_b.ctime_nsec(), on_b.nlink()),
            "{change:?}: A sees {d}'s attributes from before"
        );
    }
}

/// A holder that stops polling (its invalidation thread stalled, as if
/// its process were stopped) delays another mount's change only until its
/// delegation runs out, and by then answers nothing from it; one that polls
/// keeps its delegation for many TTLs. (A change waits for a silent holder
/// within the client's 5 s RPC timeout only if the TTL is shorter.)
#[test]
fn a_delegation_lasts_while_its_holder_polls_and_no_longer() {
    let ttl = Duration::from_secs(2);
    let (_c, a, b) = cluster(ttl);
    fs::create_dir(a.path("d")).unwrap();
    close(&a, fs::File::create(a.path("d/f")).unwrap());
    std::thread::sleep(ttl * 2);
    // d's entry in the root, a grant, ran out: it is looked up again.
    fs::metadata(a.path("d")).unwrap();
    free_stat(&a, "d/f").expect("A's file, two TTLs later");

    a.invalidations.stall(true);
    let _hang = b.watchdog(Duration::from_secs(120));
    fs::remove_file(b.path("d/f")).unwrap();
    assert!(missing(&a, "d/f"), "stalled A answers from a delegation B's unlink has outlived");
    a.invalidations.stall(false);
    eventually("A drops its delegation", || a.invalidations.delegated_dirs() == 0);
    // A's next create there asks the meta-server first: two mounts, two
    // views, one directory.
    let calls = a.client.rpc_counts();
    close(&a, fs::File::create(a.path("d/g")).unwrap());
    assert!((a.client.rpc_counts() - calls).get(MetaKind::Lookup) >= 1);
    assert!(!missing(&b, "d/g"));
}

/// A caching mount whose process stops past its lease is fenced; resumed,
/// it registers again, and answers nothing from the delegations of its old
/// registration (the new one's polls renew none of them): a name another
/// mount made meanwhile in a directory it had made is seen at once. The
/// TTL outlasts the fence, so the old listing would still be good.
#[test]
fn a_mount_fenced_and_registered_again_answers_nothing_from_its_old_delegations() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mount-worker"));
    cmd.arg(c.meta.local_addr().to_string()).arg(dir.path()).arg("--cache-ttl-ms").arg("4000");
    let a = citronfs_tests::ProcessMount::start(cmd, dir, "mounted");
    let on_a = |rel: &str| a.dir.path().join(rel);
    fs::create_dir(on_a("d")).unwrap();
    fs::File::create(on_a("d/f")).unwrap();
    assert!(fs::metadata(on_a("d/g")).is_err());
    let ids = || c.meta.status().clients.iter().map(|s| s.id).collect::<Vec<_>>();
    let before = ids();
    assert_eq!(before.len(), 1);

    // SAFETY: signals to our own child.
    unsafe { libc::kill(a.pid(), libc::SIGSTOP) };
    eventually("A is fenced", || ids().is_empty());
    // SAFETY: as above.
    unsafe { libc::kill(a.pid(), libc::SIGCONT) };
    eventually("A registers again", || ids().len() == 1 && ids() != before);
    // A poll of the new registration has come and gone.
    std::thread::sleep(Duration::from_millis(1500));

    let b = c.mount_with(MountOptions { cache_ttl: LONG_TTL, ..MountOptions::default() });
    let _hang = b.watchdog(Duration::from_secs(60));
    close(&b, fs::File::create(b.path("d/g")).unwrap());
    assert!(fs::metadata(on_a("d/g")).is_ok(), "A answered from the listing of its old registration");
}

/// A file made in a delegated directory has its attributes held there;
/// a name of it elsewhere (in a directory not delegated) goes under this
/// mount's own rename over it, and its own unlink of the other name: the
/// link count the holder answers follows each, and the file is linked
/// again under a name it still has (the kernel refuses a `link(2)` of an
/// inode it believes has no link left).
#[test]
fn own_changes_elsewhere_that_remove_a_link_of_a_held_file_are_seen_in_its_link_count() {
    let (_c, a, _b) = cluster(LONG_TTL);
    fs::create_dir(a.path("d")).unwrap();
    fs::write(a.path("d/f"), b"held").unwrap();
    fs::hard_link(a.path("d/f"), a.path("g")).unwrap();
    fs::hard_link(a.path("d/f"), a.path("h")).unwrap();
    // Each link dropped what the mount held of d/f; it holds it again once
    // the kernel's entry has expired and a stat looks d/f up again.
    let lookups = a.requests.snapshot().get(FuseOp::Lookup);
    eventually("a lookup of d/f again", || {
        assert_eq!(fs::metadata(a.path("d/f")).unwrap().nlink(), 3);
        a.requests.snapshot().get(FuseOp::Lookup) > lookups
    });
    // A rename over `g`, a name in the root (not delegated): one link less.
    fs::write(a.path("k"), b"other").unwrap();
    fs::rename(a.path("k"), a.path("g")).unwrap();
    assert_eq!(fs::metadata(a.path("d/f")).unwrap().nlink(), 2, "after the rename over g");
    fs::remove_file(a.path("h")).unwrap();
    assert_eq!(fs::metadata(a.path("d/f")).unwrap().nlink(), 1, "after the unlink of h");
    fs::hard_link(a.path("d/f"), a.path("again")).unwrap();
    assert_eq!(fs::metadata(a.path("again")).unwrap().nlink(), 2);
}
