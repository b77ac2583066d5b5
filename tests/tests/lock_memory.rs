//! Lock memory that follows use (DESIGN.md §4): a file's lock
//! memory exists while the file is open somewhere or holds lock records,
//! and goes back to the meta-server when it is idle. So lock memory bounds
//! only the files open at once (ENFILE past it, never ENOLCK from open), and
//! memory given back is reused at once — which must never let a client that
//! held the old addresses change the file that has them now.

use std::os::unix::fs::MetadataExt;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use citronfs_core::client::{ClientConfig, FsClient, LockCall};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, LockOwner};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_meta_server::MetaServerConfig;
use citronfs_tests::probe::Probe;
use citronfs_tests::{ProcessMount, TestCluster, TEST_LEASE};

const ME: Caller = Caller { uid: 0, gid: 0, pid: 1 };
const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const MOUNT_WORKER: &str = env!("CARGO_BIN_EXE_mount-worker");

/// A cluster whose meta-server has `lock_bytes` of lock memory.
fn cluster(lock_bytes: u64, max_files: u64) -> TestCluster {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = 1 << 20;
    cfg.lease = TEST_LEASE;
    cfg.slot_bytes = max_files * citronfs_core::proto::AttrSlot::BYTES;
    cfg.lock_bytes = lock_bytes;
    TestCluster::start_sized(cfg, 1, 64 << 20)
}

fn client(c: &TestCluster) -> FsClient {
    FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(10),
        ..ClientConfig::new(c.meta.local_addr())
    })
    .unwrap()
}

/// The second target, below FUSE (which adds nothing to what it
/// proves): 250,000 distinct files opened, some written, and closed one
/// after another with 2 MiB of lock memory, which held some 5,000 files
/// when lock memory was kept until unlink (this loop failed with ENOLCK
/// there). The lock memory in use ends where it began.
#[test]
fn two_hundred_fifty_thousand_files_opened_and_closed_one_after_another_with_small_lock_memory() {
    const FILES: u64 = 250_000;
    let c = cluster(2 << 20, FILES + 16);
    let a = client(&c);
    let before = c.meta.lock_memory_in_use();
    let started = Instant::now();
    for i in 0..FILES {
        let name = format!("f{i:06}");
        let ino = a
            .create_open(ME, Ino::ROOT, name.as_bytes(), 0o644)
            .unwrap_or_else(|e| panic!("open of file {i} of {FILES} failed: {e:?}"))
            .ino;
        if i % 1000 == 0 {
            a.write(ino, 0, name.as_bytes(), false).unwrap();
        }
        a.release(ino).unwrap();
    }
    eprintln!("{FILES} opens and closes in {:?}", started.elapsed());
    assert_eq!(c.meta.lock_memory_in_use(), before, "every file's lock memory came back");
    let s = c.meta.status();
    assert_eq!((s.lock_memory.files, s.lock_memory.refused_opens), (0, 0));
    assert!(s.lock_memory.peak_files <= 2, "one file at a time had lock memory: {:?}", s.lock_memory);
    assert_eq!(s.files.regular_files, FILES);
    // And every file is still there with its data.
    let ino = a.lookup(ME, Ino::ROOT, b"f123000").unwrap().ino;
    a.open(ino).unwrap();
    assert_eq!(a.read(ino, 0, 100).unwrap(), b"f123000");
    a.release(ino).unwrap();
}

