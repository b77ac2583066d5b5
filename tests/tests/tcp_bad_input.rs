//! The software NIC under bad input: malformed and truncated frames, verbs
//! outside any region, clients that vanish mid-batch. Each case is fed to a
//! live host while another client keeps working, and that client must see
//! exactly its own effects; the host must keep serving.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::rdma::codec;
use citron_lock::rdma::tcp::wire::{self, Request, Response};
use citron_lock::rdma::{
    FabricAddr, Node, RdmaError, RegionId, RemoteAddr, TcpOptions, TransportError, Verb, VerbError, VerbReply,
};
use citron_rpc::auth::{client_handshake, Credential};
use citronfs_tests::{Backend, TestFabric, TEST_REGION};

const REGION_LEN: u64 = 64 * 1024;

fn at(off: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, off)
}

fn frame(seq: u64, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    wire::write_frame(&mut f, seq, body).unwrap();
    f
}

fn verb_frame(seq: u64, verb: Verb) -> Vec<u8> {
    frame(seq, &codec::encode(&Request::Verb(verb)))
}

/// A raw connection to the NIC at `addr`, past the handshake of a host
/// without keys.
fn connect(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    client_handshake(&mut s, &Credential::Anonymous, Duration::from_secs(10)).unwrap();
    s
}

fn read_response(s: &mut TcpStream) -> (u64, Response) {
    let mut body = Vec::new();
    let seq = wire::read_frame(s, &mut body).unwrap_or_else(|e| panic!("no response frame: {e:?}"));
    (seq, codec::decode(&body).expect("host sends decodable responses"))
}

/// A client that increments its own word in a loop until told to stop and
/// then checks the word holds exactly its count.
struct Bystander {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl Bystander {
    fn start(fabric: &FabricAddr, word: RemoteAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let node = Node::join(fabric).unwrap();
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let ep = node.endpoint().unwrap();
            let mut n = 0u64;
            while !s.load(Ordering::Relaxed) || n < 100 {
                assert_eq!(ep.faa(word, 1).unwrap(), n, "bystander saw a foreign update");
                n += 1;
            }
            assert_eq!(ep.read_u64(word).unwrap(), n);
        });
        Self { stop, handle }
    }

    fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("bystander failed");
    }
}

fn tcp_fabric() -> TestFabric {
    TestFabric::new(Backend::Tcp, REGION_LEN)
}

fn host_addr(f: &TestFabric) -> std::net::SocketAddr {
    match f.addr {
        FabricAddr::Tcp(a) => a,
        _ => unreachable!(),
    }
}

#[test]
fn undecodable_body_is_refused_and_the_connection_goes_on() {
    let fabric = tcp_fabric();
    let by = Bystander::start(&fabric.addr, at(4096));
    let mut s = connect(host_addr(&fabric));
    // Garbage, then a body with an unknown enum variant, then a truncated body.
    s.write_all(&frame(5, &[0xFF; 10])).unwrap();
    s.write_all(&frame(6, &[200])).unwrap();
    let mut truncated = codec::encode(&Request::Verb(Verb::Faa { addr: at(0), add: 1 }));
    truncated.pop();
    s.write_all(&frame(7, &truncated)).unwrap();
    for want in 5..=7 {
        let (seq, resp) = read_response(&mut s);
        assert_eq!(seq, want);
        assert!(matches!(resp, Response::Refused(VerbError::Malformed(_))), "{resp:?}");
    }
    // Same connection, a valid verb.
    s.write_all(&verb_frame(8, Verb::Faa { addr: at(0), add: 3 })).unwrap();
    let (seq, resp) = read_response(&mut s);
    assert_eq!(seq, 8);
    assert!(matches!(resp, Response::Verb(Ok(VerbReply::Old(0)))), "{resp:?}");
    by.finish();
}

#[test]
fn verbs_outside_regions_get_errors_and_touch_nothing() {
    let fabric = tcp_fabric();
    let by = Bystander::start(&fabric.addr, at(4096));
    let mut s = connect(host_addr(&fabric));
    let cases = [
        Verb::Read { addr: RemoteAddr::new(RegionId(7), 0), len: 8 },
        Verb::Write { addr: at(REGION_LEN - 4), data: vec![1; 8] },
        Verb::Read { addr: at(u64::MAX), len: 8 },
        Verb::Read { addr: at(0), len: u32::MAX },
        Verb::Cas { addr: at(3), expect: 0, new: 1 },
        Verb::ExtFaa { addr: at(8), add: 1, boundary_mask: 0 },
        Verb::MaskedFaa { addr: at(REGION_LEN), add: 1, boundary_mask: 0 },
    ];
    for (i, v) in cases.iter().enumerate() {
        s.write_all(&verb_frame(i as u64, v.clone())).unwrap();
    }
    for i in 0..cases.len() {
        let (seq, resp) = read_response(&mut s);
        assert_eq!(seq, i as u64);
        assert!(matches!(resp, Response::Verb(Err(_))), "case {i}: {resp:?}");
    }
    by.finish();
    // The bytes next to the refused write are still zero.
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    assert_eq!(ep.read_u64(at(REGION_LEN - 8)).unwrap(), 0);
}

