//! Citron scale-ups run by the lock host (citron-fast23.md §3.9, Algorithm 4,
//! executed by `LockMemoryHost::with_scaler` instead of the asking client),
//! on both backends: the oracle stress of `citron_scale.rs` with every
//! scale-up delegated to the host, from two worker processes and threads
//! here, while others hold and acquire ranges; what a client costs the host
//! (no RPC to open one with a known configuration, one to scale, one to
//! follow a scale-up it missed); the depth cap; locks to infinity that do
//! not ask for growth; and a host that refuses remote changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use citron_lock::citron::geometry::{nodes_of_depth, TreeGeometry};
use citron_lock::citron::host::{
    InstanceId, LockMemoryHost, RemoteTreeHost, TreeHost, TreeHostError, TreeHostServer,
};
use citron_lock::citron::lock::{CitronClient, CitronStats};
use citron_lock::citron::tree::TreeShape;
use citron_lock::dslr::{DslrConfig, DslrWord};
use citron_lock::rdma::{Endpoint, Node, RemoteAddr};
use citronfs_tests::citron_stress::{self, HOST_ARENA, SCALE_CAP, SCALE_FROM, SCALE_REGION, SPILLOVER_AT};
use citronfs_tests::{spawn_worker, wait_all, Backend, TestFabric, Watched, BACKENDS, TEST_REGION};

/// m of the paper, the default of `CitronConfig::from_rtt`.
const M: u32 = 4;

fn spillover_addr() -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, SPILLOVER_AT)
}

/// A tree host over the test region's arena that runs scale-ups itself, as
/// a client of the fabric, with the timing the stress clients use.
fn scaling_host(fabric: &TestFabric, node: &Node) -> Arc<LockMemoryHost> {
    let ep = node.endpoint().unwrap();
    let citron = citron_stress::test_config(&ep);
    let dslr = DslrConfig::from_rtt(ep.measure_rtt(spillover_addr(), 5).unwrap());
    Arc::new(LockMemoryHost::new(fabric.regions.clone(), TEST_REGION, HOST_ARENA, SCALE_REGION).with_scaler(
        node.clone(),
        citron,
        dslr,
    ))
}

/// A client over tcp RPC to `server`, starting from `geometry` (no RPC).
fn known_client(
    ep: &Endpoint,
    server: &TreeHostServer,
    id: InstanceId,
    geometry: TreeGeometry,
) -> CitronClient {
    let rpc = RemoteTreeHost::connect(server.local_addr(), Duration::from_secs(10));
    let th: Arc<dyn TreeHost> = Arc::new(RemoteTreeHost::host_scaled(rpc, id));
    let config = citron_stress::test_config(ep);
    CitronClient::with_geometry(th, geometry, config, Box::new(citron_stress::spillover(ep))).unwrap()
}

