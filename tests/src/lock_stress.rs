//! A stress workload for any [`RwLockClient`], with an oracle that works
//! across processes: counters of the holders inside, in the same fabric.
//!
//! A writer adds itself to `writers` and then reads `readers`; a reader adds
//! itself to `readers` and then reads `writers`. Every verb is sequentially
//! consistent, so of two holders that overlap, the second to enter sees the
//! first: a writer must see no one, a reader no writer.

use citron_lock::rdma::{Endpoint, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use rand::{Rng, SeedableRng};

use crate::TEST_REGION;

/// Oracle words in the test region.
pub const WRITERS_AT: u64 = 65536;
pub const READERS_AT: u64 = WRITERS_AT + 8;
/// Incremented whenever a reader entered while another reader was inside.
pub const OVERLAPS_AT: u64 = WRITERS_AT + 16;
/// Total completed critical sections.
pub const DONE_AT: u64 = WRITERS_AT + 24;
/// Where the lock under test lives.
pub const LOCK_AT: u64 = 4096;

fn at(off: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, off)
}

/// Runs `iterations` critical sections, `read_percent` of them shared.
pub fn run(ep: &Endpoint, lock: &mut dyn RwLockClient, iterations: u64, read_percent: u32, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for i in 0..iterations {
        let mode = if rng.gen_range(0..100) < read_percent { Mode::Shared } else { Mode::Exclusive };
        lock.acquire(ep, mode).unwrap_or_else(|e| panic!("acquire #{i}: {e}"));
        match mode {
            Mode::Exclusive => {
                let w = ep.faa(at(WRITERS_AT), 1).unwrap();
                let r = ep.read_u64(at(READERS_AT)).unwrap();
                assert_eq!((w, r), (0, 0), "a writer entered with {w} writers and {r} readers inside");
                spin_a_little(&mut rng);
                ep.faa(at(WRITERS_AT), u64::MAX).unwrap();
            }
            Mode::Shared => {
                let r = ep.faa(at(READERS_AT), 1).unwrap();
                let w = ep.read_u64(at(WRITERS_AT)).unwrap();
                assert_eq!(w, 0, "a reader entered with a writer inside");
                if r > 0 {
                    ep.faa(at(OVERLAPS_AT), 1).unwrap();
                }
                spin_a_little(&mut rng);
                ep.faa(at(READERS_AT), u64::MAX).unwrap();
            }
        }
        ep.faa(at(DONE_AT), 1).unwrap();
        lock.release(ep).unwrap_or_else(|e| panic!("release #{i}: {e}"));
    }
}

fn spin_a_little(rng: &mut impl Rng) {
    if rng.gen_bool(0.2) {
        std::thread::yield_now();
    }
}

/// (critical sections completed, reader overlaps observed); asserts nobody
/// is left inside.
pub fn totals(ep: &Endpoint) -> (u64, u64) {
    assert_eq!(ep.read_u64(at(WRITERS_AT)).unwrap(), 0);
    assert_eq!(ep.read_u64(at(READERS_AT)).unwrap(), 0);
    (ep.read_u64(at(DONE_AT)).unwrap(), ep.read_u64(at(OVERLAPS_AT)).unwrap())
}
