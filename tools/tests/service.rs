//! CitronFS run as a service, as an operator
//! meets it: mount(8) and fstab, a detached mount, systemd readiness,
//! SIGTERM and SIGKILL of every process, and what they leave behind.
//!
//! Nothing here changes the system for good: the mount helper is put in
//! `/sbin` only inside a private mount namespace (an overlay over
//! `/usr/sbin` that vanishes with it), fstab is a temporary file given to
//! `mount -T`, and every fabric, mount and process is the test's own.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use citronfs_tests::TestCluster;

const EXE: &str = env!("CARGO_BIN_EXE_citronfs");
/// Guards against hangs only; nothing here is timed.
const HANG: Duration = Duration::from_secs(60);

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn mounted_at(dir: &Path) -> Option<String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let target = dir.to_str().unwrap();
    mountinfo
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(target))
        .map(|l| l.split(" - ").nth(1).unwrap_or_default().to_string())
        .next_back()
}

/// Pids of the processes whose command line mentions `needle`.
fn pids_with(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // A zombie waits for its reaper; it has exited.
            let zombie = state.rsplit(')').next().is_some_and(|s| s.trim_start().starts_with('Z'));
            !zombie && String::from_utf8_lossy(&cmdline).contains(needle)
        })
        .collect()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + HANG;
    while !done() {
        assert!(Instant::now() < deadline, "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + HANG;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("process {} did not exit", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process of this test.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

fn fabric(name: &str) -> PathBuf {
    citron_lock::rdma::shm::fabric_dir(name)
}

/// A mount point that is unmounted (lazily) and whose daemons are killed
/// on drop, whatever the test did.
struct MountDir {
    dir: tempfile::TempDir,
}

impl MountDir {
    fn new() -> Self {
        Self { dir: tempfile::tempdir().unwrap() }
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for MountDir {
    fn drop(&mut self) {
        for pid in pids_with(self.path().to_str().unwrap()) {
            // SAFETY: our own daemons.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = Command::new("umount").arg("-l").arg(self.path()).output();
    }
}

/// A process of the test, killed if the test ends before it does.
struct Proc(Child);

impl std::ops::Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(command: &mut Command) -> Proc {
    Proc(command.spawn().unwrap_or_else(|e| panic!("cannot start {command:?}: {e}")))
}

/// Starts a server (`citronfs meta-server|data-server ...`) and returns it
/// with the first line it printed (its stderr goes to the test's).
fn start_server(args: &[&str]) -> (Proc, String) {
    let mut child = spawn(Command::new(EXE).args(args).stdout(Stdio::piped()));
    let line = BufReader::new(child.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    (child, line)
}

fn meta_addr(line: &str) -> String {
    // "meta-server listening on 127.0.0.1:PORT (nic ...)"
    line.split_whitespace().nth(3).unwrap_or_else(|| panic!("{line}")).to_string()
}

/// `mount -t fuse.citronfs` and an fstab line run `/sbin/mount.fuse.citronfs`
/// (the citronfs binary by that name); `umount` ends the daemon; options
/// reach the mount and a bad one fails the mount with its name.
#[test]
fn mount8_with_an_fstab_line_then_umount() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr().to_string();
    let here = cluster.mount();
    let staging = tempfile::tempdir().unwrap();
    let helpers = staging.path().join("sbin");
    std::fs::create_dir(&helpers).unwrap();
    std::os::unix::fs::symlink(EXE, helpers.join("mount.fuse.citronfs")).unwrap();

    // A private mount namespace whose /usr/sbin (= /sbin) also holds the helper.
    let script = format!(
        "mount -t overlay overlay -o lowerdir={}:/usr/sbin /usr/sbin && echo ready && exec sleep 600",
        helpers.display()
    );
    let mut ns = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    struct Namespace(Child);
    impl Drop for Namespace {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let ready = BufReader::new(ns.stdout.take().unwrap()).lines().next();
    let ns = Namespace(ns);
    assert_eq!(
        ready.and_then(Result::ok).as_deref(),
        Some("ready"),
        "cannot set up a mount namespace with the helper"
    );
    let inside = |args: &[&str]| -> Output {
        Command::new("nsenter")
            .arg("-t")
            .arg(ns.0.id().to_string())
            .arg("-m")
            .arg("--")
            .args(args)
            .output()
            .unwrap()
    };

    let dir = MountDir::new();
    let d = dir.path().to_str().unwrap();
    let fstab = staging.path().join("fstab");
    std::fs::write(&fstab, format!("# test fstab\n{meta}  {d}  fuse.citronfs  _netdev,nofail,attr-ttl=1,nosuid,x-systemd.automount  0  0\n")).unwrap();
    let fstab = fstab.to_str().unwrap();

    let out = inside(&["mount", "-T", fstab, d]);
    assert!(out.status.success(), "mount -T: {}", text(&out));
    let out = inside(&["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", d]);
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        shown.starts_with(&meta) && shown.contains("fuse.citronfs") && shown.contains("nosuid"),
        "{shown}"
    );
    // mount -a knows it is mounted (the source is the fstab spec).
    let out = inside(&["mount", "-a", "-T", fstab]);
    assert!(out.status.success(), "mount -a: {}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&inside(&["findmnt", "-n", "-o", "TARGET", d]).stdout).lines().count(),
        1
    );
    // The same file system as every other mount of the cluster.
    let out = inside(&["sh", "-c", &format!("echo through-mount8 > {d}/f")]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read_to_string(here.path("f")).unwrap(), "through-mount8\n");
    std::fs::write(here.path("g"), "from the other mount").unwrap();
    assert_eq!(String::from_utf8_lossy(&inside(&["cat", &format!("{d}/g")]).stdout), "from the other mount");

    let out = inside(&["umount", d]);
    assert!(out.status.success(), "umount: {}", text(&out));
    assert!(inside(&["findmnt", d]).stdout.is_empty(), "still mounted");
    wait_until("the daemon exits after umount", || pids_with(d).is_empty());

    // mount -t with options on the command line; a bad option is named.
    let out = inside(&["mount", "-t", "fuse.citronfs", &meta, d, "-o", "attr-ttl=0,colour=blue"]);
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("colour") && !err.contains("panicked"), "{err}");
    let out =
        inside(&["mount", "-t", "fuse.citronfs", &meta, d, "-o", "key-file=/nonexistent/key,attr-ttl=1"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/key"), "{}", text(&out));
    let out = inside(&["mount", "-t", "fuse.citronfs", &meta, d, "-o", "attr-ttl=1,ro"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = inside(&["sh", "-c", &format!("echo x > {d}/h")]);
    assert!(!out.status.success(), "a read-only mount took a write");
    assert!(inside(&["umount", d]).status.success());
    wait_until("the daemon exits after umount", || pids_with(d).is_empty());
}

/// A detached mount: the command returns once the file system is mounted
/// (exit 0), without keeping the caller's output open, logs to syslog, and
/// exits when unmounted; failures before and after the fork come back as a
/// non-zero exit with one line of reason.
#[test]
fn a_detached_mount_reports_readiness_and_failures() {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr().to_string();
    let here = cluster.mount();
    let logs = tempfile::tempdir().unwrap();
    let syslog = logs.path().join("log");
    let sock = UnixDatagram::bind(&syslog).unwrap();
    sock.set_read_timeout(Some(HANG)).unwrap();

    let dir = MountDir::new();
    // `output()` reads to the end: it returns only if the daemon let go of
    // our pipes.
    let out = Command::new(EXE)
        .args(["mount", "--meta", &meta, "-o", "attr-ttl=0"])
        .arg(dir.path())
        .env("CITRONFS_SYSLOG_SOCKET", &syslog)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("mounted at"), "{}", text(&out));
    assert!(
        mounted_at(dir.path()).is_some_and(|t| t.starts_with("fuse.citronfs")),
        "not mounted when the command returned"
    );
    std::fs::write(dir.path().join("f"), "detached").unwrap();
    assert_eq!(std::fs::read_to_string(here.path("f")).unwrap(), "detached");
    let pids = pids_with(dir.path().to_str().unwrap());
    assert_eq!(pids.len(), 1, "one daemon: {pids:?}");
    let mut buf = vec![0u8; 4096];
    let mut logged = String::new();
    while !logged.contains("mounted at") {
        let n = sock.recv(&mut buf).expect("the daemon logs to syslog");
        logged += &String::from_utf8_lossy(&buf[..n]);
    }
    assert!(logged.contains("citronfs["), "{logged}");

    let out = Command::new("umount").arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    wait_until("the daemon exits after umount", || pids_with(dir.path().to_str().unwrap()).is_empty());
    assert!(mounted_at(dir.path()).is_none());

    // Refused before detaching: an unknown option.
    let out = Command::new(EXE)
        .args(["mount", "--meta", &meta, "-o", "attr-ttl=1,colour=blue"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("colour") && err.trim().lines().count() == 1, "{err}");
    // Failed in the daemon: nobody serves this cluster.
    let out = Command::new(EXE)
        .args(["mount", "--meta", "127.0.0.1:1", "--timeout", "2"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot") && err.contains("127.0.0.1:1"), "{err}");
    assert!(mounted_at(dir.path()).is_none());
    wait_until("the failed daemon exits", || pids_with(dir.path().to_str().unwrap()).is_empty());
}

/// `Type=notify`: the servers send READY=1 to `$NOTIFY_SOCKET` once they
/// serve, and STOPPING=1 on SIGTERM.
#[test]
fn servers_notify_readiness_to_the_service_manager() {
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(HANG)).unwrap();
    let recv = || {
        let mut buf = vec![0u8; 4096];
        let n = sock.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).to_string()
    };
    let mut meta = spawn(
        Command::new(EXE)
            .args(["meta-server", "--listen", "127.0.0.1:0"])
            .env("NOTIFY_SOCKET", &notify)
            .stdout(Stdio::piped()),
    );
    let line = BufReader::new(meta.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    let ready = recv();
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready}");
    let addr = meta_addr(&line);
    // Ready means serving: a data server registers with it at once.
    let mut data = spawn(
        Command::new(EXE)
            .args(["data-server", "--meta", &addr, "--capacity", "16MiB"])
            .env("NOTIFY_SOCKET", &notify)
            .stdout(Stdio::null()),
    );
    let ready = recv();
    assert!(ready.lines().any(|l| l == "READY=1") && ready.contains("data server"), "{ready}");
    for child in [&mut data, &mut meta] {
        signal(child.id() as i32, libc::SIGTERM);
        assert!(recv().contains("STOPPING=1"));
        assert!(wait_exit(child).success());
    }
}

/// SIGTERM of each process: a meta-server, a data server, a detached
/// mount and an embedded mount exit 0, their shm regions are gone and no
/// mount point is left behind.
#[test]
fn sigterm_of_each_process_leaves_no_region_and_no_stale_mount() {
    let tag = std::process::id();
    let (meta_name, data_name) = (format!("svc-meta-{tag}"), format!("svc-data-{tag}"));
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0", "--shm", &meta_name]);
    let addr = meta_addr(&line);
    let (mut data, _) = start_server(&[
        "data-server",
        "--meta",
        &addr,
        "--capacity",
        "16MiB",
        "--shm",
        &data_name,
        "--ephemeral",
    ]);
    assert!(fabric(&meta_name).exists() && fabric(&data_name).exists());

    let joined = MountDir::new();
    let out = Command::new(EXE).args(["mount", "--meta", &addr]).arg(joined.path()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let embedded = MountDir::new();
    let out = Command::new(EXE).args(["mount", "--capacity", "16MiB"]).arg(embedded.path()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    std::fs::write(joined.path().join("f"), "x").unwrap();
    std::fs::write(embedded.path().join("f"), "y").unwrap();
    let embedded_pid = pids_with(embedded.path().to_str().unwrap())[0];
    let embedded_fabrics = [fabric(&format!("{embedded_pid}-meta")), fabric(&format!("{embedded_pid}-data"))];
    assert!(embedded_fabrics.iter().all(|f| f.exists()));

    // A mount with an open file (a busy mount point) as well.
    let open = std::fs::File::open(joined.path().join("f")).unwrap();
    for dir in [&joined, &embedded] {
        let d = dir.path().to_str().unwrap();
        signal(pids_with(d)[0], libc::SIGTERM);
        wait_until("the mount daemon exits on SIGTERM", || pids_with(d).is_empty());
        assert!(mounted_at(dir.path()).is_none(), "stale mount at {d}");
    }
    drop(open);
    assert!(embedded_fabrics.iter().all(|f| !f.exists()), "the embedded servers' regions are left");
    for (child, name) in [(&mut data, &data_name), (&mut meta, &meta_name)] {
        signal(child.id() as i32, libc::SIGTERM);
        assert!(wait_exit(child).success());
        assert!(!fabric(name).exists(), "{name} left behind");
    }
}

/// SIGKILL of a mount (with its embedded servers) and of both servers
/// leaves their regions; the next citronfs start removes them, and
/// `citronfs regions` shows them orphaned until then.
#[test]
fn after_sigkill_the_next_start_removes_the_orphaned_regions() {
    let tag = std::process::id();
    let (meta_name, data_name) = (format!("kill-meta-{tag}"), format!("kill-data-{tag}"));
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0", "--shm", &meta_name]);
    let addr = meta_addr(&line);
    let (mut data, _) = start_server(&[
        "data-server",
        "--meta",
        &addr,
        "--capacity",
        "16MiB",
        "--shm",
        &data_name,
        "--ephemeral",
    ]);
    let dir = MountDir::new();
    let mut mount = spawn(
        Command::new(EXE)
            .args(["mount", "--foreground", "--capacity", "16MiB"])
            .arg(dir.path())
            .stdout(Stdio::piped()),
    );
    let first = BufReader::new(mount.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    assert!(first.contains("mounted at"), "{first}");
    let pid = mount.id();
    // Other tests start citronfs processes meanwhile, and every start
    // sweeps: hold sweepers off (the host-wide lock, shared) while we look
    // at the orphans.
    let sweeps = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open("/dev/shm/citronfs.lock")
        .unwrap();
    // SAFETY: flock on a descriptor we hold open.
    assert_eq!(unsafe { libc::flock(sweeps.as_raw_fd(), libc::LOCK_SH) }, 0);
    let mut orphans = vec![
        fabric(&meta_name),
        fabric(&data_name),
        fabric(&format!("{pid}-meta")),
        fabric(&format!("{pid}-data")),
    ];
    for child in [&mut mount, &mut data, &mut meta] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let _ = Command::new("umount").arg("-l").arg(dir.path()).output();
    assert!(orphans.iter().all(|f| f.exists()), "SIGKILL leaves the regions (RAM until reboot)");
    let out = Command::new(EXE).args(["regions", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for name in [&meta_name, &data_name] {
        let entry = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["fabric"] == name.as_str())
            .unwrap_or_else(|| panic!("{name} not listed"));
        assert_eq!(entry["state"], "orphaned", "{entry}");
    }

    drop(sweeps);
    // The next start: a server of its own (which must not be swept).
    let live = format!("kill-next-{tag}");
    let (mut next, _) = start_server(&["meta-server", "--listen", "127.0.0.1:0", "--shm", &live]);
    for f in &orphans {
        assert!(!f.exists(), "{} survived the next start", f.display());
    }
    let out = Command::new(EXE).args(["regions", "--json"]).output().unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["fabric"] == live.as_str())
        .expect("the live server is listed");
    assert_eq!(entry["state"], "live");
    assert_eq!(entry["pid"], next.id());
    signal(next.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut next).success());
    orphans.push(fabric(&live));
    assert!(orphans.iter().all(|f| !f.exists()));
}

/// SIGTERM of a mount while a process on it waits in F_SETLKW: the waiter
/// gets an error instead of hanging, the daemon exits, and the (busy)
/// mount point is not left behind.
#[test]
fn sigterm_with_a_blocked_setlkw_waiter() {
    mount_ends_with_a_blocked_setlkw_waiter(|daemon, _| signal(daemon, libc::SIGTERM));
}

/// The same with a lazy unmount (`umount -l`) from outside: the daemon stops
/// serving too, instead of waiting for the open files to close.
#[test]
fn lazy_unmount_with_a_blocked_setlkw_waiter() {
    mount_ends_with_a_blocked_setlkw_waiter(|_, dir| {
        let out = Command::new("umount").arg("-l").arg(dir).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
    });
}

/// A mount daemon with a process of its mount blocked in F_SETLKW on a lock
/// held through another mount, ended by `end(daemon pid, mount point)`.
fn mount_ends_with_a_blocked_setlkw_waiter(end: impl FnOnce(i32, &Path)) {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr().to_string();
    let holder = cluster.mount();
    std::fs::write(holder.path("f"), b"x").unwrap();
    let held = std::fs::OpenOptions::new().read(true).write(true).open(holder.path("f")).unwrap();
    let lock = |fd: i32, cmd: i32, typ: i32| {
        // SAFETY: an all-zero flock is valid; the struct outlives the call.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        // SAFETY: fcntl on an open descriptor with a valid flock.
        let r = unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    lock(held.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK).unwrap();

    let dir = MountDir::new();
    let mut daemon = spawn(
        Command::new(EXE)
            .args(["mount", "--foreground", "--meta", &meta])
            .arg(dir.path())
            .stdout(Stdio::piped()),
    );
    let mut out = daemon.stdout.take().unwrap();
    let mut first = [0u8; 10];
    out.read_exact(&mut first).unwrap();
    let path = dir.path().join("f");
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        tx.send(()).unwrap();
        let r = lock(f.as_raw_fd(), libc::F_SETLKW, libc::F_WRLCK);
        drop(f);
        r
    });
    rx.recv().unwrap();
    // Wait until the request is registered as a waiter, cluster-wide.
    wait_until("the waiter is registered", || {
        let out = Command::new(EXE).arg("locks").arg(holder.path("f")).output().unwrap();
        String::from_utf8_lossy(&out.stdout).contains("waiting")
    });
    end(daemon.id() as i32, dir.path());
    let status = wait_exit(&mut daemon);
    assert!(status.success(), "{status}");
    let deadline = Instant::now() + HANG;
    while !waiter.is_finished() {
        assert!(Instant::now() < deadline, "the F_SETLKW waiter hangs after its mount went away");
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = waiter.join().unwrap().expect_err("the waiter must not be granted by a mount that went away");
    assert!(e.raw_os_error().is_some(), "{e}");
    assert!(mounted_at(dir.path()).is_none(), "stale mount");
    // The cluster forgets the waiter (the mount said it leaves); the
    // holder's lock is untouched.
    wait_until("the departed mount's wait is removed", || {
        let out = Command::new(EXE).arg("locks").arg(holder.path("f")).output().unwrap();
        !String::from_utf8_lossy(&out.stdout).contains("waiting")
    });
    let out = Command::new(EXE).arg("locks").arg(holder.path("f")).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("held"));
}

/// SIGTERM of a data server whose memory is not kept: it leaves the
/// cluster; files whose data it held answer EIO (promptly, not after a
/// hang) and keep their names; a data server that joins later takes new
/// files.
#[test]
fn a_data_server_that_leaves_makes_its_files_answer_eio() {
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0"]);
    let addr = meta_addr(&line);
    let (mut data, _) = start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB", "--ephemeral"]);
    let mount = citronfs_tests::TestMount::new(addr.parse().unwrap());
    std::fs::write(mount.path("lost"), vec![7u8; 100_000]).unwrap();
    let open = std::fs::File::open(mount.path("lost")).unwrap();
    signal(data.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut data).success());

    let mut buf = vec![0u8; 4096];
    let e = std::os::unix::fs::FileExt::read_at(&open, &mut buf, 0).expect_err("data of a departed server");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let e = std::fs::read(mount.path("lost")).expect_err("data of a departed server");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert_eq!(std::fs::metadata(mount.path("lost")).unwrap().len(), 100_000, "the namespace stays");

    let (mut data2, _) = start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB"]);
    std::fs::write(mount.path("new"), b"on the new server").unwrap();
    assert_eq!(std::fs::read(mount.path("new")).unwrap(), b"on the new server");
    assert!(std::fs::read(mount.path("lost")).is_err());
    std::fs::remove_file(mount.path("lost")).unwrap();
    drop(open);
    drop(mount);
    for child in [&mut data2, &mut meta] {
        signal(child.id() as i32, libc::SIGTERM);
        assert!(wait_exit(child).success());
    }
}

/// `citronfs install-units` into a staging root: both service units run
/// this binary, the settings file and the mount helper are there.
#[test]
fn install_units_into_a_staging_root() {
    let root = tempfile::tempdir().unwrap();
    let out = Command::new(EXE).args(["install-units", "--root"]).arg(root.path()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let exe = std::fs::canonicalize(EXE).unwrap();
    for unit in ["citronfs-meta-server.service", "citronfs-data-server.service"] {
        let text = std::fs::read_to_string(root.path().join("etc/systemd/system").join(unit)).unwrap();
        assert!(text.contains("Type=notify"), "{text}");
        assert!(text.contains(&format!("ExecStart={} ", exe.display())), "{text}");
    }
    assert!(root.path().join("etc/systemd/system/mnt-citron.mount.example").exists());
    assert!(std::fs::read_to_string(root.path().join("etc/default/citronfs"))
        .unwrap()
        .contains("CITRONFS_META_SERVER_ARGS"));
    assert_eq!(std::fs::read_link(root.path().join("sbin/mount.fuse.citronfs")).unwrap(), exe);
}

/// SIGKILL of a data server whose memory is not kept and which a mount
/// maps (shm): the meta-server finds it gone (its probes fail for a lease)
/// and the files whose data it held answer EIO instead of the dead
/// server's memory.
#[test]
fn a_crashed_data_server_is_found_and_its_files_answer_eio() {
    let tag = std::process::id();
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0", "--lease-ms", "1000"]);
    let addr = meta_addr(&line);
    let shm = format!("crash-data-{tag}");
    let (mut data, _) =
        start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB", "--shm", &shm, "--ephemeral"]);
    let mount = citronfs_tests::TestMount::new(addr.parse().unwrap());
    std::fs::write(mount.path("f"), b"in the dead server's memory").unwrap();
    data.kill().unwrap();
    data.wait().unwrap();
    wait_until("reads of the crashed server's file fail with EIO", || {
        std::fs::read(mount.path("f")).is_err_and(|e| e.raw_os_error() == Some(libc::EIO))
    });
    assert_eq!(std::fs::metadata(mount.path("f")).unwrap().len(), 27, "the namespace stays");
    drop(mount);
    signal(meta.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut meta).success());
}

/// A detached mount on a host without syslog (its socket missing) logs to
/// a file in the default log directory and prints which; an error that
/// reaches an application as EIO is in that log with its cause. Servers
/// log to their `--log-file`; a `--log-file` that cannot be written fails
/// the command on the caller's terminal.
#[test]
fn a_detached_mount_without_syslog_logs_to_the_file_it_printed() {
    let logs = tempfile::tempdir().unwrap();
    let meta_log = logs.path().join("servers/meta.log");
    let (mut meta, line) =
        start_server(&["meta-server", "--listen", "127.0.0.1:0", "--log-file", meta_log.to_str().unwrap()]);
    let addr = meta_addr(&line);
    let (mut data, _) = start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB"]);
    let default_dir = logs.path().join("default");

    let dir = MountDir::new();
    let out = Command::new(EXE)
        .args(["mount", "--meta", &addr])
        .arg(dir.path())
        .env("CITRONFS_SYSLOG_SOCKET", logs.path().join("no-syslog-here"))
        .env("CITRONFS_LOG_DIR", &default_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let printed = PathBuf::from(
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("log: "))
            .unwrap_or_else(|| panic!("no log line: {stdout}")),
    );
    assert_eq!(printed.parent(), Some(default_dir.as_path()), "{stdout}");
    let read_log = || std::fs::read_to_string(&printed).unwrap_or_default();
    assert!(read_log().contains("mounted at"), "{}", read_log());

    std::fs::write(dir.path().join("lost"), vec![7u8; 10_000]).unwrap();
    signal(data.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut data).success());
    let e = std::fs::read(dir.path().join("lost")).expect_err("data of a departed server");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    wait_until("the EIO's cause is in the mount's log", || {
        read_log().lines().any(|l| l.contains("WARN") && l.contains("EIO: ") && l.contains("data server"))
    });
    let meta_text = std::fs::read_to_string(&meta_log).unwrap();
    assert!(meta_text.contains("meta-server listening on"), "{meta_text}");
    assert!(meta_text.contains("data server 1 is gone"), "{meta_text}");

    let out = Command::new("umount").arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    wait_until("the daemon exits after umount", || pids_with(dir.path().to_str().unwrap()).is_empty());
    assert!(read_log().contains("unmount"), "the end is logged too: {}", read_log());

    // A log file that cannot be made fails the mount before it detaches.
    let out = Command::new(EXE)
        .args(["mount", "--meta", &addr, "--log-file", "/proc/citronfs/mount.log"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/proc/citronfs"), "{}", text(&out));
    assert!(mounted_at(dir.path()).is_none());

    signal(meta.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut meta).success());
}

/// `citronfs status` ends with a health line: a healthy cluster exits 0; a
/// cluster whose data server stopped, with a file's data on it, says so on
/// an unhealthy line (and in the JSON's `healthy` and `problems`) and exits
/// non-zero.
#[test]
fn status_says_what_is_wrong_and_exits_nonzero_when_unhealthy() {
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0"]);
    let addr = meta_addr(&line);
    let (mut data, _) = start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB"]);
    let mount = citronfs_tests::TestMount::new(addr.parse().unwrap());
    std::fs::write(mount.path("f"), vec![1u8; 10_000]).unwrap();
    let status = |json: bool| {
        let mut c = Command::new(EXE);
        c.args(["status", "--meta", &addr]);
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    // Healthy (a client's renewal may lag on a loaded machine: then ask
    // again; an unhealthy verdict that lasts fails the test).
    let mut last = None;
    wait_until("a healthy status", || {
        let out = status(false);
        let ok = out.status.success();
        last = Some(out);
        ok
    });
    let out = last.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.trim_end().lines().last().is_some_and(|l| l.starts_with("health: ok")), "{}", text(&out));

    signal(data.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut data).success());
    let out = status(false);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let health = stdout.trim_end().lines().last().unwrap_or_default();
    assert!(health.starts_with("health: UNHEALTHY"), "{}", text(&out));
    assert!(health.contains("no data server") && health.contains("1 files lost their data"), "{health}");
    let out = status(true);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["healthy"], false, "{doc:#}");
    assert_eq!(doc["problems"].as_array().map(Vec::len), Some(2), "{doc:#}");

    drop(mount);
    signal(meta.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut meta).success());
}

/// The id a data server printed at its start ("data server N exporting ...").
fn data_server_id(line: &str) -> u32 {
    line.strip_prefix("data server ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("not a data server's first line: {line}"))
}

/// Bytes that differ per file and per position.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u64).wrapping_mul(2654435761).wrapping_add(u64::from(seed)) as u8 ^ seed).collect()
}

/// A mount that reaches data servers over tcp and waits for one that does
/// not answer as long as the test guards against hangs.
fn patient_mount(meta: &str) -> citronfs_tests::TestMount {
    let mut config = citronfs_core::client::ClientConfig::new(meta.parse().unwrap());
    config.transport = citronfs_core::client::Transport::Tcp;
    config.timeout = HANG;
    citronfs_tests::TestMount::with_config(config)
}

fn write_synced(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

/// SIGKILL of a data server keeping its memory in a data directory while a
/// mount has written and fsync'ed files; a write into a file and a new
/// file's write issued while it is down. Restarted with the same
/// directory, it registers under the same id (at another port), the writes
/// that waited succeed, and the same mount, and a new one, read back every
/// byte.
#[test]
fn a_data_server_killed_and_restarted_with_its_data_dir_keeps_every_byte() {
    killed_and_restarted_with_its_data_dir(false);
}

/// The same in a cluster with keys: the restarted server's NIC is given
/// the grants of the files open on it again.
#[test]
fn a_keyed_data_server_killed_and_restarted_keeps_every_byte() {
    killed_and_restarted_with_its_data_dir(true);
}

fn killed_and_restarted_with_its_data_dir(keyed: bool) {
    let data_dir = tempfile::tempdir().unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("cluster.key");
    let mut key_args: Vec<String> = Vec::new();
    if keyed {
        let out = Command::new(EXE).args(["key", "new"]).arg(&key_file).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        key_args = vec!["--key-file".into(), key_file.to_str().unwrap().into()];
    }
    let key_args: Vec<&str> = key_args.iter().map(String::as_str).collect();
    let meta_args =
        [&["meta-server", "--listen", "127.0.0.1:0", "--lease-ms", "1000"][..], &key_args].concat();
    let (mut meta, line) = start_server(&meta_args);
    let addr = meta_addr(&line);
    let dir = data_dir.path().to_str().unwrap().to_string();
    let data_args =
        [&["data-server", "--meta", &addr, "--capacity", "16MiB", "--data-dir", &dir][..], &key_args]
            .concat();
    let start_data = || start_server(&data_args);
    let (mut data, first) = start_data();
    let id = data_server_id(&first);

    let key = keyed.then(|| citron_rpc::auth::Keyring::load(&key_file).unwrap().first().clone());
    let patient_mount = |addr: &str| {
        let mut config = citronfs_core::client::ClientConfig::new(addr.parse().unwrap());
        config.transport = citronfs_core::client::Transport::Tcp;
        config.timeout = HANG;
        config.key = key.clone();
        citronfs_tests::TestMount::with_config(config)
    };
    let mount = patient_mount(&addr);
    // One 1 MiB chunk and less, and a file over three chunks.
    let mut files: Vec<(String, Vec<u8>)> = [1usize, 10_000, 100_000, 2_500_000]
        .iter()
        .enumerate()
        .map(|(i, &len)| (format!("f{i}"), pattern(i as u8 + 1, len)))
        .collect();
    for (name, bytes) in &files {
        write_synced(&mount.path(name), bytes);
    }
    data.kill().unwrap();
    data.wait().unwrap();

    // Into bytes the file has (an extent it has): nothing to allocate.
    let target = mount.path("f3");
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let f = std::fs::OpenOptions::new().write(true).open(&target)?;
        std::os::unix::fs::FileExt::write_all_at(&f, b"written while the server was down", 1_500_000)?;
        f.sync_all()
    });
    // A new file: its extents are allocated on the server that is down.
    let created = mount.path("created while down");
    let new_bytes = pattern(42, 50_000);
    let creator = {
        let new_bytes = new_bytes.clone();
        std::thread::spawn(move || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&created)?;
            f.write_all(&new_bytes)?;
            f.sync_all()
        })
    };
    wait_until("both writes meet the dead data server", || mount.client.data_server_waits() >= 2);
    let (mut data, again) = start_data();
    assert_eq!(data_server_id(&again), id, "registered again under its identity: {again}");
    writer.join().unwrap().expect("the write that waited for the data server");
    creator.join().unwrap().expect("the new file's write that waited for the data server");
    files[3].1[1_500_000..1_500_000 + 33].copy_from_slice(b"written while the server was down");
    files.push(("created while down".to_string(), new_bytes));

    for (name, bytes) in &files {
        assert!(std::fs::read(mount.path(name)).unwrap() == *bytes, "{name} through the same mount");
    }
    let fresh = patient_mount(&addr);
    for (name, bytes) in &files {
        assert!(std::fs::read(fresh.path(name)).unwrap() == *bytes, "{name} through a new mount");
    }
    // New files go to it as before.
    write_synced(&mount.path("after"), b"after the restart");
    assert_eq!(std::fs::read(fresh.path("after")).unwrap(), b"after the restart");
    drop((mount, fresh));
    for child in [&mut data, &mut meta] {
        signal(child.id() as i32, libc::SIGTERM);
        assert!(wait_exit(child).success());
    }
}

/// A data server keeping its memory in its default data directory (under
/// /dev/shm, named after its shm fabric): SIGKILL leaves its fabric
/// orphaned, and the sweep at the next citronfs start removes the fabric
/// but not the memory; restarted, the server registers under the same id
/// and the mount (over shm) reads its files. SIGTERM is a restart too.
#[test]
fn the_sweep_keeps_the_memory_of_a_stopped_data_server() {
    let tag = std::process::id();
    let shm = format!("kept-data-{tag}");
    let kept = citronfs_meta_server::data_dir::DataDir::default_path(&shm);
    let _ = std::fs::remove_dir_all(&kept);
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0", "--lease-ms", "1000"]);
    let addr = meta_addr(&line);
    let start_data = || start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB", "--shm", &shm]);
    let (mut data, first) = start_data();
    let id = data_server_id(&first);
    let mut config = citronfs_core::client::ClientConfig::new(addr.parse().unwrap());
    config.timeout = HANG;
    let mount = citronfs_tests::TestMount::with_config(config);
    let bytes = pattern(9, 300_000);
    write_synced(&mount.path("f"), &bytes);

    data.kill().unwrap();
    data.wait().unwrap();
    assert!(fabric(&shm).exists(), "SIGKILL leaves the fabric");
    let out = Command::new(EXE).args(["regions", "--remove-orphans"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(!fabric(&shm).exists(), "the orphaned fabric is swept");
    assert!(kept.join("region").exists(), "the sweep removed the memory in {}", kept.display());

    let (mut data, again) = start_data();
    assert_eq!(data_server_id(&again), id, "{again}");
    assert!(std::fs::read(mount.path("f")).unwrap() == bytes, "after SIGKILL and the sweep");
    signal(data.id() as i32, libc::SIGTERM);
    assert!(wait_exit(&mut data).success());
    let (mut data, again) = start_data();
    assert_eq!(data_server_id(&again), id, "SIGTERM is a restart: {again}");
    let fresh = citronfs_tests::TestMount::new(addr.parse().unwrap());
    assert!(std::fs::read(fresh.path("f")).unwrap() == bytes, "after SIGTERM, through a new mount");
    drop((mount, fresh));
    for child in [&mut data, &mut meta] {
        signal(child.id() as i32, libc::SIGTERM);
        assert!(wait_exit(child).success());
    }
    std::fs::remove_dir_all(&kept).unwrap();
}

/// fsync through a mount: on a data server whose data directory is on a
/// persistent path, it flushes the file's extents there (a flush verb per
/// extent, `msync(MS_SYNC)` on the server); where the memory is on tmpfs
/// it costs nothing after the first (the kernel is told there is nothing
/// to do, and asks no more).
#[test]
fn fsync_flushes_the_files_extents_on_a_persistent_data_dir() {
    use citron_lock::rdma::VerbKind;
    use citronfs_mount::FuseOp;
    let on_disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (mut meta, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0"]);
    let addr = meta_addr(&line);
    let dir = on_disk.path().to_str().unwrap();
    let (mut data, _) =
        start_server(&["data-server", "--meta", &addr, "--capacity", "16MiB", "--data-dir", dir]);
    let mount = patient_mount(&addr);
    let file = std::fs::File::create(mount.path("f")).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &pattern(3, 100_000), 0).unwrap();
    assert_eq!(mount.client.verb_counts().get(VerbKind::Flush), 0, "writing flushes nothing");
    file.sync_all().unwrap();
    assert_eq!(mount.client.verb_counts().get(VerbKind::Flush), 1, "one extent, flushed");
    file.sync_data().unwrap();
    assert_eq!(mount.client.verb_counts().get(VerbKind::Flush), 2, "fdatasync flushes too");
    drop(file);
    drop(mount);

    // The same on tmpfs: the first fsync is the last the mount hears of.
    let shm = format!("fsync-data-{}", std::process::id());
    let kept = citronfs_meta_server::data_dir::DataDir::default_path(&shm);
    let (mut meta2, line) = start_server(&["meta-server", "--listen", "127.0.0.1:0"]);
    let addr2 = meta_addr(&line);
    let (mut data2, _) =
        start_server(&["data-server", "--meta", &addr2, "--capacity", "16MiB", "--shm", &shm]);
    let mount = patient_mount(&addr2);
    let file = std::fs::File::create(mount.path("f")).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &pattern(4, 100_000), 0).unwrap();
    file.sync_all().unwrap();
    file.sync_all().unwrap();
    assert_eq!(mount.client.verb_counts().get(VerbKind::Flush), 0);
    assert_eq!(mount.requests.snapshot().get(FuseOp::Fsync), 1, "asked once, answered ENOSYS");
    drop(file);
    drop(mount);
    for child in [&mut data, &mut meta, &mut data2, &mut meta2] {
        signal(child.id() as i32, libc::SIGTERM);
        assert!(wait_exit(child).success());
    }
    std::fs::remove_dir_all(&kept).unwrap();
}
