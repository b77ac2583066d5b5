//! Strict coherence of metadata across mounts: a change made
//! through mount A is seen by the very next `stat`, `readdir` and lookup on
//! mount B — creates, unlinks, chmod, renames and size changes — both with
//! no kernel caching (attribute and entry TTL zero) and with the coherent
//! cache (the kernel caches what the meta-server granted, and the
//! meta-server invalidates it on every other mount before a change
//! answers). Each check first makes mount B look at the old state (so a
//! cache holds it), then changes it on A and looks again on B at once. The
//! cached mode uses a long TTL, so a missed invalidation is a stale answer,
//! never hidden by an expiry.
//!
//! And what the round-trip cuts must keep: only the last close of a file
//! on a mount reaches the meta-server, so the file counts as open there
//! (lock memory lent, an unlinked file readable) until that last close
//! and not a moment longer.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::time::{Duration, Instant};

use citronfs_core::rpc_counts::MetaKind;
use citronfs_core::types::Ino;
use citronfs_mount::{FuseOp, MountOptions};
use citronfs_tests::coherence::{
    close, create_counted, eventually, missing, missing_cost, releases, stat_cost,
};
use citronfs_tests::{TestCluster, TestMount};

/// How the mounts of a test let their kernels cache.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// TTL zero: every lookup and stat reaches the meta-server.
    Uncached,
    /// Coherent caching with this grant TTL.
    Cached(Duration),
}

/// Long enough that no cached answer expires during a test: whatever B
/// sees after a change, it sees because it was invalidated.
const LONG_TTL: Duration = Duration::from_secs(60);

fn options(mode: Mode) -> MountOptions {
    match mode {
        Mode::Uncached => MountOptions::default(),
        Mode::Cached(ttl) => MountOptions { cache_ttl: ttl, ..MountOptions::default() },
    }
}

fn cluster(mode: Mode) -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = c.mount_with(options(mode));
    let b = c.mount_with(options(mode));
    (c, a, b)
}

