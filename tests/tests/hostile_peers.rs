//! Hostile input from peers with and without the key (cluster keys): a
//! property test throws malformed, truncated and out-of-order frames at
//! the meta-server's RPC service and at both kinds of software NIC (the
//! meta-server's and a data server's) of a keyed cluster, from peers that
//! never handshake, peers with a wrong key, and registered clients (a
//! root-squashed client key) that send well-formed but unauthorised
//! requests and verbs mixed with garbage. Meanwhile honest clients keep
//! working. After every case the honest file's bytes, size and namespace
//! are exactly as they were; at the end no thread of the process has
//! panicked and the honest clients never saw an error.
//!
//! Also: a peer that opens connections and sends nothing costs each server
//! one bounded place in the handshake; beyond the bound new connections are
//! refused at once, and the server serves again when the peer goes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::codec;
use citron_lock::rdma::tcp::wire::{self, Request};
use citron_lock::rdma::tcp::{AccessCommand, Extent, RpcClient};
use citron_lock::rdma::{RemoteAddr, Verb};
use citron_rpc::auth::{
    client_handshake, Credential, Credentials, Key, KeyOptions, Keyring, Role, SessionId, Squash, Status,
};
use citronfs_core::client::{FsClient, Transport};
use citronfs_core::proto::{FileLayout, MetaRequest, MetaResponse, RenameMode, XattrMode};
use citronfs_core::types::{Caller, ChunkIndex, ClientId, FileKind, Ino, SetAttr};
use citronfs_tests::TestCluster;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const TIMEOUT: Duration = Duration::from_secs(10);

/// Panics on any thread of this process, counted by a hook.
static PANICS: AtomicU64 = AtomicU64::new(0);

fn count_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default(info);
    }));
}

#[derive(Clone, Copy, Debug)]
enum Target {
    MetaRpc,
    MetaNic,
    DataNic,
}

#[derive(Clone, Copy, Debug)]
enum Peer {
    /// Never handshakes: its bytes are the first on the connection.
    NoKey,
    /// Proves a key of the cluster key's name with another secret (the
    /// server's proof fails, the handshake stops), then sends anyway.
    WrongKey,
    /// A registered client of a root-squashing client key.
    Member,
}

/// One thing written to the connection.
#[derive(Clone, Debug)]
enum Piece {
    Bytes(Vec<u8>),
    /// A frame with sequence number `seq` (any order) carrying `body`.
    Frame {
        seq: u64,
        body: Body,
    },
    /// A header whose length is impossible.
    BadLength(u32),
    /// A frame cut after `keep` bytes (the connection then carries on
    /// with the next piece inside it).
    Cut {
        seq: u64,
        body: Body,
        keep: usize,
    },
}

#[derive(Clone, Debug)]
enum Body {
    Random(Vec<u8>),
    /// Request number `which` of the target's list, then bytes flipped
    /// at the given positions (modulo its length) and maybe truncated.
    Mutated {
        which: usize,
        flips: Vec<(usize, u8)>,
        cut: Option<usize>,
    },
}

/// What the fuzzed peers aim at, known once the honest client wrote.
struct Aim {
    honest: Ino,
    layout: FileLayout,
    /// The member's own client id (for requests naming it or another).
    member: ClientId,
    other: ClientId,
}

