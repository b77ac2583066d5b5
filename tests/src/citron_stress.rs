//! The Citron stress workload shared by the in-process test and the worker
//! processes: random ranges of mixed sizes, some crossing the tree's bound,
//! checked by an oracle of per-unit counters in the same fabric.

use std::time::Duration;

use citron_lock::citron::lock::{CitronClient, CitronConfig, CitronLayout, CitronStats};
use citron_lock::citron::tree::TreeShape;
use citron_lock::dslr::{DslrConfig, DslrLock, DslrWord};
use citron_lock::rdma::{Endpoint, RemoteAddr, Verb};
use rand::{Rng, SeedableRng};

use crate::TEST_REGION;

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

/// Runs `iterations` random acquisitions on `ep`; panics on any overlap.
pub fn run(ep: &Endpoint, iterations: u64, seed: u64) -> CitronStats {
    let rtt = ep.measure_rtt(unit_word(0), 5).expect("rtt");
    let mut config = CitronConfig::from_rtt(rtt);
    config.give_up = Duration::from_secs(10);
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
