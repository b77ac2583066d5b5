//! A meta-server that restarts keeps its file system: SIGTERM and SIGKILL
//! of `citronfs meta-server` with a state directory, then the same command
//! again, with a data server that keeps running. What every call that
//! returned before the kill made is there afterwards, seen through the
//! mounts that were up (without remounting) and by a new one. Their open
//! files and their locks ride through the restart: a lock held before it
//! is held after it, a waiter blocked across it is granted when the lock
//! goes, on tcp and on shm. A mount that reconnects to another file system
//! never shows an empty tree in place of the old one (it answers EIO).
//! A torn journal tail is replayed up to its last whole record; damage in
//! the middle stops the start with an error naming the file and offset.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use citronfs_core::client::ClientConfig;
use citronfs_core::locks::record::RecordState;
use citronfs_core::types::Ino;
use citronfs_mount::MountOptions;
use citronfs_tests::sqlite::SqliteWriters;
use citronfs_tests::TestMount;

const EXE: &str = env!("CARGO_BIN_EXE_citronfs");
/// Guards against hangs only; nothing here is timed.
const HANG: Duration = Duration::from_secs(60);

/// A server process, killed if the test ends first.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Server {
    /// Starts `citronfs ARGS` and waits for its first line on stdout.
    fn start(args: &[&str]) -> Self {
        Self::start_with(args, &[])
    }

    /// [`Server::start`], with `env` set.
    fn start_with(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child =
            Command::new(EXE).args(args).envs(env.iter().copied()).stdout(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "citronfs {args:?} printed nothing: {:?}", child.wait());
        Self(child)
    }

    fn stop(mut self, sig: i32) {
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, sig) }, 0);
        let deadline = Instant::now() + HANG;
        while self.0.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "server did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A port free now on loopback (the restarted meta-server listens there again).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn meta(addr: &str, state: &Path) -> Server {
    meta_with(addr, state, &[])
}

fn meta_with(addr: &str, state: &Path, more: &[&str]) -> Server {
    let mut args =
        vec!["meta-server", "--listen", addr, "--lease-ms", "1000", "--state-dir", state.to_str().unwrap()];
    args.extend_from_slice(more);
    Server::start(&args)
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + HANG;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A state directory on tmpfs, as the default one is.
fn state_dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("citronfs-test-state-").tempdir_in("/dev/shm").unwrap()
}