/// Runs each named test function in both modes, as `uncached::NAME` and
/// `cached::NAME`.
macro_rules! both_modes {
    ($($name:ident),* $(,)?) => {
        mod uncached {
            $(#[test] fn $name() { super::$name(super::Mode::Uncached) })*
        }
        mod cached {
            $(#[test] fn $name() { super::$name(super::Mode::Cached(super::LONG_TTL)) })*
        }
    };
}

both_modes!(
    create_and_unlink_on_one_mount_are_seen_at_once_on_the_other,
    chmod_rename_and_size_changes_are_seen_at_once_on_the_other_mount,
    only_the_last_close_on_a_mount_reaches_the_meta_server,
    big_directories_are_listed_whole_on_the_other_mount,
    a_directory_changed_on_either_mount_is_seen_at_once_by_the_other,
    a_directory_kept_open_sees_the_other_mounts_changes_at_each_rewind,
    a_directory_the_other_mount_moved_is_renamed_there,
);

/// B looked at a directory, A moved it, and B renames it under its new
/// name — to another directory, and back into the one it came from:
/// B's kernel still held the directory's entry under its old name, which
/// it must drop first (a rename there answered ESTALE).
fn a_directory_the_other_mount_moved_is_renamed_there(mode: Mode) {
    let (_c, a, b) = cluster(mode);
    for d in ["d1", "d2", "d3"] {
        fs::create_dir(a.path(d)).unwrap();
    }
    fs::create_dir(a.path("d1/x")).unwrap();
    let ino = fs::metadata(a.path("d1/x")).unwrap().ino();
    for (round, (on_a, on_b)) in [
        (("d1/x", "d2/x"), ("d2/x", "d3/x")),
        (("d3/x", "d2/y"), ("d2/y", "d3/x")),
        (("d3/x", "x"), ("x", "d1/x")),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(fs::metadata(b.path(on_a.0)).unwrap().ino(), ino, "round {round}: B looks first");
        fs::rename(a.path(on_a.0), a.path(on_a.1)).unwrap();
        fs::rename(b.path(on_b.0), b.path(on_b.1))
            .unwrap_or_else(|e| panic!("round {round}: B's rename of {} to {}: {e}", on_b.0, on_b.1));
        assert_eq!(fs::metadata(a.path(on_b.1)).unwrap().ino(), ino, "round {round}: A sees B's rename");
    }
}

fn names(m: &TestMount, dir: &str) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(m.path(dir)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

fn create_and_unlink_on_one_mount_are_seen_at_once_on_the_other(mode: Mode) {
    let (_c, a, b) = cluster(mode);
    fs::create_dir(a.path("d")).unwrap();
    for round in 0..20 {
        let name = format!("d/f{round}");
        // B looks first: the name is missing (a negative entry, if cached).
        assert!(missing(&b, &name), "round {round}: {name} exists before its create");
        assert!(!names(&b, "d").contains(&format!("f{round}")));
        fs::write(a.path(&name), format!("round {round}")).unwrap();
        let on_b =
            fs::metadata(b.path(&name)).unwrap_or_else(|e| panic!("round {round}: B cannot stat: {e}"));
        assert_eq!(on_b.ino(), fs::metadata(a.path(&name)).unwrap().ino());
        assert!(names(&b, "d").contains(&format!("f{round}")), "round {round}: B's readdir misses it");
        assert_eq!(fs::read_to_string(b.path(&name)).unwrap(), format!("round {round}"));
        // B has just seen it (a positive entry, if cached); A removes it.
        fs::remove_file(a.path(&name)).unwrap();
        assert!(missing(&b, &name), "round {round}: B still sees {name} after A unlinked it");
        assert!(!names(&b, "d").contains(&format!("f{round}")), "round {round}: B's readdir still lists it");
        assert!(fs::File::open(b.path(&name)).is_err(), "round {round}: B opens an unlinked name");
    }
}

fn chmod_rename_and_size_changes_are_seen_at_once_on_the_other_mount(mode: Mode) {
    let (_c, a, b) = cluster(mode);
    fs::write(a.path("f"), b"12345").unwrap();
    assert_eq!(fs::metadata(b.path("f")).unwrap().len(), 5);
    for (round, mode) in [0o600u32, 0o644, 0o640, 0o755].into_iter().enumerate() {
        fs::set_permissions(a.path("f"), fs::Permissions::from_mode(mode)).unwrap();
        let seen = fs::metadata(b.path("f")).unwrap().permissions().mode() & 0o7777;
        assert_eq!(seen, mode, "round {round}: B sees mode {seen:o}, A set {mode:o}");
    }

    // Size: growing writes, a truncate down and up, through an open file
    // on A and by path; B stats by path and through a file it holds open.
    let held = fs::File::open(b.path("f")).unwrap();
    let mut w = fs::OpenOptions::new().write(true).open(a.path("f")).unwrap();
    for (round, len) in [4096u64, 10, 70_000, 1, 0].into_iter().enumerate() {
        match round % 2 {
            0 => fs::OpenOptions::new().write(true).open(a.path("f")).unwrap().set_len(len).unwrap(),
            _ => {
                w.set_len(0).unwrap();
                w.seek(SeekFrom::Start(len - 1)).unwrap();
                w.write_all(b"x").unwrap();
            }
        }
        assert_eq!(fs::metadata(b.path("f")).unwrap().len(), len, "round {round}: B's stat by path");
        assert_eq!(held.metadata().unwrap().len(), len, "round {round}: B's fstat of an open file");
    }
    drop((held, w));

    // Rename: B looked at both names first.
    let ino = fs::metadata(a.path("f")).unwrap().ino();
    for round in 0..10 {
        let (from, to) = if round % 2 == 0 { ("f", "g") } else { ("g", "f") };
        assert!(fs::metadata(b.path(from)).is_ok());
        assert!(missing(&b, to));
        fs::rename(a.path(from), a.path(to)).unwrap();
        assert!(missing(&b, from), "round {round}: B still finds {from} after the rename");
        assert_eq!(fs::metadata(b.path(to)).unwrap().ino(), ino, "round {round}: B does not find {to}");
        assert_eq!(names(&b, "."), vec![to.to_string()], "round {round}: B's readdir");
    }

    // A directory made and removed on A, looked up on B.
    fs::create_dir(a.path("sub")).unwrap();
    assert!(fs::metadata(b.path("sub")).unwrap().is_dir());
    fs::write(b.path("sub/x"), b"").unwrap();
    assert_eq!(names(&a, "sub"), vec!["x".to_string()]);
    fs::remove_file(a.path("sub/x")).unwrap();
    fs::remove_dir(a.path("sub")).unwrap();
    assert!(missing(&b, "sub"));
}

/// Closes other than a file's last one on a mount cost no call to the
/// meta-server; the last hands back every open, and only then does the file
/// give up its lock memory.
fn only_the_last_close_on_a_mount_reaches_the_meta_server(mode: Mode) {
    let (c, a, b) = cluster(mode);
    fs::write(a.path("f"), b"keep me").unwrap();
    let ino = Ino(fs::metadata(a.path("f")).unwrap().ino());
    eventually("the written file is closed", || c.meta.lock_area(ino).is_none());

    let first = fs::File::open(a.path("f")).unwrap();
    let mut second = fs::File::open(a.path("f")).unwrap();
    let on_b = fs::File::open(b.path("f")).unwrap();
    let area = c.meta.lock_area(ino).expect("an open file has lock memory");
    assert_eq!(c.meta.status().files.opens, 3);

    let spent = close(&a, first);
    assert_eq!(releases(&spent), 0, "a close that is not the last sent {}", spent.describe());
    assert_eq!(c.meta.lock_area(ino), Some(area), "the file is still open on both mounts");

    // Unlinked on B while A still holds it open: its data lives on A.
    let spent = close(&b, on_b);
    assert_eq!(releases(&spent), 1, "B's only close sent {}", spent.describe());
    fs::remove_file(b.path("f")).unwrap();
    let mut got = String::new();
    second.read_to_string(&mut got).unwrap();
    assert_eq!(got, "keep me");
    assert_eq!(c.meta.lock_area(ino), Some(area), "A has it open still");

    let spent = close(&a, second);
    assert_eq!(releases(&spent), 1, "the last close sent {}", spent.describe());
    assert!(c.meta.lock_area(ino).is_none(), "closed everywhere, yet it keeps lock memory");
    let files = c.meta.status().files;
    assert_eq!((files.opens, files.open_files), (0, 0), "the meta-server still counts opens: {files:?}");
}

/// `readdir` asks the meta-server for pages of entries and stops at a short
/// one: a directory of several pages (and one of exactly a page) is listed
/// whole on the other mount, and a name added or removed on A is in or out
/// of B's very next listing.
fn big_directories_are_listed_whole_on_the_other_mount(mode: Mode) {
    let (_c, a, b) = cluster(mode);
    // 512 is the page: "." and ".." plus 510 names fill exactly one.
    for (dir, n) in [("one-page", 510usize), ("pages", 1300)] {
        fs::create_dir(a.path(dir)).unwrap();
        for i in 0..n {
            fs::File::create(a.path(&format!("{dir}/n{i}"))).unwrap();
        }
        let listed = names(&b, dir);
        assert_eq!(listed.len(), n, "{dir}: B lists {} of {n}", listed.len());
        let mut want: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
        want.sort();
        assert_eq!(listed, want, "{dir}");
        fs::File::create(a.path(&format!("{dir}/late"))).unwrap();
        assert_eq!(names(&b, dir).len(), n + 1, "{dir}: B misses a name A added");
        fs::remove_file(a.path(&format!("{dir}/n0"))).unwrap();
        let after = names(&b, dir);
        assert!(!after.contains(&"n0".to_string()) && after.len() == n, "{dir}: B lists a removed name");
    }
}

/// Makes directory `d` on mount `m` with `files` files `d/f0`, `d/f1`, ...
/// holding `content`, and waits until all are closed.
fn make_files(c: &TestCluster, m: &TestMount, files: usize, content: &[u8]) {
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..files {
        fs::write(m.path(&format!("d/f{i}")), content).unwrap();
    }
    all_closed(c);
}

/// Waits until no file is open anywhere: a regular file's attributes are
/// cached only while nobody has it open for writing, and the kernel sends
/// the release of a closed file after close(2) has returned.
fn all_closed(c: &TestCluster) {
    eventually("every file is closed", || c.meta.status().files.opens == 0);
}

/// The cache works: a stat of an unchanged file (and of its directory) on
/// B is answered by B's kernel alone, no FUSE request and no round trip;
/// after a chmod on A, B's very next stat sees the new mode, and the one
/// after that is free again.
#[test]
fn cached_stats_of_unchanged_files_cost_no_round_trip_and_a_chmod_is_seen_at_once() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    fs::create_dir(a.path("d")).unwrap();
    fs::write(a.path("d/f"), b"cached").unwrap();
    all_closed(&c);
    let ino = Ino(fs::metadata(b.path("d/f")).unwrap().ino());
    // The client's own getattr and lookup (the daemon's permission and
    // set-ID checks use them) take a granted answer too.
    assert_eq!(b.client.getattr(ino).unwrap().ino, ino);
    let d = Ino(fs::metadata(b.path("d")).unwrap().ino());
    assert_eq!(b.client.lookup(citronfs_core::types::Caller::ROOT, d, b"f").unwrap().ino, ino);
    for rel in ["d/f", "d", "d/f"] {
        let (_, calls, requests) = stat_cost(&b, rel);
        assert_eq!(calls.operations(), 0, "a repeated stat of {rel} sent {}", calls.describe());
        assert_eq!(requests, 0, "a repeated stat of {rel} reached the daemon");
    }
    for (round, mode) in [0o600u32, 0o640, 0o604].into_iter().enumerate() {
        fs::set_permissions(a.path("d/f"), fs::Permissions::from_mode(mode)).unwrap();
        let (seen, _, _) = stat_cost(&b, "d/f");
        assert_eq!(seen.permissions().mode() & 0o7777, mode, "round {round}: B's first stat after the chmod");
        let (seen, calls, _) = stat_cost(&b, "d/f");
        assert_eq!(seen.permissions().mode() & 0o7777, mode, "round {round}");
        assert_eq!(calls.operations(), 0, "round {round}: the stat after sent {}", calls.describe());
    }
}

/// A mount that does not acknowledge (its invalidation thread stalled, as
/// if its process were stopped) delays a change on another mount until its
/// grant has expired, never less, and no longer than it must: its kernel
/// then asks again and sees the change at once, stalled or not; resumed,
/// it acknowledges, and the next change does not wait.
#[test]
fn a_change_waits_out_the_grant_of_a_mount_that_does_not_acknowledge() {
    let ttl = Duration::from_secs(1);
    let (c, a, b) = cluster(Mode::Cached(ttl));
    fs::write(a.path("f"), b"x").unwrap();
    all_closed(&c);
    fs::set_permissions(a.path("f"), fs::Permissions::from_mode(0o644)).unwrap();
    // B caches f: its grant is made after this instant.
    let asked = Instant::now();
    fs::metadata(b.path("f")).unwrap();
    let (_, calls, _) = stat_cost(&b, "f");
    assert_eq!(calls.operations(), 0, "B does not cache f: {}", calls.describe());

    b.invalidations.stall(true);
    let _hang = a.watchdog(Duration::from_secs(120));
    fs::set_permissions(a.path("f"), fs::Permissions::from_mode(0o600)).unwrap();
    let done = Instant::now();
    assert!(done >= asked + ttl, "the chmod answered {:?} after B's grant, before it expired", done - asked);
    let seen = fs::metadata(b.path("f")).unwrap().permissions().mode() & 0o7777;
    assert_eq!(seen, 0o600, "stalled B still sees the old mode after the chmod answered");

    b.invalidations.stall(false);
    let delivered = b.invalidations.delivered();
    eventually("B tells its kernel what it missed", || b.invalidations.delivered() > delivered);
    // B caches f again; A's next change is acknowledged by B and seen.
    fs::metadata(b.path("f")).unwrap();
    fs::set_permissions(a.path("f"), fs::Permissions::from_mode(0o640)).unwrap();
    let seen = fs::metadata(b.path("f")).unwrap().permissions().mode() & 0o7777;
    assert_eq!(seen, 0o640);
}

/// A change that waits out the grant of a mount that does not acknowledge
/// (stalled, as a mount of a loaded machine may be) waits as long as the
/// grant lasts, here longer than the changer's RPC time-out, and then
/// answers: a wait the meta-server is in, alive and answering heartbeats,
/// is no reason for EIO. Only a server that is gone is.
#[test]
fn a_change_waiting_out_a_grant_longer_than_the_rpc_timeout_answers() {
    // Longer than a test mount's RPC time-out (3 s): the chmod below waits
    // for B's grant past it.
    let ttl = Duration::from_secs(8);
    let (c, a, b) = cluster(Mode::Cached(ttl));
    fs::write(a.path("f"), b"x").unwrap();
    all_closed(&c);
    fs::set_permissions(a.path("f"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::metadata(b.path("f")).unwrap();
    let (_, calls, _) = stat_cost(&b, "f");
    assert_eq!(calls.operations(), 0, "B does not cache f: {}", calls.describe());

    b.invalidations.stall(true);
    let _hang = a.watchdog(Duration::from_secs(120));
    fs::set_permissions(a.path("f"), fs::Permissions::from_mode(0o600))
        .expect("a chmod that waits out a stalled mount's grant answers, not EIO");
    let seen = fs::metadata(b.path("f")).unwrap().permissions().mode() & 0o7777;
    assert_eq!(seen, 0o600, "stalled B still sees the old mode after the chmod answered");
    b.invalidations.stall(false);
}

/// Two mounts unlinking at once in one directory, each names the other has
/// cached: neither waits for the other's grants (an entry invalidation
/// takes no directory lock, so each acknowledges while its own unlinks
/// wait), and both end with an empty directory. With a minute's TTL, one
/// grant waited out per unlink would trip the watchdog.
#[test]
fn concurrent_unlinks_in_one_directory_on_two_mounts_wait_for_no_grant() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    const FILES: usize = 40;
    make_files(&c, &a, FILES, b"");
    for m in [&a, &b] {
        for i in 0..FILES {
            fs::metadata(m.path(&format!("d/f{i}"))).unwrap();
        }
    }
    let (_wa, _wb) = (a.watchdog(Duration::from_secs(50)), b.watchdog(Duration::from_secs(50)));
    std::thread::scope(|s| {
        for (m, parity) in [(&a, 0), (&b, 1)] {
            s.spawn(move || {
                for i in (parity..FILES).step_by(2) {
                    fs::remove_file(m.path(&format!("d/f{i}"))).unwrap();
                }
            });
        }
    });
    for m in [&a, &b] {
        assert!(names(m, "d").is_empty());
        for i in 0..FILES {
            assert!(missing(m, &format!("d/f{i}")), "f{i} is still seen");
        }
    }
}

/// A directory stream kept open and listed from its start again each
/// time (`rewinddir`), as a mail-spool poller does.
struct KeptDir(*mut libc::DIR);

impl KeptDir {
    fn open(path: &std::path::Path) -> Self {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is NUL-terminated.
        let dir = unsafe { libc::opendir(c.as_ptr()) };
        assert!(!dir.is_null(), "opendir {}", path.display());
        Self(dir)
    }

    /// The names from the start, without "." and "..", sorted.
    fn names(&mut self) -> Vec<String> {
        // SAFETY: `self.0` is an open stream that only this value uses.
        unsafe { libc::rewinddir(self.0) };
        let mut names = Vec::new();
        loop {
            // SAFETY: as above; each entry is read before the next call.
            let entry = unsafe { libc::readdir(self.0) };
            if entry.is_null() {
                break;
            }
            // SAFETY: `d_name` of an entry readdir returned is NUL-terminated.
            let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) };
            let name = name.to_string_lossy().into_owned();
            if name != "." && name != ".." {
                names.push(name);
            }
        }
        names.sort();
        names
    }
}

impl Drop for KeptDir {
    fn drop(&mut self) {
        // SAFETY: the stream is open and closed only here.
        unsafe { libc::closedir(self.0) };
    }
}

/// The kernel caches a directory's listing in an open directory stream
/// (the mount answers OPENDIR with ENOSYS, so the kernel opens it with
/// `FOPEN_CACHE_DIR`): a stream B keeps open and rewinds still sees every
/// create, unlink and rename A makes in the directory at once.
fn a_directory_kept_open_sees_the_other_mounts_changes_at_each_rewind(mode: Mode) {
    let (_c, a, b) = cluster(mode);
    fs::create_dir(a.path("spool")).unwrap();
    fs::write(a.path("spool/m1"), b"x").unwrap();
    let mut kept = KeptDir::open(&b.path("spool"));
    assert_eq!(kept.names(), ["m1"]);
    assert_eq!(kept.names(), ["m1"], "listed again unchanged");
    fs::write(a.path("spool/m2"), b"y").unwrap();
    assert_eq!(kept.names(), ["m1", "m2"], "B's kept stream misses A's create");
    fs::remove_file(a.path("spool/m1")).unwrap();
    assert_eq!(kept.names(), ["m2"], "B's kept stream still lists what A unlinked");
    fs::rename(a.path("spool/m2"), a.path("spool/m3")).unwrap();
    assert_eq!(kept.names(), ["m3"], "B's kept stream misses A's rename");
    // And B's own change, seen by a stream A keeps.
    let mut kept_a = KeptDir::open(&a.path("spool"));
    assert_eq!(kept_a.names(), ["m3"]);
    fs::write(b.path("spool/m4"), b"z").unwrap();
    assert_eq!(kept_a.names(), ["m3", "m4"], "A's kept stream misses B's create");
}

/// A caching mount's listing brings every entry's attributes, also to a
/// caller that reads the whole directory before it stats what it found
/// (`du`, `tar`, `rsync`, GNU `find`'s fts): none of its stats reaches the
/// daemon. (With the kernel's `FUSE_READDIRPLUS_AUTO`, each name past the
/// first kernel buffer cost a `LOOKUP` and a round trip.)
#[test]
fn a_listing_read_to_its_end_before_any_stat_brings_every_entrys_attributes() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    // Several kernel buffers of entries.
    const FILES: usize = 600;
    make_files(&c, &a, FILES, b"x");
    let listed = names(&b, "d");
    assert_eq!(listed.len(), FILES);
    for name in listed {
        let (meta, calls, requests) = stat_cost(&b, &format!("d/{name}"));
        assert_eq!(meta.len(), 1, "d/{name}");
        assert_eq!(calls.operations(), 0, "the stat of listed d/{name} sent {}", calls.describe());
        assert_eq!(requests, 0, "the stat of listed d/{name} reached the daemon");
    }
}

