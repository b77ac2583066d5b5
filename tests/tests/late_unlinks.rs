//! Unlinks answered before they are sent (`fs::client::late_changes`
//! has the protocol): a caching mount answers the unlink of a file it made
//! in a directory delegated to it at once and sends it later with others,
//! and nobody can tell — its own next calls, and every other mount's first
//! look at the directory, come after the unlink at the meta-server.
//!
//! Most tests hold the queued unlinks until a call sends them (a linger of
//! an hour), so that what another mount sees is what the recall made the
//! holder send, not what a timer happened to send first.

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use citronfs_core::client::Transport;
use citronfs_core::rpc_counts::MetaKind;
use citronfs_mount::MountOptions;
use citronfs_tests::coherence::{close, eventually, missing, race_late_changes};
use citronfs_tests::{TestCluster, TestMount};

/// Long enough that no grant or delegation expires during a test.
const LONG_TTL: Duration = Duration::from_secs(60);

fn caching() -> MountOptions {
    MountOptions { cache_ttl: LONG_TTL, ..MountOptions::default() }
}

/// A caching mount whose answered unlinks wait until a call sends them
/// (`hold`), or go as they would in use.
fn mount(c: &TestCluster, hold: bool) -> TestMount {
    mount_ttl(c, hold, LONG_TTL)
}

fn mount_ttl(c: &TestCluster, hold: bool, ttl: Duration) -> TestMount {
    let mut config = c.client_config(None, Transport::Auto);
    if hold {
        config.late_linger = Duration::from_secs(3600);
    }
    TestMount::with_config_and_options(config, MountOptions { cache_ttl: ttl, ..MountOptions::default() })
}

fn cluster() -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, true);
    let b = c.mount_with(caching());
    (c, a, b)
}

/// Makes `files` empty files `dir/f<i>` through `m`, closed.
fn make(m: &TestMount, dir: &str, files: usize) {
    for i in 0..files {
        close(m, fs::File::create(m.path(&format!("{dir}/f{i}"))).unwrap());
    }
}

fn names(m: &TestMount, dir: &str) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(m.path(dir)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

/// Unlinks `dir/f0` for each of `dirs` on `m`, each answered first.
fn unlink_on(m: &TestMount, dirs: &[&str]) {
    for d in dirs {
        fs::remove_file(m.path(&format!("{d}/f0"))).unwrap();
    }
    assert_eq!(m.client.queued_changes(), dirs.len(), "the unlinks were not answered first");
}

fn unlink_all_on(m: &TestMount) {
    unlink_on(m, &["c", "r", "l"]);
}

/// Directories c, r and l made by `m`, each with a file f0.
fn make_dirs(m: &TestMount) {
    for d in ["c", "r", "l"] {
        fs::create_dir(m.path(d)).unwrap();
        make(m, d, 1);
    }
}

#[test]
fn unlinks_in_a_directory_made_here_cost_no_round_trip_and_go_together() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, false);
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 100);
    let before = a.client.rpc_counts();
    for i in 0..100 {
        fs::remove_file(a.path(&format!("d/f{i}"))).unwrap();
    }
    a.client.flush_late_changes();
    let spent = a.client.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::Unlink), 0, "an unlink was sent at once: {}", spent.describe());
    let batches = spent.get(MetaKind::LateChanges);
    assert!((1..=100).contains(&batches), "{batches} batches for 100 unlinks: {}", spent.describe());
    assert!(spent.operations() <= 100, "more than a call per unlink: {}", spent.describe());
    assert_eq!(a.client.late_change_failures(), 0);
    assert!(names(&a, "d").is_empty());
    // Gone at the meta-server too: another mount sees nothing, and the
    // directory can go.
    let b = c.mount();
    assert!(names(&b, "d").is_empty(), "unlinked names left at the meta-server");
    fs::remove_dir(b.path("d")).unwrap();
}

