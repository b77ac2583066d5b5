//! The range locks behind `RangeLockClient` (static segmentation, the RPC
//! range lock server, Citron) under contention from several processes and
//! threads, with the per-unit oracle of `range_stress`: no unit is ever held
//! twice, every request completes, the lock's words (or the server's state)
//! are idle afterwards. Plus failures: killed holders and waiters, and bad
//! input to the server.

use std::io::{BufReader, BufWriter, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use citron_lock::range_lock::rpc::{
    spawn_range_server, RangeLockServer, RangeRequestId, RangeRpcRequest, RangeRpcResponse, RangeServerConfig,
};
use citron_lock::range_lock::{RangeAlgorithm, RangeGuard, RangeLockSite};
use citron_lock::rdma::tcp::rpc::RpcClient;
use citron_lock::rdma::tcp::wire;
use citron_lock::rdma::{codec, Node};
use citron_lock::rwlock::LockError;
use citronfs_tests::{
    citron_stress, range_stress, spawn_worker, wait_all, Backend, TestFabric, Watched, BACKENDS,
};

const WORKER: &str = env!("CARGO_BIN_EXE_range-stress-worker");

fn server() -> RangeLockServer {
    spawn_range_server("127.0.0.1:0".parse().unwrap(), RangeServerConfig::default())
        .expect("range lock server")
}

/// 2 worker processes × 3 threads and 2 threads here run `iterations` random
/// critical sections each on `spec`; returns the completed count after
/// checking the oracle.
fn stress(fabric: &TestFabric, spec: &str, iterations: u64) -> u64 {
    let workers: Vec<_> = (0..2u64)
        .map(|p| {
            let args = [
                "stress".to_string(),
                spec.to_string(),
                fabric.addr.to_string(),
                "3".into(),
                iterations.to_string(),
                (p + 1).to_string(),
            ];
            spawn_worker(WORKER, &args)
        })
        .collect();
    let node = Node::join(&fabric.addr).unwrap();
    let site = range_stress::site(spec);
    std::thread::scope(|s| {
        for t in 0..2 {
            let node = node.clone();
            s.spawn(move || {
                let ep = node.endpoint().unwrap();
                let ctx = range_stress::context(&ep, None);
                let mut lock = ctx.client(&site).unwrap();
                let stats = range_stress::run(&ep, &mut *lock, iterations, 100 + t);
                assert_eq!(stats.acquisitions, iterations);
                println!("{spec} on {:?}, local thread {t}: {stats:?}", fabric.backend);
            });
        }
    });
    wait_all(workers);
    let done = range_stress::check_oracle(&node.endpoint().unwrap());
    assert_eq!(done, 8 * iterations, "every request of every client completed");
    done
}

fn iterations(backend: Backend, shm: u64, tcp: u64) -> u64 {
    match backend {
        Backend::Shm => shm,
        Backend::Tcp | Backend::Ib => tcp,
    }
}

#[test]
fn segments_never_hold_overlapping_ranges_at_once() {
    for backend in BACKENDS {
        // Aligned-looking and odd segment sizes, so ranges straddle borders.
        for s in [7, 64] {
            let fabric = TestFabric::new(backend, range_stress::REGION_BYTES);
            let spec = format!("segments:{s}");
            stress(&fabric, &spec, iterations(backend, 300, 80));
            let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
            range_stress::check_segments_idle(&ep, &range_stress::site(&spec));
        }
    }
}

#[test]
fn rpc_server_never_grants_overlapping_ranges_at_once() {
    // The oracle lives in a tcp fabric; the lock is the server's.
    let fabric = TestFabric::new(Backend::Tcp, range_stress::REGION_BYTES);
    let server = server();
    let spec = format!("rpc:{}", server.local_addr());
    stress(&fabric, &spec, 150);
    assert_eq!(server.service().totals(), (0, 0), "nothing held or queued afterwards");
    let st = server.service().stats();
    let (now, later) =
        (st.granted_at_once.load(Ordering::Relaxed), st.granted_after_wait.load(Ordering::Relaxed));
    println!("server: {now} granted at once, {later} after waiting");
    assert_eq!(now + later, 8 * 150);
    assert!(later > 0, "the workload had conflicts");
    assert_eq!(st.refused.load(Ordering::Relaxed), 0);
}

#[test]
fn citron_behind_the_interface_never_holds_overlapping_ranges_at_once() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, range_stress::REGION_BYTES);
        stress(&fabric, "citron", iterations(backend, 300, 80));
        citron_stress::check_idle_tree(&Node::join(&fabric.addr).unwrap().endpoint().unwrap());
    }
}

