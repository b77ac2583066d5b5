//! Citron tree growth inside the file system (DESIGN.md §4 "Tree growth",
//! citron-fast23.md §3.9): a file's range lock starts as a small tree on the
//! meta-server's tree host, writes and locks past it go through the
//! spillover mutex, and the releases ask the host to scale the tree up.
//! Checked through the file system on both backends (shm and tcp clients):
//! a file written far past its tree by two clients ends with a grown,
//! idle tree and its data intact; concurrent writers on two clients lose
//! nothing and never tear while the tree grows; fcntl locks at 1 GiB
//! (SQLite's lock bytes) from two mounts work and grow the tree; opening a
//! range lock per operation costs no RPC; the tree goes with the inode.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use citron_lock::dslr::DslrWord;
use citron_lock::rdma::{Node, TcpOptions};
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::types::{Caller, Ino};
use citronfs_meta_server::CitronTreeState;
use citronfs_tests::citron_stress;
use citronfs_tests::probe::Probe;
use citronfs_tests::TestCluster;

const ME: Caller = Caller { uid: 1000, gid: 1000, pid: 1 };
const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
/// m of the paper (the clients' and the host's `CitronConfig`).
const M: u32 = 4;
/// A file's tree at creation: 1024 units of 4 KiB, depth 2.
const FIRST_DEPTH: u32 = 2;

fn client(c: &TestCluster, transport: Transport) -> FsClient {
    let mut config = ClientConfig::new(c.meta.local_addr());
    config.transport = transport;
    config.timeout = Duration::from_secs(5);
    FsClient::connect(config).expect("join the cluster")
}

/// Deterministic contents of piece `n`.
fn pattern(n: u64, len: u64) -> Vec<u8> {
    (0..len).map(|i| ((n * 131 + i * 7 + i / 4096) % 251) as u8).collect()
}

fn tree(c: &TestCluster, ino: Ino) -> CitronTreeState {
    c.meta.citron_tree(ino).expect("the file has a hosted Citron tree")
}

/// Every word of every segment idle (with exactly the Sup/Exp marks of its
/// history), the maximizer zero and the spillover mutex idle, read through
/// the meta-server's NIC.
fn assert_idle(c: &TestCluster, state: &CitronTreeState) {
    let node = Node::join_tcp(c.meta.nic_addr(), TcpOptions::default()).unwrap();
    let ep = node.endpoint().unwrap();
    citron_stress::check_idle_geometry(&ep, &state.geometry, M, false);
    let spill = DslrWord(state.spillover);
    assert_eq!((spill.nx(), spill.ns()), (spill.maxx(), spill.maxs()), "spillover idle: {spill:?}");
}

/// Two clients write a 72 MiB file in alternating 256 KiB blocks, in
/// increasing order, from a tree of 1024 units (4 MiB): every block past
/// the tree goes through the spillover and its release asks for a
/// scale-up. The tree ends deep enough for the whole file (depth 5 at
/// least), idle, with its maximizer zero and its spillover idle and used;
/// every byte reads back as written, from both clients.
#[test]
fn a_file_written_far_past_its_tree_by_two_clients_ends_with_a_grown_tree() {
    for transport in [Transport::Auto, Transport::Tcp] {
        let c = TestCluster::start(2, 48 << 20, 1 << 20);
        let (a, b) = (client(&c, transport), client(&c, transport));
        let ino = a.create_open(ME, Ino::ROOT, b"big", 0o644).unwrap().ino;
        b.open(ino).unwrap();
        assert_eq!(tree(&c, ino).geometry.depths(), vec![FIRST_DEPTH]);
        const BLOCK: u64 = 256 << 10;
        const BLOCKS: u64 = 288; // 72 MiB
        std::thread::scope(|s| {
            for (k, cl) in [&a, &b].into_iter().enumerate() {
                s.spawn(move || {
                    for blk in (k as u64..BLOCKS).step_by(2) {
                        cl.write(ino, blk * BLOCK, &pattern(blk, BLOCK), false).unwrap();
                    }
                });
            }
        });
        assert_eq!(a.file_size(ino).unwrap(), BLOCKS * BLOCK);
        for (who, cl) in [("a", &a), ("b", &b)] {
            for piece in 0..BLOCKS / 16 {
                let got = cl.read(ino, piece * 16 * BLOCK, (16 * BLOCK) as u32).unwrap();
                for i in 0..16 {
                    let blk = piece * 16 + i;
                    let part = &got[(i * BLOCK) as usize..((i + 1) * BLOCK) as usize];
                    assert!(
                        part == pattern(blk, BLOCK).as_slice(),
                        "{transport:?}: block {blk} read by {who}"
                    );
                }
            }
        }
        let state = tree(&c, ino);
        let g = &state.geometry;
        println!("{transport:?}: tree depths {:?}, host {:?}", g.depths(), c.meta.tree_scale_stats());
        assert!(g.segments.len() >= 2, "the tree grew: {:?}", g.depths());
        assert!(g.shape().depth() >= 5, "covers 72 MiB of 4 KiB units: {:?}", g.depths());
        assert!(g.shape().units() >= BLOCKS * BLOCK / 4096);
        assert!(DslrWord(state.spillover).maxx() > 0, "the blocks past the first tree used the spillover");
        assert_idle(&c, &state);
    }
}