/// READDIRPLUS (caching mounts): B's listing of a directory, each entry
/// stat'ed as it is read (`ls -l`), brings each entry's attributes along,
/// granted, so B's kernel answers the stat of every listed file alone (no
/// FUSE request, no round trip); and what A changes afterwards — a chmod,
/// an unlink, a rename, a write through a file it holds open — is seen by
/// B's very next stat or listing.
#[test]
fn a_listing_caches_what_it_lists_and_changes_are_still_seen_at_once() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    // Several kernel pages of entries.
    const FILES: usize = 300;
    make_files(&c, &a, FILES, b"x");
    let plus = b.requests.snapshot().get(FuseOp::ReadDirPlus);
    let mut listed = 0;
    for e in fs::read_dir(b.path("d")).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        let (meta, calls, requests) = stat_cost(&b, &format!("d/{name}"));
        assert_eq!(meta.len(), 1, "d/{name}");
        assert_eq!(calls.operations(), 0, "the stat of listed d/{name} sent {}", calls.describe());
        assert_eq!(requests, 0, "the stat of listed d/{name} reached the daemon");
        listed += 1;
    }
    assert_eq!(listed, FILES);
    assert!(b.requests.snapshot().get(FuseOp::ReadDirPlus) - plus >= 2, "{FILES} entries in one buffer");

    // A chmod: B stats at once, and B lists first then stats.
    fs::set_permissions(a.path("d/f0"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(fs::metadata(b.path("d/f0")).unwrap().permissions().mode() & 0o7777, 0o600);
    fs::set_permissions(a.path("d/f1"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(names(&b, "d").len(), FILES);
    assert_eq!(fs::metadata(b.path("d/f1")).unwrap().permissions().mode() & 0o7777, 0o640);

    // An unlink and a rename, each seen by the next stat and listing.
    fs::remove_file(a.path("d/f2")).unwrap();
    assert!(missing(&b, "d/f2"), "B still sees d/f2 after A unlinked it");
    let ino = fs::metadata(a.path("d/f3")).unwrap().ino();
    fs::rename(a.path("d/f3"), a.path("d/g3")).unwrap();
    let (calls, requests) = (b.client.rpc_counts(), b.requests.snapshot());
    let listed = names(&b, "d");
    // The directory changed, so the kernel lists it anew, and the mount
    // learned at the first listing how many entries a kernel buffer
    // takes: one meta-server call per request.
    let calls = b.client.rpc_counts() - calls;
    let plus = b.requests.snapshot().get(FuseOp::ReadDirPlus) - requests.get(FuseOp::ReadDirPlus);
    let plain = b.requests.snapshot().get(FuseOp::ReadDir) - requests.get(FuseOp::ReadDir);
    assert!(plus + plain >= 2, "{FILES} entries take several kernel buffers: {plus} + {plain} requests");
    assert_eq!(calls.get(MetaKind::ReadDirPlus), plus, "{plus} READDIRPLUS: {}", calls.describe());
    assert_eq!(calls.get(MetaKind::ReadDir), plain, "{plain} READDIR: {}", calls.describe());
    assert!(!listed.contains(&"f2".to_string()) && !listed.contains(&"f3".to_string()), "B lists old names");
    assert!(listed.contains(&"g3".to_string()) && listed.len() == FILES - 1, "B misses the renamed name");
    assert!(missing(&b, "d/f3"), "B still sees d/f3 after A renamed it");
    assert_eq!(fs::metadata(b.path("d/g3")).unwrap().ino(), ino);

    // A file open for writing on A: its size changes without the
    // meta-server seeing it, so a listing must not let B's kernel cache
    // its attributes.
    let mut w = fs::OpenOptions::new().append(true).open(a.path("d/f4")).unwrap();
    assert_eq!(names(&b, "d").len(), FILES - 1);
    w.write_all(b"more").unwrap();
    assert_eq!(fs::metadata(b.path("d/f4")).unwrap().len(), 5, "B's stat after A's write");
    drop(w);
}

/// What a `stat` of `rel` on `m` shows of a directory that can change: its
/// mode, link count, times and size.
fn dir_state(meta: &fs::Metadata) -> (u32, u64, i64, i64, i64, i64, u64) {
    (meta.mode(), meta.nlink(), meta.mtime(), meta.mtime_nsec(), meta.ctime(), meta.ctime_nsec(), meta.size())
}

/// The same, as the meta-server has it now (asked directly, past every
/// cache).
fn true_dir_state(m: &TestMount, ino: Ino) -> (u32, u64, i64, i64, i64, i64, u64) {
    let a = m.client.getattr(ino).unwrap();
    let mode = libc::S_IFDIR | u32::from(a.perm);
    (
        mode,
        u64::from(a.nlink),
        a.mtime.secs,
        i64::from(a.mtime.nanos),
        a.ctime.secs,
        i64::from(a.ctime.nanos),
        a.size,
    )
}

/// A directory's attributes after a change on either mount: a caching
/// mount answers `GETATTR` of a directory it just changed itself from the
/// change's answer (no round trip), and must still see every change the
/// other mount makes at once. Each round: B caches the directory; A
/// creates in it (a file or a subdirectory: new mtime, new link count) and
/// stats it (answered by A itself); B sees what A did; then B makes one of
/// create, unlink, chmod, rename, mkdir, rmdir in it and A — which holds
/// the directory's attributes from its own change — sees it at once.
fn a_directory_changed_on_either_mount_is_seen_at_once_by_the_other(mode: Mode) {
    let (_c, a, b) = cluster(mode);
    fs::create_dir(a.path("d")).unwrap();
    let d = Ino(fs::metadata(a.path("d")).unwrap().ino());
    let check = |m: &TestMount, who: &str, round: usize, what: &str| {
        let seen = dir_state(&fs::metadata(m.path("d")).unwrap());
        assert_eq!(seen, true_dir_state(m, d), "round {round}: {who}'s stat of d after {what}");
        seen
    };
    for round in 0..60 {
        fs::metadata(b.path("d")).unwrap();
        let before = check(&a, "A", round, "nothing");
        // A changes d: the kernel drops d's attributes, the next stat asks.
        let what = if round % 3 == 0 {
            fs::create_dir(a.path(&format!("d/sub{round}"))).unwrap();
            "A's mkdir"
        } else {
            fs::OpenOptions::new().write(true).create_new(true).open(a.path(&format!("d/a{round}"))).unwrap();
            "A's create"
        };
        let on_a = check(&a, "A", round, what);
        assert_ne!(on_a, before, "round {round}: d did not change");
        assert_eq!(check(&b, "B", round, what), on_a, "round {round}: A and B disagree");
        // A stats d again (its own change's answer, if it keeps it); B changes it.
        check(&a, "A", round, "its own stat");
        let what = match round % 6 {
            0 => {
                fs::write(b.path(&format!("d/b{round}")), b"").unwrap();
                "B's create"
            }
            1 => {
                fs::remove_file(b.path(&format!("d/a{round}"))).unwrap();
                "B's unlink"
            }
            2 => {
                let perm = if round % 4 == 0 { 0o750 } else { 0o755 };
                fs::set_permissions(b.path("d"), fs::Permissions::from_mode(perm)).unwrap();
                "B's chmod"
            }
            3 => {
                fs::rename(b.path(&format!("d/sub{round}")), b.path(&format!("d/moved{round}"))).unwrap();
                "B's rename"
            }
            4 => {
                fs::create_dir(b.path(&format!("d/bsub{round}"))).unwrap();
                "B's mkdir"
            }
            _ => {
                fs::remove_dir(b.path(&format!("d/bsub{}", round - 1))).unwrap();
                "B's rmdir"
            }
        };
        let after = check(&a, "A", round, what);
        assert_eq!(check(&b, "B", round, what), after, "round {round}: A and B disagree after {what}");
    }
}

/// The round trips of a create on a caching mount, in a directory it holds
/// a grant on: the kernel's path walk asks `GETATTR` of the directory (it
/// dropped the attributes after the previous create), which the mount
/// answers from the previous create's answer; then a negative `LOOKUP` of
/// the name, the create itself, the kernel's `GETATTR` of the new file
/// (answered by the mount: the file's attributes are granted to its
/// creator until its release, meta-server `grants`, "Creators"), and the
/// close's release: three calls. A `stat` of the directory then costs
/// nothing, and one of the new file (no longer granted) at most one call.
#[test]
fn a_cached_create_costs_three_calls_and_the_stat_of_its_directory_none() {
    let (_c, a, _b) = cluster(Mode::Cached(LONG_TTL));
    fs::create_dir(a.path("d")).unwrap();
    fs::metadata(a.path("d")).unwrap();
    // A create before: the kernel dropped d's attributes, as in a loop of
    // creates (its release is waited for, not counted below).
    close(&a, fs::File::create(a.path("d/warm")).unwrap());
    for round in 0..20 {
        let name = format!("d/f{round}");
        let (opened, released) = create_counted(&a, &name);
        let spent = opened.operations() + released.operations();
        assert!(
            spent <= 3,
            "round {round}: a create and close sent {spent} calls: {} then {}",
            opened.describe(),
            released.describe()
        );
        let (_, calls, _) = stat_cost(&a, "d");
        assert_eq!(
            calls.operations(),
            0,
            "round {round}: the stat of d after a create sent {}",
            calls.describe()
        );
        let (meta, calls, _) = stat_cost(&a, &name);
        assert_eq!(meta.len(), 0);
        assert!(
            calls.operations() <= 1,
            "round {round}: the stat of {name} after its create sent {}",
            calls.describe()
        );
    }
}

/// What `stat` shows of a regular file that a write, a truncate or a
/// chmod changes: mode, size, blocks, mtime and ctime.
fn file_state(meta: &fs::Metadata) -> (u32, u64, u64, i64, i64, i64, i64) {
    (meta.mode(), meta.len(), meta.blocks(), meta.mtime(), meta.mtime_nsec(), meta.ctime(), meta.ctime_nsec())
}

/// The same, as the meta-server answers it now.
fn true_file_state(m: &TestMount, ino: Ino) -> (u32, u64, u64, i64, i64, i64, i64) {
    let a = m.client.getattr(ino).unwrap();
    let (mtime, ctime) = (a.mtime, a.ctime);
    (
        libc::S_IFREG | u32::from(a.perm),
        a.size,
        a.allocated.div_ceil(512),
        mtime.secs,
        i64::from(mtime.nanos),
        ctime.secs,
        i64::from(ctime.nanos),
    )
}

/// A file open for writing on both mounts — a database — has no
/// attributes granted, but all but its size, times and blocks are
/// (`Grant::live`, meta-server `grants`, "Written files"): each mount that
/// has it open answers its `fstat` and `stat` with one read of the file's
/// attribute slot and no round trip, and still sees at once what the
/// other mount's writes (growing it by a chunk too), truncate and chmod
/// did.
#[test]
fn a_file_open_for_writing_on_two_mounts_is_stated_without_a_round_trip_and_seen_at_once() {
    let (_c, a, b) = cluster(Mode::Cached(LONG_TTL));
    let open = |m: &TestMount| fs::OpenOptions::new().read(true).write(true).open(m.path("db")).unwrap();
    fs::write(a.path("db"), [1u8; 100]).unwrap();
    let (fa, fb) = (open(&a), open(&b));
    let ino = Ino(fa.metadata().unwrap().ino());
    for (m, f) in [(&a, &fa), (&b, &fb)] {
        f.metadata().unwrap();
        let calls = m.client.rpc_counts();
        for _ in 0..3 {
            assert_eq!(file_state(&f.metadata().unwrap()), true_file_state(m, ino));
            assert_eq!(file_state(&fs::metadata(m.path("db")).unwrap()), true_file_state(m, ino));
        }
        // Three calls: true_file_state's own.
        let spent = m.client.rpc_counts() - calls;
        assert!(spent.operations() <= 6, "the stats of a written file sent {}", spent.describe());
        let calls = m.client.rpc_counts();
        f.metadata().unwrap();
        fs::metadata(m.path("db")).unwrap();
        assert_eq!((m.client.rpc_counts() - calls).operations(), 0, "a stat of the written file went out");
    }
    let chunk = a.client.chunk_size();
    let changes: [(&str, &dyn Fn()); 5] = [
        ("a write on A", &|| fa.write_all_at(&[2u8; 5000], 50).unwrap()),
        ("a write on B past a chunk", &|| fb.write_all_at(&[3u8; 10], chunk + 7).unwrap()),
        ("a chmod on A", &|| fs::set_permissions(a.path("db"), fs::Permissions::from_mode(0o600)).unwrap()),
        ("a truncate on B", &|| fb.set_len(10).unwrap()),
        ("a write on B", &|| fb.write_all_at(&[4u8; 3], 4096).unwrap()),
    ];
    for (what, change) in changes {
        // Both mounts keep the base: the next stat costs nothing.
        for (m, f) in [(&a, &fa), (&b, &fb)] {
            f.metadata().unwrap();
            let calls = m.client.rpc_counts();
            f.metadata().unwrap();
            assert_eq!((m.client.rpc_counts() - calls).operations(), 0, "before {what}: a stat went out");
        }
        std::thread::sleep(Duration::from_millis(5)); // a new mtime
        change();
        for (m, f) in [(&a, &fa), (&b, &fb)] {
            let seen = file_state(&f.metadata().unwrap());
            assert_eq!(seen, true_file_state(m, ino), "after {what}: fstat on one mount");
            assert_eq!(file_state(&fs::metadata(m.path("db")).unwrap()), seen, "after {what}: stat");
        }
    }
    // An own unlink drops what A keeps of the inode it removed, and only
    // of that one (its answer names it).
    fs::write(a.path("other"), b"x").unwrap();
    fs::hard_link(a.path("db"), a.path("db-link")).unwrap();
    assert_eq!(fa.metadata().unwrap().nlink(), 2);
    fs::remove_file(a.path("other")).unwrap();
    let calls = a.client.rpc_counts();
    fa.metadata().unwrap();
    let spent = a.client.rpc_counts() - calls;
    assert_eq!(spent.operations(), 0, "the unlink of another file dropped db's: {}", spent.describe());
    fs::remove_file(a.path("db-link")).unwrap();
    assert_eq!(fa.metadata().unwrap().nlink(), 1, "A's own unlink of a link to db is not seen by A");
    assert_eq!(fb.metadata().unwrap().nlink(), 1, "A's unlink of a link to db is not seen by B");
}

/// What an SQLite transaction in rollback-journal mode costs a caching
/// mount, replayed call by call (the locks aside; `bench fcntl` runs the
/// real thing): stats of `-journal` and `-wal` (absent: cached negative
/// entries after the first), three stats of the open database (its
/// written-file attributes: a slot read each), the journal's create, ten
/// writes and fsyncs, the directory's fsync, the database's writes, the
/// journal's close and unlink. Seven calls: the journal's lookup after its
/// unlink, its create, first allocation, one growth, release, and the
/// lookup and unlink (13 with an earlier mount).
#[test]
fn a_rollback_journal_transaction_costs_seven_calls() {
    let (_c, a, _b) = cluster(Mode::Cached(LONG_TTL));
    // As SQLite opens its files: read-write, made if missing, kept if not.
    let open = |rel: &str| {
        fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(a.path(rel)).unwrap()
    };
    let db = open("db");
    db.write_all_at(&[1u8; 12288], 0).unwrap();
    let pieces = [(0u64, 512usize), (512, 4), (516, 4096), (4612, 4), (4616, 4), (4620, 4096), (8716, 4)];
    for round in 0..4 {
        let calls = a.client.rpc_counts();
        assert!(missing(&a, "db-journal") && missing(&a, "db-wal"));
        for meta in
            [db.metadata().unwrap(), fs::metadata(a.path("db")).unwrap(), fs::metadata(a.path("db")).unwrap()]
        {
            assert_eq!(meta.len(), 12288);
        }
        let journal = open("db-journal");
        for (offset, len) in pieces {
            journal.write_all_at(&vec![round as u8; len], offset).unwrap();
        }
        journal.sync_data().unwrap();
        fs::File::open(a.path(".")).unwrap().sync_all().unwrap();
        db.write_all_at(&[2u8; 8192], 0).unwrap();
        db.sync_data().unwrap();
        close(&a, journal);
        fs::remove_file(a.path("db-journal")).unwrap();
        let spent = a.client.rpc_counts() - calls;
        // The first round looks the names up for the first time.
        if round > 0 {
            assert!(spent.operations() <= 7, "round {round}: a transaction sent {}", spent.describe());
        }
    }
}

/// How a test makes a name on a mount.
#[derive(Clone, Copy, Debug)]
enum Maker {
    Create,
    Mkdir,
    Mkfifo,
    Symlink,
    HardLink,
    RenameTo,
}

impl Maker {
    const ALL: [Maker; 6] =
        [Maker::Create, Maker::Mkdir, Maker::Mkfifo, Maker::Symlink, Maker::HardLink, Maker::RenameTo];

    /// Makes `rel` on `m`; `spare` is an existing regular file there that
    /// a link or rename may use up (the caller makes a new one each time).
    fn make(self, m: &TestMount, rel: &str, spare: &str) {
        match self {
            Maker::Create => fs::write(m.path(rel), b"made").unwrap(),
            Maker::Mkdir => fs::create_dir(m.path(rel)).unwrap(),
            Maker::Mkfifo => {
                let path = std::ffi::CString::new(m.path(rel).into_os_string().into_encoded_bytes()).unwrap();
                // SAFETY: `path` is a NUL-terminated string that outlives the call.
                assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o644) }, 0, "mkfifo {rel}");
            }
            Maker::Symlink => std::os::unix::fs::symlink("anywhere", m.path(rel)).unwrap(),
            Maker::HardLink => fs::hard_link(m.path(spare), m.path(rel)).unwrap(),
            Maker::RenameTo => fs::rename(m.path(spare), m.path(rel)).unwrap(),
        }
    }
}