/// Writes the tree every restart test checks, each call returning before
/// the kill: files with bytes and fsync, a directory, a rename, a link,
/// a symlink, a chmod, an unlink.
fn make_tree(m: &TestMount) {
    std::fs::create_dir(m.path("dir")).unwrap();
    let mut f = std::fs::File::create(m.path("dir/big")).unwrap();
    let big: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
    f.write_all(&big).unwrap();
    f.sync_all().unwrap();
    std::fs::write(m.path("small"), b"small file").unwrap();
    std::fs::rename(m.path("small"), m.path("dir/renamed")).unwrap();
    std::fs::hard_link(m.path("dir/renamed"), m.path("linked")).unwrap();
    std::os::unix::fs::symlink("dir/renamed", m.path("sym")).unwrap();
    std::fs::set_permissions(m.path("dir/renamed"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::write(m.path("gone"), b"removed before the kill").unwrap();
    std::fs::remove_file(m.path("gone")).unwrap();
}

fn check_tree(m: &TestMount) {
    let big = std::fs::read(m.path("dir/big")).unwrap();
    assert_eq!(big.len(), 3 << 20);
    assert!(big.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "the bytes of dir/big");
    assert_eq!(std::fs::read(m.path("dir/renamed")).unwrap(), b"small file");
    let meta = std::fs::metadata(m.path("dir/renamed")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o640);
    assert_eq!(meta.nlink(), 2);
    assert_eq!(meta.ino(), std::fs::metadata(m.path("linked")).unwrap().ino());
    assert_eq!(std::fs::read_link(m.path("sym")).unwrap(), Path::new("dir/renamed"));
    assert!(!m.path("gone").exists());
    assert!(!m.path("small").exists());
    let mut names: Vec<_> = std::fs::read_dir(m.path("")).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["dir", "linked", "sym"]);
}

/// A mount that finds another file system answers EIO from when it
/// notices, and until then shows the old tree, never an empty one.
fn old_mount_fails_loudly(old: &TestMount) {
    wait_until("the old mount answers EIO", || match std::fs::read_dir(old.path("")) {
        Err(e) => {
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
            true
        }
        Ok(entries) => {
            let names: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
            assert!(names.iter().any(|n| n == "dir"), "the old mount shows another tree: {names:?}");
            false
        }
    });
}

/// A cluster on state directory `state` with the tree of [`make_tree`]
/// written through a mount.
struct Written {
    addr: String,
    meta: Server,
    data: Server,
    mount: TestMount,
}

fn written(state: &Path) -> Written {
    let addr = format!("127.0.0.1:{}", free_port());
    let meta = meta(&addr, state);
    let data = Server::start(&["data-server", "--meta", &addr, "--capacity", "64MiB"]);
    let mount = TestMount::new(addr.parse().unwrap());
    make_tree(&mount);
    Written { addr, meta, data, mount }
}

fn restart_keeps_the_file_system(sig: i32) {
    let state = state_dir();
    let Written { addr, meta: server, data: _data, mount: old } = written(state.path());
    server.stop(sig);
    let _server = meta(&addr, state.path());

    // The mount that was up goes on, without remounting (its calls waited
    // while the meta-server was away).
    check_tree(&old);
    let new = TestMount::new(addr.parse().unwrap());
    check_tree(&new);
    // The data server was linked again: new files get space.
    std::fs::write(new.path("after"), vec![9u8; 100_000]).unwrap();
    assert_eq!(std::fs::read(old.path("after")).unwrap(), vec![9u8; 100_000]);
    std::fs::write(old.path("after-old"), b"from the old mount").unwrap();
    assert_eq!(std::fs::read(new.path("after-old")).unwrap(), b"from the old mount");
}

/// `fcntl(fd, cmd, ...)` with a flock of `typ` over `[start, start+len)`;
/// the flock as the call left it, or the errno.
fn ofd_lock(fd: &std::fs::File, cmd: i32, typ: i32, start: i64, len: i64) -> Result<libc::flock, i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero flock is valid; the struct outlives the call.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: fcntl on an open descriptor with a valid flock.
    match unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &mut fl as *mut libc::flock) } {
        0 => Ok(fl),
        _ => Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)),
    }
}

/// Two mounts of one cluster, a file open on each, a lock held on one and
/// a waiter blocked on the other; the meta-server is killed with `sig` and
/// started again. The lock is still held (a conflicting request is refused,
/// F_OFD_GETLK names it), the open files go on (write, fsync, read across
/// the mounts), and the waiter is granted when the lock goes.
fn opens_and_locks_ride_through(sig: i32, shm: bool) {
    let _ = env_logger::builder().is_test(true).try_init();
    let state = state_dir();
    let addr = format!("127.0.0.1:{}", free_port());
    let shm_name = format!("restart{}", addr.rsplit(':').next().unwrap());
    let shm_args: Vec<&str> = if shm { vec!["--shm", &shm_name] } else { Vec::new() };
    let server = meta_with(&addr, state.path(), &shm_args);
    let _data = Server::start(&["data-server", "--meta", &addr, "--capacity", "64MiB"]);
    // The restarted meta-server: declared before the mounts, so it stops
    // after them.
    let mut restarted = None;
    let (a, b) = (TestMount::new(addr.parse().unwrap()), TestMount::new(addr.parse().unwrap()));
    std::fs::write(a.path("f"), vec![1u8; 4096]).unwrap();
    let open = |m: &TestMount| std::fs::OpenOptions::new().read(true).write(true).open(m.path("f")).unwrap();
    let (held, refused, waiting) = (open(&a), open(&b), open(&b));
    ofd_lock(&held, libc::F_OFD_SETLK, libc::F_WRLCK, 0, 100).expect("the lock is free");
    assert_eq!(ofd_lock(&refused, libc::F_OFD_SETLK, libc::F_WRLCK, 50, 1).unwrap_err(), libc::EAGAIN);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| ofd_lock(&waiting, libc::F_OFD_SETLKW, libc::F_WRLCK, 60, 1));
        let ino = Ino(std::fs::metadata(a.path("f")).unwrap().ino());
        let blocked = || b.client.lock_records(ino).unwrap().iter().any(|r| r.state == RecordState::Waiting);
        wait_until("the waiter is blocked", blocked);

        server.stop(sig);
        restarted = Some(meta_with(&addr, state.path(), &shm_args));
        // A failed check must not leave the waiter blocked (the scope would
        // wait for it forever): the lock goes whatever happens.
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Held across the restart: refused to the other mount, and named.
            assert_eq!(
                ofd_lock(&refused, libc::F_OFD_SETLK, libc::F_WRLCK, 50, 1).unwrap_err(),
                libc::EAGAIN
            );
            let seen = ofd_lock(&refused, libc::F_OFD_GETLK, libc::F_WRLCK, 50, 1).unwrap();
            assert_eq!((seen.l_type, seen.l_start, seen.l_len), (libc::F_WRLCK as i16, 0, 100));
            assert!(!waiter.is_finished(), "the waiter must not get a lock that is held");
            // The open files go on.
            use std::os::unix::fs::FileExt;
            held.write_all_at(b"after the restart", 10).unwrap();
            held.sync_all().unwrap();
            let mut back = [0u8; 17];
            refused.read_exact_at(&mut back, 10).unwrap();
            assert_eq!(&back, b"after the restart");
        }));
        // The lock goes; the waiter blocked across the restart gets it.
        let unlocked = ofd_lock(&held, libc::F_OFD_SETLK, libc::F_UNLCK, 0, 0);
        let granted = waiter.join().unwrap();
        if let Err(panic) = checked {
            std::panic::resume_unwind(panic);
        }
        unlocked.expect("unlock");
        assert!(granted.is_ok(), "the waiter is granted: {granted:?}");
        let seen = ofd_lock(&held, libc::F_OFD_GETLK, libc::F_WRLCK, 0, 0).unwrap();
        assert_eq!((seen.l_type, seen.l_start, seen.l_len), (libc::F_WRLCK as i16, 60, 1));
    });
}

