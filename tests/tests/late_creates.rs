//! Creates answered before they are sent (`fs::client::late_changes`
//! has the protocol): a caching mount answers the create of a regular file
//! in a directory delegated to it at once, with an inode the meta-server
//! lent it, and sends the create later with others. Nobody can tell: its
//! own next calls (a write, a lock, a rename, a release), and every other
//! mount's first look at the directory, come after the create at the
//! meta-server, and what the mount showed its kernel is what the
//! meta-server made.
//!
//! Tests that look from another mount hold the queued creates (and the
//! releases, which send them) until a call sends them, so that what the
//! other mount sees is what the recall made the holder send.

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use citron_lock::rdma::tcp::RpcClient;
use citron_rpc::auth::Keyring;
use citronfs_core::client::{FsClient, Transport};
use citronfs_core::proto::{AttrSlot, LateCreate, MetaRequest, MetaResponse};
use citronfs_core::rpc_counts::MetaKind;
use citronfs_core::types::{Caller, Ino, Timestamp};
use citronfs_meta_server::namespace::MAX_LOAN;
use citronfs_mount::MountOptions;
use citronfs_tests::coherence::{close, missing, race_late_changes};
use citronfs_tests::probe::Probe;
use citronfs_tests::{TestCluster, TestMount};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
/// Long enough that no grant or delegation expires during a test.
const LONG_TTL: Duration = Duration::from_secs(60);
const NOBODY: u32 = 65534;

fn caching() -> MountOptions {
    MountOptions { cache_ttl: LONG_TTL, ..MountOptions::default() }
}

/// A caching mount whose answered creates (and releases) wait until a
/// call sends them (`hold`), or go as they would in use.
fn mount(c: &TestCluster, hold: bool) -> TestMount {
    let config =
        if hold { c.holding_config(Transport::Auto) } else { c.client_config(None, Transport::Auto) };
    TestMount::with_config_and_options(config, caching())
}

fn cluster() -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, true);
    let b = c.mount_with(caching());
    (c, a, b)
}

fn names(m: &TestMount, dir: &str) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(m.path(dir)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    names
}

/// Creates `rel` on `m` and opens it for reading and writing.
fn create_rw(m: &TestMount, rel: &str) -> fs::File {
    fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(m.path(rel)).unwrap()
}

/// What two mounts must agree on about a file.
fn identity(m: &fs::Metadata) -> (u64, u32, u32, u32, u64, i64, i64, i64, i64) {
    (m.ino(), m.mode(), m.uid(), m.gid(), m.size(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec())
}

#[test]
fn creates_in_a_directory_made_here_cost_no_round_trip_and_go_together() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, true);
    fs::create_dir(a.path("d")).unwrap();
    let before = a.client.rpc_counts();
    for i in 0..100 {
        drop(fs::File::create(a.path(&format!("d/f{i}"))).unwrap());
    }
    let queued = a.client.queued_changes();
    a.client.flush_late_changes();
    let spent = a.client.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::CreateOpen), 0, "a create was sent at once: {}", spent.describe());
    assert_eq!(queued, 100, "the creates were sent one by one: {}", spent.describe());
    assert_eq!(spent.get(MetaKind::LateChanges), 1, "{}", spent.describe());
    assert_eq!(spent.get(MetaKind::LendInodes), 1, "{}", spent.describe());
    assert!(spent.operations() <= 3, "{}", spent.describe());
    a.client.flush_releases();
    assert_eq!(a.client.late_change_failures(), 0);
    // Made at the meta-server as the mount showed them: another mount
    // sees the same names, inodes, owners, modes and times.
    let b = c.mount();
    let expected: Vec<String> = {
        let mut v: Vec<String> = (0..100).map(|i| format!("f{i}")).collect();
        v.sort();
        v
    };
    assert_eq!(names(&b, "d"), expected);
    for i in [0, 57, 99] {
        let rel = format!("d/f{i}");
        let (on_a, on_b) = (fs::metadata(a.path(&rel)).unwrap(), fs::metadata(b.path(&rel)).unwrap());
        assert_eq!(identity(&on_a), identity(&on_b), "{rel} differs between the mounts");
    }
    let (dir_a, dir_b) = (fs::metadata(a.path("d")).unwrap(), fs::metadata(b.path("d")).unwrap());
    assert_eq!(identity(&dir_a), identity(&dir_b), "the directory differs between the mounts");
}