/// A client may hold several disjoint ranges; tokens go back to their own
/// kind of client only; empty ranges are refused.
#[test]
fn several_ranges_per_client_and_misuse() {
    let fabric = TestFabric::new(Backend::Tcp, range_stress::REGION_BYTES);
    let server = server();
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let ctx = range_stress::context(&ep, None);
    let specs = ["citron".to_string(), "segments:16".to_string(), format!("rpc:{}", server.local_addr())];
    let mut clients: Vec<_> = specs.iter().map(|s| ctx.client(&range_stress::site(s)).unwrap()).collect();
    for lock in clients.iter_mut() {
        let a = lock.acquire(&ep, 0, 10).unwrap();
        let b = lock.acquire(&ep, 20, 30).unwrap();
        let c = lock.acquire(&ep, 2000, u64::MAX).unwrap();
        assert_eq!(c.end(), u64::MAX);
        assert_eq!(a.algorithm(), lock.algorithm());
        for h in [b, a, c] {
            lock.release(&ep, h).unwrap();
        }
        assert!(matches!(lock.acquire(&ep, 5, 5), Err(LockError::Misuse(_))));
        assert!(matches!(lock.acquire(&ep, 6, 5), Err(LockError::Misuse(_))));
        let g = RangeGuard::acquire(&mut **lock, &ep, 3, 4).unwrap();
        assert_eq!(g.range(), (3, 4));
        g.release().unwrap();
    }
    let (first, rest) = clients.split_at_mut(1);
    let token = first[0].acquire(&ep, 0, 1).unwrap();
    assert_eq!(token.algorithm(), RangeAlgorithm::Citron);
    assert!(matches!(rest[0].release(&ep, token), Err(LockError::Misuse(_))), "a Citron token on segments");
    // The misreleased range is gone with its token: Citron's leaf bit stays
    // set, as a crashed holder's would, so this test ends here.
    assert_eq!(server.service().totals(), (0, 0));
}