fn meta_requests(aim: &Aim) -> Vec<Vec<u8>> {
    let root = Caller::ROOT;
    let reqs = vec![
        MetaRequest::Open { caller: root, client: aim.member, ino: aim.honest, flags: libc::O_RDWR },
        MetaRequest::Open { caller: root, client: aim.other, ino: aim.honest, flags: libc::O_RDWR },
        MetaRequest::SetAttr {
            caller: root,
            ino: aim.honest,
            set: SetAttr { size: Some(0), ..Default::default() },
        },
        MetaRequest::SetAttr {
            caller: root,
            ino: aim.honest,
            set: SetAttr { perm: Some(0o777), ..Default::default() },
        },
        MetaRequest::Unlink { caller: root, parent: Ino::ROOT, name: b"honest".to_vec() },
        MetaRequest::Rename {
            caller: root,
            parent: Ino::ROOT,
            name: b"honest".to_vec(),
            new_parent: Ino::ROOT,
            new_name: b"x".to_vec(),
            flags: RenameMode::Replace,
        },
        MetaRequest::Create {
            caller: root,
            parent: Ino::ROOT,
            name: b"planted".to_vec(),
            kind: FileKind::File,
            perm: 0o777,
            rdev: 0,
        },
        MetaRequest::Link { caller: root, ino: aim.honest, new_parent: Ino::ROOT, new_name: b"l".to_vec() },
        MetaRequest::AllocChunks { ino: aim.honest, chunks: vec![(ChunkIndex(5), 4096)], ahead: Vec::new() },
        MetaRequest::GrowExtents { ino: aim.honest, chunks: vec![(ChunkIndex(0), 1 << 20)] },
        MetaRequest::DataServerLeaves { id: citronfs_core::types::DataServerId(1) },
        MetaRequest::ClientLeaves { client: aim.other },
        MetaRequest::Fallocate { ino: aim.honest, offset: 0, len: 1 << 22, keep_size: false },
        MetaRequest::GrowLockTable { ino: aim.honest, last: None },
        MetaRequest::Release { client: aim.other, ino: aim.honest, opens: 1 },
        MetaRequest::Heartbeat { client: aim.other },
        MetaRequest::SetXattr {
            caller: root,
            ino: aim.honest,
            name: b"user.x".to_vec(),
            value: b"v".to_vec(),
            mode: XattrMode::Any,
        },
        MetaRequest::RegisterDataServer {
            nic: "127.0.0.1:9".parse().unwrap(),
            shm: None,
            ib: None,
            region: 1,
            capacity: 1 << 20,
            rejoin: None,
            fs: None,
            kept: false,
            durable: false,
        },
        MetaRequest::Layout { ino: aim.honest },
        MetaRequest::StatFs,
    ];
    reqs.iter().map(codec::encode).collect()
}

fn nic_requests(aim: &Aim, on_meta: bool) -> Vec<Vec<u8>> {
    let chunk = aim.layout.chunks[0].1.addr;
    let slot = aim.layout.slot.0;
    let area = aim.layout.locks.expect("lock memory").base;
    let targets: Vec<RemoteAddr> =
        if on_meta { vec![slot, slot + 8, area, area + 32] } else { vec![chunk, chunk + 4096] };
    let mut reqs = Vec::new();
    for at in targets {
        reqs.push(Request::Verb(Verb::Write { addr: at, data: vec![0xEE; 16] }));
        reqs.push(Request::Verb(Verb::Faa { addr: at, add: 1 }));
        reqs.push(Request::Verb(Verb::Cas { addr: at, expect: 0, new: 1 }));
        reqs.push(Request::Verb(Verb::MaskedCas { addr: at, cmp: 0, cmp_mask: 0, swap: !0, swap_mask: !0 }));
        reqs.push(Request::Verb(Verb::ExtFaa { addr: at, add: 1, boundary_mask: 0 }));
        reqs.push(Request::Verb(Verb::Read { addr: at, len: 64 }));
    }
    reqs.push(Request::Access(vec![AccessCommand::Grant {
        client: aim.member.0,
        extents: vec![Extent::new(chunk, 1 << 20), Extent::new(slot, 32)],
        write: true,
    }]));
    reqs.push(Request::Access(vec![AccessCommand::Fence { client: aim.other.0 }]));
    reqs.push(Request::ListRegions);
    reqs.push(Request::Join { mailbox: "127.0.0.1:9".parse().unwrap() });
    reqs.iter().map(codec::encode).collect()
}