#[test]
fn another_mounts_first_look_at_the_directory_sees_the_queued_creates() {
    let (_c, a, b) = cluster();
    for d in ["s", "l", "x"] {
        fs::create_dir(a.path(d)).unwrap();
        // The root is not delegated: its entry of the directory is looked
        // up once (a call, which would send the queue), then cached.
        fs::metadata(a.path(d)).unwrap();
    }
    let before = a.client.rpc_counts();
    for d in ["s", "l", "x"] {
        drop(fs::File::create(a.path(&format!("{d}/f"))).unwrap());
    }
    let spent = a.client.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::CreateOpen), 0, "a create was sent at once: {}", spent.describe());
    assert_eq!(a.client.queued_changes(), 3, "the creates were sent: {}", spent.describe());
    // A stat, a listing and an exclusive create of the same name on B.
    assert!(!missing(&b, "s/f"), "B's stat did not find a file A created");
    assert_eq!(names(&b, "l"), vec!["f".to_string()]);
    let excl = fs::OpenOptions::new().write(true).create_new(true).open(b.path("x/f"));
    assert_eq!(excl.map(drop).map_err(|e| e.kind()), Err(ErrorKind::AlreadyExists));
    assert_eq!(a.client.queued_changes(), 0);
    assert_eq!(a.client.late_change_failures(), 0);
}

#[test]
fn a_file_created_late_is_written_locked_and_read_at_once() {
    let (_c, a, b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    let mut f = create_rw(&a, "d/f");
    assert!(a.client.queued_changes() >= 1, "the create was not answered first");
    // A lock needs the file's lock memory, which the create's answer lends.
    let lock = libc::flock {
        l_type: libc::F_WRLCK as i16,
        l_whence: libc::SEEK_SET as i16,
        l_start: 0,
        l_len: 10,
        l_pid: 0,
    };
    // SAFETY: a valid descriptor and a flock struct that lives across the call.
    assert_eq!(
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETLK, &lock) },
        0,
        "{}",
        std::io::Error::last_os_error()
    );
    f.write_all(b"hello, late").unwrap();
    let mut back = String::new();
    let mut again = fs::File::open(a.path("d/f")).unwrap();
    again.read_to_string(&mut back).unwrap();
    assert_eq!(back, "hello, late");
    assert_eq!(fs::read(b.path("d/f")).unwrap(), b"hello, late", "B read what A wrote");
    // B's process sees A's lock.
    let mut p = Probe::spawn(PROBE);
    let fd = p.open(&b.path("d/f"));
    let seen = p.ask(&format!("getlk {fd} w 0 10"));
    assert!(seen.starts_with("w 0 10"), "B does not see A's lock: {seen}");
    p.kill();
    drop(f);
    assert_eq!(a.client.late_change_failures(), 0);
}

/// A file created late and then written (mdtest-hard-write's files, a
/// SQLite journal): the write sends the create, which brings the extents
/// the write needs with it. One call for the create and its first write,
/// wherever the write lands, and another mount reads what was written.
#[test]
fn a_create_and_its_first_write_cost_one_call() {
    const FILES: usize = 20;
    /// mdtest-hard-write's bytes per file.
    const BYTES: usize = 3901;
    let (_c, a, b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    let bytes = |i: usize| -> Vec<u8> { (0..BYTES).map(|j| (i * 31 + j) as u8).collect() };
    let before = a.client.rpc_counts();
    for i in 0..FILES {
        let mut f = create_rw(&a, &format!("d/f{i}"));
        f.write_all(&bytes(i)).unwrap();
        close(&a, f);
    }
    let spent = a.client.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::CreateOpen), 0, "a create was sent at once: {}", spent.describe());
    assert_eq!(spent.get(MetaKind::LateChanges), FILES as u64, "{}", spent.describe());
    assert_eq!(spent.get(MetaKind::AllocChunks), 0, "a write asked for its extent: {}", spent.describe());
    assert_eq!(spent.get(MetaKind::GrowExtents), 0, "{}", spent.describe());
    assert_eq!(spent.get(MetaKind::Layout), 0, "{}", spent.describe());
    // Past a hole, across a chunk's end, and appended.
    let f = create_rw(&a, "d/hole");
    f.write_all_at(b"after a hole", 5000).unwrap();
    drop(f);
    let f = create_rw(&a, "d/across");
    f.write_all_at(&[7u8; 8192], (1 << 20) - 4096).unwrap();
    drop(f);
    let mut f = fs::OpenOptions::new().append(true).create(true).open(a.path("d/appended")).unwrap();
    f.write_all(b"appended").unwrap();
    drop(f);
    assert_eq!(a.client.late_change_failures(), 0);
    for i in 0..FILES {
        assert_eq!(fs::read(b.path(&format!("d/f{i}"))).unwrap(), bytes(i), "B reads other bytes in f{i}");
    }
    let mut expected = vec![0u8; 5000];
    expected.extend_from_slice(b"after a hole");
    assert_eq!(fs::read(b.path("d/hole")).unwrap(), expected);
    let mut expected = vec![0u8; (1 << 20) - 4096];
    expected.extend_from_slice(&[7u8; 8192]);
    assert!(fs::read(b.path("d/across")).unwrap() == expected, "B reads other bytes across the chunk's end");
    assert_eq!(fs::read(b.path("d/appended")).unwrap(), b"appended");
}

