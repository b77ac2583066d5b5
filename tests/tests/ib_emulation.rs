//! The `ib` backend's emulation of masked atomics (a CAS loop over 8-byte
//! READ and CAS, `citron_lock::rdma::ib::emulate`) against the shm
//! backend's native masked verbs: the same operations on two words give the
//! same old values and the same words, and concurrent emulated updates of
//! disjoint fields lose nothing. Runs on any machine (no RDMA device).

use citron_lock::rdma::arith::field_boundaries;
use citron_lock::rdma::ib::emulate::{self, WordVerbs};
use citron_lock::rdma::{Endpoint, Node, RdmaError, RemoteAddr};
use citronfs_tests::{Backend, TestFabric, TEST_REGION};
use rand::{Rng, SeedableRng};

/// The emulation's two primitive verbs on a shm endpoint.
struct ShmWords<'a>(&'a Endpoint);

impl WordVerbs for ShmWords<'_> {
    type Addr = RemoteAddr;
    type Error = RdmaError;
    fn read_word(&mut self, at: RemoteAddr) -> Result<u64, RdmaError> {
        self.0.read_u64(at)
    }
    fn cas_word(&mut self, at: RemoteAddr, expect: u64, new: u64) -> Result<u64, RdmaError> {
        self.0.cas(at, expect, new)
    }
}

fn at(off: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, off)
}

#[test]
fn emulated_masked_verbs_match_the_shm_backend() {
    let fabric = TestFabric::new(Backend::Shm, 1 << 16);
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let (native, emulated) = (at(0), at(64));
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let masks = [0, u64::MAX, 0xFF, 0xFFFF_0000, 1 << 63, field_boundaries(&[(0, 16), (16, 16), (32, 32)])];
    let mut guess = None;
    for i in 0..20_000 {
        let pick = |rng: &mut rand::rngs::StdRng| {
            if rng.gen() {
                masks[rng.gen_range(0..masks.len())]
            } else {
                rng.gen()
            }
        };
        // Small values make compares succeed often enough to matter.
        let small = |rng: &mut rand::rngs::StdRng| if rng.gen() { rng.gen_range(0..4) } else { rng.gen() };
        let (old_n, old_e) = if rng.gen() {
            let (cmp, cmp_mask, swap, swap_mask) =
                (small(&mut rng), pick(&mut rng), small(&mut rng), pick(&mut rng));
            let n = ep.masked_cas(native, cmp, cmp_mask, swap, swap_mask).unwrap();
            let e = emulate::masked_cas(&mut ShmWords(&ep), emulated, guess, cmp, cmp_mask, swap, swap_mask)
                .unwrap();
            (n, e)
        } else {
            let (add, boundary) = (small(&mut rng), pick(&mut rng));
            let n = ep.masked_faa(native, add, boundary).unwrap();
            let e = emulate::masked_faa(&mut ShmWords(&ep), emulated, guess, add, boundary).unwrap();
            (n, e)
        };
        assert_eq!(old_n, old_e.old, "operation {i}: the old values differ");
        let word = ep.read_u64(native).unwrap();
        assert_eq!(word, ep.read_u64(emulated).unwrap(), "operation {i}: the words differ");
        // Without contention: one CAS at most, plus one a stale guess made fail.
        let max_cases = 1 + u64::from(guess.is_some_and(|g| g != old_n));
        assert!(old_e.round_trips() >= 1 && old_e.cases <= max_cases, "operation {i}: {old_e:?}");
        // Sometimes a right guess, sometimes a stale one.
        guess = match rng.gen_range(0..3) {
            0 => None,
            1 => Some(word),
            _ => Some(rng.gen()),
        };
    }
}

#[test]
fn concurrent_emulated_faa_on_disjoint_fields_loses_nothing() {
    let fabric = TestFabric::new(Backend::Shm, 1 << 16);
    let word = at(128);
    // Four 16-bit fields; thread t adds 1 to field t, 3000 times.
    let mask = field_boundaries(&[(0, 16), (16, 16), (32, 16), (48, 16)]);
    const PER_THREAD: u64 = 3000;
    let retries: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4u32)
            .map(|t| {
                let addr = fabric.addr.clone();
                s.spawn(move || {
                    let ep = Node::join(&addr).unwrap().endpoint().unwrap();
                    let mut extra = 0;
                    for _ in 0..PER_THREAD {
                        let r =
                            emulate::masked_faa(&mut ShmWords(&ep), word, None, 1 << (16 * t), mask).unwrap();
                        extra += r.cases - 1;
                    }
                    extra
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
    let v = ep.read_u64(word).unwrap();
    for t in 0..4 {
        assert_eq!((v >> (16 * t)) & 0xFFFF, PER_THREAD, "field {t}");
    }
    eprintln!("CAS retries under contention (the emulation's extra round trips): {retries:?}");
}