#[test]
fn another_mounts_first_look_at_the_directory_sees_the_queued_changes() {
    let (_c, a, b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 3);
    fs::remove_file(a.path("d/f0")).unwrap();
    fs::remove_file(a.path("d/f1")).unwrap();
    assert_eq!(a.client.queued_changes(), 2, "the unlinks were not answered first");
    // B's lookup recalls A's delegation, and A sends its unlinks before it
    // acknowledges.
    assert!(missing(&b, "d/f0"), "B found a name A had unlinked");
    assert_eq!(a.client.queued_changes(), 0);
    assert_eq!(names(&b, "d"), ["f2"]);
    // The directory's times are those A's kernel showed.
    let (on_a, on_b) = (fs::metadata(a.path("d")).unwrap(), fs::metadata(b.path("d")).unwrap());
    assert_eq!((on_a.mtime(), on_a.mtime_nsec()), (on_b.mtime(), on_b.mtime_nsec()));
    assert_eq!((on_a.ctime(), on_a.ctime_nsec()), (on_b.ctime(), on_b.ctime_nsec()));
    // Recalled: A's unlinks there are sent at once from now on.
    fs::remove_file(a.path("d/f2")).unwrap();
    assert_eq!(a.client.queued_changes(), 0, "an unlink answered first after the recall");
    assert!(missing(&b, "d/f2"));
    assert_eq!(a.client.late_change_failures(), 0);
}

#[test]
fn another_mounts_changes_in_the_directory_come_after_the_queued_changes() {
    let (_c, a, b) = cluster();
    // Each of A's calls sends what is queued: everything is made first.
    make_dirs(&a);
    unlink_all_on(&a);
    // A create of the name A unlinked: no EEXIST.
    let f = fs::OpenOptions::new().write(true).create_new(true).open(b.path("c/f0")).unwrap();
    close(&b, f);
    assert_eq!(a.client.queued_changes(), 0);
    assert_eq!(names(&a, "c"), ["f0"], "A does not see B's create");
    fs::remove_file(b.path("c/f0")).unwrap();
    drop((a, b));

    // An rmdir of a directory A emptied, and a listing of the parent (the
    // directories' attributes, in B's READDIRPLUS), each come after them.
    let (_c, a, b) = cluster();
    make_dirs(&a);
    unlink_all_on(&a);
    fs::remove_dir(b.path("r")).unwrap();
    assert_eq!(a.client.queued_changes(), 0);
    make(&a, "c", 1);
    // One unlink: A's next path walk may cost a call (the root's
    // attributes are contended a moment after B's rmdir), which would
    // send it.
    unlink_on(&a, &["c"]);
    let listed = names(&b, "");
    assert_eq!(listed, ["c", "l"]);
    assert_eq!(a.client.queued_changes(), 0, "B's listing of the parent did not recall c");
    assert!(names(&b, "c").is_empty());
    fs::remove_dir(b.path("c")).unwrap();
}

#[test]
fn the_holders_own_calls_come_after_its_queued_changes() {
    let (_c, a, _b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 2);
    fs::remove_file(a.path("d/f0")).unwrap();
    assert_eq!(a.client.queued_changes(), 1);
    // The name again, exclusively: the create sends the unlink first.
    let f = fs::OpenOptions::new().write(true).create_new(true).open(a.path("d/f0")).unwrap();
    close(&a, f);
    assert_eq!(a.client.queued_changes(), 0);
    assert_eq!(names(&a, "d"), ["f0", "f1"]);
    for name in ["d/f0", "d/f1"] {
        fs::remove_file(a.path(name)).unwrap();
    }
    assert_eq!(a.client.queued_changes(), 2);
    // The directory is empty here; its rmdir sends the unlinks first.
    fs::remove_dir(a.path("d")).unwrap();
    assert_eq!(a.client.queued_changes(), 0);
    assert_eq!(a.client.late_change_failures(), 0);
}

