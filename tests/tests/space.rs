//! Space near a file's size (DESIGN.md §5): a file's chunk is an
//! extent of a power-of-two capacity from a buddy allocator, so small files
//! take small space, `st_blocks`, `du` and `df` tell the truth, a deleted
//! file's space is reused at once, and a chunk that grows moves to a bigger
//! extent without any reader or writer seeing it half-moved.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use citronfs_core::client::{ClientConfig, FsClient};
use citronfs_core::types::{Caller, Ino};
use citronfs_meta_server::MetaServerConfig;
use citronfs_tests::{TestCluster, TEST_LEASE};

const MIB: u64 = 1 << 20;
const ME: Caller = Caller { uid: 0, gid: 0, pid: 1 };

/// A cluster with one data server of `capacity` that can hold `max_files`.
fn cluster(capacity: u64, max_files: u64) -> TestCluster {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = MIB;
    cfg.lease = TEST_LEASE;
    cfg.slot_bytes = max_files * citronfs_core::proto::AttrSlot::BYTES;
    cfg.lock_bytes = 16 << 20;
    TestCluster::start_sized(cfg, 1, capacity)
}

fn client(c: &TestCluster) -> FsClient {
    FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(10),
        ..ClientConfig::new(c.meta.local_addr())
    })
    .unwrap()
}

/// What the allocator gives a file of `size` bytes written from its start:
/// the first chunk the smallest power of two of at least 4 KiB that holds
/// it, every later chunk whole.
fn expected_allocation(size: u64) -> u64 {
    match size {
        0 => 0,
        s if s <= MIB => s.max(4096).next_power_of_two(),
        s => MIB * s.div_ceil(MIB),
    }
}

/// (blocks, free blocks, block size) of the file system at `path`.
fn statvfs(path: &Path) -> (u64, u64, u64) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: an all-zero statvfs is valid to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated, `st` a valid out-pointer.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    (st.f_blocks as u64, st.f_bfree as u64, st.f_frsize as u64)
}

fn used_bytes(path: &Path) -> u64 {
    let (blocks, free, size) = statvfs(path);
    (blocks - free) * size
}

/// `du -sB1`: what du says the tree at `path` takes.
fn du(path: &Path) -> u64 {
    let out = std::process::Command::new("du").arg("-sB1").arg(path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().parse().unwrap()
}

fn content(i: u64, len: usize) -> Vec<u8> {
    let tag = format!("file {i:08} ");
    tag.bytes().cycle().take(len).collect()
}

/// The first target, through real mounts: a data server of 1 GiB
/// holds 200,000 files of 4 KiB (it held 1,024 when every file took a
/// chunk), and a second mount lists them all and reads them back.
#[test]
fn two_hundred_thousand_files_of_4_kib_fit_one_gib_and_read_back_from_another_mount() {
    const FILES: u64 = 200_000;
    const DIRS: u64 = 100;
    const WRITERS: u64 = 4;
    let c = cluster(1 << 30, 2 * FILES);
    let (a, b) = (c.mount(), c.mount());
    for d in 0..DIRS {
        fs::create_dir(a.path(&format!("d{d:03}"))).unwrap();
    }
    let name = |i: u64| format!("d{:03}/f{i:06}", i % DIRS);
    let started = Instant::now();
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let a = &a;
            s.spawn(move || {
                for i in (w..FILES).step_by(WRITERS as usize) {
                    fs::write(a.path(&name(i)), content(i, 4096))
                        .unwrap_or_else(|e| panic!("file {i} of {FILES}: {e}"));
                }
            });
        }
    });
    eprintln!("wrote {FILES} files of 4 KiB in {:?}", started.elapsed());
    // Listed from the other mount: every one of them.
    let mut listed = 0;
    for d in 0..DIRS {
        listed += fs::read_dir(b.path(&format!("d{d:03}"))).unwrap().count() as u64;
    }
    assert_eq!(listed, FILES);
    // Spot-read from the other mount.
    for i in (0..FILES).step_by(197) {
        let p = b.path(&name(i));
        assert_eq!(fs::read(&p).unwrap(), content(i, 4096), "{}", p.display());
        assert_eq!(fs::metadata(&p).unwrap().blocks(), 8, "4 KiB of space");
    }
    // The space taken is exactly the data.
    assert_eq!(used_bytes(b.dir.path()), FILES * 4096);
}

