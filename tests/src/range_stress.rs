//! The range lock stress workload, for every algorithm behind
//! [`RangeLockClient`], shared by the in-process tests and the worker
//! processes (`range-stress-worker`): random ranges of mixed sizes and
//! positions — inside the covered space, across its end, and "to infinity" —
//! checked by an oracle of per-unit counters in the same fabric.
//!
//! Oracle (in the test region, at [`ORACLE_AT`]): one word per unit of
//! `[0, ORACLE_UNITS)` and one [`INFINITY_WORD`] for everything beyond. A
//! holder of `[l, r)` adds 1 to each of its words (the units below
//! `ORACLE_UNITS`, and the infinity word if `r > ORACLE_UNITS`) and must find
//! every one at 0; then subtracts 1 again. Verbs are sequentially consistent,
//! so two holders of overlapping ranges at once would see each other.
//! [`DONE_AT`] counts completed critical sections, so a test can check that
//! every request completed.

use std::time::Duration;

use citron_lock::range_lock::rpc::RangeInstanceId;
use citron_lock::range_lock::{RangeLockClient, RangeLockContext, RangeLockSite, RangeLockStats};
use citron_lock::rdma::{Endpoint, RemoteAddr, Verb, VerbReply};
use rand::{Rng, SeedableRng};

use crate::TEST_REGION;

/// Units the lock instance covers (Citron: a depth-2 tree; segments: the array).
pub const UNITS: u64 = 1024;
/// Units past `UNITS` that finite requests may reach.
pub const BEYOND: u64 = 128;
/// Units with their own oracle word.
pub const ORACLE_UNITS: u64 = UNITS + BEYOND;
/// Where the lock's memory starts in the test region.
pub const LOCK_AT: u64 = 0;
pub const ORACLE_AT: u64 = 65536;
/// The word standing for `[ORACLE_UNITS, ∞)`.
pub const INFINITY_WORD: u64 = ORACLE_AT + 8 * ORACLE_UNITS;
pub const DONE_AT: u64 = INFINITY_WORD + 8;
/// The region every range lock test needs.
pub const REGION_BYTES: u64 = 1 << 20;
/// The lock instance the rpc tests use.
pub const INSTANCE: RangeInstanceId = RangeInstanceId(42);

fn at(off: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, off)
}

/// The site named by `spec`: `citron`, `segments:S` or `rpc:HOST:PORT`.
pub fn site(spec: &str) -> RangeLockSite {
    let base = at(LOCK_AT);
    if spec == "citron" {
        RangeLockSite::citron(base, UNITS)
    } else if let Some(s) = spec.strip_prefix("segments:") {
        RangeLockSite::segments(base, UNITS, s.parse().expect("segment size")).expect("segment layout")
    } else if let Some(addr) = spec.strip_prefix("rpc:") {
        RangeLockSite::rpc(addr.parse().expect("server address"), INSTANCE)
    } else {
        panic!("site {spec:?} is not citron, segments:S or rpc:ADDR")
    }
}

/// A context with the transport's timing, a short lease (`lease_ms`) if
/// given, and bounded waits.
pub fn context(ep: &Endpoint, lease_ms: Option<u64>) -> RangeLockContext {
    let rtt = ep.measure_rtt(at(ORACLE_AT), 5).expect("rtt");
    let mut ctx = RangeLockContext::from_rtt(rtt).with_give_up(Duration::from_secs(30));
    if let Some(ms) = lease_ms {
        ctx.dslr.lease = Duration::from_millis(ms);
        ctx.citron.lease = Duration::from_millis(ms);
    }
    ctx
}

/// A random range: mostly small, some large, some across `UNITS`, a few to
/// infinity.
pub fn random_range(rng: &mut impl Rng) -> (u64, u64) {
    match rng.gen_range(0..100u32) {
        0..=49 => {
            let len = rng.gen_range(1..=4);
            let l = rng.gen_range(0..=UNITS - len);
            (l, l + len)
        }
        50..=79 => {
            let len = rng.gen_range(5..=64);
            let l = rng.gen_range(0..=UNITS - len);
            (l, l + len)
        }
        80..=89 => {
            let len = rng.gen_range(65..=400);
            let l = rng.gen_range(0..=UNITS - len);
            (l, l + len)
        }
        90..=95 => {
            let l = rng.gen_range(UNITS - 64..UNITS + BEYOND - 1);
            (l, rng.gen_range(l + 1..=ORACLE_UNITS))
        }
        _ => (rng.gen_range(0..ORACLE_UNITS + 10), u64::MAX),
    }
}

/// The oracle words of `[l, r)`.
fn oracle_words(l: u64, r: u64) -> Vec<RemoteAddr> {
    let mut words: Vec<RemoteAddr> =
        (l.min(ORACLE_UNITS)..r.min(ORACLE_UNITS)).map(|u| at(ORACLE_AT + 8 * u)).collect();
    if r > ORACLE_UNITS {
        words.push(at(INFINITY_WORD));
    }
    words
}

/// Runs `iterations` random critical sections; panics on any overlap or error.
pub fn run(ep: &Endpoint, lock: &mut dyn RangeLockClient, iterations: u64, seed: u64) -> RangeLockStats {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for i in 0..iterations {
        let (l, r) = random_range(&mut rng);
        let held = lock.acquire(ep, l, r).unwrap_or_else(|e| panic!("acquire #{i} [{l}, {r}): {e}"));
        assert_eq!((held.start(), held.end()), (l, r));
        let words = oracle_words(l, r);
        let enter: Vec<Verb> = words.iter().map(|&addr| Verb::Faa { addr, add: 1 }).collect();
        for (addr, reply) in words.iter().zip(ep.execute(&enter).expect("oracle enter")) {
            let old = match reply.expect("oracle verb") {
                VerbReply::Old(v) => v,
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!(
                old,
                0,
                "{} [{l}, {r}): oracle word {addr} was held by someone else too",
                lock.algorithm()
            );
        }
        if rng.gen_bool(0.3) {
            std::thread::yield_now();
        }
        let leave: Vec<Verb> = words.iter().map(|&addr| Verb::Faa { addr, add: u64::MAX }).collect();
        for reply in ep.execute(&leave).expect("oracle leave") {
            reply.expect("oracle verb");
        }
        ep.faa(at(DONE_AT), 1).expect("done counter");
        lock.release(ep, held).unwrap_or_else(|e| panic!("release #{i} [{l}, {r}): {e}"));
    }
    lock.stats()
}

/// After every client is done: no oracle word counted; returns the number of
/// completed critical sections.
pub fn check_oracle(ep: &Endpoint) -> u64 {
    for u in 0..ORACLE_UNITS {
        assert_eq!(ep.read_u64(at(ORACLE_AT + 8 * u)).unwrap(), 0, "oracle word of unit {u}");
    }
    assert_eq!(ep.read_u64(at(INFINITY_WORD)).unwrap(), 0, "oracle word of infinity");
    ep.read_u64(at(DONE_AT)).unwrap()
}

/// Every DSLR word of a segments instance drained (no ticket left behind).
pub fn check_segments_idle(ep: &Endpoint, site: &RangeLockSite) {
    let RangeLockSite::Segments(layout) = site else { panic!("not a segments site") };
    for i in 0..=layout.segments {
        let w = citron_lock::dslr::DslrWord(ep.read_u64(layout.base + 8 * i).unwrap());
        assert!(w.drained(), "DSLR word {i} of {} not idle: {w:?}", layout.segments);
    }
}