/// The mount's idle invalidation polls (one per `POLL_WAIT` while nothing
/// happens) send nothing queued: a create waits for its batch, or for the
/// write that brings its extents, however many polls go by.
#[test]
fn idle_polls_leave_the_queued_creates_to_their_batch() {
    let (_c, a, _b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    let f = create_rw(&a, "d/f");
    assert_eq!(a.client.queued_changes(), 1, "the create was not answered first");
    let polled = || a.client.rpc_counts().get(MetaKind::AwaitInvalidations);
    let before = polled();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while polled() < before + 2 {
        assert!(std::time::Instant::now() < deadline, "the mount stopped polling");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(a.client.queued_changes(), 1, "an idle poll sent the queued create");
    drop(f);
    assert_eq!(a.client.late_change_failures(), 0);
}

/// A late create whose first write finds the data servers full: the
/// create stands (another client finds the file), and the write is
/// refused with ENOSPC, as any write into a full file system.
#[test]
fn a_late_create_stands_when_its_first_write_finds_no_space() {
    const CHUNK: u64 = 1 << 20;
    let c = TestCluster::start(1, 4 * CHUNK, CHUNK);
    let a = FsClient::connect(c.holding_config(Transport::Auto)).unwrap();
    let b = FsClient::connect(c.holding_config(Transport::Auto)).unwrap();
    let filler = a.create_open(Caller::ROOT, Ino::ROOT, b"filler", 0o644).unwrap().ino;
    let chunk = vec![1u8; CHUNK as usize];
    let mut offset = 0;
    while a.write(filler, offset, &chunk, false).is_ok() {
        offset += CHUNK;
        assert!(offset <= 16 * CHUNK, "a data server of 4 chunks took {offset} bytes");
    }
    let (ino, _) = a.lent_inode().expect("no inode lent");
    a.open_late(ino);
    a.create_later(LateCreate {
        caller: Caller::ROOT,
        parent: Ino::ROOT,
        name: b"late".to_vec(),
        ino,
        perm: 0o644,
        at: Timestamp::now(),
        first_write: Vec::new(),
    });
    assert_eq!(a.write(ino, 0, b"no room", false).err(), Some(citronfs_core::FsError::NoSpace));
    assert_eq!(a.late_change_failures(), 0, "the create was refused");
    assert_eq!(b.lookup(Caller::ROOT, Ino::ROOT, b"late").unwrap().ino, ino, "the create did not stand");
    a.release(ino).unwrap();
    a.release(filler).unwrap();
}

/// On a keyed cluster, where each data server lets a client's verbs reach
/// only the extents of files it has open, the extents a late create
/// brought are granted before its answer leaves: the write into them is
/// not refused, and another mount reads it.
#[test]
fn on_a_keyed_cluster_the_extents_a_late_create_brought_are_granted() {
    let c = TestCluster::keyed(std::sync::Arc::new(Keyring::generate("cluster").unwrap()), 1);
    let a = TestMount::with_config_and_options(c.holding_config(Transport::Tcp), caching());
    let b = c.mount_tcp();
    fs::create_dir(a.path("d")).unwrap();
    let before = a.client.rpc_counts();
    for i in 0..10 {
        fs::write(a.path(&format!("d/f{i}")), format!("file {i}")).unwrap();
    }
    let spent = a.client.rpc_counts() - before;
    assert_eq!(spent.get(MetaKind::CreateOpen), 0, "a create was sent at once: {}", spent.describe());
    assert_eq!(spent.get(MetaKind::AllocChunks), 0, "a write asked for its extent: {}", spent.describe());
    for i in 0..10 {
        assert_eq!(fs::read_to_string(b.path(&format!("d/f{i}"))).unwrap(), format!("file {i}"));
    }
    assert_eq!(a.client.late_change_failures(), 0);
    let refused = c.data[0].access().stats().refused.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(refused, 0, "the data server refused verbs");
}

/// Other processes open a file created late while its create is still
/// queued (IO500's ior-hard: rank 0 creates the shared file, the others
/// open it): each open reaches the meta-server after the create, and all
/// of them write and lock it.
#[test]
fn a_file_created_late_is_opened_again_while_its_create_is_queued() {
    let (_c, a, b) = cluster();
    let _hang = a.watchdog(Duration::from_secs(120));
    fs::create_dir(a.path("d")).unwrap();
    let first = create_rw(&a, "d/f");
    assert!(a.client.queued_changes() >= 1, "the create was not answered first");
    std::thread::scope(|s| {
        for i in 0..3u64 {
            let a = &a;
            s.spawn(move || {
                use std::os::unix::fs::FileExt;
                let f = fs::OpenOptions::new().read(true).write(true).open(a.path("d/f")).unwrap();
                f.write_all_at(&[b'a' + i as u8; 4], 4 * i).unwrap();
            });
        }
    });
    use std::os::unix::fs::FileExt;
    first.write_all_at(b"head", 12).unwrap();
    assert_eq!(fs::read(b.path("d/f")).unwrap(), b"aaaabbbbcccchead", "B read other bytes than A wrote");
    assert_eq!(a.client.late_change_failures(), 0);
}

#[test]
fn the_holders_own_calls_come_after_its_queued_creates() {
    let (_c, a, b) = cluster();
    fs::create_dir(a.path("d")).unwrap();
    drop(fs::File::create(a.path("d/r")).unwrap());
    drop(fs::File::create(a.path("d/u")).unwrap());
    assert!(a.client.queued_changes() >= 2);
    // A rename is sent at once, after the create of what it renames.
    fs::rename(a.path("d/r"), a.path("d/r2")).unwrap();
    // An unlink of a file created late goes late too, after its create.
    fs::remove_file(a.path("d/u")).unwrap();
    assert_eq!(names(&b, "d"), vec!["r2".to_string()]);
    // A directory emptied by late creates and unlinks can go at once.
    fs::create_dir(a.path("e")).unwrap();
    drop(fs::File::create(a.path("e/f")).unwrap());
    fs::remove_file(a.path("e/f")).unwrap();
    fs::remove_dir(a.path("e")).unwrap();
    assert!(missing(&b, "e"));
    assert_eq!(a.client.late_change_failures(), 0);
}

/// An unprivileged creator in a set-group-id directory: the mount answers
/// the owner, group and mode the meta-server gives the file.
#[test]
fn an_unprivileged_creator_in_a_set_group_id_directory_gets_what_the_meta_server_gives() {
    let (_c, a, b) = cluster();
    fs::create_dir(a.path("g")).unwrap();
    std::os::unix::fs::chown(a.path("g"), None, Some(4242)).unwrap();
    fs::set_permissions(a.path("g"), fs::Permissions::from_mode(0o2777)).unwrap();
    let before = a.client.rpc_counts();
    let mut p = Probe::spawn(PROBE);
    assert_eq!(p.ask(&format!("become {NOBODY} {NOBODY}")), "ok");
    p.open(&a.path("g/p"));
    let on_a = fs::metadata(a.path("g/p")).unwrap();
    p.kill();
    let late = (a.client.rpc_counts() - before).get(MetaKind::CreateOpen) == 0;
    let on_b = fs::metadata(b.path("g/p")).unwrap();
    assert_eq!((on_b.uid(), on_b.gid()), (NOBODY, 4242), "the meta-server's owner and group");
    assert_eq!(identity(&on_a), identity(&on_b), "A showed other attributes than B sees (late: {late})");
    assert!(late, "the create was sent at once");
}

/// A mount that is not lent an inode (the meta-server's attribute slots
/// are nearly all used) sends its creates at once, and those past the
/// last slot are refused: no create is answered and then refused.
#[test]
fn with_few_attribute_slots_left_no_create_is_answered_and_then_refused() {
    /// The region holds a page of slots at least.
    const SLOTS: u64 = 300;
    let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = 1 << 20;
    cfg.slot_bytes = SLOTS * AttrSlot::BYTES;
    cfg.lock_bytes = 16 << 20;
    let c = TestCluster::start_sized(cfg, 1, 64 << 20);
    let a = mount(&c, false);
    let b = c.mount();
    fs::create_dir(a.path("d")).unwrap();
    let mut made = 0;
    let mut refused = 0;
    for i in 0..SLOTS * 4 {
        match fs::File::create(a.path(&format!("d/f{i}"))) {
            Ok(f) => {
                assert_eq!(refused, 0, "create {i} made a file after one was refused");
                close(&a, f);
                made += 1;
            }
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "create {i}: {e}");
                refused += 1;
                if refused == 10 {
                    break;
                }
            }
        }
    }
    a.client.flush_late_changes();
    assert_eq!(a.client.late_change_failures(), 0, "a create answered first was refused");
    assert_eq!(refused, 10, "{made} made and none refused");
    assert!(a.client.rpc_counts().get(MetaKind::LateChanges) > 0, "no create was answered first");
    assert_eq!(names(&b, "d").len(), made, "the other mount sees other files than A made");
}

