//! The Citron stress workloads shared by the in-process tests and the worker
//! processes: random ranges of mixed sizes, some crossing the tree's bound,
//! checked by an oracle of per-unit counters in the same fabric; and the same
//! with a tree that starts small and is scaled up while it is used
//! ([`run_scaling`]), with the checks of what idle means afterwards
//! ([`check_idle_geometry`]).

use std::time::Duration;

use std::net::SocketAddr;
use std::sync::Arc;

use citron_lock::citron::geometry::{SegmentedTree, TreeGeometry};
use citron_lock::citron::host::{InstanceId, LockMemoryHost, RemoteTreeHost, TreeHost};
use citron_lock::citron::lock::{CitronClient, CitronConfig, CitronLayout, CitronStats};
use citron_lock::citron::tree::{NodeKey, TreeShape};
use citron_lock::citron::tuning::TWaitPublisher;
use citron_lock::citron::word::Internal;
use citron_lock::dslr::{DslrConfig, DslrLock, DslrWord};
use citron_lock::rdma::{Endpoint, Node, RegionTable, RemoteAddr, Verb, VerbReply};
use rand::{Rng, SeedableRng};

use crate::{TestFabric, TEST_REGION};

/// Tree depth of the stressed instance: N = 64 * 4^2 = 1024 units.
pub const DEPTH: u32 = 2;
/// Units past N that requests may reach (through the spillover mutex).
pub const BEYOND: u64 = 128;
/// Offsets in the test region.
pub const CITRON_AT: u64 = 0;
pub const SPILLOVER_AT: u64 = 8192;
pub const ORACLE_AT: u64 = 16384;

pub fn layout() -> CitronLayout {
    CitronLayout { base: RemoteAddr::new(TEST_REGION, CITRON_AT), shape: TreeShape::new(DEPTH) }
}

fn unit_word(u: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, ORACLE_AT + 8 * u)
}

/// The spillover mutex: DSLR, as in the paper (§3.3).
pub fn spillover(ep: &Endpoint) -> DslrLock {
    let addr = RemoteAddr::new(TEST_REGION, SPILLOVER_AT);
    DslrLock::new(addr, DslrConfig::from_rtt(ep.measure_rtt(addr, 5).expect("rtt")))
}

/// A random range: mostly small, some large, some crossing N.
fn random_range(rng: &mut impl Rng, n: u64) -> (u64, u64) {
    let p: u32 = rng.gen_range(0..100);
    let len = match p {
        0..=54 => rng.gen_range(1..=4),
        55..=84 => rng.gen_range(5..=64),
        85..=94 => rng.gen_range(65..=400),
        _ => 0, // crossing
    };
    if len == 0 {
        let l = rng.gen_range(n - 64..n);
        (l, rng.gen_range(n + 1..=n + BEYOND))
    } else {
        let l = rng.gen_range(0..=n - len);
        (l, l + len)
    }
}

/// Where a test publishes the `T_wait` its clients share: unused memory of
/// the test region, below the lock host's arena and above every oracle
/// word (the scaling tests' included).
pub const T_WAIT_AT: u64 = HOST_ARENA - 64;
/// T_lease of every client of a stressed tree.
pub const STRESS_LEASE: Duration = Duration::from_secs(1);

/// Publishes the `T_wait` of the test's trees, from an RTT measured once,
/// here. Citron's Inequation (1) holds only between clients that wait and
/// budget with one value (`CitronConfig::t_wait` is the cluster's), and its
/// recovery only between clients with one T_lease. Each client measuring
/// its own RTT, a busy machine gave two of them values far apart, and they
/// held one unit at once (a CI run of `overlapping_ranges_are_never_held_at_once`).
/// So clients of [`run`] and [`test_config`] read the value published here
/// at every attempt (§3.5.5, as a file system's clients read the
/// meta-server's), and share [`STRESS_LEASE`]. Publish before any client
/// starts: an unpublished word leaves each client its own value.
///
/// The RTT is the slowest of [`RTT_PROBES`] medians, not one sample: on a
/// busy machine one median can come from a quiet moment, and a `T_wait`
/// below what most round trips take makes nearly every attempt abort and
/// lock the root (a tcp run then took minutes instead of seconds).
pub fn publish_t_wait(fabric: &TestFabric) -> TWaitPublisher {
    let ep = Node::join(&fabric.addr).expect("join the fabric").endpoint().expect("endpoint");
    let rtt = (0..RTT_PROBES).map(|_| ep.measure_rtt(unit_word(0), 5).expect("rtt")).max().unwrap();
    TWaitPublisher::start(&ep, t_wait_word(), CitronConfig::from_rtt(rtt).t_wait).expect("publish T_wait")
}

/// Medians of five round trips each that [`publish_t_wait`] takes the
/// largest of.
pub const RTT_PROBES: usize = 8;