/// `st_blocks`, `du` and `df` say what the allocator took: each file the
/// capacity of its extents, the sum in `du` and in `statfs`; and after the
/// files go, nothing.
#[test]
fn statfs_and_du_match_the_data_written_within_the_allocators_rounding() {
    let c = cluster(64 * MIB, 1 << 16);
    let m = c.mount();
    let base = used_bytes(m.dir.path());
    assert_eq!(base, 0, "an empty file system uses nothing");
    let (_, free0, bsize) = statvfs(m.dir.path());
    assert_eq!(free0 * bsize, 64 * MIB);
    fs::create_dir(m.path("d")).unwrap();
    let sizes = [1, 100, 3901, 4096, 4097, 5000, 65_536, 100_000, MIB - 1, MIB, MIB + 1, 3 * MIB + 5];
    let mut expected = 0;
    for (i, &size) in sizes.iter().enumerate() {
        let p = m.path(&format!("d/f{i}"));
        fs::write(&p, content(i as u64, size as usize)).unwrap();
        let meta = fs::metadata(&p).unwrap();
        assert_eq!(meta.len(), size);
        assert_eq!(meta.blocks() * 512, expected_allocation(size), "st_blocks of a file of {size} bytes");
        assert!(meta.blocks() * 512 >= size && meta.blocks() * 512 < 2 * size.max(4096), "{size}");
        expected += expected_allocation(size);
    }
    // A file written in small appends grows through bigger extents and
    // ends in the one that holds it.
    let log = m.path("d/log");
    {
        use std::io::Write;
        let mut f = fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        for k in 0..50u64 {
            f.write_all(&content(k, 1000)).unwrap();
        }
    }
    let grown: Vec<u8> = (0..50u64).flat_map(|k| content(k, 1000)).collect();
    assert_eq!(fs::read(&log).unwrap(), grown);
    assert_eq!(fs::metadata(&log).unwrap().blocks() * 512, 65_536);
    expected += 65_536;
    assert_eq!(du(&m.path("d")), expected, "du");
    assert_eq!(used_bytes(m.dir.path()), expected, "statfs");
    // A truncate to zero gives a file's space back; a hole takes none.
    let big = m.path(&format!("d/f{}", sizes.len() - 1));
    fs::OpenOptions::new().write(true).open(&big).unwrap().set_len(0).unwrap();
    expected -= expected_allocation(3 * MIB + 5);
    let sparse = m.path("d/sparse");
    fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&sparse)
        .unwrap()
        .set_len(10 * MIB)
        .unwrap();
    assert_eq!(fs::metadata(&sparse).unwrap().blocks(), 0);
    assert_eq!(fs::read(&sparse).unwrap().len() as u64, 10 * MIB);
    assert_eq!(du(&m.path("d")), expected);
    assert_eq!(used_bytes(m.dir.path()), expected);
    fs::remove_dir_all(m.path("d")).unwrap();
    assert_eq!(used_bytes(m.dir.path()), 0, "deleted files' space is free at once");
}

