//! Only cluster members get in (cluster keys): a keyed cluster works for mounts
//! and servers with the key; a peer without it, or with a wrong one, is
//! refused in the handshake and changes nothing; a registered client touches
//! only the memory of files it has open; a fenced client's grants are gone;
//! the meta-server checks permissions and squashes root per key.
//!
//! The mounts here reach server memory over tcp (the NICs enforce grants;
//! shm, one trusted host's shared memory, cannot).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::rdma::tcp::{Extent, RpcClient};
use citron_lock::rdma::{
    Endpoint, Node, NodeCredentials, RdmaError, TcpOptions, TransportError, Verb, VerbError,
};
use citron_rpc::auth::{
    client_handshake, Credential, Credentials, HandshakeError, Key, KeyOptions, Keyring, Role, SessionId,
    Squash, Status,
};
use citronfs_core::client::{FsClient, Transport};
use citronfs_core::proto::{ClusterInfo, FileLayout, MetaRequest, MetaResponse};
use citronfs_core::types::{Caller, FileKind, Ino};
use citronfs_core::FsError;
use citronfs_tests::{TestCluster, TestMount};

const TIMEOUT: Duration = Duration::from_secs(10);

fn cluster_key() -> Arc<Keyring> {
    Arc::new(Keyring::generate("cluster").unwrap())
}

fn opts() -> TcpOptions {
    TcpOptions::with_timeouts(TIMEOUT, TIMEOUT)
}

/// Waits (at most 20 s, against hangs only) until `cond` holds.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A client that registers by hand and keeps nothing alive: what a
/// misbehaving program with a key can do with the protocol.
struct RawClient {
    rpc: RpcClient<MetaRequest, MetaResponse>,
    info: ClusterInfo,
    session: Credential,
}

impl RawClient {
    fn register(meta: SocketAddr, key: &Key) -> Self {
        let creds = Credentials::new(Credential::Key(key.clone()));
        let rpc = RpcClient::new(meta, TIMEOUT).with_credentials(creds.clone());
        let info = match rpc.call(&MetaRequest::RegisterClient { hostname: "raw".into(), pid: 1 }).unwrap() {
            MetaResponse::Registered(info) => info,
            other => panic!("{other:?}"),
        };
        let keys = info.session.clone().expect("a keyed cluster gives a session");
        let (secret, _) = keys.unwrap(key, info.client);
        let id = SessionId { incarnation: keys.incarnation, client: info.client.0 };
        let session = Credential::Session { id, secret };
        creds.set(session.clone());
        rpc.reset();
        Self { rpc, info, session }
    }