/// Changes on their way back when the meta-server is killed: applied and
/// durable, their answers never sent (a test hook of the meta-server holds
/// them). The mount sends them again to the restarted meta-server, which
/// answers each as it was applied, once: the unlink returns 0 (not ENOENT,
/// as a second unlink would, nor EIO), the exclusive create returns its new
/// file open (not EEXIST), the mkdir returns 0 (not EEXIST).
#[test]
fn changes_answered_as_the_meta_server_died_are_applied_once() {
    let _ = env_logger::builder().is_test(true).try_init();
    let state = state_dir();
    let marks = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let hold = format!("Unlink,CreateOpen,Create:{}", marks.path().display());
    let args = [
        "meta-server",
        "--listen",
        &addr,
        "--lease-ms",
        "1000",
        "--state-dir",
        state.path().to_str().unwrap(),
    ];
    let server = Server::start_with(&args, &[("CITRONFS_TEST_HOLD_ANSWERS", &hold)]);
    let _data = Server::start(&["data-server", "--meta", &addr, "--capacity", "64MiB"]);
    let mut restarted = None;
    let m = TestMount::new(addr.parse().unwrap());
    // In three directories: the kernel holds a directory's lock through a
    // change of its entries.
    for dir in ["a", "b", "c"] {
        std::fs::create_dir(m.path(dir)).unwrap();
    }
    std::fs::write(m.path("a/doomed"), b"x").unwrap();
    std::fs::write(marks.path().join("hold"), b"").unwrap();
    std::thread::scope(|s| {
        let unlink = s.spawn(|| std::fs::remove_file(m.path("a/doomed")));
        let create = s.spawn(|| {
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(m.path("b/new"))
        });
        let mkdir = s.spawn(|| std::fs::create_dir(m.path("c/dir")));
        let held = |kind: &str| marks.path().join(kind).exists();
        for kind in ["Unlink", "CreateOpen", "Create"] {
            wait_until(&format!("{kind} applied"), || held(kind));
        }
        server.stop(libc::SIGKILL);
        restarted = Some(meta(&addr, state.path()));
        unlink.join().unwrap().expect("the unlink applied before the kill returns 0");
        mkdir.join().unwrap().expect("the mkdir applied before the kill returns 0");
        let mut new = create.join().unwrap().expect("the create applied before the kill returns the file");
        new.write_all(b"written through the open the create returned").unwrap();
        new.sync_all().unwrap();
    });
    assert!(std::fs::read_dir(m.path("a")).unwrap().next().is_none(), "unlinked");
    assert_eq!(std::fs::read(m.path("b/new")).unwrap(), b"written through the open the create returned");
    assert!(std::fs::metadata(m.path("c/dir")).unwrap().is_dir());
}

