//! Releases sent after the close, in batches (`fs::client::releases`): what
//! the meta-server counts open while they wait, and what a later unlink,
//! rename, statfs or reopen on the same client sees.

use std::time::{Duration, Instant};

use citronfs_core::client::{ClientConfig, FsClient};
use citronfs_core::proto::RenameMode;
use citronfs_core::rpc_counts::MetaKind;
use citronfs_core::types::{Caller, Ino};
use citronfs_meta_server::MetaServerConfig;
use citronfs_tests::{TestCluster, TEST_LEASE};

const MIB: u64 = 1 << 20;
const ME: Caller = Caller { uid: 0, gid: 0, pid: 1 };
/// A failure bound only.
const BOUND: Duration = Duration::from_secs(20);

fn cluster() -> TestCluster {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = MIB;
    cfg.lease = TEST_LEASE;
    TestCluster::start_sized(cfg, 1, 64 * MIB)
}

fn client(c: &TestCluster) -> FsClient {
    FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(10),
        ..ClientConfig::new(c.meta.local_addr())
    })
    .unwrap()
}

/// A client whose queued releases wait until something sends them (a
/// batch fills up, a flush), not a moment.
fn holding_client(c: &TestCluster) -> FsClient {
    FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(10),
        release_linger: Duration::from_secs(3600),
        ..ClientConfig::new(c.meta.local_addr())
    })
    .unwrap()
}