fn body_bytes(body: &Body, menu: &[Vec<u8>]) -> Vec<u8> {
    match body {
        Body::Random(b) => b.clone(),
        Body::Mutated { which, flips, cut } => {
            let mut b = menu[which % menu.len()].clone();
            if !b.is_empty() {
                for (at, x) in flips {
                    let n = b.len();
                    b[at % n] ^= x;
                }
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            b
        }
    }
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Body::Random),
        (
            any::<usize>(),
            proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
            any::<Option<usize>>()
        )
            .prop_map(|(which, flips, cut)| Body::Mutated { which, flips, cut }),
        // Unmutated, for requests that decode and must be refused on their merits.
        any::<usize>().prop_map(|which| Body::Mutated { which, flips: vec![], cut: None }),
    ]
}

fn piece() -> impl Strategy<Value = Piece> {
    prop_oneof![
        1 => proptest::collection::vec(any::<u8>(), 1..40).prop_map(Piece::Bytes),
        6 => (any::<u64>(), body()).prop_map(|(seq, body)| Piece::Frame { seq, body }),
        1 => prop_oneof![Just(0u32), Just(3), Just(u32::MAX), 20_000_000u32..u32::MAX].prop_map(Piece::BadLength),
        1 => (any::<u64>(), body(), 0usize..30).prop_map(|(seq, body, keep)| Piece::Cut { seq, body, keep }),
    ]
}

fn case() -> impl Strategy<Value = (Target, Peer, Vec<Piece>)> {
    let target = prop_oneof![Just(Target::MetaRpc), Just(Target::MetaNic), Just(Target::DataNic)];
    let peer = prop_oneof![1 => Just(Peer::NoKey), 1 => Just(Peer::WrongKey), 2 => Just(Peer::Member)];
    (target, peer, proptest::collection::vec(piece(), 1..12))
}

struct World {
    cluster: TestCluster,
    honest: FsClient,
    aim: Aim,
    content: Vec<u8>,
    cluster_key: Key,
    member_session: Credential,
}

impl World {
    fn addr(&self, t: Target) -> SocketAddr {
        match t {
            Target::MetaRpc => self.cluster.meta.local_addr(),
            Target::MetaNic => self.cluster.meta.nic_addr(),
            Target::DataNic => self.cluster.data[0].nic_addr(),
        }
    }

    /// Runs one hostile connection; the server's answers are read and
    /// thrown away (whatever they are, they must not have changed state).
    fn attack(&self, target: Target, peer: Peer, pieces: &[Piece]) {
        let Ok(mut s) = TcpStream::connect(self.addr(target)) else { return };
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let _ = s.set_write_timeout(Some(TIMEOUT));
        match peer {
            Peer::NoKey => {}
            Peer::WrongKey => {
                let wrong = Key { secret: citron_rpc::auth::Secret::generate(), ..self.cluster_key.clone() };
                assert!(client_handshake(&mut s, &Credential::Key(wrong), TIMEOUT).is_err());
            }
            Peer::Member => {
                if client_handshake(&mut s, &self.member_session, TIMEOUT).is_err() {
                    return;
                }
            }
        }
        let menu = match target {
            Target::MetaRpc => meta_requests(&self.aim),
            Target::MetaNic => nic_requests(&self.aim, true),
            Target::DataNic => nic_requests(&self.aim, false),
        };
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Bytes(b) => out.extend_from_slice(b),
                Piece::Frame { seq, body } => {
                    let _ = wire::write_frame(&mut out, *seq, &body_bytes(body, &menu));
                }
                Piece::BadLength(len) => {
                    out.extend_from_slice(&len.to_le_bytes());
                    out.extend_from_slice(&[0; 8]);
                }
                Piece::Cut { seq, body, keep } => {
                    let mut f = Vec::new();
                    let _ = wire::write_frame(&mut f, *seq, &body_bytes(body, &menu));
                    f.truncate(*keep);
                    out.extend_from_slice(&f);
                }
            }
        }
        let _ = s.write_all(&out);
        // Read what comes back (bounded) so the server's writes finish.
        let mut sink = [0u8; 4096];
        let mut total = 0;
        while total < 1 << 20 {
            match s.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    }

    /// The honest file and the namespace are exactly as they were.
    fn check(&self) -> Result<(), TestCaseError> {
        let got = self.honest.read(self.aim.honest, 0, self.content.len() as u32 + 100);
        prop_assert_eq!(got.as_deref().ok(), Some(&self.content[..]), "the honest file's bytes");
        let attr = self.honest.getattr(self.aim.honest).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(attr.size, self.content.len() as u64);
        prop_assert_eq!(attr.perm, 0o644);
        let names: Vec<Vec<u8>> = self
            .honest
            .readdir(Caller::ROOT, Ino::ROOT, 0, 100)
            .map_err(|e| TestCaseError::fail(e.to_string()))?
            .into_iter()
            .map(|e| e.name)
            .collect();
        prop_assert_eq!(names, vec![b".".to_vec(), b"..".to_vec(), b"honest".to_vec(), b"busy".to_vec()]);
        Ok(())
    }
}