/// The issue's `rm -rf` case: a file system filled to the last byte with
/// files big and small, removed, and the same bytes written again at once,
/// with no ENOSPC and no wait for space to come back.
#[test]
fn rm_rf_of_a_full_file_system_then_rewriting_the_same_bytes_succeeds_at_once() {
    let c = cluster(64 * MIB, 1 << 16);
    let m = c.mount();
    // 48 files of 1 MiB, 2048 of 4 KiB, 256 of 16 KiB and 16 of 256 KiB:
    // 40 + 8 + 4 + 4 + 8 = 64 MiB to the byte.
    let mut plan: Vec<(String, u64)> = Vec::new();
    plan.extend((0..40).map(|i| (format!("big/{i}"), MIB)));
    plan.extend((0..2048).map(|i| (format!("small/{i}"), 4096)));
    plan.extend((0..256).map(|i| (format!("mid/{i}"), 16 << 10)));
    plan.extend((0..16).map(|i| (format!("quarter/{i}"), 256 << 10)));
    plan.extend((0..8).map(|i| (format!("top/{i}"), MIB)));
    assert_eq!(plan.iter().map(|(_, s)| s).sum::<u64>(), 64 * MIB);
    let fill = |round: u64| {
        fs::create_dir(m.path("tree")).unwrap();
        for d in ["big", "small", "mid", "quarter", "top"] {
            fs::create_dir(m.path(&format!("tree/{d}"))).unwrap();
        }
        for (i, (p, size)) in plan.iter().enumerate() {
            fs::write(m.path(&format!("tree/{p}")), content(round * 100_000 + i as u64, *size as usize))
                .unwrap_or_else(|e| panic!("round {round}: {p}: {e}"));
        }
    };
    fill(0);
    let (_, free, _) = statvfs(m.dir.path());
    assert_eq!(free, 0, "full");
    let err = fs::write(m.path("one-more"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    let _ = fs::remove_file(m.path("one-more"));
    for round in 1..=3 {
        fs::remove_dir_all(m.path("tree")).unwrap();
        assert_eq!(used_bytes(m.dir.path()), 0, "round {round}: space is free right after rm -rf");
        fill(round);
        for (i, (p, size)) in plan.iter().enumerate().step_by(37) {
            let got = fs::read(m.path(&format!("tree/{p}"))).unwrap();
            assert_eq!(got, content(round * 100_000 + i as u64, *size as usize), "round {round}: {p}");
        }
    }
}

/// Chunk 0 of a file grows from 4 KiB to 512 KiB in small writes of one
/// client while another reads the whole file again and again: every read
/// sees exactly the bytes written before it (never a zeroed hole where an
/// old extent was, never a torn write), on both transports.
#[test]
fn a_chunk_that_grows_moves_under_concurrent_readers_without_tearing() {
    let c = cluster(16 * MIB, 1 << 10);
    for tcp in [false, true] {
        let mk = |tcp: bool| {
            let mut cfg = ClientConfig::new(c.meta.local_addr());
            cfg.timeout = Duration::from_secs(10);
            if tcp {
                cfg.transport = citronfs_core::client::Transport::Tcp;
            }
            FsClient::connect(cfg).unwrap()
        };
        let (w, r) = (mk(tcp), mk(tcp));
        let name = format!("grow-{tcp}");
        let ino = w.create_open(ME, Ino::ROOT, name.as_bytes(), 0o644).unwrap().ino;
        r.open(ino).unwrap();
        const STEP: u64 = 3000;
        const STEPS: u64 = 170; // 510,000 bytes: chunk 0 moves four times
        let expect = |n: u64| -> Vec<u8> { (0..n).map(|i| (i * 131 % 251) as u8).collect() };
        let all = expect(STEP * STEPS);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut reads = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let got = r.read(ino, 0, (STEP * STEPS) as u32).unwrap();
                    assert!(
                        (got.len() as u64).is_multiple_of(STEP),
                        "a write is seen whole: {} bytes",
                        got.len()
                    );
                    assert_eq!(got[..], all[..got.len()], "read {reads} of {} bytes", got.len());
                    reads += 1;
                }
                reads
            });
            for k in 0..STEPS {
                w.write(ino, k * STEP, &all[(k * STEP) as usize..((k + 1) * STEP) as usize], false).unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(reader.join().unwrap() > 0);
        });
        assert_eq!(r.read(ino, 0, (STEP * STEPS) as u32).unwrap(), all);
        // Each move makes room for twice what the write needed: the last
        // one, for 264,000 bytes, took the whole chunk.
        assert_eq!(r.getattr(ino).unwrap().allocated, 1 << 20);
        // Two clients writing disjoint halves of a fresh chunk at once, each
        // needing it to grow: both halves land.
        let name2 = format!("halves-{tcp}");
        let ino2 = w.create_open(ME, Ino::ROOT, name2.as_bytes(), 0o644).unwrap().ino;
        r.open(ino2).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                for k in 0..64u64 {
                    w.write(ino2, k * 2048, &[1u8; 1024], false).unwrap();
                }
            });
            s.spawn(|| {
                for k in 0..64u64 {
                    r.write(ino2, k * 2048 + 1024, &[2u8; 1024], false).unwrap();
                }
            });
        });
        let got = w.read(ino2, 0, 128 << 10).unwrap();
        for k in 0..64usize {
            assert_eq!(&got[k * 2048..k * 2048 + 1024], &[1u8; 1024][..], "half {k} of the first writer");
            assert_eq!(&got[k * 2048 + 1024..k * 2048 + 2048], &[2u8; 1024][..], "half {k} of the second");
        }
        for (cl, i) in [(&w, ino), (&r, ino), (&w, ino2), (&r, ino2)] {
            cl.release(i).unwrap();
        }
    }
}

