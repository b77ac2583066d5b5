//! The file system below FUSE: a meta-server, data servers and several
//! clients in one process, talking over loopback tcp exactly as separate
//! processes would. Each client is its own node with its own connections.

use std::time::{Duration, Instant};

use citronfs_core::client::{ClientConfig, FsClient};
use citronfs_core::proto::{RenameMode, XattrMode};
use citronfs_core::types::{Caller, FileKind, Ino, SetAttr, MAX_FILE_SIZE};
use citronfs_core::FsError;
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use citronfs_tests::TEST_LEASE;

const ME: Caller = Caller { uid: 1000, gid: 1000, pid: 1 };
const CHUNK: u64 = 64 * 1024;

struct Cluster {
    meta: MetaServer,
    data: Vec<DataServer>,
}

impl Cluster {
    fn start(data_servers: usize, capacity: u64) -> Self {
        let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.chunk_size = CHUNK;
        cfg.slot_bytes = 1 << 20;
        // The suite's lease, not shorter: a client of a busy machine keeps it.
        cfg.lease = TEST_LEASE;
        let meta = MetaServer::start(cfg).unwrap();
        let data = (0..data_servers)
            .map(|_| {
                DataServer::start("127.0.0.1:0".parse().unwrap(), meta.local_addr(), capacity, None).unwrap()
            })
            .collect();
        Self { meta, data }
    }

    /// A client whose calls wait long enough for a meta-server on a busy
    /// machine (a 2 s bound failed an open at load 7); a server that is
    /// gone answers at once, whatever the bound.
    fn client(&self) -> FsClient {
        FsClient::connect(ClientConfig {
            timeout: Duration::from_secs(10),
            ..ClientConfig::new(self.meta.local_addr())
        })
        .unwrap()
    }
}

fn new_file(c: &FsClient, name: &str) -> Ino {
    let a = c.create(ME, Ino::ROOT, name.as_bytes(), FileKind::File, 0o644, 0).unwrap();
    c.open(a.ino).unwrap();
    a.ino
}

#[test]
fn data_written_by_one_client_is_read_by_another() {
    let cluster = Cluster::start(2, 4 << 20);
    let (a, b) = (cluster.client(), cluster.client());
    let ino = new_file(&a, "f");
    // Crosses chunk boundaries and both data servers.
    let data: Vec<u8> = (0..3 * CHUNK + 123).map(|i| (i * 7 % 251) as u8).collect();
    a.write(ino, 1000, &data, false).unwrap();
    b.open(ino).unwrap();
    assert_eq!(b.read(ino, 1000, data.len() as u32).unwrap(), data);
    assert_eq!(b.getattr(ino).unwrap().size, 1000 + data.len() as u64);
    // The bytes before the first write are a hole: zeros.
    assert_eq!(b.read(ino, 0, 1000).unwrap(), vec![0; 1000]);
    // Reading past the end is short.
    assert_eq!(b.read(ino, 1000 + data.len() as u64 - 10, 100).unwrap().len(), 10);
    // An overwrite from b is seen by a right after (no cache).
    b.write(ino, 1000, b"XYZ", false).unwrap();
    assert_eq!(a.read(ino, 1000, 3).unwrap(), b"XYZ");
    let c = a.verb_counts();
    assert!(c.round_trips > 0 && c.bytes_written >= data.len() as u64);
}

#[test]
fn sparse_files_beyond_4gib_and_truncate() {
    let cluster = Cluster::start(1, 4 << 20);
    let c = cluster.client();
    let ino = new_file(&c, "sparse");
    let far = 5u64 << 30;
    c.write(ino, far, b"tail", false).unwrap();
    assert_eq!(c.getattr(ino).unwrap().size, far + 4);
    assert_eq!(c.read(ino, far - 4, 8).unwrap(), b"\0\0\0\0tail");
    assert_eq!(c.read(ino, 1 << 30, 16).unwrap(), vec![0; 16], "a hole in the middle");
    // Shrink into the middle of a chunk, then extend: the cut bytes read zero.
    c.write(ino, 0, &[0xAB; 100], false).unwrap();
    c.setattr(ME, ino, SetAttr { size: Some(10), ..Default::default() }).unwrap();
    assert_eq!(c.read(ino, 0, 100).unwrap(), vec![0xAB; 10]);
    c.setattr(ME, ino, SetAttr { size: Some(100), ..Default::default() }).unwrap();
    let back = c.read(ino, 0, 100).unwrap();
    assert_eq!(&back[..10], &[0xAB; 10]);
    assert_eq!(&back[10..], &[0; 90][..], "truncate then extend reads zeros");
    // Past the maximum size.
    assert_eq!(c.write(ino, MAX_FILE_SIZE, b"x", false), Err(FsError::FileTooBig));
}

