//! POSIX behaviour that programs notice, checked across two real mounts of
//! one cluster: two mounts creating one name at the same moment,
//! set-user/group-ID bits cleared by unprivileged writes, truncates and
//! chowns, the lock `F_GETLK` reports, and what leases can and cannot do.
//! Wherever Linux defines the answer, the same steps also run on a local
//! tmpfs (`/dev/shm`) and the mounts must answer what it answers.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Barrier;

use citronfs_tests::probe::Probe;
use citronfs_tests::{TestCluster, TestMount};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");

fn cluster() -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = c.mount();
    let b = c.mount();
    (c, a, b)
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// `open(2)` as a C program calls it: the descriptor, or the errno.
fn open(path: &Path, flags: i32) -> Result<i32, i32> {
    let c = cpath(path);
    // SAFETY: a valid NUL-terminated path; the mode argument is read only
    // with O_CREAT.
    let fd = unsafe { libc::open(c.as_ptr(), flags, 0o644) };
    if fd < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(fd)
    }
}

fn close(fd: i32) {
    // SAFETY: a descriptor this test opened and closes once.
    unsafe { libc::close(fd) };
}

fn inode_of(fd: i32) -> u64 {
    // SAFETY: an all-zero stat is valid; fstat fills it for an open fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    st.st_ino
}

/// Runs `open(name, flags)` on mount `a` and mount `b` at the same moment,
/// `rounds` times with a fresh name each round; returns both results of
/// every round (an inode number or an errno).
fn open_pairs(a: &TestMount, b: &TestMount, flags: i32, rounds: usize) -> Vec<[Result<u64, i32>; 2]> {
    let barrier = Barrier::new(2);
    let side = |m: &TestMount| {
        (0..rounds)
            .map(|i| {
                let path = m.path(&format!("same-{i}"));
                barrier.wait();
                let r = open(&path, flags).map(|fd| {
                    let ino = inode_of(fd);
                    close(fd);
                    ino
                });
                barrier.wait();
                r
            })
            .collect::<Vec<_>>()
    };
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| side(a));
        let tb = s.spawn(|| side(b));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    ra.into_iter().zip(rb).map(|(x, y)| [x, y]).collect()
}

#[test]
fn o_creat_from_two_mounts_at_once_opens_one_file_on_both() {
    let (_c, a, b) = cluster();
    let rounds = 150;
    let pairs = open_pairs(&a, &b, libc::O_CREAT | libc::O_RDWR, rounds);
    let failed: Vec<_> = pairs.iter().enumerate().filter(|(_, p)| p.iter().any(Result::is_err)).collect();
    assert!(failed.is_empty(), "{} of {rounds} O_CREAT pairs had a failure: {failed:?}", failed.len());
    for (i, [x, y]) in pairs.iter().enumerate() {
        assert_eq!(x, y, "round {i}: both opens must reach the same inode");
    }
    // O_TRUNC without O_EXCL is just as idempotent.
    std::fs::create_dir(a.path("t")).unwrap();
    let pairs = open_pairs(&a, &b, libc::O_CREAT | libc::O_TRUNC | libc::O_WRONLY, 50);
    assert!(pairs.iter().all(|[x, y]| x.is_ok() && x == y), "{pairs:?}");
}

#[test]
fn o_excl_from_two_mounts_at_once_has_exactly_one_winner_and_mkdir_one_too() {
    let (_c, a, b) = cluster();
    let rounds = 150;
    let pairs = open_pairs(&a, &b, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, rounds);
    for (i, p) in pairs.iter().enumerate() {
        let winners = p.iter().filter(|r| r.is_ok()).count();
        assert_eq!(winners, 1, "round {i}: {p:?}");
        assert!(p.contains(&Err(libc::EEXIST)), "round {i}: the loser sees EEXIST: {p:?}");
    }
    // mkdir stays exclusive.
    let barrier = Barrier::new(2);
    let mkdirs = |m: &TestMount| {
        (0..50)
            .map(|i| {
                barrier.wait();
                let r = std::fs::create_dir(m.path(&format!("dir-{i}"))).map_err(|e| e.raw_os_error());
                barrier.wait();
                r
            })
            .collect::<Vec<_>>()
    };
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| mkdirs(&a));
        let tb = s.spawn(|| mkdirs(&b));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    for (i, (x, y)) in ra.iter().zip(&rb).enumerate() {
        let mut both = [*x, *y];
        both.sort();
        assert_eq!(both, [Ok(()), Err(Some(libc::EEXIST))], "mkdir round {i}");
    }
}