/// Registers by hand with `key`; returns (client, session credential).
fn register(meta: SocketAddr, key: &Key) -> (ClientId, Credential, RpcClient<MetaRequest, MetaResponse>) {
    let creds = Credentials::new(Credential::Key(key.clone()));
    let rpc = RpcClient::new(meta, TIMEOUT).with_credentials(creds.clone());
    let info = match rpc.call(&MetaRequest::RegisterClient { hostname: "fuzz".into(), pid: 1 }).unwrap() {
        MetaResponse::Registered(info) => info,
        other => panic!("{other:?}"),
    };
    let keys = info.session.clone().unwrap();
    let (secret, _) = keys.unwrap(key, info.client);
    let session = Credential::Session {
        id: SessionId { incarnation: keys.incarnation, client: info.client.0 },
        secret,
    };
    creds.set(session.clone());
    rpc.reset();
    (info.client, session, rpc)
}

#[test]
fn hostile_frames_from_any_peer_change_nothing_while_honest_clients_work() {
    count_panics();
    let ring = Keyring::generate("cluster").unwrap();
    let squashed = Key::generate(
        "guest",
        KeyOptions { role: Role::Client, squash: Squash::All, ..KeyOptions::default() },
    )
    .unwrap();
    let keyring = Arc::new(Keyring::new(vec![ring.first().clone(), squashed.clone()]).unwrap());
    let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.chunk_size = 1 << 20;
    cfg.lease = citronfs_tests::TEST_LEASE;
    cfg.keyring = Some(keyring.clone());
    // Refused verbs wait this long for a grant that never comes.
    cfg.grant_hold = Duration::from_millis(20);
    let cluster = TestCluster::start_with(cfg, 1, 64 << 20);
    let honest = FsClient::connect(cluster.client_config(None, Transport::Tcp)).unwrap();
    let content: Vec<u8> = (0..100_000u32).map(|i| (i * 13 % 256) as u8).collect();
    let ino = honest.create(Caller::ROOT, Ino::ROOT, b"honest", FileKind::File, 0o644, 0).unwrap().ino;
    honest.open(ino).unwrap();
    honest.write(ino, 0, &content, false).unwrap();
    let busy = honest.create(Caller::ROOT, Ino::ROOT, b"busy", FileKind::File, 0o600, 0).unwrap().ino;
    // The member: registered with the squashing key, kept alive, with its
    // own connection for heartbeats.
    let (member, member_session, member_rpc) = register(cluster.meta.local_addr(), &squashed);
    let (other, _, _other_rpc) = register(cluster.meta.local_addr(), &squashed);
    let stop = Arc::new(AtomicBool::new(false));
    let heartbeats = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = member_rpc.call(&MetaRequest::Heartbeat { client: member });
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    // Where the honest file lives, as a server may ask.
    let admin: RpcClient<MetaRequest, MetaResponse> = RpcClient::new(cluster.meta.local_addr(), TIMEOUT)
        .with_credentials(Credentials::new(Credential::Key(ring.first().clone())));
    let mut layout = match admin.call(&MetaRequest::Layout { ino }).unwrap() {
        MetaResponse::Layout(l) => l,
        other => panic!("{other:?}"),
    };
    // Lock addresses are lent only with an open; the file is open, so it
    // has them, and an attacker that guessed them would know them.
    layout.locks = cluster.meta.lock_area(ino);
    let world = World {
        aim: Aim { honest: ino, layout, member, other },
        cluster_key: ring.first().clone(),
        member_session,
        honest,
        content,
        cluster,
    };
    // A second honest client keeps writing and checking its own file all along.
    let rounds = AtomicU64::new(0);
    let busy_client = FsClient::connect(world.cluster.client_config(None, Transport::Tcp)).unwrap();
    busy_client.open(busy).unwrap();
    std::thread::scope(|s| {
        let worker = s.spawn(|| -> Result<(), String> {
            let mut n = 0u8;
            while !stop.load(Ordering::Relaxed) {
                n = n.wrapping_add(1);
                let block = vec![n; 8192];
                busy_client.write(busy, 4096, &block, false).map_err(|e| e.to_string())?;
                let back = busy_client.read(busy, 4096, 8192).map_err(|e| e.to_string())?;
                if back != block {
                    return Err(format!("round {n}: read back other bytes"));
                }
                rounds.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        });
        let mut runner =
            TestRunner::new(Config { cases: 256, failure_persistence: None, ..Config::default() });
        let result = runner.run(&case(), |(target, peer, pieces)| {
            world.attack(target, peer, &pieces);
            world.check()
        });
        stop.store(true, Ordering::Relaxed);
        let worker = worker.join().unwrap();
        if let Err(e) = result {
            panic!("{e}");
        }
        worker.expect("the busy honest client failed");
    });
    heartbeats.join().unwrap();
    assert!(rounds.load(Ordering::Relaxed) > 0, "the honest client made progress");
    // The cases reached past the handshake and were refused on their merits.
    let refused = |a: &citron_lock::rdma::tcp::AccessTable| a.stats().refused.load(Ordering::Relaxed);
    let (meta_refused, data_refused) =
        (refused(world.cluster.meta.nic_access()), refused(world.cluster.data[0].access()));
    let handshakes = world.cluster.meta.refused_handshakes() + world.cluster.data[0].refused_handshakes();
    eprintln!(
        "verbs refused: {meta_refused} at the meta-server's NIC, {data_refused} at the data server's; \
         {handshakes} handshakes refused"
    );
    assert!(meta_refused > 0 && data_refused > 0 && handshakes > 0);
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
    // The servers still take new members.
    let late = FsClient::connect(world.cluster.client_config(None, Transport::Tcp)).unwrap();
    late.open(world.aim.honest).unwrap();
    assert_eq!(late.read(world.aim.honest, 0, 100).unwrap(), world.content[..100]);
}

#[test]
fn silent_connections_cost_a_bounded_place_and_are_refused_beyond_it() {
    let cluster = TestCluster::keyed(Arc::new(Keyring::generate("cluster").unwrap()), 1);
    let honest = FsClient::connect(cluster.client_config(None, Transport::Tcp)).unwrap();
    let ino = honest.create(Caller::ROOT, Ino::ROOT, b"f", FileKind::File, 0o644, 0).unwrap().ino;
    honest.open(ino).unwrap();
    honest.write(ino, 0, b"before", false).unwrap();
    let nic = cluster.data[0].nic_addr();
    let silent: Vec<TcpStream> =
        (0..citron_rpc::auth::MAX_PENDING_HANDSHAKES).map(|_| TcpStream::connect(nic).unwrap()).collect();
    // Once the server holds them all, one more is refused at once.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut s = TcpStream::connect(nic).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut b = [0u8; 1];
        if s.read_exact(&mut b).is_ok() && b[0] == Status::Busy as u8 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no refusal at the bound");
    }
    // Connections already made keep working meanwhile.
    honest.write(ino, 0, b"during", false).unwrap();
    assert_eq!(honest.read(ino, 0, 6).unwrap(), b"during");
    drop(silent);
    // The places come back: a new member joins.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match FsClient::connect(cluster.client_config(None, Transport::Tcp)) {
            Ok(c) => {
                c.open(ino).unwrap();
                assert_eq!(c.read(ino, 0, 6).unwrap(), b"during");
                break;
            }
            Err(e) => assert!(std::time::Instant::now() < deadline, "never served again: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