    /// Renews the lease until the returned guard is dropped.
    fn keep_alive(&self) -> impl Drop {
        struct Renewing(Arc<std::sync::atomic::AtomicBool>, Option<std::thread::JoinHandle<()>>);
        impl Drop for Renewing {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
                if let Some(h) = self.1.take() {
                    let _ = h.join();
                }
            }
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rpc: RpcClient<MetaRequest, MetaResponse> = RpcClient::new(self.rpc.server(), TIMEOUT)
            .with_credentials(Credentials::new(self.session.clone()));
        let (client, s) = (self.info.client, stop.clone());
        let h = std::thread::spawn(move || {
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = rpc.call(&MetaRequest::Heartbeat { client });
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Renewing(stop, Some(h))
    }

    fn call(&self, r: MetaRequest) -> MetaResponse {
        self.rpc.call(&r).unwrap()
    }

    /// An endpoint on the NIC at `nic`, proving this client's session.
    fn endpoint(&self, nic: SocketAddr) -> Endpoint {
        let creds =
            NodeCredentials { host: Credentials::new(self.session.clone()), ..NodeCredentials::default() };
        Node::join_tcp_as(nic, opts(), creds).unwrap().endpoint().unwrap()
    }

    fn open(&self, ino: Ino) -> FileLayout {
        self.open_with(ino, libc::O_RDWR)
    }

    fn open_with(&self, ino: Ino, flags: i32) -> FileLayout {
        let open = MetaRequest::Open { caller: Caller::ROOT, client: self.info.client, ino, flags };
        match self.call(open) {
            MetaResponse::Layout(l) => l,
            other => panic!("{other:?}"),
        }
    }

    fn layout(&self, ino: Ino) -> FileLayout {
        match self.call(MetaRequest::Layout { ino }) {
            MetaResponse::Layout(l) => l,
            other => panic!("{other:?}"),
        }
    }
}

fn not_granted<T: std::fmt::Debug>(r: Result<T, RdmaError>) -> bool {
    matches!(r, Err(RdmaError::Verb(VerbError::NotGranted { .. })))
}

#[test]
fn mounts_and_servers_with_the_key_work_across_mounts() {
    let cluster = TestCluster::keyed(cluster_key(), 2);
    let a = cluster.mount_tcp();
    let b = cluster.mount_tcp();
    // Data across chunks and both data servers, written on one mount, read on the other.
    let data: Vec<u8> = (0..3_500_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(a.path("f"), &data).unwrap();
    assert_eq!(std::fs::read(b.path("f")).unwrap(), data);
    // Truncate, extend and overwrite from the other mount (chunks freed and reallocated).
    let f = std::fs::OpenOptions::new().write(true).open(b.path("f")).unwrap();
    f.set_len(1000).unwrap();
    f.set_len(2_500_000).unwrap();
    drop(f);
    std::fs::write(b.path("g"), b"second file").unwrap();
    let got = std::fs::read(a.path("f")).unwrap();
    assert_eq!(got.len(), 2_500_000);
    assert_eq!(&got[..1000], &data[..1000]);
    assert!(got[1000..].iter().all(|&x| x == 0));
    // fcntl locks across the mounts: lock records in lock memory, the waiter
    // woken by a message between the mounts' mailboxes.
    use std::os::fd::AsRawFd;
    let fa = std::fs::OpenOptions::new().read(true).write(true).open(a.path("g")).unwrap();
    let fb = std::fs::OpenOptions::new().read(true).write(true).open(b.path("g")).unwrap();
    let lock = |fd: i32, cmd: i32, typ: i32| {
        // SAFETY: an all-zero flock is valid; it outlives the call.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        // SAFETY: fcntl on an open descriptor with a valid flock.
        unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) }
    };
    assert_eq!(lock(fa.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK), 0);
    assert_eq!(lock(fb.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK), -1, "held by the other mount");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| lock(fb.as_raw_fd(), libc::F_SETLKW, libc::F_WRLCK));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(lock(fa.as_raw_fd(), libc::F_SETLK, libc::F_UNLCK), 0);
        assert_eq!(waiter.join().unwrap(), 0, "woken by the releasing mount");
    });
    // Nothing was refused along the way.
    for d in &cluster.data {
        assert_eq!(d.access().stats().refused.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
    assert_eq!(cluster.meta.nic_access().stats().refused.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn without_the_key_or_with_a_wrong_one_nothing_gets_in_and_nothing_changes() {
    let cluster = TestCluster::keyed(cluster_key(), 1);
    let m = cluster.mount_tcp();
    let content = vec![b'S'; 64 * 1024];
    std::fs::write(m.path("victim"), &content).unwrap();
    let before = cluster.meta.refused_handshakes() + cluster.data[0].refused_handshakes();
    let ports = [cluster.meta.local_addr(), cluster.meta.nic_addr(), cluster.data[0].nic_addr()];
    let wrong = Key::generate("cluster", KeyOptions::default()).unwrap();
    let unknown = Key::generate("intruder", KeyOptions::default()).unwrap();
    let mut refusals = 0;
    for port in ports {
        // No key: the verbs layer (the issue's `citronfs bench verbs`) and the RPC.
        let err = Node::join_tcp(port, opts()).unwrap_err();
        assert!(matches!(err, TransportError::Handshake(HandshakeError::KeyRequired)), "{port}: {err:?}");
        // A key of the right name but another secret: the server cannot
        // prove it, so the client stops (and the server sees the proof missing).
        let creds =
            NodeCredentials { host: Credentials::new(Credential::Key(wrong.clone())), ..Default::default() };
        let err = Node::join_tcp_as(port, opts(), creds).unwrap_err();
        assert!(
            matches!(err, TransportError::Handshake(HandshakeError::ServerNotAuthenticated)),
            "{port}: {err:?}"
        );
        // A key the server does not know.
        let creds = NodeCredentials {
            host: Credentials::new(Credential::Key(unknown.clone())),
            ..Default::default()
        };
        let err = Node::join_tcp_as(port, opts(), creds).unwrap_err();
        assert!(
            matches!(err, TransportError::Handshake(HandshakeError::Refused(Status::UnknownCredential))),
            "{port}: {err:?}"
        );
        // Frames before any handshake: refused, nothing answered but a status.
        let mut s = TcpStream::connect(port).unwrap();
        let mut frame = Vec::new();
        citron_lock::rdma::tcp::wire::write_frame(
            &mut frame,
            1,
            &citron_lock::rdma::codec::encode(&citron_lock::rdma::tcp::wire::Request::ListRegions),
        )
        .unwrap();
        s.write_all(&frame).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        assert_eq!(answer, [Status::BadHello as u8], "{port}");
        refusals += 4;
    }
    // A peer that proves a wrong key to the server (it ignores the server's proof).
    let mut s = TcpStream::connect(cluster.data[0].nic_addr()).unwrap();
    let forged = Credential::Key(Key {
        secret: wrong.secret.clone(),
        ..cluster.keyring.as_ref().unwrap().first().clone()
    });
    let err = client_handshake(&mut s, &forged, TIMEOUT).unwrap_err();
    assert!(matches!(err, HandshakeError::ServerNotAuthenticated), "{err:?}");
    // A mount without the key, or with the wrong one, cannot join.
    let mut config = cluster.client_config(None, Transport::Tcp);
    config.key = None;
    assert!(FsClient::connect(config.clone()).is_err());
    config.key = Some(wrong);
    assert!(FsClient::connect(config).is_err());
    // Every refusal was counted (and logged) by the servers.
    eventually("the servers count every refused handshake", || {
        cluster.meta.refused_handshakes() + cluster.data[0].refused_handshakes() >= before + refusals
    });
    // The file is as it was, and the cluster still serves its members.
    assert_eq!(std::fs::read(m.path("victim")).unwrap(), content);
    let other = cluster.mount_tcp();
    assert_eq!(std::fs::read(other.path("victim")).unwrap(), content);
}

#[test]
fn a_client_with_the_key_touches_only_files_it_has_open() {
    let cluster = TestCluster::keyed(cluster_key(), 1);
    let key = cluster.keyring.as_ref().unwrap().first().clone();
    let owner = FsClient::connect(cluster.client_config(None, Transport::Tcp)).unwrap();
    let secret_file = owner.create(Caller::ROOT, Ino::ROOT, b"secret", FileKind::File, 0o600, 0).unwrap().ino;
    owner.open(secret_file).unwrap();
    owner.write(secret_file, 0, &[0x5A; 8192], false).unwrap();
    let mine = owner.create(Caller::ROOT, Ino::ROOT, b"mine", FileKind::File, 0o666, 0).unwrap().ino;
    owner.open(mine).unwrap();
    owner.write(mine, 0, &[1; 4096], false).unwrap();

    let intruder = RawClient::register(cluster.meta.local_addr(), &key);
    let _lease = intruder.keep_alive();
    // It may learn where the other file lives, but not touch it.
    let secret = intruder.layout(secret_file);
    let chunk = secret.chunks[0].1.addr;
    let data = intruder.endpoint(cluster.data[0].nic_addr());
    let meta = intruder.endpoint(cluster.meta.nic_addr());
    let mut buf = [0u8; 64];
    assert!(not_granted(data.read(chunk, &mut buf)));
    assert!(not_granted(data.write(chunk + 100, b"overwritten")));
    assert!(not_granted(data.faa(chunk, 1)));
    assert!(not_granted(meta.read_u64(secret.slot.size())), "nor its size");
    assert!(not_granted(meta.faa(secret.slot.size(), 1 << 40)));
    // (A client learns lock addresses only by opening; the test asks the
    // meta-server where they are, as a client that guessed would know.)
    let area = cluster.meta.lock_area(secret_file).expect("opened files have lock memory");
    assert!(not_granted(meta.cas(area.inode_mutex(), 0, u64::MAX)), "nor its locks");
    // Batches are checked verb by verb: the refused ones change nothing.
    let replies = data
        .execute(&[Verb::Write { addr: chunk, data: vec![0; 16] }, Verb::Faa { addr: chunk + 64, add: 7 }])
        .unwrap();
    assert!(replies.iter().all(|r| matches!(r, Err(VerbError::NotGranted { .. }))), "{replies:?}");
    // The endpoints stay usable: its own file works at once (the grant is
    // pushed before the open is answered, or the NIC holds the verb for it).
    let own = intruder.open(mine);
    data.read(own.chunks[0].1.addr, &mut buf).unwrap();
    assert_eq!(buf, [1; 64]);
    meta.read_u64(own.slot.size()).unwrap();
    // Opened for reading only, a file's bytes and size can be read, not written.
    intruder.open_with(secret_file, libc::O_RDONLY);
    data.read(chunk, &mut buf).unwrap();
    assert_eq!(buf, [0x5A; 64]);
    assert_eq!(meta.read_u64(secret.slot.size()).unwrap(), 8192);
    assert!(not_granted(data.write(chunk, b"overwritten")));
    assert!(not_granted(data.faa(chunk, 1)));
    assert!(not_granted(meta.faa(secret.slot.size(), 1)));
    match intruder.call(MetaRequest::Release { client: intruder.info.client, ino: secret_file, opens: 1 }) {
        MetaResponse::Done => {}
        other => panic!("{other:?}"),
    }
    // The bytes it aimed at are unchanged.
    assert_eq!(owner.read(secret_file, 0, 8192).unwrap(), vec![0x5A; 8192]);
    assert_eq!(owner.getattr(secret_file).unwrap().size, 8192);
    // Closing ends the grants.
    match intruder.call(MetaRequest::Release { client: intruder.info.client, ino: mine, opens: 1 }) {
        MetaResponse::Done => {}
        other => panic!("{other:?}"),
    }
    // The grant is the file's extent (4 KiB here: space near the size), and
    // revocation reaches the data server's NIC after the answer.
    let own_chunk = Extent::new(own.chunks[0].1.addr, own.chunks[0].1.capacity);
    eventually("the data server revokes the closed file's chunk", || {
        !cluster.data[0].access().grants_of(intruder.info.client.0).contains(&own_chunk)
    });
    assert!(not_granted(data.read(own.chunks[0].1.addr, &mut buf)));
    assert!(not_granted(meta.read_u64(own.slot.size())));
    // And it cannot act as the owner: requests naming another client are refused.
    let as_owner = MetaRequest::Release { client: owner.client_id(), ino: mine, opens: 1 };
    assert!(matches!(intruder.call(as_owner), MetaResponse::Failed(FsError::Perm)));
}

#[test]
fn after_fencing_a_clients_grants_and_connections_are_gone() {
    let cluster = TestCluster::keyed(cluster_key(), 1);
    let key = cluster.keyring.as_ref().unwrap().first().clone();
    let owner = FsClient::connect(cluster.client_config(None, Transport::Tcp)).unwrap();
    let ino = owner.create(Caller::ROOT, Ino::ROOT, b"f", FileKind::File, 0o666, 0).unwrap().ino;
    owner.open(ino).unwrap();
    owner.write(ino, 0, &[3; 4096], false).unwrap();
    // A client that opens the file and then stops renewing its lease.
    let doomed = RawClient::register(cluster.meta.local_addr(), &key);
    let layout = doomed.open(ino);
    let me = doomed.info.client.0;
    let data = doomed.endpoint(cluster.data[0].nic_addr());
    let chunk = layout.chunks[0].1.addr;
    let mut buf = [0u8; 8];
    data.read(chunk, &mut buf).unwrap();
    assert!(!cluster.meta.nic_access().grants_of(me).is_empty());
    eventually("the data server has the grant", || !cluster.data[0].access().grants_of(me).is_empty());
    // The lease (2 s) runs out; the meta-server fences it everywhere.
    eventually("the client is fenced at every NIC", || {
        cluster.meta.nic_access().grants_of(me).is_empty()
            && cluster.data[0].access().grants_of(me).is_empty()
    });
    // Its connections were cut, and it cannot connect again with its session.
    let err = data.read(chunk, &mut buf).unwrap_err();
    assert!(matches!(err, RdmaError::Transport(TransportError::Disconnected)), "{err:?}");
    let err = data.read(chunk, &mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            RdmaError::Transport(TransportError::Handshake(HandshakeError::Refused(Status::NotAdmitted)))
        ),
        "{err:?}"
    );
    let creds = NodeCredentials { host: Credentials::new(doomed.session.clone()), ..Default::default() };
    let err = Node::join_tcp_as(cluster.data[0].nic_addr(), opts(), creds).unwrap_err();
    assert!(
        matches!(err, TransportError::Handshake(HandshakeError::Refused(Status::NotAdmitted))),
        "{err:?}"
    );
    assert!(doomed.rpc.call(&MetaRequest::StatFs).is_err(), "the meta-server refuses the session too");
    // The live client is untouched.
    assert_eq!(owner.read(ino, 0, 4096).unwrap(), vec![3; 4096]);
}

#[test]
fn the_meta_server_checks_permissions_and_squashes_root_per_key() {
    let ring = cluster_key();
    let squashed = Key::generate(
        "lab",
        KeyOptions { role: Role::Client, squash: Squash::Root, ..KeyOptions::default() },
    )
    .unwrap();
    let keys = Arc::new(Keyring::new(vec![ring.first().clone(), squashed.clone()]).unwrap());
    let cluster = TestCluster::keyed(keys, 1);
    // A trusted mount (the cluster key) sets up; a root-squashed one tries.
    let admin = cluster.mount_tcp();
    let lab = TestMount::with_config(cluster.client_config(Some(squashed.clone()), Transport::Tcp));
    std::fs::write(admin.path("root-file"), b"root's").unwrap();
    std::fs::create_dir(admin.path("public")).unwrap();
    std::fs::set_permissions(admin.path("public"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    // The lab mount's root is nobody to the cluster: its kernel lets it try,
    // the meta-server refuses.
    let err = std::fs::write(lab.path("new-at-top"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    let err =
        std::fs::set_permissions(lab.path("root-file"), std::fs::Permissions::from_mode(0o666)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    let err = std::fs::OpenOptions::new().write(true).open(lab.path("root-file")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    assert_eq!(std::fs::read(lab.path("root-file")).unwrap(), b"root's", "reading is allowed (0644)");
    // What it may create belongs to the anonymous ids.
    std::fs::write(lab.path("public/mine"), b"y").unwrap();
    let meta = std::fs::metadata(admin.path("public/mine")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
    // Sticky directory: the squashed root cannot remove root's file there.
    std::fs::write(admin.path("public/roots"), b"z").unwrap();
    let err = std::fs::remove_file(lab.path("public/roots")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    let err = std::fs::rename(lab.path("public/roots"), lab.path("public/stolen")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    std::fs::remove_file(lab.path("public/mine")).unwrap();
    assert_eq!(std::fs::read(admin.path("root-file")).unwrap(), b"root's");

    // A client library user bypasses its kernel: the meta-server alone checks.
    let client = FsClient::connect(cluster.client_config(None, Transport::Tcp)).unwrap();
    let alice = Caller { uid: 1000, gid: 1000, pid: 1 };
    let bob = Caller { uid: 1001, gid: 1001, pid: 1 };
    let public = client.lookup(alice, Ino::ROOT, b"public").unwrap().ino;
    let f = client.create(alice, public, b"alice", FileKind::File, 0o600, 0).unwrap().ino;
    assert_eq!(client.open_as(bob, f, libc::O_RDONLY), Err(FsError::Access));
    client.open_as(alice, f, libc::O_RDWR).unwrap();
    assert_eq!(client.unlink(bob, public, b"alice"), Err(FsError::Perm), "sticky");
    let chmod = citronfs_core::types::SetAttr { perm: Some(0o666), ..Default::default() };
    assert_eq!(client.setattr(bob, f, chmod.clone()).map(|_| ()), Err(FsError::Perm));
    client.setattr(alice, f, chmod).unwrap();
    client.unlink(alice, public, b"alice").unwrap();
}

/// The shm backend cannot check anything (processes map the memory), so
/// its files are its owner's alone: it serves one trusted host.
#[test]
fn shm_fabrics_are_private_to_their_owner() {
    let fabric = citronfs_tests::TestFabric::new(citronfs_tests::Backend::Shm, 64 * 1024);
    let dir = fabric.shm_host().unwrap().dir().to_path_buf();
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        if meta.is_file() {
            assert_eq!(meta.permissions().mode() & 0o077, 0, "{} is open to others", entry.path().display());
        }
    }
}
