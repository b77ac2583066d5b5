//! Data shared by mounts under the I/O locks: overlapping writes
//! from two mounts never tear what a reader sees, nor does a write that
//! overwrites a file's last bytes and extends it, `O_APPEND` from two
//! mounts never loses or interleaves a record, SQLite used by four processes
//! on two mounts keeps every row and passes its integrity check — and the
//! same with every selectable range lock and inode mutex.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::rwlock::Algorithm;
use citronfs_core::locks::area::LockChoice;
use citronfs_tests::probe::Probe;
use citronfs_tests::sqlite::SqliteWriters;
use citronfs_tests::{TestCluster, TestMount};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const KIB: usize = 1024;

fn two_mounts(choice: LockChoice) -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::with_locks(choice);
    let a = c.mount();
    let b = c.mount();
    (c, a, b)
}

/// Mount A writes 64 KiB at 0, mount B 64 KiB at 32 KiB, each write one byte
/// value throughout; a reader on each mount reads the 32 KiB they share and
/// must see one write's bytes, never a mix. Runs for `run_for` and until
/// `min_reads` reads were checked (however slow the machine; a bound of
/// minutes only guards against a hang). Returns the reads checked.
/// Longest a stress loop below waits for its minimum of work: only a hang
/// takes that long.
const HANG: Duration = Duration::from_secs(300);