/// Capacity like tmpfs: a data server of 1 GiB takes from the host only the
/// pages that were written, and gives a deleted file's pages back.
#[test]
fn data_server_memory_is_touched_only_as_written_and_given_back_when_freed() {
    let c = cluster(1 << 30, 1 << 10);
    let resident = || c.data[0].resident_bytes().expect("a shm data server");
    assert!(resident() < MIB, "an empty data server holds {} bytes", resident());
    let a = client(&c);
    let ino = a.create_open(ME, Ino::ROOT, b"eight", 0o644).unwrap().ino;
    for k in 0..8u64 {
        a.write(ino, k * MIB, &vec![7u8; MIB as usize], false).unwrap();
    }
    let written = resident();
    assert!((8 * MIB..9 * MIB).contains(&written), "8 MiB written, {written} bytes resident");
    a.release(ino).unwrap();
    a.unlink(ME, Ino::ROOT, b"eight").unwrap();
    // Freed after the orphan grace (a lookup racing the unlink may still
    // open it), at the meta-server's next sweep.
    let deadline = Instant::now() + Duration::from_secs(20);
    while resident() >= MIB {
        assert!(Instant::now() < deadline, "the deleted file's pages stayed: {} bytes", resident());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The memory is reused, and reads back zero where nothing was written.
    let ino = a.create_open(ME, Ino::ROOT, b"again", 0o644).unwrap().ino;
    a.write(ino, MIB + 10, b"tail", false).unwrap();
    let back = a.read(ino, MIB, 14).unwrap();
    assert_eq!(&back[..10], &[0u8; 10]);
    assert_eq!(&back[10..], b"tail");
    assert_eq!(a.read(ino, 0, 4096).unwrap(), vec![0u8; 4096], "a hole reads zero");
}

/// The meta-server's table of regular files (attribute slots, `--max-files`)
/// is the one fixed table that grows with files: when it is full, creating a
/// file answers ENOSPC (and the meta-server logs the flag to raise), and a
/// deleted file's slot is reused at once.
#[test]
fn the_most_files_is_a_flag_and_a_deleted_files_slot_is_reused_at_once() {
    // One page of the meta-server's slot region: as many slots as fit it.
    let slots = 4096 / citronfs_core::proto::AttrSlot::BYTES;
    let c = cluster(16 * MIB, slots);
    let a = client(&c);
    let made: Vec<Ino> = (0..slots)
        .map(|i| {
            a.create(
                ME,
                Ino::ROOT,
                format!("f{i}").as_bytes(),
                citronfs_core::types::FileKind::File,
                0o644,
                0,
            )
        })
        .map(|r| r.unwrap().ino)
        .collect();
    let full = a.create(ME, Ino::ROOT, b"one-more", citronfs_core::types::FileKind::File, 0o644, 0);
    assert_eq!(full.unwrap_err(), citronfs_core::FsError::NoSpace);
    // Directories take no slot.
    a.create(ME, Ino::ROOT, b"dir", citronfs_core::types::FileKind::Dir, 0o755, 0).unwrap();
    let st = a.statfs().unwrap();
    assert_eq!(st.max_inodes - st.inodes, 0, "no regular file can be made: {st:?}");
    a.unlink(ME, Ino::ROOT, b"f7").unwrap();
    let again = a.create(ME, Ino::ROOT, b"one-more", citronfs_core::types::FileKind::File, 0o644, 0).unwrap();
    assert!(!made.contains(&again.ino));
}

/// A writer that extends a file alone asks for chunks ahead of it (chunk
/// 1 brings 2, 3 brings 4 to 6, 7 brings 8 to 14), and its own allocation
/// does not make its next write fetch the whole chunk list again (which
/// grew with the file, so a sequential write of N chunks fetched O(N²)
/// entries): 9 new chunks cost 3 calls. Another client's allocation still
/// makes it refetch, and everything written reads back on either.
#[test]
fn a_writer_extending_a_file_alone_asks_ahead_and_never_refetches() {
    use citronfs_core::rpc_counts::MetaKind;
    let c = cluster(64 * MIB, 1 << 10);
    let (a, b) = (client(&c), client(&c));
    let ino = a.create_open(ME, Ino::ROOT, b"seq", 0o644).unwrap().ino;
    let block = |k: u64| vec![k as u8 + 1; MIB as usize];
    a.write(ino, 0, &block(0), false).unwrap();
    let before = a.rpc_counts();
    for k in 1..10u64 {
        a.write(ino, k * MIB, &block(k), false).unwrap();
    }
    let spent = a.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::AllocChunks), 3, "chunks 1, 3 and 7 asked: {}", spent.describe());
    assert_eq!(spent.total(), 3, "9 writes past the end, alone: {}", spent.describe());

    // Another client allocates past what came ahead: the writer's next
    // I/O sees the generation move past its cache and refetches, and both
    // read every chunk (the ones ahead and never written read zero).
    b.open(ino).unwrap();
    b.write(ino, 15 * MIB, &block(15), false).unwrap();
    let before = a.rpc_counts();
    a.write(ino, 10 * MIB, &block(10), false).unwrap();
    let spent = a.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::Layout), 1, "another client allocated: {}", spent.describe());
    assert_eq!(spent.get(MetaKind::AllocChunks), 0, "chunk 10 came ahead: {}", spent.describe());
    for reader in [&a, &b] {
        for k in 0..16u64 {
            let want = if (11..15).contains(&k) { vec![0; MIB as usize] } else { block(k) };
            let got = reader.read(ino, k * MIB, MIB as u32).unwrap();
            assert!(got == want, "chunk {k} read back wrong");
        }
    }
    a.release(ino).unwrap();
    b.release(ino).unwrap();
    // Closed everywhere: the chunks ahead within the size (11 to 14, holes
    // now) stay, the ones past it (16 to 30, which chunk 15 brought) go.
    assert_eq!(a.getattr(ino).unwrap().allocated, 16 * MIB);
}