/// SQLite from four processes on two mounts while the meta-server and then
/// the data server (which keeps its memory in a data directory) are killed
/// with SIGKILL and started again: no writer sees an error, every committed
/// row is there, and the database passes its integrity check.
#[test]
fn sqlite_rides_through_kills_of_the_meta_server_and_the_data_server() {
    let state = state_dir();
    let data_dir = state_dir();
    let addr = format!("127.0.0.1:{}", free_port());
    let data_args = [
        "data-server",
        "--meta",
        &addr,
        "--capacity",
        "64MiB",
        "--data-dir",
        data_dir.path().to_str().unwrap(),
    ];
    let meta_server = meta(&addr, state.path());
    let data_server = Server::start(&data_args);
    let mut restarted = Vec::new();
    let (a, b) = (TestMount::new(addr.parse().unwrap()), TestMount::new(addr.parse().unwrap()));
    let writers = SqliteWriters::start(&a, &b, 150);
    wait_until("the writers commit", || writers.rows(&a) >= 100);
    meta_server.stop(libc::SIGKILL);
    restarted.push(meta(&addr, state.path()));
    let after_meta = writers.rows(&b);
    wait_until("the writers commit after the meta-server's restart", || writers.rows(&b) >= after_meta + 100);
    data_server.stop(libc::SIGKILL);
    restarted.push(Server::start(&data_args));
    writers.finish(&a);
}