/// Two worker processes of three threads and two threads here on one
/// instance that starts with N = 256 units, as in `citron_scale.rs`, but
/// the host runs every scale-up: crossing requests ask for one after their
/// release, and a poller here asks for a 4× one every 150 ms (up to depth
/// 7). Every request completes, no unit is ever held twice (the oracle),
/// and afterwards every word of every segment is idle with exactly the
/// expected marks, the maximizer zero and the spillover idle.
#[test]
fn host_run_scale_ups_under_contention_keep_ranges_exclusive() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, SCALE_REGION);
        let _t_wait = citron_stress::publish_t_wait(&fabric);
        let node = Node::join(&fabric.addr).unwrap();
        let host = scaling_host(&fabric, &node);
        let server = host.serve("127.0.0.1:0".parse().unwrap()).unwrap();
        let (instance, _) = host.create(TreeShape::new(SCALE_FROM)).unwrap();
        host.enable_scaling(instance, spillover_addr(), 7).unwrap();
        let iterations = match backend {
            Backend::Shm => 2000,
            Backend::Tcp | Backend::Ib => 600,
        };
        let exe = env!("CARGO_BIN_EXE_citron-stress-worker");
        let workers: Vec<_> = (0..2)
            .map(|p| {
                let args = [
                    fabric.addr.to_string(),
                    "3".into(),
                    iterations.to_string(),
                    (p + 1).to_string(),
                    "scale".into(),
                    server.local_addr().to_string(),
                    instance.0.to_string(),
                ];
                spawn_worker(exe, &args)
            })
            .collect();
        let stop = AtomicBool::new(false);
        let addr = server.local_addr();
        let (stats, polled) = std::thread::scope(|s| {
            struct StopOnDrop<'a>(&'a AtomicBool);
            impl Drop for StopOnDrop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::SeqCst);
                }
            }
            let _stop = StopOnDrop(&stop);
            let poller = {
                let (node, stop) = (node.clone(), &stop);
                s.spawn(move || {
                    let ep = node.endpoint().unwrap();
                    citron_stress::run_scaler(&ep, addr, instance, 7, Duration::from_millis(150), stop)
                })
            };
            let handles: Vec<_> = (0..2)
                .map(|t| {
                    let node = node.clone();
                    s.spawn(move || {
                        let ep = node.endpoint().unwrap();
                        citron_stress::run_scaling(&ep, addr, instance, iterations, 100 + t)
                    })
                })
                .collect();
            let stats: Vec<CitronStats> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            wait_all(workers);
            drop(_stop);
            (stats, poller.join().unwrap())
        });
        let ep = node.endpoint().unwrap();
        let mut last = citron_stress::scaling_client(&ep, addr, instance);
        while last.scale_up_if_needed(&ep).unwrap().is_some() {}
        let g = host.instance(instance).configuration().unwrap();
        println!(
            "{backend:?}: depths {:?}, {polled} by the poller, in-process threads {stats:?}",
            g.depths()
        );
        assert!(g.segments.len() >= 3, "several scale-ups: {:?}", g.depths());
        assert!(g.shape().units() >= SCALE_CAP, "scaled to cover every request: {:?}", g.depths());
        // Every growth was the host's doing, and clients asked for more
        // than that (asks that found the tree already grown).
        let host_stats = host.scale_stats();
        assert_eq!(host_stats.grew as usize, g.segments.len() - 1, "{host_stats:?}");
        assert_eq!(host_stats.failed, 0, "{host_stats:?}");
        assert!(stats.iter().all(|s| s.failed_scale_ups == 0), "{stats:?}");
        let words = citron_stress::check_idle_geometry(&ep, &g, M, false);
        assert_eq!(words, nodes_of_depth(g.shape().depth()));
        citron_stress::check_idle_oracle_and_spillover(&ep, SCALE_CAP);
        // Nobody but the host changed the instance: a client's own attempt
        // at Algorithm 4 is refused before it touches anything.
        let rpc = RemoteTreeHost::connect(addr, Duration::from_secs(5));
        let remote = RemoteTreeHost::new(rpc, instance);
        assert!(matches!(remote.allocate(64), Err(TreeHostError::Refused(_))));
        assert!(matches!(remote.publish(g.version, &g), Err(TreeHostError::Refused(_))));
        assert_eq!(host.instance(instance).configuration().unwrap(), g);
    }
}