/// A lookup of a name that is not there is granted as the entry
/// (meta-server `grants`, "Absent names"): B's kernel caches the absence,
/// so B's stats of it cost no request at all; and whatever makes the name
/// on A — create, mkdir, mkfifo, symlink, link, rename onto it — is seen
/// by B's very next stat and listing, in a directory delegated to A and
/// in one delegated to nobody (the root).
#[test]
fn an_absent_name_is_cached_until_another_mount_makes_it() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    fs::create_dir(a.path("d")).unwrap();
    for dir in ["d", ""] {
        for (round, maker) in Maker::ALL.into_iter().enumerate() {
            let rel = if dir.is_empty() { format!("m{round}") } else { format!("{dir}/m{round}") };
            let spare = format!("{rel}-spare");
            fs::write(a.path(&spare), b"spare").unwrap();
            all_closed(&c);
            assert!(missing(&b, &rel), "{maker:?}: {rel} is there before it is made");
            let (gone, calls, requests) = missing_cost(&b, &rel);
            assert!(gone);
            assert_eq!(
                (calls.operations(), requests),
                (0, 0),
                "{maker:?}: B's second stat of the absent {rel} sent {} in {requests} requests",
                calls.describe()
            );
            maker.make(&a, &rel, &spare);
            let on_b = fs::symlink_metadata(b.path(&rel))
                .unwrap_or_else(|e| panic!("{maker:?}: B does not see {rel} that A made: {e}"));
            assert_eq!(on_b.ino(), fs::symlink_metadata(a.path(&rel)).unwrap().ino(), "{maker:?}");
            let listed = if dir.is_empty() { names(&b, ".") } else { names(&b, dir) };
            assert!(listed.contains(&format!("m{round}")), "{maker:?}: B's listing misses {rel}");
        }
    }
}

