//! The mounted file system as POSIX programs see it: two real FUSE mounts of
//! one cluster (two clients) in this process, checked through the kernel with
//! ordinary system calls. Needs root, /dev/fuse and fusermount3 (fuse3).

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use citronfs_tests::TestCluster;

const CHUNK: u64 = 1 << 20;

fn errno_of(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or_else(|| panic!("not an OS error: {e}"))
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

#[test]
fn files_written_on_one_mount_are_read_on_the_other() {
    let cluster = TestCluster::start(2, 64 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    let data: Vec<u8> = (0..5 * CHUNK as usize + 77).map(|i| (i % 253) as u8).collect();
    fs::write(a.path("f"), &data).unwrap();
    assert_eq!(fs::read(b.path("f")).unwrap(), data);
    // Overwrite in the middle from b; a sees it at once (no cache).
    let f = OpenOptions::new().write(true).open(b.path("f")).unwrap();
    f.write_all_at(b"MIDDLE", 3 * CHUNK - 3).unwrap();
    let mut buf = [0u8; 6];
    File::open(a.path("f")).unwrap().read_exact_at(&mut buf, 3 * CHUNK - 3).unwrap();
    assert_eq!(&buf, b"MIDDLE");
}

#[test]
fn sparse_files_big_offsets_append_and_truncate() {
    let cluster = TestCluster::start(1, 64 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    // A hole, then data beyond 4 GiB.
    let f =
        OpenOptions::new().create(true).truncate(true).read(true).write(true).open(a.path("sparse")).unwrap();
    let far = (4u64 << 30) + 12345;
    f.write_all_at(b"far away", far).unwrap();
    assert_eq!(fs::metadata(b.path("sparse")).unwrap().len(), far + 8);
    let mut g = File::open(b.path("sparse")).unwrap();
    let mut buf = vec![0xFFu8; 4096];
    g.read_exact_at(&mut buf, 1 << 30).unwrap();
    assert!(buf.iter().all(|&x| x == 0), "holes read as zeros");
    g.seek(SeekFrom::Start(far)).unwrap();
    let mut s = String::new();
    g.read_to_string(&mut s).unwrap();
    assert_eq!(s, "far away");
    // O_APPEND from both mounts: nothing overwritten.
    for i in 0..20 {
        let m = if i % 2 == 0 { &a } else { &b };
        let mut f = OpenOptions::new().append(true).create(true).open(m.path("log")).unwrap();
        writeln!(f, "line {i:02}").unwrap();
    }
    let log = fs::read_to_string(a.path("log")).unwrap();
    let expect: String = (0..20).map(|i| format!("line {i:02}\n")).collect();
    assert_eq!(log, expect);
    // Truncate down into a chunk and back up: the cut part reads zeros.
    fs::write(a.path("t"), vec![7u8; 3000]).unwrap();
    let t = OpenOptions::new().write(true).open(b.path("t")).unwrap();
    t.set_len(1000).unwrap();
    t.set_len(3000).unwrap();
    let back = fs::read(a.path("t")).unwrap();
    assert_eq!(back.len(), 3000);
    assert!(back[..1000].iter().all(|&x| x == 7) && back[1000..].iter().all(|&x| x == 0));
}

#[test]
fn namespace_operations_with_their_errors() {
    let cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    fs::create_dir(a.path("d")).unwrap();
    assert_eq!(errno_of(fs::create_dir(b.path("d")).unwrap_err()), libc::EEXIST);
    fs::write(b.path("d/f"), b"x").unwrap();
    assert_eq!(errno_of(fs::remove_dir(a.path("d")).unwrap_err()), libc::ENOTEMPTY);
    assert_eq!(errno_of(fs::remove_file(a.path("d")).unwrap_err()), libc::EISDIR);
    assert_eq!(errno_of(fs::read(a.path("nope")).unwrap_err()), libc::ENOENT);
    assert_eq!(errno_of(fs::read(a.path("d/f/x")).unwrap_err()), libc::ENOTDIR);
    let long = "n".repeat(256);
    assert_eq!(errno_of(fs::write(a.path(&long), b"").unwrap_err()), libc::ENAMETOOLONG);
    // Links and nlink.
    fs::hard_link(a.path("d/f"), a.path("hard")).unwrap();
    assert_eq!(fs::metadata(b.path("d/f")).unwrap().nlink(), 2);
    assert_eq!(fs::metadata(b.path("d")).unwrap().nlink(), 2);
    fs::create_dir(a.path("d/sub")).unwrap();
    assert_eq!(fs::metadata(b.path("d")).unwrap().nlink(), 3);
    std::os::unix::fs::symlink("d/f", a.path("sym")).unwrap();
    assert_eq!(fs::read_link(b.path("sym")).unwrap(), Path::new("d/f"));
    assert_eq!(fs::read(b.path("sym")).unwrap(), b"x");
    // Rename over an existing file, seen atomically from the other mount.
    fs::write(a.path("old"), b"old").unwrap();
    fs::write(a.path("new"), b"new").unwrap();
    fs::rename(a.path("new"), a.path("old")).unwrap();
    assert_eq!(fs::read(b.path("old")).unwrap(), b"new");
    assert_eq!(errno_of(fs::metadata(b.path("new")).unwrap_err()), libc::ENOENT);
    // renameat2 flags pass through.
    fs::write(a.path("p"), b"p").unwrap();
    let (p, o) = (cpath(&a.path("p")), cpath(&a.path("old")));
    // SAFETY: valid NUL-terminated paths; renameat2 has no other preconditions.
    let r = unsafe {
        libc::renameat2(libc::AT_FDCWD, p.as_ptr(), libc::AT_FDCWD, o.as_ptr(), libc::RENAME_NOREPLACE)
    };
    assert_eq!((r, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EEXIST)));
    // SAFETY: as above.
    let r = unsafe {
        libc::renameat2(libc::AT_FDCWD, p.as_ptr(), libc::AT_FDCWD, o.as_ptr(), libc::RENAME_EXCHANGE)
    };
    assert_eq!(r, 0);
    assert_eq!(fs::read(b.path("old")).unwrap(), b"p");
    assert_eq!(fs::read(b.path("p")).unwrap(), b"new");
    // mknod: a fifo, seen as one from the other mount.
    let fifo = cpath(&a.path("fifo"));
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    use std::os::unix::fs::FileTypeExt;
    assert!(fs::metadata(b.path("fifo")).unwrap().file_type().is_fifo());
    // Permissions and ownership.
    fs::set_permissions(a.path("p"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(b.path("p")).unwrap().permissions().mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(a.path("p"), Some(1234), Some(5678)).unwrap();
    let m = fs::metadata(b.path("p")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 5678));
}

#[test]
fn xattrs_and_timestamps() {
    let cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    fs::write(a.path("f"), b"data").unwrap();
    let (pa, pb) = (cpath(&a.path("f")), cpath(&b.path("f")));
    let name = CString::new("user.color").unwrap();
    // SAFETY: valid paths, name and value buffers with their true lengths.
    let r = unsafe { libc::setxattr(pa.as_ptr(), name.as_ptr(), b"blue".as_ptr().cast(), 4, 0) };
    assert_eq!(r, 0);
    let mut buf = [0u8; 16];
    // SAFETY: as above; the buffer is 16 bytes.
    let n = unsafe { libc::getxattr(pb.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n as usize], b"blue");
    // SAFETY: as above.
    let r =
        unsafe { libc::setxattr(pb.as_ptr(), name.as_ptr(), b"red".as_ptr().cast(), 3, libc::XATTR_CREATE) };
    assert_eq!((r, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EEXIST)));
    // SAFETY: as above.
    let r = unsafe { libc::removexattr(pa.as_ptr(), name.as_ptr()) };
    assert_eq!(r, 0);
    // SAFETY: as above.
    let n = unsafe { libc::getxattr(pb.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!((n, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::ENODATA)));
    // utimens sets, a later write moves mtime forward.
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    File::options().write(true).open(a.path("f")).unwrap().set_modified(t).unwrap();
    assert_eq!(fs::metadata(b.path("f")).unwrap().modified().unwrap(), t);
    fs::write(b.path("f"), b"newer").unwrap();
    assert!(fs::metadata(a.path("f")).unwrap().modified().unwrap() > t);
}

#[test]
fn readdir_of_ten_thousand_entries() {
    let cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    fs::create_dir(a.path("many")).unwrap();
    for i in 0..10_000 {
        File::create(a.path(&format!("many/f{i:05}"))).unwrap();
    }
    let mut names: Vec<_> = fs::read_dir(b.path("many"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 10_000);
    assert_eq!(names[0], "f00000");
    assert_eq!(names[9999], "f09999");
}

#[test]
fn statfs_and_enospc() {
    let cluster = TestCluster::start(1, 4 << 20, CHUNK);
    let a = cluster.mount();
    let mut f = File::create(a.path("fill")).unwrap();
    let block = vec![1u8; CHUNK as usize];
    let mut written = 0;
    let err = loop {
        match f.write_all(&block) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(errno_of(err), libc::ENOSPC);
    assert_eq!(written, 4);
    drop(f);
    assert_eq!(fs::metadata(a.path("fill")).unwrap().len(), 4 * CHUNK);
    fs::remove_file(a.path("fill")).unwrap();
    assert!(fs::metadata(a.path("fill")).is_err());
}

#[test]
fn permissions_cross_mount_rename_fallocate_and_efbig() {
    use std::os::unix::process::CommandExt;
    let cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount_tcp());
    fs::write(a.path("root-only"), b"secret").unwrap();
    fs::set_permissions(a.path("root-only"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(a.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    // An unprivileged user is refused by the kernel's permission checks.
    let run_as_user = |script: &str| {
        std::process::Command::new("sh").arg("-c").arg(script).uid(65534).gid(65534).output().unwrap()
    };
    let out = run_as_user(&format!("cat {}", b.path("root-only").display()));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"));
    let out = run_as_user(&format!("touch {}", b.path("new-file").display()));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"));
    let out = run_as_user(&format!("chmod 777 {}", b.path("root-only").display()));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not permitted"),
        "EPERM for chmod of another's file"
    );
    // Two mounts are two file systems to the kernel: rename between them is EXDEV.
    assert_eq!(errno_of(fs::rename(a.path("root-only"), b.path("moved")).unwrap_err()), libc::EXDEV);
    // fallocate reserves space and grows the size; KEEP_SIZE does not.
    let f = OpenOptions::new().create(true).truncate(true).write(true).open(a.path("fa")).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open descriptor; fallocate has no memory preconditions.
    assert_eq!(unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 3 * CHUNK as i64) }, 0);
    assert_eq!(fs::metadata(b.path("fa")).unwrap().len(), 3 * CHUNK);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 5 * CHUNK as i64) }, 0);
    assert_eq!(fs::metadata(b.path("fa")).unwrap().len(), 3 * CHUNK);
    assert_eq!(fs::read(b.path("fa")).unwrap(), vec![0; 3 * CHUNK as usize], "allocated space reads zeros");
    // Past the largest file: EFBIG.
    let err = f.write_all_at(b"x", citronfs_core::types::MAX_FILE_SIZE).unwrap_err();
    assert_eq!(errno_of(err), libc::EFBIG);
}

#[test]
fn a_vanished_data_server_gives_eio_promptly() {
    let mut cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let a = cluster.mount_tcp();
    fs::write(a.path("f"), b"data").unwrap();
    cluster.data[0].shutdown();
    let t = std::time::Instant::now();
    assert_eq!(errno_of(fs::read(a.path("f")).unwrap_err()), libc::EIO);
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "took {:?}", t.elapsed());
    // Metadata still works: only the data server is gone.
    assert_eq!(fs::metadata(a.path("f")).unwrap().len(), 4);
}