fn open_files(c: &TestCluster) -> u64 {
    c.meta.status().files.open_files
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + BOUND;
    while !f() {
        assert!(Instant::now() < end, "{what}: not seen in {BOUND:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A file written, closed (its release queued) and unlinked at once: the
/// unlink sends the queued release first, so the space is free when it
/// answers; so is a file a rename replaces.
#[test]
fn an_unlink_or_rename_right_after_the_close_frees_the_space_when_it_answers() {
    let c = cluster();
    let a = holding_client(&c);
    let free = |a: &FsClient| a.statfs().unwrap().free_bytes;
    let empty = free(&a);
    // One chunk less a byte: released later (a file past its first chunk
    // is released at once).
    let block = vec![5u8; MIB as usize - 1];
    let ino = a.create_open(ME, Ino::ROOT, b"big", 0o644).unwrap().ino;
    a.write(ino, 0, &block, false).unwrap();
    a.release_later(ino).unwrap();
    assert_eq!(a.queued_releases(), 1);
    a.unlink(ME, Ino::ROOT, b"big").unwrap();
    assert_eq!(open_files(&c), 0, "the queued release went before the unlink");
    assert_eq!(free(&a), empty, "the unlinked file's space is free when the unlink answers");

    let target = a.create_open(ME, Ino::ROOT, b"target", 0o644).unwrap().ino;
    a.write(target, 0, &block, false).unwrap();
    a.release_later(target).unwrap();
    let other = a.create_open(ME, Ino::ROOT, b"other", 0o644).unwrap().ino;
    a.release(other).unwrap();
    a.rename(ME, Ino::ROOT, b"other", Ino::ROOT, b"target", RenameMode::Replace).unwrap();
    assert_eq!(free(&a), empty, "the replaced file's space is free when the rename answers");
}

/// A reopen on the same client before its queued release is sent: the
/// meta-server counts the opens, so the file stays open there after the
/// late release, and closes with the reopen's release.
#[test]
fn a_reopen_before_the_queued_release_keeps_the_file_open() {
    let c = cluster();
    let a = client(&c);
    let ino = a.create_open(ME, Ino::ROOT, b"f", 0o644).unwrap().ino;
    a.release_later(ino).unwrap();
    a.open(ino).unwrap();
    a.flush_releases();
    assert_eq!(a.queued_releases(), 0);
    assert_eq!(open_files(&c), 1, "the reopen is still counted after the late release");
    a.write(ino, 0, b"still open", false).unwrap();
    a.release(ino).unwrap();
    assert_eq!(open_files(&c), 0);
}

/// A create loop's releases wait for one another; the first call of
/// another kind (here a lookup) has them sent at once, not after the
/// linger (an hour here).
#[test]
fn creates_batch_their_releases_and_another_call_sends_them() {
    let c = cluster();
    let a = holding_client(&c);
    let files = 5;
    for i in 0..files {
        let ino = a.create_open(ME, Ino::ROOT, format!("f{i}").as_bytes(), 0o644).unwrap().ino;
        a.release_later(ino).unwrap();
    }
    assert_eq!(a.queued_releases(), files, "a create sent the releases queued before it");
    assert_eq!(open_files(&c), files as u64);
    a.lookup(ME, Ino::ROOT, b"f0").unwrap();
    until("the releases sent after a lookup", || open_files(&c) == 0);
    assert_eq!(a.queued_releases(), 0);
}

/// Nobody flushes: the sender thread sends what was queued by itself, as
/// few messages for many files.
#[test]
fn queued_releases_reach_the_meta_server_by_themselves() {
    let c = cluster();
    let a = client(&c);
    let files = 50;
    let inos: Vec<Ino> = (0..files)
        .map(|i| a.create_open(ME, Ino::ROOT, format!("f{i}").as_bytes(), 0o644).unwrap().ino)
        .collect();
    assert_eq!(open_files(&c), files);
    let before = a.rpc_counts();
    for ino in inos {
        a.release_later(ino).unwrap();
    }
    until("every release at the meta-server", || open_files(&c) == 0);
    let sent = a.rpc_counts() - before;
    assert_eq!(sent.get(MetaKind::Release), 0);
    let batches = sent.get(MetaKind::ReleaseMany);
    assert!((1..=files).contains(&batches), "{batches} batches for {files} files");
}

/// Releases held back (a linger of an hour): files closed here and
/// unlinked by another client keep their space until their releases reach
/// the meta-server. A writer here gets that space: its first call that is
/// not an allocation sends the queue, and an allocation refused for want
/// of space would send it too.
#[test]
fn a_writer_short_of_space_sends_the_queued_releases_and_gets_their_space() {
    let c = cluster();
    let a = holding_client(&c);
    let b = client(&c);
    let empty = a.statfs().unwrap().free_bytes;
    // Files of one chunk each, less a byte: released later, not at once.
    let small = vec![3u8; MIB as usize - 1];
    let files = 40;
    for i in 0..files {
        let name = format!("small{i}");
        let ino = a.create_open(ME, Ino::ROOT, name.as_bytes(), 0o644).unwrap().ino;
        a.write(ino, 0, &small, false).unwrap();
        a.release_later(ino).unwrap();
        b.unlink(ME, Ino::ROOT, name.as_bytes()).unwrap();
    }
    assert_eq!(a.queued_releases(), files as usize, "the releases wait in the queue");
    let free_while_queued = b.statfs().unwrap().free_bytes;
    assert!(free_while_queued + files * (MIB - 1) <= empty, "the unlinked files still hold their space");

    // A file of more than is free while the releases wait.
    let big = a.create_open(ME, Ino::ROOT, b"big", 0o644).unwrap().ino;
    let chunks = free_while_queued / MIB + 4;
    let chunk = vec![7u8; MIB as usize];
    for i in 0..chunks {
        a.write(big, i * MIB, &chunk, false).unwrap_or_else(|e| panic!("chunk {i} of {chunks}: {e}"));
    }
    assert_eq!(a.queued_releases(), 0, "the writer sent the queued releases");
    assert_eq!(open_files(&c), 1, "only the big file is open");
    let back = a.read(big, (chunks - 1) * MIB, MIB as u32).unwrap();
    assert!(back == chunk, "the last chunk reads back as written");
}

/// A file past its first chunk is released at once: chunks taken ahead of
/// its writer go back with the release, so a statfs from another client
/// right after counts only what the file holds.
#[test]
fn a_file_past_its_first_chunk_is_released_at_once() {
    let c = cluster();
    let a = client(&c);
    let b = client(&c);
    let empty = b.statfs().unwrap().free_bytes;
    let ino = a.create_open(ME, Ino::ROOT, b"f", 0o644).unwrap().ino;
    let chunk = vec![9u8; MIB as usize];
    for i in 0..8 {
        a.write(ino, i * MIB, &chunk, false).unwrap();
    }
    assert!(empty - b.statfs().unwrap().free_bytes > 8 * MIB, "the writer was given chunks ahead");
    a.release_later(ino).unwrap();
    assert_eq!(a.queued_releases(), 0);
    assert_eq!(open_files(&c), 0);
    assert_eq!(
        empty - b.statfs().unwrap().free_bytes,
        8 * MIB,
        "the chunks ahead went back with the release"
    );
}

/// Lock memory held by files whose releases wait in the queue: a create
/// refused for want of it (ENFILE at the meta-server) sends them and
/// succeeds.
#[test]
fn a_create_short_of_lock_memory_sends_the_queued_releases_and_succeeds() {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = MIB;
    cfg.lease = TEST_LEASE;
    // Room for some 130-160 files.
    cfg.lock_bytes = 64 << 10;
    let c = TestCluster::start_sized(cfg, 1, 64 * MIB);
    let a = holding_client(&c);
    // Kept open: what is left is room for fewer files than a batch
    // (`releases::BATCH`), so only a refused create sends the queue.
    let held: Vec<Ino> = (0..100)
        .map(|i| a.create_open(ME, Ino::ROOT, format!("held{i}").as_bytes(), 0o644).unwrap().ino)
        .collect();
    for i in 0..300 {
        let name = format!("f{i}");
        let ino = a
            .create_open(ME, Ino::ROOT, name.as_bytes(), 0o644)
            .unwrap_or_else(|e| panic!("create {i} with {} releases queued: {e}", a.queued_releases()))
            .ino;
        a.release_later(ino).unwrap();
    }
    let s = c.meta.status();
    assert!(s.lock_memory.refused_opens >= 1, "lock memory never filled up: {:?}", s.lock_memory);
    for ino in held {
        a.release(ino).unwrap();
    }
}