/// A client SIGKILLed while holding `[0, ∞)` and one killed while queued:
/// the server drops both with their connections, and a survivor gets in.
#[test]
fn rpc_server_drops_what_killed_clients_held_and_queued() {
    let fabric = TestFabric::new(Backend::Tcp, range_stress::REGION_BYTES);
    let server = server();
    let spec = format!("rpc:{}", server.local_addr());
    let args =
        |l: &str, r: &str| ["hold", &spec, &fabric.addr.to_string(), l, r, "1000"].map(String::from).to_vec();
    let mut holder = Watched::spawn(WORKER, &args("0", "inf"));
    holder.wait_for("held");
    let mut queued = Watched::spawn(WORKER, &args("5", "6"));
    queued.wait_for("acquiring");
    let status =
        RpcClient::<RangeRpcRequest, RangeRpcResponse>::new(server.local_addr(), Duration::from_secs(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = status.call(&RangeRpcRequest::Status { instance: range_stress::INSTANCE }).unwrap();
        if s == (RangeRpcResponse::Status { held: 1, waiting: 1 }) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the second worker never queued: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    holder.kill();
    queued.kill();
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let ctx = range_stress::context(&ep, None);
    let mut lock = ctx.client(&range_stress::site(&spec)).unwrap();
    let t = std::time::Instant::now();
    let held = lock.acquire(&ep, 0, 10).unwrap();
    println!("survivor got [0, 10) after {:?}", t.elapsed());
    assert_eq!(server.service().stats().dropped.load(Ordering::Relaxed), 2);
    assert_eq!(server.service().totals(), (1, 0));
    lock.release(&ep, held).unwrap();
    assert_eq!(server.service().totals(), (0, 0));
}

/// Malformed frames, unknown ids and empty ranges are refused with a reason;
/// the connection and the server go on serving.
#[test]
fn rpc_server_refuses_bad_input_and_goes_on() {
    let server = server();
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    // A server without keys: the anonymous handshake, then frames.
    citron_rpc::auth::client_handshake(
        &mut stream,
        &citron_rpc::auth::Credential::Anonymous,
        Duration::from_secs(10),
    )
    .unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = BufWriter::new(stream);
    let mut body = Vec::new();
    let mut ask = |seq: u64, bytes: &[u8]| -> RangeRpcResponse {
        wire::write_frame(&mut writer, seq, bytes).unwrap();
        writer.flush().unwrap();
        assert_eq!(wire::read_frame(&mut reader, &mut body).unwrap(), seq);
        codec::decode(&body).unwrap()
    };
    let refused = |r: RangeRpcResponse| match r {
        RangeRpcResponse::Refused(why) => why,
        other => panic!("expected a refusal, got {other:?}"),
    };
    println!("{}", refused(ask(1, b"\xff\xff\xff\xff garbage")));
    let i = range_stress::INSTANCE;
    let enc = |r: &RangeRpcRequest| codec::encode(r);
    println!("{}", refused(ask(2, &enc(&RangeRpcRequest::Acquire { instance: i, start: 9, end: 9 }))));
    let unknown = RangeRpcRequest::Release { instance: i, request: RangeRequestId(12345) };
    println!("{}", refused(ask(3, &enc(&unknown))));
    let unknown = RangeRpcRequest::Wait { instance: i, request: RangeRequestId(12345) };
    println!("{}", refused(ask(4, &enc(&unknown))));
    // Still serving on the same connection.
    let granted = ask(5, &enc(&RangeRpcRequest::Acquire { instance: i, start: 0, end: u64::MAX }));
    let RangeRpcResponse::Granted(id) = granted else { panic!("{granted:?}") };
    let wrong =
        RangeRpcRequest::Release { instance: citron_lock::range_lock::rpc::RangeInstanceId(1), request: id };
    println!("{}", refused(ask(6, &enc(&wrong))));
    assert_eq!(
        ask(7, &enc(&RangeRpcRequest::Release { instance: i, request: id })),
        RangeRpcResponse::Released
    );
    assert_eq!(server.service().stats().refused.load(Ordering::Relaxed), 5);
    assert_eq!(server.service().totals(), (0, 0));
}

/// A vanished server is an error after the call timeout, never a hang.
#[test]
fn rpc_client_of_a_vanished_server_gets_an_error() {
    let fabric = TestFabric::new(Backend::Shm, range_stress::REGION_BYTES);
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let mut s = server();
    let site = RangeLockSite::rpc(s.local_addr(), range_stress::INSTANCE);
    s.shutdown();
    let mut ctx = range_stress::context(&ep, None);
    ctx.rpc.call_timeout = Duration::from_secs(2);
    let mut lock = ctx.client(&site).unwrap();
    let err = lock.acquire(&ep, 0, 1).unwrap_err();
    println!("{err}");
    assert!(matches!(err, LockError::Rdma(_)), "{err:?}");
}

/// Static segmentation inherits DSLR's lease recovery (§4.7 of the DSLR
/// paper): a process SIGKILLed holding three segments does not block a
/// survivor for longer than the lease allows.
#[test]
fn segments_recover_from_a_killed_holder() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, range_stress::REGION_BYTES);
        let spec = "segments:16";
        let args = ["hold", spec, &fabric.addr.to_string(), "10", "40", "150"].map(String::from);
        let mut holder = Watched::spawn(WORKER, &args);
        holder.wait_for("held");
        holder.kill();
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let ctx = range_stress::context(&ep, Some(150));
        let mut lock = ctx.client(&range_stress::site(spec)).unwrap();
        let t = std::time::Instant::now();
        let held = lock.acquire(&ep, 0, 64).unwrap();
        println!("{backend:?}: survivor got [0, 64) after {:?}", t.elapsed());
        lock.release(&ep, held).unwrap();
        range_stress::check_segments_idle(&ep, &range_stress::site(spec));
    }
}