#[test]
fn full_data_servers_give_enospc_and_lose_nothing() {
    let cluster = Cluster::start(1, 1 << 20); // 16 chunks of 64 KiB
    let c = cluster.client();
    let ino = new_file(&c, "big");
    let block = vec![1u8; CHUNK as usize];
    let mut written = 0;
    let err = loop {
        match c.write(ino, written, &block, false) {
            Ok(_) => written += CHUNK,
            Err(e) => break e,
        }
    };
    assert_eq!(err, FsError::NoSpace);
    assert_eq!(written, 16 * CHUNK);
    assert_eq!(c.getattr(ino).unwrap().size, written, "the refused write did not change the size");
    assert_eq!(c.read(ino, written - CHUNK, CHUNK as u32).unwrap(), block, "earlier data intact");
    let st = c.statfs().unwrap();
    assert_eq!((st.total_bytes, st.free_bytes), (16 * CHUNK, 0));
}

#[test]
fn namespace_operations_and_their_errors() {
    let cluster = Cluster::start(1, 4 << 20);
    let (a, b) = (cluster.client(), cluster.client());
    let d = a.create(ME, Ino::ROOT, b"dir", FileKind::Dir, 0o755, 0).unwrap();
    assert_eq!(a.getattr(Ino::ROOT).unwrap().nlink, 3);
    assert_eq!(a.create(ME, Ino::ROOT, b"dir", FileKind::File, 0o644, 0).unwrap_err(), FsError::Exists);
    let f = a.create(ME, d.ino, b"f", FileKind::File, 0o600, 0).unwrap();
    assert_eq!(b.lookup(ME, d.ino, b"f").unwrap().ino, f.ino, "seen from the other client");
    assert_eq!(b.lookup(ME, d.ino, b"nope").unwrap_err(), FsError::NotFound);
    assert_eq!(a.rmdir(ME, Ino::ROOT, b"dir").unwrap_err(), FsError::NotEmpty);
    assert_eq!(a.unlink(ME, Ino::ROOT, b"dir").unwrap_err(), FsError::IsDir);
    assert_eq!(a.lookup(ME, f.ino, b"x").unwrap_err(), FsError::NotDir);
    let long = vec![b'a'; 256];
    assert_eq!(a.create(ME, d.ino, &long, FileKind::File, 0o644, 0).unwrap_err(), FsError::NameTooLong);
    // Hard links count.
    a.link(ME, f.ino, Ino::ROOT, b"hard").unwrap();
    assert_eq!(b.getattr(f.ino).unwrap().nlink, 2);
    a.unlink(ME, d.ino, b"f").unwrap();
    assert_eq!(b.getattr(f.ino).unwrap().nlink, 1);
    // Symlinks.
    let s = a.symlink(ME, Ino::ROOT, b"ln", b"dir/target").unwrap();
    assert_eq!(b.readlink(s.ino).unwrap(), b"dir/target");
    // Rename over an existing file replaces it atomically; NOREPLACE refuses; EXCHANGE swaps.
    let x = a.create(ME, Ino::ROOT, b"x", FileKind::File, 0o644, 0).unwrap();
    let y = a.create(ME, Ino::ROOT, b"y", FileKind::File, 0o644, 0).unwrap();
    assert_eq!(
        a.rename(ME, Ino::ROOT, b"x", Ino::ROOT, b"y", RenameMode::NoReplace).unwrap_err(),
        FsError::Exists
    );
    a.rename(ME, Ino::ROOT, b"x", Ino::ROOT, b"y", RenameMode::Exchange).unwrap();
    assert_eq!(b.lookup(ME, Ino::ROOT, b"y").unwrap().ino, x.ino);
    assert_eq!(b.lookup(ME, Ino::ROOT, b"x").unwrap().ino, y.ino);
    a.rename(ME, Ino::ROOT, b"x", Ino::ROOT, b"y", RenameMode::Replace).unwrap();
    assert_eq!(b.lookup(ME, Ino::ROOT, b"y").unwrap().ino, y.ino);
    assert_eq!(b.lookup(ME, Ino::ROOT, b"x").unwrap_err(), FsError::NotFound);
    assert_eq!(b.getattr(x.ino).map(|a| a.nlink), Ok(0), "the replaced inode has no link left");
    // A directory cannot move into itself.
    let sub = a.create(ME, d.ino, b"sub", FileKind::Dir, 0o755, 0).unwrap();
    assert!(matches!(
        a.rename(ME, Ino::ROOT, b"dir", sub.ino, b"loop", RenameMode::Replace),
        Err(FsError::Invalid(_))
    ));
    // Xattrs.
    a.set_xattr(ME, y.ino, b"user.k", b"v1", XattrMode::Create).unwrap();
    assert_eq!(a.set_xattr(ME, y.ino, b"user.k", b"v2", XattrMode::Create).unwrap_err(), FsError::Exists);
    assert_eq!(a.set_xattr(ME, y.ino, b"user.n", b"v", XattrMode::Replace).unwrap_err(), FsError::NoAttr);
    assert_eq!(b.get_xattr(ME, y.ino, b"user.k").unwrap(), b"v1");
    assert_eq!(b.list_xattr(ME, y.ino).unwrap(), vec![b"user.k".to_vec()]);
    b.remove_xattr(ME, y.ino, b"user.k").unwrap();
    assert_eq!(a.get_xattr(ME, y.ino, b"user.k").unwrap_err(), FsError::NoAttr);
    // Timestamps: an explicit mtime sticks, a write moves it forward.
    let t = citronfs_core::types::Timestamp { secs: 1_000_000, nanos: 5 };
    let attr =
        a.setattr(ME, y.ino, SetAttr { mtime: Some(t), atime: Some(t), ..Default::default() }).unwrap();
    assert_eq!((attr.mtime, attr.atime), (t, t));
    a.open(y.ino).unwrap();
    a.write(y.ino, 0, b"now", false).unwrap();
    assert!(b.getattr(y.ino).unwrap().mtime > t);
}