/// Chunks taken ahead of a writer are given back at its last close when
/// they are still past the end, but not those `fallocate` asked for since;
/// and speculation never takes the last quarter of the data servers'
/// memory, so a nearly full cluster still gives a second writer every
/// byte it writes.
#[test]
fn chunks_ahead_are_given_back_at_close_and_never_take_the_last_memory() {
    let c = cluster(16 * MIB, 1 << 10);
    let a = client(&c);
    let block = vec![7u8; MIB as usize];
    let free = |a: &FsClient| a.statfs().unwrap().free_bytes;
    let ino = a.create_open(ME, Ino::ROOT, b"first", 0o644).unwrap().ino;
    for k in 0..4u64 {
        a.write(ino, k * MIB, &block, false).unwrap();
    }
    assert_eq!(a.getattr(ino).unwrap().allocated, 7 * MIB, "chunk 3 brought 4 to 6");
    // fallocate past the end, keeping the size: chunk 4 is now asked for.
    a.fallocate(ino, 4 * MIB, MIB, true).unwrap();
    a.release(ino).unwrap();
    assert_eq!(a.getattr(ino).unwrap().allocated, 5 * MIB, "5 and 6 went back, 4 was fallocated");
    assert_eq!(free(&a), 11 * MIB);

    // A second file grows into the cluster's last quarter: what comes ahead
    // stops at 4 MiB free, and the writer itself gets every chunk.
    let ino = a.create_open(ME, Ino::ROOT, b"second", 0o644).unwrap().ino;
    for k in 0..4u64 {
        a.write(ino, k * MIB, &block, false).unwrap();
    }
    assert_eq!(a.getattr(ino).unwrap().allocated, 7 * MIB, "11 MiB free, so 4 to 6 came ahead");
    assert_eq!(free(&a), 4 * MIB);
    for k in 4..11u64 {
        a.write(ino, k * MIB, &block, false).unwrap();
        assert!(free(&a) <= 4 * MIB, "chunk {k}: nothing more came ahead");
    }
    assert_eq!(free(&a), 0, "the writer got the whole cluster");
    let err = a.write(ino, 11 * MIB, &block, false).unwrap_err();
    assert!(matches!(err, citronfs_core::FsError::NoSpace), "{err:?}");
    a.release(ino).unwrap();
    assert_eq!(a.getattr(ino).unwrap().allocated, 11 * MIB);
}