fn t_wait_word() -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, T_WAIT_AT)
}

/// The configuration every client of a stressed tree shares (see
/// [`publish_t_wait`]), giving up after `give_up`.
fn shared_config(ep: &Endpoint, give_up: Duration) -> CitronConfig {
    let rtt = ep.measure_rtt(unit_word(0), 5).expect("rtt");
    let mut config = CitronConfig::from_rtt(rtt);
    config.published_t_wait = Some(t_wait_word());
    config.lease = STRESS_LEASE;
    config.give_up = give_up;
    config
}

/// Runs `iterations` random acquisitions on `ep`; panics on any overlap.
pub fn run(ep: &Endpoint, iterations: u64, seed: u64) -> CitronStats {
    run_with(ep, shared_config(ep, Duration::from_secs(10)), iterations, seed)
}

/// [`run`] with a given configuration (clients of one tree must share
/// `T_wait`: a cluster's value, or a published one).
pub fn run_with(ep: &Endpoint, config: CitronConfig, iterations: u64, seed: u64) -> CitronStats {
    let mut client = CitronClient::new(layout(), config, Box::new(spillover(ep)));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n = layout().shape.units();
    for _ in 0..iterations {
        let (l, r) = random_range(&mut rng, n);
        let held = client.acquire(ep, l, r).expect("acquire");
        // Oracle: every unit's counter goes 0 -> 1 while we hold it.
        let enter: Vec<Verb> = (l..r).map(|u| Verb::Faa { addr: unit_word(u), add: 1 }).collect();
        let replies = ep.execute(&enter).expect("oracle enter");
        for (u, reply) in (l..r).zip(replies) {
            let old = match reply.expect("oracle verb") {
                citron_lock::rdma::VerbReply::Old(v) => v,
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!(
                old,
                0,
                "unit {u} of [{l}, {r}) was held by someone else too (nodes {:?})",
                held.nodes()
            );
        }
        if rng.gen_bool(0.3) {
            std::thread::yield_now();
        }
        let leave: Vec<Verb> = (l..r).map(|u| Verb::Faa { addr: unit_word(u), add: u64::MAX }).collect();
        for reply in ep.execute(&leave).expect("oracle leave") {
            reply.expect("oracle verb");
        }
        client.release(ep, held).expect("release");
    }
    client.stats()
}

/// After every client is done: no unit counted, every tree word idle.
pub fn check_idle(ep: &Endpoint) {
    let n = layout().shape.units();
    for u in 0..n + BEYOND {
        assert_eq!(ep.read_u64(unit_word(u)).unwrap(), 0, "oracle word of unit {u}");
    }
    check_idle_tree(ep);
    assert!(ep.read_u64(layout().maximizer()).unwrap() > n, "crossing requests raised the maximizer");
    let spill = DslrWord(ep.read_u64(RemoteAddr::new(TEST_REGION, SPILLOVER_AT)).unwrap());
    assert!(spill.maxx() > 0, "crossing requests took the spillover mutex");
    assert_eq!((spill.nx(), spill.ns()), (spill.maxx(), spill.maxs()), "spillover idle");
}

/// Every leaf clear, every internal node unoccupied with its counters level.
pub fn check_idle_tree(ep: &Endpoint) {
    let shape = layout().shape;
    for x in 1..=shape.node_count() {
        let node = citron_lock::citron::tree::NodeIndex(x);
        let w = ep.read_u64(layout().node(node)).unwrap();
        if shape.is_leaf(node) {
            assert_eq!(w, 0, "leaf {x} still has bits set");
        } else {
            let i = citron_lock::citron::word::Internal(w);
            assert!(
                !i.occupied() && i.tcnt() == i.tmax() && i.descendants_quiet(),
                "node {x} not idle: {i:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Scaling: a tree that starts at depth SCALE_FROM and grows while in use.

/// Depth the scaling stress starts at: N = 256 units.
pub const SCALE_FROM: u32 = 1;
/// Requests never reach past this (a depth-5 tree covers it exactly), so
/// the tree is scaled up at most to depth 5: up to four 4× scale-ups.
pub const SCALE_CAP: u64 = 64 << (2 * 5);
/// Lock memory the tree host hands out: `[HOST_ARENA, region end)`.
pub const HOST_ARENA: u64 = 1 << 20;
/// Region size of the scaling tests' fabrics.
pub const SCALE_REGION: u64 = 4 << 20;

/// A lock host serving the test region's arena, in the test process.
pub fn tree_host(regions: Arc<RegionTable>) -> Arc<LockMemoryHost> {
    Arc::new(LockMemoryHost::new(regions, TEST_REGION, HOST_ARENA, SCALE_REGION))
}

/// A configuration for tests: the paper's, with bounded waits, and the
/// `T_wait` and T_lease every client of the test shares ([`publish_t_wait`]).
pub fn test_config(ep: &Endpoint) -> CitronConfig {
    shared_config(ep, Duration::from_secs(20))
}

/// A client of `instance` on the tree host at `host` (tcp RPC, whatever the
/// verbs' backend).
pub fn scaling_client(ep: &Endpoint, host: SocketAddr, instance: InstanceId) -> CitronClient {
    scaling_client_with(ep, host, instance, test_config(ep))
}

/// As [`scaling_client`], with `config`.
pub fn scaling_client_with(
    ep: &Endpoint,
    host: SocketAddr,
    instance: InstanceId,
    config: CitronConfig,
) -> CitronClient {
    let rpc = RemoteTreeHost::connect(host, Duration::from_secs(10));
    let th: Arc<dyn TreeHost> = Arc::new(RemoteTreeHost::new(rpc, instance));
    CitronClient::with_host(th, config, Box::new(spillover(ep))).expect("client")
}

/// T_lease of [`holding_config`].
pub const HOLDING_LEASE: Duration = Duration::from_secs(60);

/// [`test_config`] for tests that hold ranges on purpose across slow steps
/// (scale-up RPCs, sleeps) and then check that others wait: on a loaded
/// machine those steps can outlast the default lease (1 s), after which
/// lease recovery rightly takes the ranges over (§3.10) and the holder's
/// release is fenced. Such a test is not about leases, so its holders get
/// a lease that no step of it comes near.
pub fn holding_config(ep: &Endpoint) -> CitronConfig {
    let mut config = test_config(ep);
    config.lease = HOLDING_LEASE;
    config.give_up = config.give_up.max(HOLDING_LEASE * 2);
    config
}

/// A random range for a tree of `n` units: mostly small, a third of them in
/// the first 1024 units (contention), some large, some crossing N (which
/// raises the maximizer and, through the release's scale policy, scales up).
/// Ranges stay below [`SCALE_CAP`] even when a poller has grown the tree
/// further.
fn random_scaling_range(rng: &mut impl Rng, n: u64) -> (u64, u64) {
    let p: u32 = rng.gen_range(0..100);
    if p >= 92 && n < SCALE_CAP {
        let l = rng.gen_range(n - 64..n);
        return (l, rng.gen_range(n + 1..=(n + n / 2).min(SCALE_CAP)));
    }
    let len = match p {
        0..=54 => rng.gen_range(1..=4),
        55..=84 => rng.gen_range(5..=64),
        _ => rng.gen_range(65..=400),
    };
    let span = if rng.gen_bool(0.35) { n.min(1024) } else { n.min(SCALE_CAP) };
    let len = len.min(span);
    let l = rng.gen_range(0..=span - len);
    (l, l + len)
}

/// The paper's poller (§4.5) with a push: until `stop`, every `period`
/// scales the tree up 4× (up to depth `max_depth`) whatever the maximizer
/// says, so scale-ups keep happening for the whole run. Returns how many.
pub fn run_scaler(
    ep: &Endpoint,
    host: SocketAddr,
    instance: InstanceId,
    max_depth: u32,
    period: Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> u64 {
    let mut client = scaling_client(ep, host, instance);
    let mut done = 0;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(period);
        client.refresh().expect("refresh");
        let shape = client.layout().shape;
        if shape.depth() < max_depth && client.scale_up(ep, shape.units() * 4).expect("scale up").is_some() {
            done += 1;
        }
    }
    done
}

/// Checks the oracle while `[l, r)` is held: every unit's counter goes 0 -> 1.
fn oracle_enter(ep: &Endpoint, l: u64, r: u64, held: &citron_lock::citron::lock::HeldRange) {
    let enter: Vec<Verb> = (l..r).map(|u| Verb::Faa { addr: unit_word(u), add: 1 }).collect();
    for (u, reply) in (l..r).zip(ep.execute(&enter).expect("oracle enter")) {
        let old = match reply.expect("oracle verb") {
            VerbReply::Old(v) => v,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(old, 0, "unit {u} of [{l}, {r}) was held by someone else too (nodes {:?})", held.nodes());
    }
}

fn oracle_leave(ep: &Endpoint, l: u64, r: u64) {
    let leave: Vec<Verb> = (l..r).map(|u| Verb::Faa { addr: unit_word(u), add: u64::MAX }).collect();
    for reply in ep.execute(&leave).expect("oracle leave") {
        reply.expect("oracle verb");
    }
}

/// Runs `iterations` random acquisitions against a growing tree; panics on
/// any overlap. Crossing ranges scale the tree up after their release
/// (`ScalePolicy::AfterSpillover`), so scale-ups run while other threads and
/// processes hold and acquire ranges under older configurations.
pub fn run_scaling(
    ep: &Endpoint,
    host: SocketAddr,
    instance: InstanceId,
    iterations: u64,
    seed: u64,
) -> CitronStats {
    let mut client = scaling_client(ep, host, instance);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..iterations {
        let (l, r) = random_scaling_range(&mut rng, client.layout().shape.units());
        let held = client.acquire(ep, l, r).expect("acquire");
        oracle_enter(ep, l, r, &held);
        if rng.gen_bool(0.3) {
            std::thread::yield_now();
        }
        oracle_leave(ep, l, r);
        client.release(ep, held).expect("release");
    }
    client.stats()
}

/// The Exp and Sup bits an idle tree of this history bears (independent of
/// the lock code's own plan): Sup on the root of every superseded
/// generation; Exp on every internal node that a scale-up found less than m
/// levels below its old root and put m or more below the new one. With
/// `cleared_top`, a scale-down has cleared both in the top m levels.
pub fn expected_marks(depths: &[u32], m: u32, cleared_top: bool) -> std::collections::HashMap<NodeKey, u64> {
    use citron_lock::citron::word::{EXP_BIT, SUP_BIT};
    let mut marks = std::collections::HashMap::new();
    let current = *depths.last().unwrap();
    for w in depths.windows(2) {
        let (old, new) = (w[0], w[1]);
        *marks.entry(NodeKey { height: old, pos: 0 }).or_insert(0) |= SUP_BIT;
        for height in 1..=old {
            let (old_level, new_level) = (old - height, new - height);
            if old_level < m && new_level >= m {
                for pos in 0..1u64 << (2 * old_level) {
                    *marks.entry(NodeKey { height, pos }).or_insert(0) |= EXP_BIT;
                }
            }
        }
    }
    if cleared_top {
        marks.retain(|k, _| current - k.height >= m);
    }
    marks
}

/// Reads every word of every segment of `geometry` and asserts the tree is
/// idle: every leaf zero; every internal node unoccupied, with TCnt = TMax
/// and DCnt = DMax, the spare bit 47 clear, and exactly the marks of
/// [`expected_marks`]; the maximizer zero. Returns the number of words.
pub fn check_idle_geometry(ep: &Endpoint, geometry: &TreeGeometry, m: u32, cleared_top: bool) -> u64 {
    use citron_lock::citron::word::{EXP_BIT, SUP_BIT};
    let tree = SegmentedTree::new(geometry).expect("geometry");
    let shape = tree.shape();
    let marks = expected_marks(&geometry.depths(), m, cleared_top);
    let mut words = 0;
    for level in 0..=shape.depth() {
        for run in tree.level_runs(level) {
            // Reads of at most 4 KiB are word-atomic; read in such chunks.
            for chunk_start in (0..run.count).step_by(512) {
                let count = (run.count - chunk_start).min(512);
                let mut buf = vec![0u8; 8 * count as usize];
                ep.read(run.addr + 8 * chunk_start, &mut buf).expect("read tree");
                for (j, w) in buf.chunks_exact(8).enumerate() {
                    let w = u64::from_le_bytes(w.try_into().unwrap());
                    let key =
                        NodeKey { height: shape.depth() - level, pos: run.first + chunk_start + j as u64 };
                    words += 1;
                    if key.height == 0 {
                        assert_eq!(w, 0, "leaf {key:?} still has bits set");
                        continue;
                    }
                    let i = Internal(w);
                    assert!(i.idle(), "node {key:?} not idle: {i:?}");
                    // Bit 47 is HB: a waiting client's heartbeat, whose
                    // parity at rest means nothing.
                    let want = marks.get(&key).copied().unwrap_or(0);
                    assert_eq!(
                        w & (SUP_BIT | EXP_BIT),
                        want,
                        "node {key:?} marks: {i:?} in {:?}",
                        geometry.depths()
                    );
                }
            }
        }
    }
    assert_eq!(ep.read_u64(geometry.maximizer).unwrap(), 0, "maximizer");
    words
}

/// After a scaling run: every oracle word zero, spillover idle and used.
pub fn check_idle_oracle_and_spillover(ep: &Endpoint, units: u64) {
    for start in (0..units).step_by(512) {
        let count = (units - start).min(512);
        let mut buf = vec![0u8; 8 * count as usize];
        ep.read(unit_word(start), &mut buf).expect("read oracle");
        for (j, w) in buf.chunks_exact(8).enumerate() {
            assert_eq!(
                u64::from_le_bytes(w.try_into().unwrap()),
                0,
                "oracle word of unit {}",
                start + j as u64
            );
        }
    }
    let spill = DslrWord(ep.read_u64(RemoteAddr::new(TEST_REGION, SPILLOVER_AT)).unwrap());
    assert!(spill.maxx() > 0, "crossing requests took the spillover mutex");
    assert_eq!((spill.nx(), spill.ns()), (spill.maxx(), spill.maxs()), "spillover idle");
}