#[test]
fn rename_over_a_file_is_atomic_as_seen_from_the_other_mount() {
    // Every replaced file keeps its chunk through a grace and a quarantine:
    // room for all 200 of them.
    let cluster = TestCluster::start(1, 256 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    fs::write(a.path("target"), b"version 0000").unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Never missing, never a mix of two versions.
                let got = fs::read(b.path("target")).expect("target exists at every instant");
                assert!(got.starts_with(b"version ") && got.len() == 12, "{got:?}");
                reads += 1;
            }
            reads
        });
        // Stop the reader however the writer ends, or the scope never would.
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(&stop);
        for i in 1..=200 {
            fs::write(a.path("tmp"), format!("version {i:04}")).unwrap();
            fs::rename(a.path("tmp"), a.path("target")).unwrap();
        }
        drop(_stop);
        assert!(reader.join().unwrap() > 0);
    });
    assert_eq!(fs::read(b.path("target")).unwrap(), b"version 0200");
}

/// fsync(2) of a file has nothing to do here (writes reach the data
/// servers' memory before they answer), so the mount answers the kernel's
/// first FSYNC with ENOSYS and the kernel sends no more: SQLite's fsyncs of
/// its journal and of the journal's directory cost no request. Every open
/// of a directory is answered (with no flags, so the kernel caches no
/// listing: see `a_directory_kept_open_sees_the_other_mounts_changes_at_each_rewind`
/// in `mount_coherence`). Data and listings stay what they were.
#[test]
fn fsyncs_reach_the_daemon_at_most_once_and_directory_opens_each_time() {
    use citronfs_mount::FuseOp;
    let cluster = TestCluster::start(1, 64 << 20, CHUNK);
    let (a, b) = (cluster.mount(), cluster.mount());
    fs::create_dir(a.path("d")).unwrap();
    let mut f = File::create(a.path("d/f")).unwrap();
    for round in 0..5u8 {
        f.write_all(&[round]).unwrap();
        f.sync_data().unwrap();
        f.sync_all().unwrap();
        let dir = File::open(a.path("d")).unwrap();
        dir.sync_all().unwrap();
        let listed: Vec<_> = fs::read_dir(a.path("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(listed, vec![std::ffi::OsString::from("f")], "round {round}");
        assert_eq!(fs::read(b.path("d/f")).unwrap(), (0..=round).collect::<Vec<u8>>(), "round {round}");
    }
    let requests = a.requests.snapshot();
    assert!(requests.get(FuseOp::Fsync) <= 1, "{} FSYNC requests", requests.get(FuseOp::Fsync));
    assert_eq!(requests.get(FuseOp::OpenDir), 10, "two directory opens a round, each answered");
}

/// A name one byte longer than NAME_MAX is refused with ENAMETOOLONG by
/// every call that names it, whatever the directory held before: here after
/// the longest name was created, changed and removed, as pjdfstest checks
/// it, in the root and in a directory the mount made (which a caching mount
/// may list itself), in both modes.
fn a_name_past_name_max_is_too_long(options: citronfs_mount::MountOptions) {
    let cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let m = cluster.mount_with(options);
    fs::create_dir(m.path("made")).unwrap();
    let (longest, past) = ("l".repeat(255), "l".repeat(256));
    for dir in ["", "made/"] {
        let at = |name: &str| m.path(&format!("{dir}{name}"));
        fs::write(at(&longest), b"").unwrap();
        fs::set_permissions(at(&longest), fs::Permissions::from_mode(0o620)).unwrap();
        assert_eq!(fs::metadata(at(&longest)).unwrap().permissions().mode() & 0o7777, 0o620);
        fs::remove_file(at(&longest)).unwrap();
        let p = at(&past);
        let too_long = |what: &str, r: std::io::Result<()>| {
            let e = r.expect_err(what);
            assert_eq!(errno_of(e), libc::ENAMETOOLONG, "{what} of a {}-byte name in {dir:?}", past.len());
        };
        too_long("chmod", fs::set_permissions(&p, fs::Permissions::from_mode(0o620)));
        too_long("chown", std::os::unix::fs::chown(&p, Some(65534), Some(65534)));
        too_long("truncate", OpenOptions::new().write(true).open(&p).and_then(|f| f.set_len(0)));
        too_long("stat", fs::symlink_metadata(&p).map(drop));
        too_long("create", fs::write(&p, b""));
        too_long("mkdir", fs::create_dir(&p));
        too_long("unlink", fs::remove_file(&p));
        too_long("rmdir", fs::remove_dir(&p));
        too_long("symlink", std::os::unix::fs::symlink("x", &p));
        fs::write(at("short"), b"").unwrap();
        too_long("link", fs::hard_link(at("short"), &p));
        too_long("rename", fs::rename(at("short"), &p));
        fs::remove_file(at("short")).unwrap();
    }
}

#[test]
fn a_name_past_name_max_is_too_long_on_a_strict_mount() {
    a_name_past_name_max_is_too_long(citronfs_mount::MountOptions::default());
}

#[test]
fn a_name_past_name_max_is_too_long_on_a_caching_mount() {
    let cache_ttl = std::time::Duration::from_secs(1);
    a_name_past_name_max_is_too_long(citronfs_mount::MountOptions { cache_ttl, ..Default::default() });
}

/// Runs `act` in a child process acting as `uid`:`gid` (no supplementary
/// groups) and answers the errno it returns (0: success). Only system
/// calls in the child: the paths are made before the fork.
fn as_user(uid: u32, gid: u32, act: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child makes only system calls (setgroups, setresgid,
    // setresuid, those of `act`) and leaves with _exit: nothing that could
    // take a lock another thread of this process held at the fork.
    unsafe {
        match libc::fork() {
            0 => {
                let ok = libc::setgroups(0, std::ptr::null()) == 0
                    && libc::setresgid(gid, gid, gid) == 0
                    && libc::setresuid(uid, uid, uid) == 0;
                libc::_exit(if ok { act() } else { 255 })
            }
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            child => {
                let mut status = 0;
                assert_eq!(libc::waitpid(child, &mut status, 0), child);
                assert!(libc::WIFEXITED(status), "the child acting as {uid} died");
                let code = libc::WEXITSTATUS(status);
                assert_ne!(code, 255, "the child could not become {uid}:{gid}");
                code
            }
        }
    }
}

/// The errno of the last failed system call if `r` is -1, else 0.
fn errno_if(r: libc::c_int) -> i32 {
    if r == -1 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(254)
    } else {
        0
    }
}

/// The calls a child of [`as_user`] makes, each answering its errno.
fn create(path: &CString) -> impl FnOnce() -> i32 + '_ {
    // SAFETY: a valid NUL-terminated path.
    move || unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY, 0o644);
        if fd >= 0 {
            libc::close(fd);
        }
        errno_if(fd)
    }
}