/// Lookups racing with another mount's creates and unlinks of the same
/// name — three threads of B looking it up without pause, so grants of
/// its absence and of its entry are made, revoked and overtaken all the
/// time — never leave B a stale answer: right after A's create B sees the
/// name, right after A's unlink it does not, round after round, in a
/// directory delegated to A and in the root.
#[test]
fn lookups_racing_with_creates_and_unlinks_never_leave_a_stale_entry() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (_c, a, b) = cluster(Mode::Cached(LONG_TTL));
    fs::create_dir(a.path("r")).unwrap();
    let _hang = a.watchdog(Duration::from_secs(120));
    for rel in ["r/x", "x"] {
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let _ = fs::symlink_metadata(b.path(rel));
                    }
                });
            }
            for round in 0..150 {
                fs::write(a.path(rel), b"x").unwrap();
                assert!(!missing(&b, rel), "round {round}: B misses {rel} right after A made it");
                fs::remove_file(a.path(rel)).unwrap();
                assert!(missing(&b, rel), "round {round}: B still sees {rel} right after A unlinked it");
            }
            stop.store(true, Ordering::Relaxed);
        });
    }
}

/// A's own rename moves its kernel's dentry to the new name; another
/// mount's later unlink of that name — while the file is still open
/// there, so the inode itself still answers a `GETATTR` — is seen by A's
/// very next stat, and so is one of a name A swapped with
/// `RENAME_EXCHANGE`.
#[test]
fn an_entry_renamed_on_one_mount_and_unlinked_on_the_other_is_gone_on_both() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    fs::create_dir(b.path("d")).unwrap();
    fs::write(b.path("d/a"), b"a").unwrap();
    fs::write(b.path("d/x"), b"x").unwrap();
    all_closed(&c);
    fs::metadata(a.path("d/a")).unwrap();
    fs::metadata(a.path("d/x")).unwrap();
    fs::rename(a.path("d/a"), a.path("d/b")).unwrap();
    assert_eq!(fs::read(a.path("d/b")).unwrap(), b"a");
    let held = fs::File::open(b.path("d/b")).unwrap();
    fs::remove_file(b.path("d/b")).unwrap();
    assert!(missing(&a, "d/b"), "A still sees d/b, which B unlinked after A's rename");
    drop(held);

    // Exchanged: each name's grant goes with its dentry.
    fs::write(b.path("d/y"), b"y").unwrap();
    all_closed(&c);
    fs::metadata(a.path("d/y")).unwrap();
    let (from, to) = (
        std::ffi::CString::new(a.path("d/x").into_os_string().into_encoded_bytes()).unwrap(),
        std::ffi::CString::new(a.path("d/y").into_os_string().into_encoded_bytes()).unwrap(),
    );
    // SAFETY: both paths are NUL-terminated strings that outlive the call.
    let swapped = unsafe {
        libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::RENAME_EXCHANGE)
    };
    assert_eq!(swapped, 0, "renameat2: {}", std::io::Error::last_os_error());
    let held = fs::File::open(b.path("d/x")).unwrap();
    fs::remove_file(b.path("d/x")).unwrap();
    assert!(missing(&a, "d/x"), "A still sees d/x, which B unlinked after A's exchange");
    drop(held);
    assert_eq!(fs::read(a.path("d/y")).unwrap(), b"x");
}