/// One client, step by step, on both backends: opening a client with a
/// known configuration costs no RPC; a range past N asks the host for a
/// scale-up after its release (one RPC) and the client follows the answer;
/// a client that missed it refreshes once; a lock to infinity from below N
/// asks for no growth, one from past N asks for its start only; and the
/// host never grows the tree past its cap, after which clients stop asking.
#[test]
fn delegated_scale_ups_cost_one_rpc_and_respect_the_cap() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, SCALE_REGION);
        let node = Node::join(&fabric.addr).unwrap();
        let host = scaling_host(&fabric, &node);
        let server = host.serve("127.0.0.1:0".parse().unwrap()).unwrap();
        let (id, g0) = host.create(TreeShape::new(2)).unwrap();
        // Scale-ups need the spillover word registered.
        let ep = node.endpoint().unwrap();
        let mut early = known_client(&ep, &server, id, g0.clone());
        let before = server.requests();
        let h = early.acquire(&ep, 1000, 1100).unwrap();
        early.release(&ep, h).unwrap();
        assert_eq!(early.stats().failed_scale_ups, 1, "refused without a spillover word");
        assert_eq!(server.requests(), before + 1);
        host.enable_scaling(id, spillover_addr(), 4).unwrap();

        let before = server.requests();
        let mut a = known_client(&ep, &server, id, g0.clone());
        assert_eq!(server.requests(), before, "opening a client costs no RPC");
        // Inside the tree: no RPC, no verb on the maximizer.
        let h = a.acquire(&ep, 10, 20).unwrap();
        a.release(&ep, h).unwrap();
        assert_eq!(server.requests(), before);
        // Past N = 1024: the release asks the host, which grows the tree 4×.
        let h = a.acquire(&ep, 1000, 1100).unwrap();
        assert!(h.used_spillover());
        a.release(&ep, h).unwrap();
        assert_eq!(server.requests(), before + 1, "one ScaleUp RPC");
        assert_eq!(a.stats().scale_ups, 1, "{:?}", a.stats());
        let g1 = host.instance(id).configuration().unwrap();
        assert_eq!(g1.depths(), vec![2, 3]);
        assert_eq!(a.geometry(), &g1, "the client follows the host's answer");
        assert_eq!(ep.read_u64(g1.maximizer).unwrap(), 0);
        // A client that starts from the old configuration finds it stale
        // and asks for the new one once.
        let mut b = known_client(&ep, &server, id, g0.clone());
        let h = b.acquire(&ep, 5, 6).unwrap();
        b.release(&ep, h).unwrap();
        assert_eq!(b.stats().refreshes, 1);
        assert_eq!(server.requests(), before + 2, "one Configuration RPC");
        let h = b.acquire(&ep, 3000, 3001).unwrap();
        assert!(!h.used_spillover(), "unit 3000 is in the grown tree");
        b.release(&ep, h).unwrap();
        assert_eq!(server.requests(), before + 2);
        // To infinity from below N: tree part and spillover, no growth asked.
        let n = g1.shape().units();
        let h = a.acquire_to_end(&ep, 100).unwrap();
        assert!(h.used_spillover());
        assert_eq!(ep.read_u64(g1.maximizer).unwrap(), 0, "no border for a lock that starts in the tree");
        a.release(&ep, h).unwrap();
        assert_eq!(host.instance(id).configuration().unwrap(), g1, "no scale-up");
        // To infinity from past N: the tree grows to reach the start only.
        let h = a.acquire_to_end(&ep, n + 10).unwrap();
        assert_eq!(ep.read_u64(g1.maximizer).unwrap(), n + 11);
        a.release(&ep, h).unwrap();
        let g2 = host.instance(id).configuration().unwrap();
        assert_eq!(g2.depths(), vec![2, 3, 4], "4× reaches unit {}", n + 10);
        // The cap is depth 4: a range far beyond grows nothing more; the
        // spillover mutex keeps it, and a client that learnt the cap from
        // the host's answer stops asking.
        let far = TreeShape::new(7).units();
        let before = server.requests();
        for _ in 0..3 {
            let h = a.acquire(&ep, far, far + 5).unwrap();
            assert!(h.used_spillover());
            a.release(&ep, h).unwrap();
        }
        assert_eq!(host.instance(id).configuration().unwrap(), g2, "capped at depth 4");
        assert_eq!(server.requests(), before, "a client at the cap does not ask");
        assert_eq!(a.stats().failed_scale_ups, 0, "{:?}", a.stats());
        // The border past the cap stays in the maximizer: only a client
        // below the cap would read it (and the host would clear it then).
        assert_eq!(ep.read_u64(g2.maximizer).unwrap(), far + 5);
        ep.write_u64(g2.maximizer, 0).unwrap();
        citron_stress::check_idle_geometry(&ep, &g2, M, false);
        let spill = DslrWord(ep.read_u64(spillover_addr()).unwrap());
        assert_eq!((spill.nx(), spill.ns()), (spill.maxx(), spill.maxs()), "spillover idle");
        // Destroying the instance gives all of it back: tree, segments and
        // the spillover if the host had allocated it (here it is the test's).
        let free = host.free_bytes();
        host.destroy(id).unwrap();
        let tree_bytes: u64 = g2.blocks().iter().map(|b| b.1.next_multiple_of(16)).sum();
        assert_eq!(host.free_bytes(), free + tree_bytes);
    }
}

