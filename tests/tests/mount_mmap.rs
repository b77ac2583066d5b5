//! Shared writable mappings across two mounts of one cluster:
//! `MAP_SHARED` with `PROT_WRITE` works, `msync` and `munmap` publish to the
//! other mount, and a process that takes an fcntl lock sees through its
//! mapping (and `read(2)`) what the other mount wrote under that lock,
//! while its own writes through the mapping are published when it
//! releases. The mappings' processes are `lock-probe`s.

use citronfs_tests::probe::Probe;
use citronfs_tests::{TestCluster, TestMount};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const PAGE: usize = 4096;

fn cluster() -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = c.mount();
    let b = c.mount();
    (c, a, b)
}

/// A probe with `path` open and mapped (`len` bytes); returns it, the
/// descriptor and the mapping.
fn mapped(path: &std::path::Path, len: usize) -> (Probe, i32, String) {
    let mut p = Probe::spawn(PROBE);
    let fd = p.open(path);
    let map = p.ask(&format!("mmap {fd} {len}"));
    let map = map.strip_prefix("map ").unwrap_or_else(|| panic!("mmap: {map}")).to_string();
    (p, fd, map)
}

fn read_at(path: &std::path::Path, offset: usize, len: usize) -> Vec<u8> {
    let data = std::fs::read(path).unwrap();
    data[offset..offset + len].to_vec()
}

#[test]
fn shared_writable_mappings_publish_at_msync_and_munmap() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), vec![b'.'; 2 * PAGE]).unwrap();
    let (mut p, fd, map) = mapped(&a.path("f"), 2 * PAGE);
    assert_eq!(p.ask(&format!("mread {map} 0 4")), "data ....");
    assert_eq!(p.ask(&format!("mwrite {map} 0 hello")), "ok");
    // The writer's own read(2) sees its mapping at once (the kernel writes
    // the range back before a direct read).
    assert_eq!(p.ask(&format!("read {fd} 0 5")), "data hello");
    assert_eq!(p.ask(&format!("msync {map}")), "ok");
    assert_eq!(read_at(&b.path("f"), 0, 5), b"hello", "msync makes it visible on the other mount");
    // munmap without msync writes back too.
    assert_eq!(p.ask(&format!("mwrite {map} {PAGE} world")), "ok");
    assert_eq!(p.ask(&format!("munmap {map}")), "ok");
    assert_eq!(read_at(&b.path("f"), PAGE, 5), b"world");
    // A write(2) on the same mount is seen by a mapping made after it, and
    // by one made before (the kernel drops the pages a direct write covers).
    let map2 = p.ask(&format!("mmap {fd} {}", 2 * PAGE));
    let map2 = map2.strip_prefix("map ").unwrap().to_string();
    assert_eq!(p.ask(&format!("mread {map2} 0 5")), "data hello");
    assert_eq!(p.ask(&format!("write {fd} 0 HELLO")), "ok");
    assert_eq!(p.ask(&format!("mread {map2} 0 5")), "data HELLO");
    // Closing the descriptor with a dirty mapping still open: the mapping
    // stays usable and munmap publishes.
    assert_eq!(p.ask(&format!("mwrite {map2} 10 after-close")), "ok");
    assert_eq!(p.ask(&format!("close {fd}")), "ok");
    assert_eq!(p.ask(&format!("munmap {map2}")), "ok");
    assert_eq!(read_at(&b.path("f"), 10, 11), b"after-close");
}