/// The absence granted to the lookup the kernel sends before a create ends
/// with the create (meta-server `grants`, "Absent names"): another mount's
/// unlink of the new file calls the creator back for nothing. Here the
/// creator never acknowledges, and the grant would last a minute: an
/// unlink that waited for it would fail (the RPC's time-out) or trip the
/// watchdog.
#[test]
fn a_creator_is_not_called_back_for_the_absence_its_create_ended() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    fs::create_dir(b.path("s")).unwrap();
    for i in 0..5 {
        let rel = format!("s/f{i}");
        assert!(missing(&a, &rel));
        fs::write(a.path(&rel), b"x").unwrap();
    }
    all_closed(&c);
    // A's grant of s's attributes (its creates' answers) goes while A
    // still acknowledges: what is left of A's grants in s is what the
    // creates ended, or should have.
    fs::write(b.path("s/z"), b"").unwrap();
    a.invalidations.stall(true);
    let _hang = b.watchdog(Duration::from_secs(50));
    for i in 0..5 {
        fs::remove_file(b.path(&format!("s/f{i}"))).unwrap_or_else(|e| panic!("B's unlink of s/f{i}: {e}"));
    }
    a.invalidations.stall(false);
    assert_eq!(names(&a, "s"), vec!["z".to_string()]);
}