fn unlink(path: &CString) -> impl FnOnce() -> i32 + '_ {
    // SAFETY: a valid NUL-terminated path.
    move || unsafe { errno_if(libc::unlink(path.as_ptr())) }
}

fn rename<'a>(from: &'a CString, to: &'a CString) -> impl FnOnce() -> i32 + 'a {
    // SAFETY: valid NUL-terminated paths.
    move || unsafe { errno_if(libc::rename(from.as_ptr(), to.as_ptr())) }
}

fn mkdir(path: &CString) -> impl FnOnce() -> i32 + '_ {
    // SAFETY: a valid NUL-terminated path.
    move || unsafe { errno_if(libc::mkdir(path.as_ptr(), 0o755)) }
}

fn rmdir(path: &CString) -> impl FnOnce() -> i32 + '_ {
    // SAFETY: a valid NUL-terminated path.
    move || unsafe { errno_if(libc::rmdir(path.as_ptr())) }
}

fn chmod(path: &CString, mode: libc::mode_t) -> impl FnOnce() -> i32 + '_ {
    // SAFETY: a valid NUL-terminated path.
    move || unsafe { errno_if(libc::chmod(path.as_ptr(), mode)) }
}

fn stat(path: &CString) -> impl FnOnce() -> i32 + '_ {
    // SAFETY: a valid NUL-terminated path and a stat buffer.
    move || unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        errno_if(libc::stat(path.as_ptr(), &mut st))
    }
}