/// Another mount's first look racing a loop of creates never misses a
/// file whose create returned.
#[test]
fn another_mounts_first_look_racing_the_creates_never_misses_a_created_name() {
    const DIRS: usize = 30;
    const FILES: usize = 20;
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = mount(&c, false);
    let b = c.mount_with(caching());
    for d in 0..DIRS {
        fs::create_dir(a.path(&format!("d{d}"))).unwrap();
    }
    let create = |rel: &str| drop(fs::File::create(a.path(rel)).unwrap());
    race_late_changes((&a, &b), (DIRS, FILES), create, |rel| !missing(&b, rel));
    for d in 0..DIRS {
        assert_eq!(names(&b, &format!("d{d}")).len(), FILES);
    }
}

/// An inode is created only by the client it was lent to.
#[test]
fn an_inode_lent_to_one_client_is_refused_to_another() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let a = FsClient::connect(c.holding_config(Transport::Auto)).unwrap();
    let b = FsClient::connect(c.holding_config(Transport::Auto)).unwrap();
    let (ino, _) = a.lent_inode().expect("no inode lent");
    let create = |name: &[u8], ino| LateCreate {
        caller: Caller::ROOT,
        parent: Ino::ROOT,
        name: name.to_vec(),
        ino,
        perm: 0o644,
        at: Timestamp::now(),
        first_write: Vec::new(),
    };
    b.open_late(ino);
    b.create_later(create(b"stolen", ino));
    assert!(b.flush_late_changes());
    assert_eq!(b.late_change_failures(), 1, "B created an inode lent to A");
    assert!(b.lookup(Caller::ROOT, Ino::ROOT, b"stolen").is_err());
    b.unopen_late(ino);
    a.open_late(ino);
    a.create_later(create(b"mine", ino));
    assert!(a.flush_late_changes());
    assert_eq!(a.late_change_failures(), 0);
    assert_eq!(a.lookup(Caller::ROOT, Ino::ROOT, b"mine").unwrap().ino, ino);
    a.release(ino).unwrap();
}