/// A created file's attributes are granted to its creator only while it
/// has the file open (meta-server `grants`, "Creators"): the kernel's
/// `GETATTR` of a new file (its permission check in the open that follows
/// the create, an `fstat`) is answered by the creating mount alone; a
/// change on another mount while the file is open is seen by the
/// creator's very next `fstat`; and once the creator closed the file, the
/// other mount's unlink of it calls the creator back for nothing — nor
/// does one that comes while the file is still open wait past the
/// creator's close, even if the creator never acknowledges.
#[test]
fn a_creator_answers_the_attributes_of_its_new_file_until_its_close_and_no_longer() {
    let (c, a, b) = cluster(Mode::Cached(LONG_TTL));
    // Made on B: A's creates are a creator's, not a delegation holder's
    // (`mount_delegation` has those).
    fs::create_dir(b.path("d")).unwrap();
    fs::metadata(a.path("d")).unwrap();
    close(&a, fs::File::create(a.path("d/warm")).unwrap());

    // Created and open on A: A answers its GETATTRs, until B's chmod.
    let calls = a.client.rpc_counts();
    let f = fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(a.path("d/f")).unwrap();
    let opened = a.client.rpc_counts() - calls;
    assert!(opened.operations() <= 2, "the create of d/f sent {}", opened.describe());
    let (getattrs, calls) = (a.requests.snapshot().get(FuseOp::GetAttr), a.client.rpc_counts());
    assert_eq!(f.metadata().unwrap().permissions().mode() & 0o7777, 0o644);
    let spent = a.client.rpc_counts() - calls;
    assert!(a.requests.snapshot().get(FuseOp::GetAttr) > getattrs, "the kernel asked no GETATTR of d/f");
    assert_eq!(spent.operations(), 0, "the fstat of an open new file sent {}", spent.describe());
    fs::set_permissions(b.path("d/f"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(f.metadata().unwrap().permissions().mode() & 0o7777, 0o600, "A's fstat after B's chmod");
    close(&a, f);

    // Created, checked and closed on A: three calls in all.
    let calls = a.client.rpc_counts();
    let g = fs::OpenOptions::new().write(true).create_new(true).open(a.path("d/g")).unwrap();
    assert_eq!(g.metadata().unwrap().len(), 0);
    let spent = (a.client.rpc_counts() - calls).operations() + close(&a, g).operations();
    assert!(spent <= 3, "a create, fstat and close sent {spent} calls");

    // B's change of d calls A's grant of d's attributes back (A's
    // creates were granted them); after that A holds nothing of d's names.
    close(&b, fs::File::create(b.path("d/x")).unwrap());
    let delivered = a.invalidations.delivered();
    fs::remove_file(b.path("d/g")).unwrap();
    fs::remove_file(b.path("d/f")).unwrap();
    assert_eq!(
        a.invalidations.delivered(),
        delivered,
        "B's unlinks of files A created and closed called A back"
    );

    // Open on A, whose invalidation thread is stalled: B's unlink waits
    // for A (it may not answer while A answers the old attributes), and
    // A's close ends the wait, long before the grant's minute.
    let h = fs::File::create(a.path("d/h")).unwrap();
    close(&b, fs::File::create(b.path("d/y")).unwrap());
    a.invalidations.stall(true);
    let _hang = b.watchdog(LONG_TTL / 2);
    std::thread::scope(|s| {
        let unlink = s.spawn(|| fs::remove_file(b.path("d/h")).unwrap());
        std::thread::sleep(Duration::from_millis(200));
        assert!(!unlink.is_finished(), "B's unlink did not wait for the creator, which has d/h open");
        close(&a, h);
        unlink.join().unwrap();
    });
    a.invalidations.stall(false);
    assert!(missing(&a, "d/h") && missing(&b, "d/h"));
    all_closed(&c);
}

/// Two mounts creating in one directory by turns (the
/// shared-directory create of several processes on two mounts): once a
/// create has called the other mount back for the directory's attributes,
/// they are contended, granted to neither (meta-server `grants`,
/// "Contended attributes"), so the creates after it call no one back — and
/// each mount still sees the other's create at its very next stat of the
/// directory, and its listing. The window is made long here so that a slow
/// step of a busy machine cannot end it between two creates.
#[test]
fn a_directory_two_mounts_create_in_by_turns_calls_no_one_back_and_is_seen_at_once() {
    let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = 1 << 20;
    cfg.lease = citronfs_tests::TEST_LEASE;
    cfg.contended_for = LONG_TTL;
    let c = TestCluster::start_with(cfg, 1, 64 << 20);
    let (a, b) =
        (c.mount_with(options(Mode::Cached(LONG_TTL))), c.mount_with(options(Mode::Cached(LONG_TTL))));
    fs::create_dir(a.path("d")).unwrap();
    let d = Ino(fs::metadata(a.path("d")).unwrap().ino());
    let check = |m: &TestMount, who: &str, round: usize, made: usize| {
        let seen = dir_state(&fs::metadata(m.path("d")).unwrap());
        assert_eq!(seen, true_dir_state(m, d), "round {round}: {who}'s stat of d");
        assert_eq!(names(m, "d").len(), made, "round {round}: {who}'s listing of d");
    };
    let delivered = |m: &TestMount| m.invalidations.delivered();
    let mut quiet_from = None;
    for round in 0..30 {
        // The first rounds call back what each mount cached of d (and A's
        // delegation of it); from the third on, nobody is called back.
        if round == 2 {
            quiet_from = Some((delivered(&a), delivered(&b)));
        }
        fs::write(a.path(&format!("d/a{round}")), b"").unwrap();
        check(&b, "B", round, 2 * round + 1);
        check(&a, "A", round, 2 * round + 1);
        fs::write(b.path(&format!("d/b{round}")), b"").unwrap();
        check(&a, "A", round, 2 * round + 2);
        check(&b, "B", round, 2 * round + 2);
    }
    let quiet_from = quiet_from.unwrap();
    assert_eq!(
        (delivered(&a), delivered(&b)),
        quiet_from,
        "creates by turns in a contended directory called back"
    );
}