/// The failure the host-run scale-up exists for: the client that asked dies
/// while its scale-up is under way. Here the test holds the spillover mutex
/// so the host's scale-up is stuck at Algorithm 4 line 2 when the asking
/// process is SIGKILLed; the host finishes it anyway once the mutex is
/// free: the tree grows, nothing is left superseded, every client goes on,
/// and the tree is idle afterwards. (A client-run scale-up killed between
/// its marks and its publication would leave the instance superseded with
/// no successor: every client would time out.)
#[test]
fn a_scale_up_survives_the_death_of_the_client_that_asked() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, SCALE_REGION);
        let node = Node::join(&fabric.addr).unwrap();
        let host = scaling_host(&fabric, &node);
        let server = host.serve("127.0.0.1:0".parse().unwrap()).unwrap();
        let (id, g0) = host.create(TreeShape::new(2)).unwrap();
        host.enable_scaling(id, spillover_addr(), 8).unwrap();
        let ep = node.endpoint().unwrap();
        let mut holder = citron_stress::spillover(&ep);
        citron_lock::rwlock::RwLockClient::acquire(&mut holder, &ep, citron_lock::rwlock::Mode::Exclusive)
            .unwrap();
        let exe = env!("CARGO_BIN_EXE_lock-hold-worker");
        let args = [
            "citron-scale".to_string(),
            fabric.addr.to_string(),
            server.local_addr().to_string(),
            id.0.to_string(),
            TreeShape::new(4).units().to_string(),
        ];
        let mut asker = Watched::spawn(exe, &args);
        asker.wait_for("asking");
        // The host's scaler has taken its ticket on the spillover word.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while DslrWord(ep.read_u64(spillover_addr()).unwrap()).maxx() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "{backend:?}: the host never asked for the spillover"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        asker.kill();
        assert_eq!(host.instance(id).configuration().unwrap(), g0, "not scaled while the mutex is held");
        citron_lock::rwlock::RwLockClient::release(&mut holder, &ep).unwrap();
        let g = loop {
            let g = host.instance(id).configuration().unwrap();
            if g.version > g0.version {
                break g;
            }
            assert!(std::time::Instant::now() < deadline, "{backend:?}: the host never finished");
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(g.depths(), vec![2, 4], "{backend:?}");
        // The scaler counts an ask once its scale-up has returned, which is
        // after the grown configuration is published: wait for the count.
        let stats = loop {
            let stats = host.scale_stats();
            if stats.asked > 0 {
                break stats;
            }
            assert!(std::time::Instant::now() < deadline, "{backend:?}: the host never counted its ask");
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!((stats.grew, stats.failed), (1, 0), "{backend:?}: {stats:?}");
        // A client of the old configuration follows and works in the grown tree.
        let mut c = known_client(&ep, &server, id, g0.clone());
        let h = c.acquire(&ep, 5000, 5010).unwrap();
        assert!(!h.used_spillover());
        c.release(&ep, h).unwrap();
        assert_eq!(c.stats().refreshes, 1);
        citron_stress::check_idle_geometry(&ep, &g, M, false);
        let spill = DslrWord(ep.read_u64(spillover_addr()).unwrap());
        assert_eq!((spill.nx(), spill.ns()), (spill.maxx(), spill.maxs()), "spillover idle");
    }
}