/// The sticky bit, search and write permissions, and the rules of
/// renaming directories, as Linux applies them, on two mounts: the
/// directories are made on the first (which a caching mount lists itself,
/// answering creates first) and each step is tried on both. pjdfstest's
/// sticky, permission and directory-rename cases, in short.
fn sticky_permission_and_rename_rules(options: citronfs_mount::MountOptions) {
    const ALICE: u32 = 1000;
    const BOB: u32 = 1001;
    let cluster = TestCluster::start(1, 16 << 20, CHUNK);
    let (a, b) = (cluster.mount_with(options.clone()), cluster.mount_with(options));
    fs::create_dir(a.path("t")).unwrap();
    fs::set_permissions(a.path("t"), fs::Permissions::from_mode(0o1777)).unwrap();
    for (round, m) in [&a, &b].into_iter().enumerate() {
        let p = |rel: &str| cpath(&m.path(&format!("t/{rel}{round}")));
        let within = |rel: &str| cpath(&m.path(&format!("t/alicedir{round}/{rel}")));
        let (mine, bobs, mydir, renamed) = (p("alice"), p("bob"), p("alicedir"), p("renamed"));
        assert_eq!(as_user(ALICE, ALICE, create(&mine)), 0, "alice creates in a sticky 1777 directory");
        assert_eq!(as_user(BOB, BOB, create(&bobs)), 0, "bob creates in a sticky 1777 directory");
        assert_eq!(as_user(ALICE, ALICE, mkdir(&mydir)), 0);
        // Sticky: only the owner of the file (or of the directory, or
        // root) removes or renames it.
        assert_eq!(as_user(BOB, BOB, unlink(&mine)), libc::EPERM, "bob unlinks alice's file (round {round})");
        assert_eq!(as_user(BOB, BOB, rename(&mine, &renamed)), libc::EPERM, "bob renames alice's file");
        assert_eq!(as_user(BOB, BOB, rename(&bobs, &mine)), libc::EPERM, "bob renames over alice's file");
        assert_eq!(as_user(BOB, BOB, rmdir(&mydir)), libc::EPERM, "bob removes alice's directory");
        assert_eq!(as_user(BOB, BOB, rename(&mydir, &renamed)), libc::EPERM, "bob renames alice's directory");
        assert_eq!(as_user(ALICE, ALICE, unlink(&bobs)), libc::EPERM, "alice unlinks bob's file");
        assert_eq!(as_user(ALICE, ALICE, rename(&mine, &renamed)), 0, "alice renames her own file");
        assert_eq!(as_user(ALICE, ALICE, unlink(&renamed)), 0, "alice unlinks her own file");
        assert_eq!(as_user(BOB, BOB, unlink(&bobs)), 0, "bob unlinks his own file");
        // Permissions: alice's 0755 directory is not bob's to write in,
        // and once 0700 not his to search.
        let inside = within("x");
        assert_eq!(as_user(BOB, BOB, create(&inside)), libc::EACCES, "bob creates in alice's 0755 directory");
        assert_eq!(as_user(ALICE, ALICE, create(&inside)), 0);
        assert_eq!(as_user(BOB, BOB, unlink(&inside)), libc::EACCES, "bob unlinks in alice's 0755 directory");
        assert_eq!(as_user(ALICE, ALICE, chmod(&mydir, 0o700)), 0);
        assert_eq!(as_user(BOB, BOB, stat(&inside)), libc::EACCES, "bob searches alice's 0700 directory");
        assert_eq!(as_user(ALICE, ALICE, stat(&inside)), 0);
        assert_eq!(as_user(BOB, BOB, chmod(&mydir, 0o777)), libc::EPERM, "bob chmods alice's directory");
        // Directory renames: not into itself, not over a non-empty
        // directory, not over a file (and a file not over a directory).
        let (sub, file, other) = (within("sub"), p("file"), p("other"));
        assert_eq!(as_user(ALICE, ALICE, mkdir(&sub)), 0);
        assert_eq!(as_user(ALICE, ALICE, rename(&mydir, &sub)), libc::EINVAL, "a directory into itself");
        assert_eq!(as_user(ALICE, ALICE, create(&file)), 0);
        assert_eq!(as_user(ALICE, ALICE, rename(&mydir, &file)), libc::ENOTDIR, "a directory over a file");
        assert_eq!(as_user(ALICE, ALICE, rename(&file, &mydir)), libc::EISDIR, "a file over a directory");
        assert_eq!(as_user(ALICE, ALICE, mkdir(&other)), 0);
        let err = as_user(ALICE, ALICE, rename(&other, &mydir));
        assert!(err == libc::ENOTEMPTY || err == libc::EEXIST, "over a non-empty directory: {err}");
        // A directory moved into another: both parents' link counts, on
        // both mounts, and the moved directory's `..`.
        let nlink = |m: &citronfs_tests::TestMount, rel: &str| fs::metadata(m.path(rel)).unwrap().nlink();
        let (before_t, before_d) = (nlink(&a, "t"), nlink(&b, &format!("t/alicedir{round}")));
        let moved = within("other");
        assert_eq!(as_user(ALICE, ALICE, rename(&other, &moved)), 0);
        for seen in [&a, &b] {
            assert_eq!(nlink(seen, "t"), before_t - 1, "t lost a subdirectory (round {round})");
            assert_eq!(nlink(seen, &format!("t/alicedir{round}")), before_d + 1, "alicedir gained one");
            let dotdot = fs::metadata(seen.path(&format!("t/alicedir{round}/other/.."))).unwrap().ino();
            assert_eq!(dotdot, fs::metadata(seen.path(&format!("t/alicedir{round}"))).unwrap().ino());
        }
    }
}

#[test]
fn sticky_permission_and_rename_rules_on_strict_mounts() {
    sticky_permission_and_rename_rules(citronfs_mount::MountOptions::default());
}

#[test]
fn sticky_permission_and_rename_rules_on_caching_mounts() {
    let cache_ttl = std::time::Duration::from_secs(1);
    sticky_permission_and_rename_rules(citronfs_mount::MountOptions { cache_ttl, ..Default::default() });
}