/// Past the files lock memory can hold at once, open(2) answers ENFILE —
/// never ENOLCK — and creates nothing; once files close, opens work again.
#[test]
fn enfile_when_too_many_files_are_open_at_once_and_all_works_again_after_they_close() {
    raise_fd_limit();
    let c = cluster(1 << 20, 1 << 16);
    let m = c.mount();
    std::fs::write(m.path("closed"), b"a file that is not open").unwrap();
    let before = idle_lock_memory(&c);
    let mut open = Vec::new();
    let err = loop {
        match std::fs::File::create(m.path(&format!("f{}", open.len()))) {
            Ok(f) => open.push(f),
            Err(e) => break e,
        }
        assert!(open.len() < 15_000, "1 MiB of lock memory never filled up");
    };
    let held = open.len();
    assert_eq!(err.raw_os_error(), Some(libc::ENFILE), "{err}");
    assert!(held >= 1000, "only {held} files fit");
    assert!(!m.path(&format!("f{held}")).exists(), "the refused create left a file");
    // A file that is not open cannot be opened either; one that is open
    // already can, again (it has its lock memory).
    let e = std::fs::File::open(m.path("closed")).map(|_| ()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENFILE));
    std::fs::write(m.path("f0"), b"written while full").unwrap();
    let s = c.meta.status();
    assert!(s.lock_memory.refused_opens >= 2, "{:?}", s.lock_memory);
    assert_eq!(s.files.open_files, held as u64);
    drop(open);
    // All closed: their lock memory is back, and as many open again.
    assert_eq!(idle_lock_memory(&c), before, "lock memory came back after the closes");
    let again: Vec<std::fs::File> = (0..held)
        .map(|i| std::fs::File::options().write(true).open(m.path(&format!("f{i}"))).unwrap())
        .collect();
    drop(again);
    assert_eq!(std::fs::read(m.path("closed")).unwrap(), b"a file that is not open");
    assert_eq!(std::fs::read(m.path("f0")).unwrap(), b"written while full");
}

/// The lock memory in use once no file has any (FUSE sends releases after
/// close(2) has returned).
fn idle_lock_memory(c: &TestCluster) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.meta.status().lock_memory.files != 0 {
        assert!(Instant::now() < deadline, "files kept lock memory: {:?}", c.meta.status().lock_memory);
        std::thread::sleep(Duration::from_millis(20));
    }
    c.meta.lock_memory_in_use()
}

fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
}

fn lock_call(ino: Ino, owner: u64, mode: Option<LockMode>) -> LockCall {
    LockCall {
        ino,
        owner: LockOwner(owner),
        flavor: LockFlavor::Posix,
        mode,
        range: ByteRange::new(0, 9).unwrap(),
        pid: owner as u32,
        fh: owner,
    }
}

/// A client's own operation paths keep no old lock address after its last
/// release: here the waiter thread of a blocked F_SETLKW whose caller the
/// kernel abandoned (as for a SIGKILLed process, whose probe has not fired
/// yet). The file's lock memory is freed and reused for another file at
/// once; the old client's waiter, its lock calls and its I/O on the old
/// file change nothing in the new one.
#[test]
fn a_client_holding_an_old_lock_address_after_the_memory_was_reused_changes_nothing() {
    let c = cluster(16 << 20, 1 << 10);
    let (a, b, new, other) = (client(&c), client(&c), client(&c), client(&c));
    let f = b.create_open(ME, Ino::ROOT, b"old", 0o644).unwrap().ino;
    b.setlk(&lock_call(f, 1, Some(LockMode::Write))).unwrap();
    a.open(f).unwrap();
    let old_tree = c.meta.citron_tree(f).expect("an open file has its tree").geometry.maximizer;
    let (tx, rx) = mpsc::channel();
    a.setlkw(
        &lock_call(f, 2, Some(LockMode::Write)),
        Box::new(|| false),
        Box::new(move |r| drop(tx.send(r))),
    );
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "b holds the lock: a waits");
    assert_eq!(b.lock_records(f).unwrap().len(), 2, "b's lock and a's wait");
    // a's last close of the file withdraws its wait first.
    a.release(f).unwrap();
    assert_eq!(rx.try_recv(), Ok(Err(FsError::Interrupted)), "the wait was withdrawn before the release");
    assert_eq!(b.lock_records(f).unwrap().len(), 1, "only b's lock is left");
    b.setlk(&lock_call(f, 1, None)).unwrap();
    b.release(f).unwrap();
    assert!(c.meta.citron_tree(f).is_none(), "closed everywhere: its lock memory is gone");
    // Another file gets the same memory at once.
    let g = new.create_open(ME, Ino::ROOT, b"new", 0o644).unwrap().ino;
    assert_eq!(c.meta.citron_tree(g).unwrap().geometry.maximizer, old_tree, "the memory was reused");
    new.setlk(&lock_call(g, 3, Some(LockMode::Write))).unwrap();
    let records = new.lock_records(g).unwrap();
    // The old client, with the old file's addresses gone, changes nothing:
    // its lock calls and I/O on the old file are refused, and its waiter
    // thread (which retries every RETRY_EVERY) holds nothing.
    assert!(matches!(a.setlk(&lock_call(f, 2, Some(LockMode::Write))), Err(FsError::Invalid(_))));
    assert!(matches!(a.write(f, 0, b"x", false), Err(FsError::Invalid(_))));
    assert!(matches!(a.read(f, 0, 1), Err(FsError::Invalid(_))));
    std::thread::sleep(citronfs_core::locks::waiter::RETRY_EVERY * 3);
    assert_eq!(new.lock_records(g).unwrap(), records, "the new file's locks are only its own");
    assert_eq!(
        other.open(g).and_then(|()| other.setlk(&lock_call(g, 4, Some(LockMode::Write)))),
        Err(FsError::WouldBlock)
    );
    new.setlk(&lock_call(g, 3, None)).unwrap();
    other.setlk(&lock_call(g, 4, Some(LockMode::Write))).unwrap();
    assert!(rx.try_recv().is_err(), "the withdrawn wait was answered once");
}