#[test]
fn only_files_made_here_with_one_link_and_not_open_are_answered_first() {
    let (_c, a, b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 3);
    // Open here: unlinked at once, so the meta-server counts it open.
    let open = fs::File::open(a.path("d/f0")).unwrap();
    fs::remove_file(a.path("d/f0")).unwrap();
    assert_eq!(a.client.queued_changes(), 0, "a file open here was answered first");
    close(&a, open);
    // Two links: at once.
    fs::hard_link(a.path("d/f1"), a.path("d/f1b")).unwrap();
    fs::remove_file(a.path("d/f1")).unwrap();
    assert_eq!(a.client.queued_changes(), 0, "a file with two links was answered first");
    // Renamed in: at once (other mounts may know the inode).
    fs::create_dir(a.path("e")).unwrap();
    fs::rename(a.path("d/f2"), a.path("e/moved")).unwrap();
    fs::remove_file(a.path("e/moved")).unwrap();
    assert_eq!(a.client.queued_changes(), 0, "a file renamed in was answered first");
    // A directory made elsewhere (by B): at once.
    fs::create_dir(b.path("bdir")).unwrap();
    close(&a, fs::File::create(a.path("bdir/x")).unwrap());
    fs::remove_file(a.path("bdir/x")).unwrap();
    assert_eq!(a.client.queued_changes(), 0, "a file in another mount's directory was answered first");
    assert!(missing(&b, "bdir/x") && missing(&b, "e/moved") && missing(&b, "d/f0"));
    assert_eq!(names(&b, "d"), ["f1b"]);
}

#[test]
fn queued_changes_reach_the_meta_server_before_the_mount_goes() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, true);
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 5);
    for i in 0..5 {
        fs::remove_file(a.path(&format!("d/f{i}"))).unwrap();
    }
    assert_eq!(a.client.queued_changes(), 5);
    // As `citronfs mount` ends: the session, then the client.
    let client = a.client.clone();
    drop(a);
    client.shutdown();
    let b = c.mount();
    assert!(names(&b, "d").is_empty(), "unlinks answered first were lost with the mount");
    match fs::remove_dir(b.path("d")) {
        Err(e) if e.kind() == ErrorKind::DirectoryNotEmpty => panic!("d kept names"),
        other => other.unwrap(),
    }
}

/// A holder that stops acknowledging (its invalidation thread stalled, as
/// a frozen mount's) delays another mount's look at its directory by its
/// delegation's time at most — the look is answered, not refused — and
/// sends what it queued once it goes on.
#[test]
fn a_holder_that_stops_acknowledging_delays_another_mounts_look_and_catches_up() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount_ttl(&c, true, Duration::from_secs(1));
    let b = c.mount_with(caching());
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 2);
    fs::remove_file(a.path("d/f0")).unwrap();
    assert_eq!(a.client.queued_changes(), 1);
    a.invalidations.stall(true);
    let _hang = b.watchdog(Duration::from_secs(120));
    // B's request waits for A's acknowledgement or the delegation's expiry
    // (a second and a margin), well within its own timeout.
    assert_eq!(fs::metadata(b.path("d/f1")).unwrap().len(), 0);
    a.invalidations.stall(false);
    eventually("A sends the unlink it answered first", || a.client.queued_changes() == 0);
    assert!(missing(&b, "d/f0"), "the unlink A answered first never reached the meta-server");
    assert_eq!(a.client.late_change_failures(), 0);
}

/// An oracle for the race the recall closes: one thread of A unlinks
/// files in directories A made, as fast as it can, counting what has
/// returned; one of B stats, for the first time in its directory, the
/// name whose unlink returned last. A stat that starts after an unlink
/// returned never finds the name.
#[test]
fn another_mounts_first_look_racing_the_unlinks_never_finds_an_unlinked_name() {
    const DIRS: usize = 30;
    const FILES: usize = 20;
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, false);
    let b = c.mount_with(caching());
    for d in 0..DIRS {
        fs::create_dir(a.path(&format!("d{d}"))).unwrap();
        make(&a, &format!("d{d}"), FILES);
    }
    let unlink = |rel: &str| fs::remove_file(a.path(rel)).unwrap();
    race_late_changes((&a, &b), (DIRS, FILES), unlink, |rel| missing(&b, rel));
    for d in 0..DIRS {
        assert!(names(&b, &format!("d{d}")).is_empty());
    }
}