/// A caching mount answers creates in a directory delegated to it before
/// it sends them, with inodes the meta-server lent it. Those loans are
/// journaled: creates still queued when the meta-server is killed land in
/// the restarted one, as the mount showed them.
#[test]
fn creates_answered_before_they_were_sent_land_after_a_restart() {
    let state = state_dir();
    let addr = format!("127.0.0.1:{}", free_port());
    let server = meta(&addr, state.path());
    let _data = Server::start(&["data-server", "--meta", &addr, "--capacity", "64MiB"]);
    let restarted;
    let mut config = ClientConfig::new(addr.parse().unwrap());
    // The creates wait in the mount until a call sends them.
    (config.late_linger, config.release_linger) = (HANG, HANG);
    let options = MountOptions { cache_ttl: HANG, ..MountOptions::default() };
    let a = TestMount::with_config_and_options(config, options);
    std::fs::create_dir(a.path("d")).unwrap();
    let made: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
    for name in &made {
        drop(std::fs::File::create(a.path(&format!("d/{name}"))).unwrap());
    }
    assert!(a.client.queued_changes() > 0, "the creates were sent at once: nothing to carry");
    server.stop(libc::SIGKILL);
    restarted = meta(&addr, state.path());
    a.client.flush_late_changes();
    assert_eq!(a.client.late_change_failures(), 0, "a create answered before the restart was refused");
    let b = TestMount::new(addr.parse().unwrap());
    let mut names: Vec<String> = std::fs::read_dir(b.path("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want = made.clone();
    want.sort();
    assert_eq!(names, want);
    let inode = |m: &TestMount| std::fs::metadata(m.path("d/f7")).unwrap().ino();
    assert_eq!(inode(&a), inode(&b), "made as the mount showed it");
    drop((a, b, restarted));
}

#[test]
fn opens_and_locks_ride_through_a_sigkill_on_tcp() {
    opens_and_locks_ride_through(libc::SIGKILL, false);
}

#[test]
fn opens_and_locks_ride_through_a_sigkill_on_shm() {
    opens_and_locks_ride_through(libc::SIGKILL, true);
}

#[test]
fn opens_and_locks_ride_through_a_sigterm() {
    opens_and_locks_ride_through(libc::SIGTERM, false);
}

#[test]
fn sigterm_of_the_meta_server_keeps_the_file_system() {
    restart_keeps_the_file_system(libc::SIGTERM);
}

#[test]
fn sigkill_of_the_meta_server_keeps_the_file_system() {
    restart_keeps_the_file_system(libc::SIGKILL);
}

/// The last segment of the journal (the one written before the kill).
fn last_segment(state: &Path) -> std::path::PathBuf {
    let mut segments: Vec<_> = std::fs::read_dir(state)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("journal-"))
        .filter(|p| std::fs::metadata(p).unwrap().len() > 0)
        .collect();
    segments.sort();
    segments.pop().expect("a journal segment with records")
}

#[test]
fn a_torn_tail_is_replayed_up_to_its_last_whole_record() {
    let state = state_dir();
    let Written { addr, meta: server, data: _data, mount } = written(state.path());
    drop(mount);
    server.stop(libc::SIGKILL);
    // A crash in the middle of an append: a header and half a payload.
    let mut f = std::fs::OpenOptions::new().append(true).open(last_segment(state.path())).unwrap();
    f.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    drop(f);
    let _server = meta(&addr, state.path());
    check_tree(&TestMount::new(addr.parse().unwrap()));
}

#[test]
fn damage_in_the_middle_of_the_journal_stops_the_start() {
    let state = state_dir();
    let Written { addr, meta: server, data: _data, mount } = written(state.path());
    drop(mount);
    server.stop(libc::SIGKILL);
    let segment = last_segment(state.path());
    let mut bytes = std::fs::read(&segment).unwrap();
    // A byte of the first record's payload: records follow it.
    bytes[10] ^= 0xff;
    std::fs::write(&segment, &bytes).unwrap();
    let out = Command::new(EXE)
        .args(["meta-server", "--listen", &addr, "--state-dir", state.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a damaged journal must stop the start");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(segment.file_name().unwrap().to_str().unwrap())
            && stderr.contains("damaged record at byte 0"),
        "the error names the file and offset: {stderr}"
    );
}

#[test]
fn a_mount_that_finds_another_file_system_answers_eio() {
    let state = state_dir();
    let Written { addr, meta: server, data: _data, mount: old } = written(state.path());
    server.stop(libc::SIGKILL);
    // Another, empty file system at the same address.
    let other = state_dir();
    let _server = meta(&addr, other.path());
    old_mount_fails_loudly(&old);
    let e = std::fs::read(old.path("dir/renamed")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
}

/// A file system kept on persistent directories (a disk here): every
/// process stopped, all started again as after a reboot, and the file
/// system is whole, its bytes included.
#[test]
fn state_and_data_on_persistent_directories_survive_stopping_everything() {
    let disk = tempfile::tempdir().unwrap();
    let (state, data) = (disk.path().join("state"), disk.path().join("data"));
    let addr = format!("127.0.0.1:{}", free_port());
    let data_args =
        ["data-server", "--meta", &addr, "--capacity", "64MiB", "--data-dir", data.to_str().unwrap()];
    let meta_server = meta(&addr, &state);
    let data_server = Server::start(&data_args);
    let m = TestMount::new(addr.parse().unwrap());
    make_tree(&m);
    drop(m);
    data_server.stop(libc::SIGTERM);
    meta_server.stop(libc::SIGTERM);

    let _meta = meta(&addr, &state);
    let _data = Server::start(&data_args);
    let m = TestMount::new(addr.parse().unwrap());
    check_tree(&m);
    std::fs::write(m.path("after"), b"written after the reboot").unwrap();
    assert_eq!(std::fs::read(m.path("after")).unwrap(), b"written after the reboot");
}

/// A data server whose memory belongs to another file system (its data
/// directory names another identity) is refused, with why.
#[test]
fn a_data_server_of_another_file_system_is_refused() {
    let data = state_dir();
    let addr = format!("127.0.0.1:{}", free_port());
    let data_args =
        ["data-server", "--meta", &addr, "--capacity", "64MiB", "--data-dir", data.path().to_str().unwrap()];
    let first = state_dir();
    let meta_server = meta(&addr, first.path());
    let data_server = Server::start(&data_args);
    data_server.stop(libc::SIGKILL);
    meta_server.stop(libc::SIGKILL);
    // Another, empty file system at the same address.
    let other = state_dir();
    let _meta = meta(&addr, other.path());
    let out = Command::new(EXE).args(data_args).output().unwrap();
    assert!(!out.status.success(), "a data server of another file system must not join");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("belongs to file system"), "{stderr}");
}