/// However often a client asks, it holds at most [`MAX_LOAN`] inodes on
/// loan; the attribute slots kept for them are free again when it leaves,
/// so that another client, lent what was left, is then lent its whole cap.
#[test]
fn a_loan_is_capped_per_client_and_its_slots_come_back_when_the_client_leaves() {
    /// The cap and a few more (the region is rounded up to whole pages):
    /// after A's loan, B can't be lent its whole cap.
    const SLOTS: u64 = MAX_LOAN as u64 + 200;
    let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = 1 << 20;
    cfg.slot_bytes = SLOTS * AttrSlot::BYTES;
    let c = TestCluster::start_sized(cfg, 1, 64 << 20);
    let rpc: RpcClient<MetaRequest, MetaResponse> =
        RpcClient::new(c.meta.local_addr(), Duration::from_secs(10));
    let register = || match rpc.call(&MetaRequest::RegisterClient { hostname: "raw".into(), pid: 1 }).unwrap()
    {
        MetaResponse::Registered(info) => info.client,
        other => panic!("{other:?}"),
    };
    let lend = |client, count| match rpc.call(&MetaRequest::LendInodes { client, count }).unwrap() {
        MetaResponse::Lent(lent) => lent.count,
        other => panic!("{other:?}"),
    };
    let a = register();
    let lent_to_a: u32 = (0..8).map(|_| lend(a, 256)).sum();
    assert_eq!(lent_to_a, MAX_LOAN, "A asked for 2048");
    assert_eq!(lend(a, 1), 0, "A is past its cap");
    let b = register();
    let first_to_b: u32 = (0..8).map(|_| lend(b, 256)).sum();
    assert!(first_to_b < MAX_LOAN, "B was lent {first_to_b} of about {SLOTS} slots while A holds {MAX_LOAN}");
    assert!(matches!(rpc.call(&MetaRequest::ClientLeaves { client: a }).unwrap(), MetaResponse::Done));
    let then_to_b: u32 = (0..8).map(|_| lend(b, 256)).sum();
    assert_eq!(first_to_b + then_to_b, MAX_LOAN, "A's kept slots did not come back");
}