/// Threads of one client writing into the same new chunk at once (ranks of
/// a job writing a shared file through one mount) ask the meta-server for
/// it at most once: the others find the first one's extent once it is in.
#[test]
fn concurrent_writes_into_one_new_chunk_ask_for_it_once() {
    use citronfs_core::rpc_counts::MetaKind;
    const THREADS: u64 = 4;
    let c = cluster(64 * MIB, 1 << 10);
    let a = client(&c);
    let ino = a.create_open(ME, Ino::ROOT, b"shared", 0o644).unwrap().ino;
    a.write(ino, 0, &vec![1u8; MIB as usize], false).unwrap();
    for round in 1..6u64 {
        let before = a.rpc_counts();
        let start = std::sync::Barrier::new(THREADS as usize);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (a, start) = (&a, &start);
                s.spawn(move || {
                    start.wait();
                    let piece = MIB / THREADS;
                    a.write(ino, round * MIB + t * piece, &vec![t as u8 + 2; piece as usize], false).unwrap();
                });
            }
        });
        let spent = a.rpc_counts() - before;
        // Rounds 1 and 3 find no chunk and ask once (bringing chunk 2, and
        // 4 and 5, ahead); the others find theirs already there.
        let asks = u64::from(round == 1 || round == 3);
        assert_eq!(spent.get(MetaKind::AllocChunks), asks, "round {round}: {}", spent.describe());
        let back = a.read(ino, round * MIB, MIB as u32).unwrap();
        for t in 0..THREADS as usize {
            let piece = (MIB / THREADS) as usize;
            assert!(
                back[t * piece..(t + 1) * piece].iter().all(|b| *b == t as u8 + 2),
                "round {round} piece {t}"
            );
        }
    }
    a.release(ino).unwrap();
}

/// A small file written alone in 4 KiB steps (a journal, say) grows its
/// first chunk's extent 4 → 16 → 64 KiB (each move makes room for twice
/// what the write needs): each growth is one call, and the writer never
/// refetches its layout after its own move.
#[test]
fn a_first_chunk_growing_alone_costs_one_call_per_growth() {
    use citronfs_core::rpc_counts::MetaKind;
    let c = cluster(64 * MIB, 1 << 10);
    let a = client(&c);
    let ino = a.create_open(ME, Ino::ROOT, b"journal", 0o644).unwrap().ino;
    let before = a.rpc_counts();
    for k in 0..16u64 {
        a.write(ino, k * 4096, &vec![k as u8 + 1; 4096], false).unwrap();
    }
    let spent = a.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::AllocChunks), 1, "{}", spent.describe());
    assert_eq!(spent.get(MetaKind::GrowExtents), 2, "4 → 16 → 64 KiB: {}", spent.describe());
    assert_eq!(spent.total(), 3, "nothing but the allocation and the growths: {}", spent.describe());
    assert_eq!(a.getattr(ino).unwrap().allocated, 64 << 10);
    let back = a.read(ino, 0, 16 * 4096).unwrap();
    for k in 0..16usize {
        assert!(back[k * 4096..(k + 1) * 4096].iter().all(|b| *b == k as u8 + 1), "page {k}");
    }
    a.release(ino).unwrap();
}