fn overlapping_writes_never_tear(a: &TestMount, b: &TestMount, run_for: Duration, min_reads: u64) -> u64 {
    std::fs::write(a.path("torn"), vec![0u8; 96 * KIB]).unwrap();
    let stop = AtomicBool::new(false);
    let checked = AtomicU64::new(0);
    std::thread::scope(|s| {
        for (i, (m, at)) in [(a, 0u64), (b, 32 * KIB as u64)].into_iter().enumerate() {
            let stop = &stop;
            s.spawn(move || {
                let f = std::fs::OpenOptions::new().write(true).open(m.path("torn")).unwrap();
                let mut v = 1u8 + i as u8;
                while !stop.load(Ordering::Relaxed) {
                    f.write_all_at(&vec![v; 64 * KIB], at).unwrap();
                    v = v.wrapping_add(2).max(1);
                }
            });
        }
        for m in [a, b] {
            let (stop, checked) = (&stop, &checked);
            s.spawn(move || {
                let f = std::fs::File::open(m.path("torn")).unwrap();
                let mut buf = vec![0u8; 32 * KIB];
                while !stop.load(Ordering::Relaxed) {
                    f.read_exact_at(&mut buf, 32 * KIB as u64).unwrap();
                    if let Some(at) = buf.iter().position(|&x| x != buf[0]) {
                        stop.store(true, Ordering::Relaxed);
                        panic!("torn read: byte {} is {} but byte 0 is {}", at, buf[at], buf[0]);
                    }
                    checked.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let start = Instant::now();
        while (start.elapsed() < run_for || checked.load(Ordering::Relaxed) < min_reads)
            && start.elapsed() < HANG
            && !stop.load(Ordering::Relaxed)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::Relaxed);
    });
    checked.load(Ordering::Relaxed)
}

/// Each mount appends `n` 64-byte records with O_APPEND: all 2n records are
/// there, whole (the inode mutex is exclusive for appends).
fn appends_from_two_mounts_are_atomic(a: &TestMount, b: &TestMount, n: usize) {
    std::fs::write(a.path("log"), b"").unwrap();
    std::thread::scope(|s| {
        for (tag, m) in [('a', a), ('b', b)] {
            s.spawn(move || {
                let mut f = std::fs::OpenOptions::new().append(true).open(m.path("log")).unwrap();
                for i in 0..n {
                    let line = format!("{tag}{i:0>62}\n");
                    assert_eq!(line.len(), 64);
                    f.write_all(line.as_bytes()).unwrap();
                }
            });
        }
    });
    let text = std::fs::read_to_string(b.path("log")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2 * n, "records lost or merged");
    for tag in ['a', 'b'] {
        let mut mine: Vec<usize> = lines
            .iter()
            .filter(|l| l.starts_with(tag))
            .map(|l| {
                assert_eq!(l.len(), 63, "a torn record: {l:?}");
                l[1..].parse().unwrap()
            })
            .collect();
        mine.sort();
        assert_eq!(mine, (0..n).collect::<Vec<_>>(), "records of {tag}");
    }
}

/// Two processes per mount increment a counter under F_SETLKW.
fn counter_under_setlkw(a: &TestMount, b: &TestMount, rounds: u64) {
    std::fs::write(a.path("counter"), b"").unwrap();
    let mut probes: Vec<(Probe, i32)> = (0..4)
        .map(|i| {
            let mut p = Probe::spawn(PROBE);
            let fd = p.open(&if i % 2 == 0 { a.path("counter") } else { b.path("counter") });
            (p, fd)
        })
        .collect();
    for (p, fd) in probes.iter_mut() {
        for _ in 0..rounds {
            p.send(&format!("setlkw {fd} w 0 1"));
            p.send(&format!("incr {fd} 0"));
            p.send(&format!("setlk {fd} u 0 1"));
        }
    }
    for (p, _) in probes.iter() {
        for _ in 0..rounds {
            assert_eq!(p.answer(), "ok");
            assert!(p.answer().starts_with("ok "));
            assert_eq!(p.answer(), "ok");
        }
    }
    let text = std::fs::read_to_string(b.path("counter")).unwrap();
    assert_eq!(text.trim_matches('\0').parse::<u64>().unwrap(), 4 * rounds);
}

#[test]
fn overlapping_writes_from_two_mounts_never_tear() {
    let (_c, a, b) = two_mounts(LockChoice::default());
    let checked = overlapping_writes_never_tear(&a, &b, Duration::from_secs(2), 51);
    assert!(checked > 50, "too few reads to mean anything: {checked}");
}

/// Mount A (over tcp, where a write's steps are far apart) makes writes
/// that each overwrite the file's last byte and extend it by one: write
/// `n` puts `[n, n]` at offset `n - 1`, so after it the file is
/// `1, 2, .., n - 1, n, n`. Mount B reads the whole file with one read(2)
/// at a time: each read must show the file after some write, whole — never
/// a write's byte below the old end without the new size (`.., n - 1, n`).
#[test]
fn a_write_across_the_end_of_the_file_is_read_whole_or_not_at_all() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let tcp = || {
        let config = c.client_config(None, citronfs_core::client::Transport::Tcp);
        TestMount::with_config_and_options(config, citronfs_tests::mount_options())
    };
    let (a, b) = (tcp(), tcp());
    let _hang = b.watchdog(HANG);
    const WRITES: usize = 3000;
    std::fs::write(a.path("grows"), [0u8]).unwrap();
    let done = AtomicBool::new(false);
    let reads = std::thread::scope(|s| {
        s.spawn(|| {
            let f = std::fs::OpenOptions::new().write(true).open(a.path("grows")).unwrap();
            for n in 1..=WRITES {
                let byte = (n % 251) as u8;
                f.write_all_at(&[byte, byte], n as u64 - 1).unwrap();
            }
            done.store(true, Ordering::SeqCst);
        });
        let f = std::fs::File::open(b.path("grows")).unwrap();
        let mut buf = vec![0u8; WRITES + 2];
        let mut reads = 0u64;
        while !done.load(Ordering::SeqCst) {
            let len = f.read_at(&mut buf, 0).unwrap();
            reads += 1;
            let seen = &buf[..len];
            let whole = len == 1
                || (seen[len - 1] == seen[len - 2]
                    && seen[..len - 1].iter().enumerate().all(|(i, &x)| x == ((i + 1) % 251) as u8));
            assert!(
                whole,
                "read {reads} saw a write in part: the file's last bytes are {:?}",
                &seen[len.saturating_sub(4)..]
            );
        }
        reads
    });
    assert!(reads > 0, "B never read while A wrote");
}

#[test]
fn o_append_from_two_mounts_keeps_every_record_whole() {
    let (_c, a, b) = two_mounts(LockChoice::default());
    appends_from_two_mounts_are_atomic(&a, &b, 300);
}

/// Every selectable range lock and inode mutex keeps the same guarantees.
#[test]
fn every_lock_choice_keeps_data_and_locks_exact() {
    let choices = [
        (RangeAlgorithm::Segments, Algorithm::Dslr),
        (RangeAlgorithm::Rpc, Algorithm::Dql),
        (RangeAlgorithm::Citron, Algorithm::Cas),
        (RangeAlgorithm::Rpc, Algorithm::Rpc),
        (RangeAlgorithm::Segments, Algorithm::ALock),
    ];
    for (range, inode) in choices {
        let t = Instant::now();
        let choice = LockChoice { range, inode, ..LockChoice::default() };
        let (_c, a, b) = two_mounts(choice);
        let checked = overlapping_writes_never_tear(&a, &b, Duration::from_millis(600), 11);
        assert!(checked > 10, "{range}/{inode}: too few reads: {checked}");
        appends_from_two_mounts_are_atomic(&a, &b, 60);
        counter_under_setlkw(&a, &b, 25);
        eprintln!("--range-lock {range} --inode-lock {inode}: ok in {:?}", t.elapsed());
    }
}

/// SQLite used concurrently by four processes on two mounts (its locks are
/// POSIX byte-range locks at 1 GiB in the database file): every row is
/// inserted and the database is intact.
#[test]
fn sqlite_from_four_processes_on_two_mounts_keeps_every_row() {
    let (_c, a, b) = two_mounts(LockChoice::default());
    sqlite_writers_keep_every_row(&a, &b, 40);
}

/// Two writers on each mount insert `per_writer` rows, one per
/// transaction; then every row is there and the database passes its
/// integrity check.
fn sqlite_writers_keep_every_row(a: &TestMount, b: &TestMount, per_writer: usize) {
    let elapsed = SqliteWriters::start(a, b, per_writer).finish(b);
    let want = 4 * per_writer;
    eprintln!("sqlite: {want} transactions in {elapsed:?} ({:.0} tx/s)", want as f64 / elapsed.as_secs_f64());
}

/// The same guarantees in a keyed cluster whose mounts reach server memory
/// over tcp: every lock service and NIC admits the mounts' sessions, and
/// no verb any algorithm issues falls outside the mounts' grants.
#[test]
fn every_lock_choice_works_for_keyed_mounts_over_tcp() {
    let choices = [
        (RangeAlgorithm::Citron, Algorithm::ShiftLock),
        (RangeAlgorithm::Segments, Algorithm::Dslr),
        (RangeAlgorithm::Rpc, Algorithm::Dql),
        (RangeAlgorithm::Rpc, Algorithm::Rpc),
        (RangeAlgorithm::Citron, Algorithm::ALock),
    ];
    for (range, inode) in choices {
        let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.chunk_size = 1 << 20;
        cfg.lease = citronfs_tests::TEST_LEASE;
        cfg.lock_choice = LockChoice { range, inode, ..LockChoice::default() };
        cfg.keyring = Some(std::sync::Arc::new(citron_rpc::auth::Keyring::generate("cluster").unwrap()));
        let c = TestCluster::start_with(cfg, 1, 64 << 20);
        let (a, b) = (c.mount_tcp(), c.mount_tcp());
        eprintln!("--range-lock {range} --inode-lock {inode}");
        let checked = overlapping_writes_never_tear(&a, &b, Duration::from_millis(600), 11);
        assert!(checked > 10, "{range}/{inode}: too few reads: {checked}");
        appends_from_two_mounts_are_atomic(&a, &b, 60);
        counter_under_setlkw(&a, &b, 25);
        let refused = c.meta.nic_access().stats().refused.load(Ordering::Relaxed)
            + c.data[0].access().stats().refused.load(Ordering::Relaxed);
        assert_eq!(refused, 0, "{range}/{inode}: verbs refused");
    }
}

/// How much farther the far mount of the distance tests is:
/// one switch hop, a campus, a metro link.
const DISTANCES_MS: [f64; 3] = [0.1, 1.0, 5.0];

/// A cluster with a near mount (shm) and a mount `ms` farther away (tcp,
/// every round trip `ms` longer).
fn near_and_far(ms: f64) -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::with_locks(LockChoice::default());
    let near = c.mount();
    let far = c.mount_far(Duration::from_secs_f64(ms / 1000.0));
    (c, near, far)
}

/// Distance: a mount far from the servers beside a near one. Overlapping
/// writes never tear, appends are never lost, and the F_SETLKW counter
/// loses no update, at every distance. (Before: the far mount's first
/// write never completed, its Citron attempts aborting forever.)
#[test]
fn a_near_and_a_far_mount_keep_data_and_locks_exact() {
    for ms in DISTANCES_MS {
        let t = Instant::now();
        let (_c, near, far) = near_and_far(ms);
        let _guards = (near.watchdog(HANG), far.watchdog(HANG));
        let checked = overlapping_writes_never_tear(&near, &far, Duration::from_millis(800), 11);
        assert!(checked > 10, "+{ms} ms: too few reads: {checked}");
        appends_from_two_mounts_are_atomic(&near, &far, 20);
        counter_under_setlkw(&near, &far, 8);
        eprintln!("+{ms} ms: {checked} reads checked, all ok in {:?}", t.elapsed());
    }
}

/// Distance: SQLite from two processes on a near mount and two on a far
/// one, at every distance.
#[test]
fn sqlite_on_a_near_and_a_far_mount_keeps_every_row() {
    for ms in DISTANCES_MS {
        let (_c, near, far) = near_and_far(ms);
        let _guards = (near.watchdog(HANG), far.watchdog(HANG));
        eprint!("+{ms} ms: ");
        // SQLite's transactions on the far mount cost tens of round trips
        // each (journal create, write and delete, its locks): fewer at 5 ms.
        sqlite_writers_keep_every_row(&near, &far, if ms < 5.0 { 8 } else { 4 });
    }
}

/// A direct write of several MiB into new space through a mount reaches
/// the daemon in max_write pieces; its client asks for chunks ahead as the
/// file grows (chunks 1, 3 and 7 each bring the next 1, 3 and 7), so 8 new
/// chunks cost 3 calls and the writer alone never refetches its layout;
/// the chunks asked ahead and never written are given back at the close,
/// and every byte reads back on the other mount.
#[test]
fn a_big_direct_write_allocates_ahead_and_gives_back_the_rest_at_close() {
    use citronfs_core::rpc_counts::MetaKind;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    const MIB: usize = 1 << 20;
    let (_c, a, b) = two_mounts(LockChoice::default());
    let data: Vec<u8> = (0..8 * MIB).map(|i| (i / 4096 % 251) as u8 + 1).collect();
    let mut buf = Aligned::new(data.len());
    buf.as_mut().copy_from_slice(&data);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(a.path("big"))
        .unwrap();
    // The first chunk's extent grows with the file from 4 KiB (a small
    // file takes little space); the later ones are whole from the start.
    let mut first = Aligned::new(MIB);
    f.write_all_at(first.as_mut(), 0).unwrap();
    let (calls, writes) = (a.client.rpc_counts(), a.requests.snapshot().get(citronfs_mount::FuseOp::Write));
    f.write_all_at(buf.as_mut(), MIB as u64).unwrap();
    let spent = a.client.rpc_counts() - calls;
    let pieces = a.requests.snapshot().get(citronfs_mount::FuseOp::Write) - writes;
    assert_eq!(
        pieces,
        (8 * MIB as u64).div_ceil(citronfs_mount::MAX_WRITE.into()),
        "the kernel cut the write into max_write pieces"
    );
    assert_eq!(spent.get(MetaKind::AllocChunks), 3, "chunks 1, 3 and 7 asked: {}", spent.describe());
    assert_eq!(spent.total(), 3, "8 new chunks, written alone: {}", spent.describe());
    // Chunks 8 to 14 came with chunk 7, ahead of the writer.
    let open_blocks = f.metadata().unwrap().blocks() * 512;
    assert_eq!(open_blocks, 15 * MIB as u64, "while open, the chunks ahead count");
    // FUSE sends the release after close(2) returned: waited for.
    citronfs_tests::coherence::close(&a, f);
    let closed = std::fs::metadata(b.path("big")).unwrap();
    assert_eq!(closed.len(), 9 * MIB as u64);
    assert_eq!(closed.blocks() * 512, 9 * MIB as u64, "closed, the file holds what its size needs");
    let back = std::fs::read(b.path("big")).unwrap();
    assert!(
        back[..MIB].iter().all(|b| *b == 0) && back[MIB..] == data[..],
        "the other mount reads it back wrong"
    );
}

/// A page-aligned buffer, as O_DIRECT needs.
struct Aligned(Vec<u8>, usize);

impl Aligned {
    fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let skip = v.as_ptr().align_offset(4096);
        Self(v, skip)
    }

    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.0.len() - 4096;
        &mut self.0[self.1..self.1 + len]
    }
}