/// Four writers (two threads on each of two clients) step through a file
/// together: at every step each writes a 96 KiB block that all of them
/// write (its own byte value throughout, straddling 64 KiB chunks, so a
/// write is several verbs) and a 6 KiB slot of its own, slots of different
/// writers sharing granules. The file reaches 24 MiB from a 4 MiB tree, so
/// it grows while the others hold and wait for ranges. Afterwards every
/// shared block holds one writer's value throughout (a write never tore
/// another), every private slot holds what its writer wrote (nothing lost),
/// readers during the run never saw a torn block, and the tree is idle.
#[test]
fn concurrent_writers_lose_nothing_and_never_tear_while_the_tree_grows() {
    const SHARED: u64 = 96 << 10;
    const SLOT: u64 = 6 << 10;
    const WRITERS: u64 = 4;
    const STEP: u64 = SHARED + WRITERS * SLOT;
    const STEPS: u64 = 200;
    for transport in [Transport::Auto, Transport::Tcp] {
        let c = TestCluster::start(2, 32 << 20, 64 << 10);
        let clients = [client(&c, transport), client(&c, transport)];
        let ino = clients[0].create_open(ME, Ino::ROOT, b"shared", 0o644).unwrap().ino;
        clients[1].open(ino).unwrap();
        std::thread::scope(|s| {
            for w in 0..WRITERS {
                let cl = &clients[(w % 2) as usize];
                s.spawn(move || {
                    let fill = vec![w as u8 + 1; SHARED as usize];
                    for k in 0..STEPS {
                        cl.write(ino, k * STEP, &fill, false).unwrap();
                        cl.write(ino, k * STEP + SHARED + w * SLOT, &pattern(k * WRITERS + w, SLOT), false)
                            .unwrap();
                        if k % 8 == 7 {
                            let seen = cl.read(ino, (k - 4) * STEP, SHARED as u32).unwrap();
                            assert!(
                                seen.iter().all(|&x| x == seen[0]) && (1..=WRITERS as u8).contains(&seen[0]),
                                "{transport:?}: writer {w} read a torn block {}",
                                k - 4
                            );
                        }
                    }
                });
            }
        });
        let reader = &clients[1];
        assert_eq!(reader.file_size(ino).unwrap(), STEPS * STEP);
        for k in 0..STEPS {
            let step = reader.read(ino, k * STEP, STEP as u32).unwrap();
            let block = &step[..SHARED as usize];
            assert!(
                block.iter().all(|&x| x == block[0]) && (1..=WRITERS as u8).contains(&block[0]),
                "{transport:?}: shared block {k} is torn"
            );
            for w in 0..WRITERS {
                let at = (SHARED + w * SLOT) as usize;
                assert!(
                    step[at..at + SLOT as usize] == pattern(k * WRITERS + w, SLOT),
                    "{transport:?}: slot of writer {w} at step {k} lost"
                );
            }
        }
        let state = tree(&c, ino);
        println!(
            "{transport:?}: tree depths {:?}, host {:?}",
            state.geometry.depths(),
            c.meta.tree_scale_stats()
        );
        assert!(state.geometry.shape().depth() >= 4, "grew to cover 24 MiB: {:?}", state.geometry.depths());
        assert_idle(&c, &state);
    }
}

