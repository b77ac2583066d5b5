//! The centralised RPC lock server (the Basecase of dql-icpp05.md §2.3)
//! under stress and failures. The server runs in this process on loopback
//! tcp (it is a tcp service by nature); the workers' oracle words live in a
//! shm fabric. Checked: mutual exclusion and reader/writer rules across
//! processes, the FIFO order of grants (a writer enters after exactly the
//! requests that arrived before it), reader overlap, every request served;
//! a client process SIGKILLed while holding and while queued (its
//! connection ends: the server drops its holds at once), a client process
//! SIGSTOPped while holding (its lease lapses); and the calls an uncontended
//! acquire + release costs, beside DQL's verbs on the same host.
//!
//! The tests of this file run one at a time.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use citron_lock::dql::{DqlConfig, DqlLock, DqlVariant};
use citron_lock::rdma::{Node, RemoteAddr};
use citron_lock::rpc_lock::{
    RpcLockClient, RpcLockConfig, RpcLockId, RpcLockServer, RpcLockServerConfig, RpcLockSession,
};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::args::Totals;
use citronfs_tests::{Backend, TestFabric, Watched, TEST_REGION};

const ORACLE_AT: u64 = 4096;
const LOCK: u64 = 42;
const WORKER: &str = env!("CARGO_BIN_EXE_rpc-lock-worker");

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn server(lease: Duration) -> RpcLockServer {
    RpcLockServer::spawn(
        "127.0.0.1:0".parse().unwrap(),
        RpcLockServerConfig::from_rtt(Duration::ZERO).with_lease(lease),
    )
    .expect("start the lock server")
}

fn client_config() -> RpcLockConfig {
    RpcLockConfig::from_rtt(Duration::from_micros(50))
}