#[test]
fn o_creat_of_an_existing_name_keeps_the_open_semantics() {
    let (_c, a, b) = cluster();
    std::fs::create_dir(a.path("d")).unwrap();
    assert_eq!(open(&b.path("d"), libc::O_CREAT | libc::O_RDWR), Err(libc::EISDIR));
    std::fs::write(a.path("f"), b"keep").unwrap();
    let fd = open(&b.path("f"), libc::O_CREAT | libc::O_RDWR).unwrap();
    close(fd);
    assert_eq!(std::fs::read(a.path("f")).unwrap(), b"keep", "O_CREAT alone keeps the data");
    let fd = open(&b.path("f"), libc::O_CREAT | libc::O_TRUNC | libc::O_RDWR).unwrap();
    close(fd);
    assert_eq!(std::fs::metadata(a.path("f")).unwrap().size(), 0, "O_TRUNC truncates");
}

/// Where a scenario runs: a local tmpfs directory (what Linux answers), or
/// two mounts of one cluster, side A and side B.
enum Place<'a> {
    Local(&'a Path),
    Mounts(&'a TestMount, &'a TestMount),
}

#[derive(Clone, Copy)]
enum Side {
    A,
    B,
}

impl Place<'_> {
    fn path(&self, side: Side, name: &str) -> std::path::PathBuf {
        match (self, side) {
            (Place::Local(dir), _) => dir.join(name),
            (Place::Mounts(a, _), Side::A) => a.path(name),
            (Place::Mounts(_, b), Side::B) => b.path(name),
        }
    }
}

/// A local tmpfs directory that an unprivileged user may enter.
fn local_tmpfs() -> tempfile::TempDir {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a directory on /dev/shm");
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    dir
}

const NOBODY: u32 = 65534;

/// Who acts in a set-ID scenario.
#[derive(Clone, Copy, Debug)]
enum Actor {
    Root,
    /// uid and gid 65534, no supplementary groups.
    Nobody,
}

#[derive(Clone, Copy, Debug)]
enum SetidOp {
    Write,
    Truncate,
    Chgrp(u32),
}