/// A root the mount's key squashes may remove, in its kernel's eyes, a
/// file in a directory that nobody (what root is to the cluster) may
/// write: the user sees the meta-server's refusal, never an unlink
/// answered first and undone. (Two guards keep it from the late path:
/// the key squashes root, and the directory's attributes kept by the mount
/// went with its chmod.)
#[test]
fn an_unlink_a_squashed_root_may_not_make_is_sent_at_once_and_refused() {
    use citron_rpc::auth::{Key, KeyOptions, Keyring, Role, Squash};
    use std::os::unix::fs::PermissionsExt;
    let cluster_key = Keyring::generate("cluster").unwrap();
    let squashed = Key::generate(
        "lab",
        KeyOptions { role: Role::Client, squash: Squash::Root, ..KeyOptions::default() },
    )
    .unwrap();
    let keys =
        std::sync::Arc::new(Keyring::new(vec![cluster_key.first().clone(), squashed.clone()]).unwrap());
    let c = TestCluster::keyed(keys, 1);
    let admin = c.mount_tcp();
    fs::create_dir(admin.path("public")).unwrap();
    fs::set_permissions(admin.path("public"), fs::Permissions::from_mode(0o1777)).unwrap();
    let lab = TestMount::with_config_and_options(c.client_config(Some(squashed), Transport::Tcp), caching());
    // Made by the lab's root, that is by nobody: delegated to the lab.
    fs::create_dir(lab.path("public/d")).unwrap();
    make(&lab, "public/d", 1);
    fs::set_permissions(lab.path("public/d"), fs::Permissions::from_mode(0o555)).unwrap();
    let err = fs::remove_file(lab.path("public/d/f0")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    assert_eq!(lab.client.queued_changes(), 0);
    assert_eq!(lab.client.late_change_failures(), 0, "answered first, then refused");
    assert!(!missing(&admin, "public/d/f0"));
}

/// A late unlink names the inode it was answered for: one that arrives
/// after the name was taken by another file (a mount stopped past its
/// delegation while others went on) removes nothing, and is no failure
/// (what it removed is gone).
#[test]
fn a_late_unlink_removes_only_the_inode_it_was_answered_for() {
    use citronfs_core::client::FsClient;
    use citronfs_core::proto::LateUnlink;
    use citronfs_core::types::{Caller, FileKind, Ino, Timestamp};
    use citronfs_core::FsError;
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let client = FsClient::connect(c.holding_config(Transport::Auto)).unwrap();
    let (root, caller) = (Ino::ROOT, Caller::ROOT);
    let old = client.create(caller, root, b"f", FileKind::File, 0o644, 0).unwrap().ino;
    client.unlink(caller, root, b"f").unwrap();
    let new = client.create(caller, root, b"f", FileKind::File, 0o644, 0).unwrap().ino;
    assert_ne!(old, new);
    let late = |ino| LateUnlink { caller, parent: root, name: b"f".to_vec(), ino, at: Timestamp::now() };
    client.unlink_later(late(old));
    assert!(client.flush_late_changes());
    assert_eq!(client.lookup(caller, root, b"f").unwrap().ino, new, "it removed what took the name since");
    assert_eq!(client.late_change_failures(), 0);
    client.unlink_later(late(new));
    assert!(client.flush_late_changes());
    assert_eq!(client.lookup(caller, root, b"f").map(|a| a.ino), Err(FsError::NotFound));
}

/// A mount that loses its lease with unlinks queued keeps them, and sends
/// them once it may again: the unlinks it answered are not lost.
#[test]
fn unlinks_queued_through_a_lost_lease_are_sent_once_the_mount_may_again() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, true);
    let b = c.mount();
    fs::create_dir(a.path("d")).unwrap();
    make(&a, "d", 2);
    fs::remove_file(a.path("d/f0")).unwrap();
    assert_eq!(a.client.queued_changes(), 1);
    a.client.pause_lease_renewal(true);
    eventually("A is fenced", || a.client.is_fenced());
    // Tried, refused by the client itself, kept (the sender tries again
    // too: it may have the batch in hand at any moment).
    a.client.flush_late_changes();
    assert!(!missing(&b, "d/f0"), "applied by a fenced client");
    assert_eq!(a.client.late_change_failures(), 0, "the unlink was given up");
    a.client.pause_lease_renewal(false);
    eventually("the unlink A answered reaches the meta-server once A may send it", || missing(&b, "d/f0"));
    assert!(!missing(&b, "d/f1"));
    assert_eq!(a.client.late_change_failures(), 0);
}