/// SQLite's locks live at 1 GiB (PENDING 0x40000000, RESERVED +1, SHARED
/// +2..+512) whatever the file's size. From two mounts: the shared range is
/// shared, RESERVED and EXCLUSIVE conflict as they must, F_GETLK reports
/// the holder across mounts; the first lock out there grows the tree to
/// reach it (a 4 KiB-granule tree of depth 7 covers 4 GiB), with no lock
/// lost while it grows; and four processes on two mounts that count under
/// a write lock on the PENDING byte lose no increment.
#[test]
fn fcntl_locks_at_one_gib_from_two_mounts_work_and_grow_the_tree() {
    const PENDING: u64 = 1 << 30;
    const RESERVED: u64 = PENDING + 1;
    const SHARED: u64 = PENDING + 2;
    let c = TestCluster::start(1, 16 << 20, 1 << 20);
    let (ma, mb) = (c.mount(), c.mount());
    std::fs::write(ma.path("db"), vec![b'0'; 20]).unwrap();
    let ino = Ino(std::fs::metadata(ma.path("db")).unwrap().ino());
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&ma.path("db"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&mb.path("db"));
    assert_eq!(tree(&c, ino).geometry.depths(), vec![FIRST_DEPTH]);
    assert_eq!(p.ask(&format!("setlk {pf} r {SHARED} 510")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} r {SHARED} 510")), "ok", "SHARED is shared across mounts");
    assert_eq!(q.ask(&format!("setlk {qf} w {RESERVED} 1")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w {RESERVED} 1")), "err EAGAIN", "one RESERVED");
    assert_eq!(p.ask(&format!("getlk {pf} w {RESERVED} 1")), format!("w {RESERVED} 1 {}", q.pid));
    assert_eq!(p.ask(&format!("setlk {pf} w {SHARED} 510")), "err EAGAIN", "EXCLUSIVE waits for q's SHARED");
    assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
    assert_eq!(p.ask(&format!("setlk {pf} w {SHARED} 510")), "ok", "EXCLUSIVE once q is gone");
    assert_eq!(q.ask(&format!("setlk {qf} r {SHARED} 1")), "err EAGAIN");
    assert_eq!(q.ask(&format!("getlk {qf} r {} 1", SHARED + 100)), format!("w {SHARED} 510 {}", p.pid));
    assert_eq!(p.ask(&format!("setlk {pf} u 0 0")), "ok");
    let grown = tree(&c, ino);
    println!(
        "after the first locks: depths {:?}, host {:?}",
        grown.geometry.depths(),
        c.meta.tree_scale_stats()
    );
    assert!(
        grown.geometry.shape().units() > (SHARED + 510) / 4096,
        "reaches 1 GiB: {:?}",
        grown.geometry.depths()
    );
    assert!(grown.geometry.shape().depth() <= grown.max_depth);
    // Counting under the PENDING byte's write lock, two processes per mount.
    const ROUNDS: u64 = 25;
    let counters: Vec<(Probe, i32)> = [&ma, &ma, &mb, &mb]
        .into_iter()
        .map(|m| {
            let mut pr = Probe::spawn(PROBE);
            let fd = pr.open(&m.path("db"));
            (pr, fd)
        })
        .collect();
    std::thread::scope(|s| {
        for (mut pr, fd) in counters {
            s.spawn(move || {
                for _ in 0..ROUNDS {
                    assert_eq!(pr.ask(&format!("setlkw {fd} w {PENDING} 1")), "ok");
                    assert!(pr.ask(&format!("incr {fd} 0")).starts_with("ok "));
                    assert_eq!(pr.ask(&format!("setlk {fd} u {PENDING} 1")), "ok");
                }
            });
        }
    });
    let text = std::fs::read_to_string(mb.path("db")).unwrap();
    assert_eq!(text.trim_matches('\0').parse::<u64>().unwrap(), 4 * ROUNDS, "no increment lost");
    assert_idle(&c, &tree(&c, ino));
}

/// A range lock is opened per operation, and that costs no RPC: a client
/// that did not see a scale-up asks the host once for the configuration
/// (when its root turns out superseded) and never again; a client that
/// made it or already follows it asks nothing; a client that joins later
/// starts from the file's site and also asks once.
#[test]
fn a_range_lock_per_operation_costs_no_rpc() {
    for transport in [Transport::Auto, Transport::Tcp] {
        let c = TestCluster::start(1, 48 << 20, 1 << 20);
        let (a, b) = (client(&c, transport), client(&c, transport));
        let ino = a.create_open(ME, Ino::ROOT, b"f", 0o644).unwrap().ino;
        b.open(ino).unwrap();
        let data = vec![5u8; 4096];
        let base = c.meta.tree_host_requests();
        for i in 0..20 {
            a.write(ino, i * 4096, &data, false).unwrap();
            b.write(ino, (i + 100) * 4096, &data, false).unwrap();
        }
        assert_eq!(c.meta.tree_host_requests(), base, "{transport:?}: no RPC inside the first tree");
        // Past the tree: one ScaleUp RPC from a's release.
        a.write(ino, 32 << 20, &data, false).unwrap();
        assert_eq!(c.meta.tree_host_requests(), base + 1, "{transport:?}: one scale-up");
        assert!(tree(&c, ino).geometry.segments.len() >= 2);
        for i in 0..20 {
            a.write(ino, (i + 2000) * 4096, &data, false).unwrap();
        }
        assert_eq!(c.meta.tree_host_requests(), base + 1, "{transport:?}: a follows what it made");
        for i in 0..20 {
            b.write(ino, (i + 3000) * 4096, &data, false).unwrap();
        }
        assert_eq!(c.meta.tree_host_requests(), base + 2, "{transport:?}: b refreshes once");
        let late = client(&c, transport);
        late.open(ino).unwrap();
        for i in 0..20 {
            late.write(ino, (i + 4000) * 4096, &data, false).unwrap();
            assert_eq!(late.read(ino, (i + 4000) * 4096, 4096).unwrap(), data);
        }
        assert_eq!(c.meta.tree_host_requests(), base + 3, "{transport:?}: a late client refreshes once");
        assert_idle(&c, &tree(&c, ino));
    }
}

/// The meta-server creates a file's tree at its first open and frees it
/// (with the segments its scale-ups added and its spillover word) with the
/// inode: after unlink and last close the lock memory in use is back to
/// what it was before the file existed.
#[test]
fn the_tree_goes_with_the_inode() {
    let c = TestCluster::start(1, 16 << 20, 1 << 20);
    let a = client(&c, Transport::Auto);
    let (memory, instances) = (c.meta.lock_memory_in_use(), c.meta.tree_instances());
    let ino = a.create_open(ME, Ino::ROOT, b"f", 0o644).unwrap().ino;
    assert_eq!(c.meta.tree_instances(), instances + 1);
    let first = c.meta.lock_memory_in_use();
    assert!(first > memory);
    a.write(ino, 100 << 20, &[7u8; 4096], false).unwrap();
    let state = tree(&c, ino);
    assert!(state.geometry.segments.len() >= 2, "{:?}", state.geometry.depths());
    assert!(c.meta.lock_memory_in_use() >= first + state.geometry.bytes() - state.geometry.blocks()[0].1);
    a.release(ino).unwrap();
    a.unlink(ME, Ino::ROOT, b"f").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.meta.lock_memory_in_use() != memory {
        assert!(
            Instant::now() < deadline,
            "lock memory {} never came back to {memory}",
            c.meta.lock_memory_in_use()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.meta.tree_instances(), instances);
    assert!(c.meta.citron_tree(ino).is_none());
}