/// Root makes `name` on side A with `mode`, owned by `owner`; `actor`
/// does `op` through side B; answers the permission bits seen on side A.
fn setid_after(place: &Place, name: &str, owner: (u32, u32), mode: u32, actor: Actor, op: SetidOp) -> u32 {
    let on_a = place.path(Side::A, name);
    std::fs::write(&on_a, b"#!/bin/sh\n").unwrap();
    std::os::unix::fs::chown(&on_a, Some(owner.0), Some(owner.1)).unwrap();
    std::fs::set_permissions(&on_a, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    let on_b = place.path(Side::B, name);
    let mut p = Probe::spawn(PROBE);
    if let Actor::Nobody = actor {
        assert_eq!(p.ask(&format!("become {NOBODY} {NOBODY}")), "ok");
    }
    let answer = match op {
        SetidOp::Write => {
            let fd = p.open(&on_b);
            p.ask(&format!("write {fd} 0 x"))
        }
        SetidOp::Truncate => {
            let fd = p.open(&on_b);
            p.ask(&format!("truncate {fd} 1"))
        }
        SetidOp::Chgrp(gid) => p.ask(&format!("chown {} -1 {gid}", on_b.display())),
    };
    assert_eq!(answer, "ok", "{actor:?} {op:?} on a {mode:o} file");
    p.kill();
    std::fs::metadata(&on_a).unwrap().mode() & 0o7777
}

#[test]
fn set_id_bits_are_cleared_as_linux_clears_them() {
    let (_c, a, b) = cluster();
    std::fs::set_permissions(a.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let local = local_tmpfs();
    let mounts = Place::Mounts(&a, &b);
    let linux = Place::Local(local.path());
    use Actor::*;
    use SetidOp::*;
    let root_file = (0, 0);
    let nobodys_file = (NOBODY, 0);
    // (owner, mode, actor, op, what Linux leaves)
    let cases = [
        (root_file, 0o4777, Nobody, Write, 0o777),
        (root_file, 0o2777, Nobody, Write, 0o777),
        (root_file, 0o6777, Nobody, Write, 0o777),
        // Set-group-ID without group-execute goes for a writer outside the group.
        (root_file, 0o2767, Nobody, Write, 0o767),
        (root_file, 0o6777, Nobody, Truncate, 0o777),
        (root_file, 0o2767, Nobody, Truncate, 0o767),
        // The owner changes the group (a chown without CAP_FSETID).
        (nobodys_file, 0o6777, Nobody, Chgrp(NOBODY), 0o777),
        (nobodys_file, 0o2767, Nobody, Chgrp(NOBODY), 0o767),
        ((NOBODY, NOBODY), 0o2767, Nobody, Chgrp(NOBODY), 0o2767),
        // Root (CAP_FSETID) keeps them on write and truncate; Linux clears
        // set-user-ID on any chown, root's too.
        (root_file, 0o6777, Root, Write, 0o6777),
        (root_file, 0o6777, Root, Truncate, 0o6777),
        (root_file, 0o6777, Root, Chgrp(1), 0o777),
        (root_file, 0o2767, Root, Chgrp(1), 0o2767),
    ];
    let mut wrong = Vec::new();
    for (i, &(owner, mode, actor, op, want)) in cases.iter().enumerate() {
        let name = format!("setid-{i}");
        let on_linux = setid_after(&linux, &name, owner, mode, actor, op);
        assert_eq!(on_linux, want, "tmpfs disagrees with the table: {actor:?} {op:?} on {mode:o}");
        let on_mounts = setid_after(&mounts, &name, owner, mode, actor, op);
        if on_mounts != want {
            wrong.push(format!("{actor:?} {op:?} on {mode:o}: {on_mounts:o}, Linux {want:o}"));
        }
    }
    assert!(wrong.is_empty(), "set-ID bits differ from Linux: {wrong:#?}");
}

/// Two lock owners on side A and B and an observer on side B run the
/// steps; answers what the observer's `F_GETLK` (write, whole file) saw
/// after each step, with holders named.
fn getlk_choices(place: &Place) -> Vec<String> {
    let file = place.path(Side::A, "locked");
    std::fs::write(&file, vec![b'x'; 100]).unwrap();
    let mut owners = [Probe::spawn(PROBE), Probe::spawn(PROBE), Probe::spawn(PROBE)];
    let fds: Vec<i32> = owners
        .iter_mut()
        .enumerate()
        .map(|(i, p)| p.open(&place.path(if i == 0 { Side::A } else { Side::B }, "locked")))
        .collect();
    let names = ["P", "Q", "R"];
    let mut observer = Probe::spawn(PROBE);
    let ofd = observer.open(&place.path(Side::B, "locked"));
    // (owner, type, start, len), then an F_GETLK by the observer.
    let steps: &[&[(usize, &str, u64, u64)]] = &[
        &[(0, "w", 10, 5), (0, "r", 1, 5)],
        &[(1, "r", 50, 5)],
        &[(1, "w", 0, 1)],
        &[(0, "u", 0, 0)],
        &[(0, "w", 60, 1)],
        &[(1, "u", 50, 5)],
        &[(1, "u", 0, 0), (1, "w", 90, 1)],
        &[(2, "r", 95, 1), (0, "u", 0, 0), (0, "w", 70, 1)],
        &[(1, "w", 91, 1), (1, "u", 90, 1)],
    ];
    let mut seen = Vec::new();
    for step in steps {
        for &(o, t, start, len) in *step {
            assert_eq!(owners[o].ask(&format!("setlk {} {t} {start} {len}", fds[o])), "ok");
        }
        let got = observer.ask(&format!("getlk {ofd} w 0 0"));
        let named = match got.rsplit_once(' ') {
            Some((lock, pid)) => {
                let who = owners.iter().position(|p| p.pid.to_string() == pid).map_or("?", |i| names[i]);
                format!("{lock} {who}")
            }
            None => got,
        };
        seen.push(named);
    }
    seen
}

#[test]
fn getlk_reports_the_lock_linux_reports() {
    let (_c, a, b) = cluster();
    let local = local_tmpfs();
    let linux = getlk_choices(&Place::Local(local.path()));
    // The issue's case: one owner holds WRLCK 10-14 and RDLCK 1-5; Linux
    // keeps an owner's locks in start order and reports the first conflict.
    assert_eq!(linux[0], "r 1 5 P", "tmpfs: {linux:?}");
    let ours = getlk_choices(&Place::Mounts(&a, &b));
    assert_eq!(ours, linux, "F_GETLK across mounts must choose as Linux does");
}

#[test]
fn leases_are_local_to_one_mount_as_documented() {
    // The daemon never hears of F_SETLEASE (no FUSE request exists for it):
    // the kernel of each mount grants and breaks leases among its own opens
    // only. README "Leases" says so; this keeps it true.
    let (_c, a, b) = cluster();
    std::fs::write(a.path("leased"), b"x").unwrap();
    let mut holder = Probe::spawn(PROBE);
    let fd = holder.ask(&format!("open-ro {}", a.path("leased").display()));
    let fd = fd.strip_prefix("fd ").unwrap_or_else(|| panic!("{fd}")).to_string();
    assert_eq!(holder.ask(&format!("lease {fd} r")), "ok", "the kernel grants it");
    assert_eq!(holder.ask(&format!("getlease {fd}")), "lease r");
    // A writer on the other mount does not break it.
    let mut other = Probe::spawn(PROBE);
    let answer = other.ask(&format!("open-nb {}", b.path("leased").display()));
    assert!(answer.starts_with("fd "), "{answer}");
    assert_eq!(holder.ask("breaks"), "breaks 0");
    assert_eq!(holder.ask(&format!("getlease {fd}")), "lease r");
    // A writer on the same mount does: it is refused for now (O_NONBLOCK)
    // and the holder is signalled.
    let mut local = Probe::spawn(PROBE);
    assert_eq!(local.ask(&format!("open-nb {}", a.path("leased").display())), "err EAGAIN");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while holder.ask("breaks") == "breaks 0" {
        assert!(std::time::Instant::now() < deadline, "the lease break never reached the holder");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The set-ID check rides on the slot read every write makes: a write by
/// a process without CAP_FSETID to a file without set-ID bits costs the
/// verbs and round trips of any write, and never asks for the writer's
/// groups (no `/proc` read, no RPC); one to a set-user-ID file clears it.
#[test]
fn an_unprivileged_write_costs_what_any_write_costs() {
    use citronfs_core::client::{ClientConfig, FsClient, WriteMode};
    use citronfs_core::types::{Caller, Ino, SetAttr};
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let client = FsClient::connect(ClientConfig::new(c.meta.local_addr())).unwrap();
    let ino = client.create_open(Caller::ROOT, Ino::ROOT, b"f", 0o666).unwrap().ino;
    // Warm up (layout, lock handles) and give the file its size, so the
    // measured writes neither fetch nor grow anything.
    client.write(ino, 0, b"warm-up!", false).unwrap();
    client.write(ino, 0, b"again", false).unwrap();
    let never = || -> Vec<u32> { panic!("the writer's groups were asked for a file without set-ID bits") };
    let unprivileged = WriteMode { append: false, unprivileged: Some(&never) };
    let before = client.verb_counts();
    client.write(ino, 0, b"plain", false).unwrap();
    let plain = client.verb_counts() - before;
    let before = client.verb_counts();
    client.write_as(ino, 0, b"other", unprivileged).unwrap();
    let other = client.verb_counts() - before;
    assert_eq!((other.by_kind, other.round_trips), (plain.by_kind, plain.round_trips));
    // A set-user-ID file: the bit goes, the groups are asked for once.
    let suid = SetAttr { perm: Some(0o4777), ..SetAttr::default() };
    client.setattr(Caller::ROOT, ino, suid).unwrap();
    let asked = std::cell::Cell::new(0);
    let groups = || {
        asked.set(asked.get() + 1);
        vec![NOBODY]
    };
    client.write_as(ino, 0, b"x", WriteMode { append: false, unprivileged: Some(&groups) }).unwrap();
    assert_eq!(client.getattr(ino).unwrap().perm, 0o777);
    assert_eq!(asked.get(), 1);
    client.write_as(ino, 0, b"y", WriteMode { append: false, unprivileged: Some(&never) }).unwrap();
}