#[test]
fn impossible_length_closes_only_that_connection() {
    let fabric = tcp_fabric();
    let by = Bystander::start(&fabric.addr, at(4096));
    let mut s = connect(host_addr(&fabric));
    s.write_all(&[0xFF, 0xFF, 0xFF, 0xFF, 1, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    let (_, resp) = read_response(&mut s);
    assert!(matches!(resp, Response::Refused(VerbError::Malformed(_))));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "the host hangs up");
    by.finish();
}

#[test]
fn truncated_frames_and_clients_vanishing_mid_batch_leave_the_host_serving() {
    let fabric = tcp_fabric();
    let by = Bystander::start(&fabric.addr, at(4096));
    let addr = host_addr(&fabric);
    // A header promising 100 bytes, 10 delivered, then gone.
    {
        let mut s = connect(addr);
        let mut f = frame(1, &[0u8; 92]);
        f.truncate(22);
        s.write_all(&f).unwrap();
    }
    // Half a header, then gone.
    {
        let mut s = connect(addr);
        s.write_all(&[4, 0, 0]).unwrap();
    }
    // A long pipelined batch of increments, then gone without reading a reply.
    let sent = 2000u64;
    {
        let mut s = connect(addr);
        let mut all = Vec::new();
        for i in 0..sent {
            all.extend(verb_frame(i, Verb::Faa { addr: at(0), add: 1 }));
        }
        s.write_all(&all).unwrap();
    }
    // Every increment that was executed was executed once; none is torn.
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut v = ep.read_u64(at(0)).unwrap();
    while v < sent && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        v = ep.read_u64(at(0)).unwrap();
    }
    assert!(v <= sent, "no increment applied twice: {v}");
    by.finish();
    assert_eq!(ep.faa(at(8), 1).unwrap(), 0, "host still serves new verbs");
}

#[test]
fn a_vanished_host_is_an_error_not_a_hang() {
    let mut fabric = tcp_fabric();
    let opts = TcpOptions::with_timeouts(Duration::from_secs(1), Duration::from_secs(1));
    let node = Node::join_tcp(host_addr(&fabric), opts).unwrap();
    let ep = node.endpoint().unwrap();
    ep.faa(at(0), 1).unwrap();
    fabric.tcp_host().unwrap().shutdown();
    let t = Instant::now();
    let err = ep.faa(at(0), 1).unwrap_err();
    assert!(matches!(err, RdmaError::Transport(_)), "{err:?}");
    // Reconnecting finds nobody listening.
    let err = ep.faa(at(0), 1).unwrap_err();
    assert!(matches!(err, RdmaError::Transport(_)), "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(30), "errors came promptly: {:?}", t.elapsed());
}

#[test]
fn a_host_that_stops_answering_times_out() {
    // A listener that accepts connections and never replies.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let _keep = std::thread::spawn(move || {
        let conns: Vec<_> = silent.incoming().take(4).collect();
        std::thread::sleep(Duration::from_secs(20));
        drop(conns);
    });
    let opts = TcpOptions::with_timeouts(Duration::from_secs(1), Duration::from_millis(300));
    let err = Node::join_tcp(addr, opts).unwrap_err();
    assert!(matches!(err, TransportError::Timeout(_)), "{err:?}");
}

#[test]
fn shm_fabric_rejects_unknown_regions_and_malformed_datagrams() {
    let fabric = TestFabric::new(Backend::Shm, REGION_LEN);
    let node = Node::join(&fabric.addr).unwrap();
    let a = node.endpoint().unwrap();
    let b = node.endpoint().unwrap();
    let err = a.read_u64(RemoteAddr::new(RegionId(42), 0)).unwrap_err();
    assert!(matches!(err, RdmaError::Verb(VerbError::UnknownRegion(RegionId(42)))));
    // Junk sent straight to the node's message socket is dropped ...
    let dir = fabric.shm_host().unwrap().dir().to_path_buf();
    let junk = std::os::unix::net::UnixDatagram::unbound().unwrap();
    junk.send_to(&[0xFF; 33], dir.join(format!("node-{}.sock", node.id().0))).unwrap();
    // ... and real messages still arrive.
    a.send(b.addr(), b"still here").unwrap();
    let m = b.recv_timeout(Duration::from_secs(5)).expect("delivered");
    assert_eq!(m.payload, b"still here");
    // A message to a node that never existed is an error, not a hang.
    let ghost =
        citron_lock::rdma::ClientAddr { node: citron_lock::rdma::NodeId(9999), mailbox: b.addr().mailbox };
    assert!(matches!(a.send(ghost, b"x"), Err(TransportError::UnknownClient(_))));
}