fn spawn_stress(
    server: SocketAddr,
    fabric: &TestFabric,
    processes: u64,
    threads: u64,
    iterations: u64,
    read: u64,
    fifo: bool,
) -> Vec<Child> {
    (0..processes)
        .map(|p| {
            Command::new(WORKER)
                .args([
                    "stress".to_string(),
                    format!("--server={server}"),
                    format!("--fabric={}", fabric.addr),
                    format!("--threads={threads}"),
                    format!("--iterations={iterations}"),
                    format!("--read={read}"),
                    format!("--seed={}", 100 + p),
                    format!("--lock={LOCK}"),
                    format!("--oracle-at={ORACLE_AT}"),
                    format!("--fifo={}", u8::from(fifo)),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .expect("start rpc-lock-worker")
        })
        .collect()
}

fn collect(children: Vec<Child>) -> Totals {
    let mut totals = Totals::default();
    for child in children {
        let out = child.wait_with_output().expect("wait for worker");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "worker failed ({}); stdout: {stdout}", out.status);
        totals.merge(&Totals::from_stdout(&stdout).expect("a result line"));
    }
    totals
}

/// Waits (bounded) until the server's statistics satisfy `cond`.
fn until(
    server: &RpcLockServer,
    what: &str,
    cond: impl Fn(&citron_lock::rpc_lock::RpcLockServerStats) -> bool,
) {
    let t = Instant::now();
    while !cond(&server.stats()) {
        assert!(t.elapsed() < Duration::from_secs(60), "never {what}: {:?}", server.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn oracle_idle(fabric: &TestFabric) -> u64 {
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let at = |o: u64| RemoteAddr::new(TEST_REGION, ORACLE_AT + o);
    assert_eq!(ep.read_u64(at(0)).unwrap(), 0, "a writer left inside");
    assert_eq!(ep.read_u64(at(8)).unwrap(), 0, "a reader left inside");
    ep.read_u64(at(16)).unwrap()
}

#[test]
fn rpc_lock_excludes_and_grants_in_arrival_order() {
    let _serial = serial();
    let server = server(Duration::from_secs(2));
    let fabric = TestFabric::new(Backend::Shm, 1 << 16);
    let (processes, threads, iterations) = (3, 3, 300);
    let t = Instant::now();
    let totals =
        collect(spawn_stress(server.local_addr(), &fabric, processes, threads, iterations, 50, true));
    let total = processes * threads * iterations;
    let stats = server.stats();
    println!("{total} sections in {:?}; {totals:?}; server {stats:?}", t.elapsed());
    assert_eq!(totals.get("done"), total);
    assert_eq!(oracle_idle(&fabric), total, "the oracle counted every section");
    assert_eq!(totals.get("fifo_checked"), totals.get("exclusive"), "every writer checked the order");
    assert!(totals.get("exclusive") > 0 && totals.get("shared") > 0);
    assert!(totals.get("queued") > 0, "the lock was never contended");
    assert_eq!(stats.deferred_grants, totals.get("queued"), "every queued request was granted by a release");
    assert_eq!(stats.grants, total);
    assert_eq!((stats.waiting, stats.refusals, stats.expired), (0, 0, 0));
    assert_eq!(totals.get("calls"), 2 * total, "one call to acquire, one to release");
    assert_eq!(totals.get("fenced") + totals.get("timeouts"), 0);
    until(&server, "all sessions closed", |s| s.sessions == 0);
}

#[test]
fn rpc_lock_readers_overlap() {
    let _serial = serial();
    let server = server(Duration::from_secs(2));
    let fabric = TestFabric::new(Backend::Shm, 1 << 16);
    let totals = collect(spawn_stress(server.local_addr(), &fabric, 3, 3, 200, 90, false));
    println!("{totals:?}");
    assert_eq!(totals.get("done"), 1800);
    assert_eq!(oracle_idle(&fabric), 1800);
    assert!(totals.get("overlaps") > 0, "readers never overlapped");
}

fn hold_args(server: &RpcLockServer, mode: &str) -> Vec<String> {
    vec![
        "hold".into(),
        format!("--server={}", server.local_addr()),
        format!("--lock={LOCK}"),
        format!("--mode={mode}"),
    ]
}

/// A survivor in this process takes the lock and says how long it waited.
fn survivor_waits(server: &RpcLockServer, mode: Mode) -> Duration {
    let mut lock = RpcLockClient::new(server.local_addr(), RpcLockId(LOCK), client_config()).unwrap();
    let t = Instant::now();
    lock.lock(mode).unwrap();
    let waited = t.elapsed();
    lock.unlock().unwrap();
    waited
}

#[test]
fn rpc_lock_drops_the_locks_of_killed_clients() {
    let _serial = serial();
    let lease = Duration::from_secs(1);
    let server = server(lease);
    for (holder_mode, queued_mode) in [("exclusive", "exclusive"), ("shared", "exclusive")] {
        let before = server.stats();
        let mut holder = Watched::spawn(WORKER, &hold_args(&server, holder_mode));
        holder.wait_for("held");
        let mut queued = Watched::spawn(WORKER, &hold_args(&server, queued_mode));
        queued.wait_for("acquiring");
        until(&server, "the second request queued", |s| s.waiting == 1);
        // A survivor queues behind both, then both die.
        let waited = std::thread::scope(|s| {
            let survivor = s.spawn(|| survivor_waits(&server, Mode::Exclusive));
            until(&server, "the survivor queued", |s| s.waiting == 2);
            holder.kill();
            queued.kill();
            survivor.join().unwrap()
        });
        // The two killed, the survivor, and the workers' RTT probes.
        until(&server, "every session gone", |s| {
            s.sessions == 0 && s.disconnected >= before.disconnected + 3
        });
        let after = server.stats();
        println!("{holder_mode} holder + {queued_mode} waiter killed: survivor waited {waited:?}; {after:?}");
        assert_eq!(after.expired, 0, "dropped for the disconnection, not the lease");
        assert_eq!(after.waiting, 0);
        // The bound: the connection reset reaches the server at once; a
        // lease leaves plenty of slack.
        assert!(waited < lease * 5, "no progress within 5 leases: {waited:?}");
    }
}

#[test]
fn rpc_lock_drops_a_hung_client_after_its_lease() {
    let _serial = serial();
    let lease = Duration::from_millis(400);
    let server = server(lease);
    let mut holder = Watched::spawn(WORKER, &hold_args(&server, "exclusive"));
    holder.wait_for("held");
    let pid = holder.child.id() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let t = Instant::now();
    let waited = survivor_waits(&server, Mode::Shared);
    let stopped_for = t.elapsed();
    let stats = server.stats();
    println!("holder stopped: survivor waited {waited:?}; {stats:?}");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    holder.kill();
    assert_eq!(stats.expired, 1, "the stopped holder's lease lapsed");
    assert!(stopped_for >= lease / 2, "granted while the holder's lease still ran: {stopped_for:?}");
    assert!(waited < lease * 10, "no progress within 10 leases: {waited:?}");
}

/// One call to acquire and one to release; printed beside DQL's verbs and
/// times on the same host (figures, not thresholds).
#[test]
fn uncontended_rpc_lock_costs_two_calls() {
    let _serial = serial();
    const CYCLES: u64 = 300;
    let server = server(Duration::from_secs(2));
    let session = RpcLockSession::connect(server.local_addr(), client_config()).unwrap();
    let mut rpc = RpcLockClient::with_session(&session, RpcLockId(LOCK));
    let fabric = TestFabric::new(Backend::Tcp, 1 << 16);
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let lock_at = RemoteAddr::new(TEST_REGION, 0);
    let config = DqlConfig::from_rtt(ep.measure_rtt(lock_at, 9).unwrap());
    let mut sf = DqlLock::new(lock_at, config).unwrap();
    let mut distributed = DqlLock::new(lock_at + 64, config.with_variant(DqlVariant::Distributed)).unwrap();
    let time = |lock: &mut dyn RwLockClient| {
        for _ in 0..20 {
            lock.acquire(&ep, Mode::Exclusive).unwrap();
            lock.release(&ep).unwrap();
        }
        ep.reset_counts();
        let t = Instant::now();
        for _ in 0..CYCLES {
            lock.acquire(&ep, Mode::Exclusive).unwrap();
            lock.release(&ep).unwrap();
        }
        (t.elapsed() / CYCLES as u32, ep.counts().round_trips as f64 / CYCLES as f64)
    };
    let before = rpc.stats().calls;
    let (rpc_time, _) = time(&mut rpc);
    let rpc_calls = (rpc.stats().calls - before - 40) as f64 / CYCLES as f64;
    let (sf_time, sf_trips) = time(&mut sf);
    let (d_time, d_trips) = time(&mut distributed);
    println!(
        "uncontended acquire + release on loopback tcp: rpc {rpc_time:?} ({rpc_calls} calls), \
         dql starvation-free {sf_time:?} ({sf_trips} round trips), dql distributed {d_time:?} ({d_trips} round trips)"
    );
    assert_eq!(rpc_calls, 2.0, "acquire and release are one call each");
    assert_eq!((sf_trips, d_trips), (3.0, 2.0));
    assert_eq!(server.stats().deferred_grants, 0, "nothing ever waited");
}