/// The fenced client of DESIGN.md §6 with lock memory that is reused: a
/// mount stops (SIGSTOP) with a file open and locked, loses its lease, and
/// the file's lock memory goes to another file; when the mount resumes, its
/// calls through what it had open fail with EIO, and the other file's locks
/// and data are untouched.
#[test]
fn a_fenced_mount_that_resumes_changes_nothing_in_reused_lock_memory() {
    let c = cluster(16 << 20, 1 << 10);
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(MOUNT_WORKER);
    cmd.arg(c.meta.local_addr().to_string()).arg(dir.path());
    let stalled = ProcessMount::start(cmd, dir, "mounted");
    let other = c.mount();
    std::fs::write(other.path("f"), b"0000").unwrap();
    let f = std::fs::metadata(other.path("f")).unwrap().ino();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&stalled.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 4")), "ok");
    let old_tree = c.meta.citron_tree(Ino(f)).unwrap().geometry.maximizer;
    stalled.signal(libc::SIGSTOP);
    // Fenced: its records and opens go, and with them the file's lock memory.
    let deadline = Instant::now() + 10 * TEST_LEASE;
    while c.meta.citron_tree(Ino(f)).is_some() {
        assert!(Instant::now() < deadline, "the stopped mount's file kept its lock memory");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(other.path("g"), b"gggg").unwrap();
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&other.path("g"));
    assert_eq!(q.ask(&format!("setlk {qf} w 0 4")), "ok");
    let g = std::fs::metadata(other.path("g")).unwrap().ino();
    assert_eq!(c.meta.citron_tree(Ino(g)).unwrap().geometry.maximizer, old_tree, "the memory was reused");
    stalled.signal(libc::SIGCONT);
    assert_eq!(p.ask(&format!("write {pf} 0 pppp")), "err EIO");
    assert_eq!(p.ask(&format!("setlk {pf} u 0 4")), "err EIO");
    assert_eq!(p.ask(&format!("setlk {pf} w 0 4")), "err EIO");
    let mut r = Probe::spawn(PROBE);
    let rf = r.open(&other.path("g"));
    assert_eq!(r.ask(&format!("getlk {rf} w 0 1")), format!("w 0 4 {}", q.pid), "g's lock is q's alone");
    assert_eq!(q.ask(&format!("setlk {qf} u 0 4")), "ok");
    assert_eq!(r.ask(&format!("setlk {rf} w 0 4")), "ok");
    assert_eq!(std::fs::read(other.path("f")).unwrap(), b"0000");
    assert_eq!(std::fs::read(other.path("g")).unwrap(), b"gggg");
    p.kill();
    q.kill();
    r.kill();
}