#[test]
fn a_lock_makes_the_mapping_coherent_with_the_other_mount() {
    let (_c, a, b) = cluster();
    std::fs::write(a.path("f"), vec![b'o'; 2 * PAGE]).unwrap();
    let (mut p, pf, pm) = mapped(&a.path("f"), 2 * PAGE);
    let (mut q, qf, qm) = mapped(&b.path("f"), 2 * PAGE);
    // Both mappings have the page cached.
    assert_eq!(p.ask(&format!("mread {pm} 0 5")), "data ooooo");
    assert_eq!(q.ask(&format!("mread {qm} 0 5")), "data ooooo");
    // q writes with write(2) under a lock on mount b.
    assert_eq!(q.ask(&format!("setlk {qf} w 0 100")), "ok");
    assert_eq!(q.ask(&format!("write {qf} 0 fresh")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} u 0 100")), "ok");
    // p takes the lock: its mapping and its read(2) see q's bytes.
    assert_eq!(p.ask(&format!("setlkw {pf} r 0 100")), "ok");
    assert_eq!(p.ask(&format!("mread {pm} 0 5")), "data fresh");
    assert_eq!(p.ask(&format!("read {pf} 0 5")), "data fresh");
    // p writes through its mapping under a write lock and releases without
    // msync: the release publishes it, to q's read(2) and to q's mapping
    // once q holds the lock.
    assert_eq!(p.ask(&format!("setlk {pf} w 0 100")), "ok");
    assert_eq!(p.ask(&format!("mwrite {pm} 0 PPPPP")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} u 0 100")), "ok");
    assert_eq!(q.ask(&format!("setlkw {qf} r 0 100")), "ok");
    assert_eq!(q.ask(&format!("read {qf} 0 5")), "data PPPPP");
    assert_eq!(q.ask(&format!("mread {qm} 0 5")), "data PPPPP");
    assert_eq!(q.ask(&format!("setlk {qf} u 0 100")), "ok");
    // flock works the same way (whole file).
    assert_eq!(p.ask(&format!("flock {pf} ex")), "ok");
    assert_eq!(p.ask(&format!("mwrite {pm} {PAGE} flock")), "ok");
    assert_eq!(p.ask(&format!("flock {pf} un")), "ok");
    assert_eq!(q.ask(&format!("flock {qf} sh")), "ok");
    assert_eq!(q.ask(&format!("mread {qm} {PAGE} 5")), "data flock");
    assert_eq!(q.ask(&format!("flock {qf} un")), "ok");
    // Without a lock, a new mmap reads afresh (the kernel drops the cached
    // pages at every mmap of a direct-I/O file)...
    assert_eq!(q.ask(&format!("munmap {qm}")), "ok");
    assert_eq!(p.ask(&format!("write {pf} 0 again")), "ok");
    let qm = q.ask(&format!("mmap {qf} {}", 2 * PAGE));
    let qm = qm.strip_prefix("map ").unwrap().to_string();
    assert_eq!(q.ask(&format!("mread {qm} 0 5")), "data again");
    // ... and so does a new open after the last close (the mount forgets
    // the file at its last release; the kernel drops its pages at open).
    assert_eq!(q.ask(&format!("munmap {qm}")), "ok");
    assert_eq!(q.ask(&format!("close {qf}")), "ok");
    assert_eq!(p.ask(&format!("write {pf} 0 once-")), "ok");
    let (mut r, _, rm) = mapped(&b.path("f"), 2 * PAGE);
    assert_eq!(r.ask(&format!("mread {rm} 0 5")), "data once-");
}

/// The oracle for coherence under load: a counter in a mapping, incremented
/// under an fcntl write lock by processes on two mounts, loses no update.
/// Each mount has a single FUSE worker thread, so a notify sent from a
/// worker (whose write-backs need a worker) would deadlock here.
#[test]
fn a_locked_counter_in_mappings_on_two_mounts_loses_no_update_with_one_worker_each() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let one_worker = citronfs_mount::MountOptions { threads: 1, ..Default::default() };
    let a = TestMount::with_options(
        c.meta.local_addr(),
        citronfs_core::client::Transport::Auto,
        one_worker.clone(),
    );
    let b = TestMount::with_options(c.meta.local_addr(), citronfs_core::client::Transport::Auto, one_worker);
    std::fs::write(a.path("counter"), vec![0u8; 2 * PAGE]).unwrap();
    const PROCESSES_PER_MOUNT: usize = 3;
    const ROUNDS: usize = 40;
    let workers: Vec<_> = (0..2 * PROCESSES_PER_MOUNT)
        .map(|i| {
            let path = if i % 2 == 0 { a.path("counter") } else { b.path("counter") };
            std::thread::spawn(move || {
                let (mut p, fd, map) = mapped(&path, 2 * PAGE);
                for _ in 0..ROUNDS {
                    assert_eq!(p.ask(&format!("setlkw {fd} w 0 20")), "ok");
                    assert!(p.ask(&format!("mincr {map} 0")).starts_with("ok "));
                    // Another page of the file, written without a lock and
                    // never read: write-backs of it run alongside.
                    assert_eq!(p.ask(&format!("mwrite {map} {} x", PAGE + i)), "ok");
                    assert_eq!(p.ask(&format!("setlk {fd} u 0 20")), "ok");
                }
                assert_eq!(p.ask(&format!("munmap {map}")), "ok");
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker failed (or a probe stopped answering)");
    }
    let text = String::from_utf8(read_at(&b.path("counter"), 0, 20)).unwrap();
    assert_eq!(text.parse::<usize>().unwrap(), 2 * PROCESSES_PER_MOUNT * ROUNDS, "lost updates");
}