#[test]
fn readdir_offsets_stay_valid_while_the_directory_changes() {
    let cluster = Cluster::start(1, 4 << 20);
    let c = cluster.client();
    let n = 10_000;
    for i in 0..n {
        c.create(ME, Ino::ROOT, format!("f{i:05}").as_bytes(), FileKind::File, 0o644, 0).unwrap();
    }
    let mut seen = std::collections::HashSet::new();
    let mut after = 0;
    let mut deleted = 0;
    loop {
        let page = c.readdir(ME, Ino::ROOT, after, 500).unwrap();
        if page.is_empty() {
            break;
        }
        // Delete an entry already listed and add a new one between pages.
        if deleted < 5 {
            let name = format!("f{deleted:05}");
            c.unlink(ME, Ino::ROOT, name.as_bytes()).unwrap();
            deleted += 1;
        }
        for e in &page {
            assert!(seen.insert(e.name.clone()), "{:?} listed twice", String::from_utf8_lossy(&e.name));
            after = e.cookie;
        }
    }
    for i in 0..n {
        assert!(seen.contains(format!("f{i:05}").as_bytes()), "f{i:05} missing");
    }
    assert!(seen.contains(b".".as_slice()) && seen.contains(b"..".as_slice()));
}

#[test]
fn unlinked_open_file_keeps_its_data_until_release() {
    let cluster = Cluster::start(1, 1 << 20);
    let (a, b) = (cluster.client(), cluster.client());
    let ino = new_file(&a, "tmp");
    a.write(ino, 0, b"still here", false).unwrap();
    b.unlink(ME, Ino::ROOT, b"tmp").unwrap();
    assert_eq!(a.read(ino, 0, 10).unwrap(), b"still here");
    a.release(ino).unwrap();
    // Freed after a grace period (a lease), not at once: a lookup that raced
    // the unlink may still open it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.getattr(ino).is_ok() {
        assert!(Instant::now() < deadline, "the unlinked file was never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(a.getattr(ino).unwrap_err(), FsError::NotFound);
}

#[test]
fn vanished_servers_give_errors_promptly() {
    let mut cluster = Cluster::start(1, 1 << 20);
    // A meta-server that does not come back is waited for this long (a
    // restart within it is ridden through: tools/tests/restart.rs).
    let meta_wait = Duration::from_secs(2);
    let c = FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(10),
        meta_wait,
        ..ClientConfig::new(cluster.meta.local_addr())
    })
    .unwrap();
    let ino = new_file(&c, "f");
    c.write(ino, 0, b"abc", false).unwrap();
    cluster.data[0].shutdown();
    let t = Instant::now();
    assert!(matches!(c.read(ino, 0, 3), Err(FsError::Io(_))));
    cluster.meta.shutdown();
    let t_meta = Instant::now();
    assert!(matches!(c.getattr(ino), Err(FsError::MetaServerDown)));
    assert!(t_meta.elapsed() >= meta_wait, "answered before the wait for a restart: {:?}", t_meta.elapsed());
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
    // And a client for a cluster that is not there fails to connect, clearly.
    let err = FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(1),
        ..ClientConfig::new(cluster.meta.local_addr())
    });
    assert!(matches!(err, Err(FsError::Io(_))));
}

/// A client far from the servers (every round trip 80 ms longer, over tcp)
/// spends longer joining the cluster than the 2 s lease (its 32 RTT probes
/// alone take 2.6 s): its lease is renewed from its registration on, so it
/// comes out of `connect` neither fenced nor registered again. (Before, the
/// renewals started after the join: the lease of a client that far
/// expired while it joined, the NICs cut the fenced client's connections,
/// and `connect` failed with "the host closed the connection".)
#[test]
fn a_far_client_keeps_its_lease_while_it_joins() {
    let cluster = Cluster::start(1, 1 << 20);
    let far = FsClient::connect(ClientConfig {
        timeout: Duration::from_secs(10),
        transport: citronfs_core::client::Transport::Tcp,
        added_rtt: Duration::from_millis(80),
        ..ClientConfig::new(cluster.meta.local_addr())
    })
    .unwrap();
    assert!(!far.is_fenced(), "fenced right after joining");
    assert_eq!(far.registration(), 0, "had to register again");
    let ino = new_file(&far, "f");
    far.write(ino, 0, b"far", false).unwrap();
    let near = cluster.client();
    near.open(ino).unwrap();
    assert_eq!(near.read(ino, 0, 3).unwrap(), b"far");
}
