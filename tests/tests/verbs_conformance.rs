//! The verbs conformance suite: every case runs against both backends, and
//! against both in the test mode `RemoteAtomicity::NicOnly` too (remote RMWs
//! read, yield and write under a NIC mutex): a verb's result must not depend
//! on the mode. Then what the mode changes: remote RMWs race with the host's
//! CPU atomics (lost updates) but never with each other.

use citron_lock::rdma::arith::{field_boundaries, field_delta};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use citron_lock::rdma::{
    Endpoint, Node, RdmaError, RegionId, RemoteAddr, RemoteAtomicity, Verb, VerbError, VerbKind, VerbReply,
    MAX_TRANSFER,
};
use citronfs_tests::{spawn_worker, wait_all, Backend, TestFabric, BACKENDS, TEST_REGION};

const REGION_LEN: u64 = 1 << 20;

fn at(off: u64) -> RemoteAddr {
    RemoteAddr::new(TEST_REGION, off)
}

const MODES: [RemoteAtomicity; 2] = [RemoteAtomicity::WithHost, RemoteAtomicity::NicOnly];

/// Runs `case` once per backend and remote atomicity with a fresh fabric and
/// endpoint.
fn on_each_backend(case: impl Fn(Backend, &Endpoint)) {
    for backend in BACKENDS {
        for mode in MODES {
            eprintln!("case on {backend:?}, remote atomicity {}", mode.name());
            let fabric = TestFabric::with_atomicity(backend, REGION_LEN, mode);
            assert_eq!(fabric.region().remote_atomicity(), mode);
            let node = Node::join(&fabric.addr).expect("join");
            let ep = node.endpoint().expect("endpoint");
            case(backend, &ep);
        }
    }
}

fn verb_err(r: Result<impl std::fmt::Debug, RdmaError>) -> VerbError {
    match r {
        Err(RdmaError::Verb(e)) => e,
        other => panic!("expected a verb error, got {other:?}"),
    }
}

#[test]
fn read_write_round_trip() {
    on_each_backend(|b, ep| {
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        ep.write(at(3), &data).unwrap();
        let mut back = vec![0u8; data.len()];
        ep.read(at(3), &mut back).unwrap();
        assert_eq!(back, data, "{b:?}");
        // A word write is seen by a word read and by atomics.
        ep.write_u64(at(4096), 0xDEAD_BEEF).unwrap();
        assert_eq!(ep.read_u64(at(4096)).unwrap(), 0xDEAD_BEEF);
        assert_eq!(ep.faa(at(4096), 1).unwrap(), 0xDEAD_BEEF);
        // Untouched memory reads as zeros.
        assert_eq!(ep.read_u64(at(REGION_LEN - 8)).unwrap(), 0);
    });
}

#[test]
fn cas_and_faa() {
    on_each_backend(|b, ep| {
        let w = at(64);
        assert_eq!(ep.cas(w, 0, 7).unwrap(), 0, "{b:?}: success returns the expected old value");
        assert_eq!(ep.cas(w, 0, 9).unwrap(), 7, "{b:?}: failure returns the current value");
        assert_eq!(ep.read_u64(w).unwrap(), 7);
        assert_eq!(ep.faa(w, u64::MAX).unwrap(), 7, "adding -1");
        assert_eq!(ep.faa(w, 0).unwrap(), 6);
        ep.write_u64(w, u64::MAX).unwrap();
        assert_eq!(ep.faa(w, 2).unwrap(), u64::MAX);
        assert_eq!(ep.read_u64(w).unwrap(), 1, "wraps like the hardware");
    });
}

#[test]
fn masked_cas_semantics() {
    on_each_backend(|b, ep| {
        let w = at(128);
        ep.write_u64(w, 0xFF00_0000_0000_00AA).unwrap();
        // Compare only the low byte; swap only bits 8..16.
        let old = ep.masked_cas(w, 0xAA, 0xFF, 0x5500, 0xFF00).unwrap();
        assert_eq!(old, 0xFF00_0000_0000_00AA, "{b:?}: the whole old value comes back");
        assert_eq!(ep.read_u64(w).unwrap(), 0xFF00_0000_0000_55AA);
        // A failing compare changes nothing and still returns the whole word.
        let old = ep.masked_cas(w, 0xAB, 0xFF, 0, u64::MAX).unwrap();
        assert_eq!(old, 0xFF00_0000_0000_55AA);
        assert_eq!(ep.read_u64(w).unwrap(), 0xFF00_0000_0000_55AA);
        // Zero compare mask: fetch-and-OR ...
        ep.masked_cas(w, 0, 0, 0x0F00_0000, 0x0F00_0000).unwrap();
        assert_eq!(ep.read_u64(w).unwrap(), 0xFF00_0000_0F00_55AA);
        // ... and fetch-and-store.
        assert_eq!(ep.masked_cas(w, 0, 0, 42, u64::MAX).unwrap(), 0xFF00_0000_0F00_55AA);
        assert_eq!(ep.read_u64(w).unwrap(), 42);
        // Setting and clearing single leaf bits as Citron does (§3.4).
        ep.write_u64(w, 0).unwrap();
        let bits = 0b1011_0000u64;
        assert_eq!(ep.masked_cas(w, 0, bits, bits, bits).unwrap(), 0, "lock bits");
        assert_eq!(ep.masked_cas(w, 0, bits, bits, bits).unwrap(), bits, "second lock fails");
        assert_eq!(ep.read_u64(w).unwrap(), bits);
        ep.masked_cas(w, bits, bits, 0, bits).unwrap();
        assert_eq!(ep.read_u64(w).unwrap(), 0, "unlock bits");
    });
}

#[test]
fn masked_faa_carries_and_borrows_stop_at_boundaries() {
    on_each_backend(|b, ep| {
        let w = at(256);
        // Fields: [0,16) [16,32) [32,33) [33,64)
        let mask = field_boundaries(&[(0, 16), (16, 16), (32, 1), (33, 31)]);
        ep.write_u64(w, 0xFFFF).unwrap();
        // Carry out of the low field is dropped.
        assert_eq!(ep.masked_faa(w, 1, mask).unwrap(), 0xFFFF, "{b:?}");
        assert_eq!(ep.read_u64(w).unwrap(), 0);
        // Borrow out of the second field is dropped: 0 - 1 = 0xFFFF inside it.
        ep.masked_faa(w, field_delta(16, 16, -1), mask).unwrap();
        assert_eq!(ep.read_u64(w).unwrap(), 0xFFFF_0000);
        // A 1-bit flag toggles without touching its neighbours.
        ep.masked_faa(w, field_delta(32, 1, 1), mask).unwrap();
        ep.masked_faa(w, field_delta(32, 1, 1), mask).unwrap();
        assert_eq!(ep.read_u64(w).unwrap(), 0xFFFF_0000, "1+1 in a 1-bit field is 0 with no carry");
        // Several fields in one verb, some up, some down.
        let add = field_delta(0, 16, 5) | field_delta(16, 16, 1) | field_delta(33, 31, -2);
        ep.masked_faa(w, add, mask).unwrap();
        let v = ep.read_u64(w).unwrap();
        assert_eq!(v & 0xFFFF, 5);
        assert_eq!((v >> 16) & 0xFFFF, 0, "0xFFFF + 1 wraps in its field");
        assert_eq!((v >> 32) & 1, 0, "the flag is untouched by the carry");
        assert_eq!(v >> 33, (1 << 31) - 2);
        // Zero mask is an ordinary 64-bit fetch-and-add with full carry.
        ep.write_u64(w, 0xFFFF_FFFF).unwrap();
        ep.masked_faa(w, 1, 0).unwrap();
        assert_eq!(ep.read_u64(w).unwrap(), 0x1_0000_0000);
    });
}

#[test]
fn extended_16_byte_atomics() {
    on_each_backend(|b, ep| {
        let e = at(512);
        // ShiftLock entry shape (§3.3, Fig. 3): 64-bit lock word + 64-bit RelCnt.
        let entry: u128 = 0x1234_5678_9ABC_DEF0 | (7u128 << 64);
        let old = ep.ext_cas(e, 0, u128::MAX, entry, u128::MAX).unwrap();
        assert_eq!(old, 0, "{b:?}");
        assert_eq!(ep.read_u128(e).unwrap(), entry);
        // Fetch-and-store of the low 64 bits only (zero compare mask).
        let old = ep.ext_cas(e, 0, 0, 0xAAAA, u64::MAX as u128).unwrap();
        assert_eq!(old, entry);
        assert_eq!(ep.read_u128(e).unwrap(), 0xAAAA | (7u128 << 64));
        // Compare on the high half only.
        let old = ep.ext_cas(e, 8u128 << 64, !(u64::MAX as u128), 0, u128::MAX).unwrap();
        assert_eq!(old, 0xAAAA | (7u128 << 64), "compare failed, nothing swapped");
        assert_eq!(ep.read_u128(e).unwrap(), 0xAAAA | (7u128 << 64));
        // Field-wise add: the low 64 bits overflow without carrying into the high half.
        ep.write(e, &u64::MAX.to_le_bytes()).unwrap();
        let boundaries = (1u128 << 63) | (1u128 << 127);
        ep.ext_faa(e, 1 | (1u128 << 64), boundaries).unwrap();
        assert_eq!(ep.read_u128(e).unwrap(), 8u128 << 64);
        // The high half is an ordinary word for 8-byte verbs and reads.
        assert_eq!(ep.read_u64(at(520)).unwrap(), 8);
    });
}

#[test]
fn bounds_and_alignment_are_checked() {
    on_each_backend(|b, ep| {
        let mut buf = [0u8; 16];
        let e = verb_err(ep.read(at(REGION_LEN - 8), &mut buf));
        assert!(matches!(e, VerbError::OutOfBounds { len: 16, region_len: REGION_LEN, .. }), "{b:?}: {e:?}");
        assert!(matches!(verb_err(ep.write(at(REGION_LEN), &[1])), VerbError::OutOfBounds { .. }));
        assert!(matches!(verb_err(ep.read(at(u64::MAX - 3), &mut buf)), VerbError::OutOfBounds { .. }));
        assert!(matches!(verb_err(ep.faa(at(REGION_LEN), 1)), VerbError::OutOfBounds { .. }));
        assert!(matches!(verb_err(ep.cas(at(4), 0, 1)), VerbError::Misaligned { align: 8, .. }));
        assert!(matches!(verb_err(ep.masked_faa(at(12), 1, 0)), VerbError::Misaligned { align: 8, .. }));
        assert!(matches!(verb_err(ep.masked_cas(at(1), 0, 0, 0, 0)), VerbError::Misaligned { .. }));
        assert!(matches!(verb_err(ep.ext_cas(at(8), 0, 0, 0, 0)), VerbError::Misaligned { align: 16, .. }));
        assert!(matches!(verb_err(ep.ext_faa(at(REGION_LEN - 8), 0, 0)), VerbError::OutOfBounds { .. }));
        let other = RemoteAddr::new(RegionId(99), 0);
        assert_eq!(verb_err(ep.read_u64(other)), VerbError::UnknownRegion(RegionId(99)));
        let mut big = vec![0u8; MAX_TRANSFER as usize + 1];
        assert!(matches!(verb_err(ep.read(at(0), &mut big)), VerbError::TooLarge { .. }));
        // Refused verbs change nothing: the memory around the edge is intact.
        ep.write_u64(at(REGION_LEN - 8), 5).unwrap();
        let _ = ep.write(at(REGION_LEN - 4), &[9; 8]);
        assert_eq!(ep.read_u64(at(REGION_LEN - 8)).unwrap(), 5);
        // The endpoint is still usable after errors.
        assert_eq!(ep.faa(at(0), 1).unwrap(), 0);
    });
}

#[test]
fn batches_execute_in_order_with_one_round_trip() {
    on_each_backend(|b, ep| {
        let w = at(1024);
        let before = ep.counts();
        let mut batch = ep.batch();
        let s_write = batch.push(Verb::Write { addr: w, data: 10u64.to_le_bytes().to_vec() });
        let s_faa1 = batch.push(Verb::Faa { addr: w, add: 5 });
        let s_cas = batch.push(Verb::Cas { addr: w, expect: 15, new: 100 });
        let s_bad = batch.push(Verb::Faa { addr: at(3), add: 1 });
        let s_masked = batch.push(Verb::MaskedFaa { addr: w, add: 1, boundary_mask: 0 });
        let s_read = batch.push(Verb::Read { addr: w, len: 8 });
        let replies = batch.submit().unwrap();
        assert_eq!(replies.get(s_write), &Ok(VerbReply::Written), "{b:?}");
        assert_eq!(replies.old(s_faa1).unwrap(), 10, "the faa sees the earlier write");
        assert_eq!(replies.old(s_cas).unwrap(), 15, "the cas sees the faa");
        assert!(matches!(replies.get(s_bad), Err(VerbError::Misaligned { .. })), "a bad verb fails alone");
        assert_eq!(replies.old(s_masked).unwrap(), 100, "later verbs still run, in order");
        assert_eq!(replies.u64(s_read).unwrap(), 101);
        let d = ep.counts() - before;
        assert_eq!(d.round_trips, 1, "a batch is one round trip");
        assert_eq!(d.verbs(), 6);
        assert_eq!(d.get(VerbKind::Faa), 2);
        assert_eq!(d.atomics(), 4);
    });
}

/// Writes from the caller's slices (the file system's data path) land as
/// a batch of `Write` verbs would: in order, one round trip, each counted,
/// and a bad one fails alone.
#[test]
fn slice_writes_are_a_batch_of_writes() {
    on_each_backend(|b, ep| {
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        let small = [7u8; 100];
        let before = ep.counts();
        let written = ep
            .write_slices(&[
                (at(0), &big),
                (at(REGION_LEN - 8), &small),
                (at(300_000), &small),
                (at(300_050), &[9u8; 8]),
            ])
            .unwrap();
        assert_eq!(written[0], Ok(()), "{b:?}");
        assert!(matches!(written[1], Err(VerbError::OutOfBounds { .. })), "{b:?}: {:?}", written[1]);
        assert_eq!((written[2].clone(), written[3].clone()), (Ok(()), Ok(())), "{b:?}");
        let d = ep.counts() - before;
        assert_eq!(d.round_trips, 1, "{b:?}: slice writes are one round trip");
        assert_eq!(d.get(VerbKind::Write), 4, "{b:?}");
        let mut back = vec![0u8; big.len()];
        ep.read(at(0), &mut back).unwrap();
        assert!(back == big, "{b:?}: the big write reads back wrong");
        let mut back = [0u8; 100];
        ep.read(at(300_000), &mut back).unwrap();
        assert_eq!(&back[..50], &small[..50], "{b:?}");
        assert_eq!(&back[50..58], &[9u8; 8], "{b:?}: the later write lands after the earlier one");
        assert_eq!(&back[58..], &small[58..], "{b:?}");
    });
}

#[test]
fn large_pipelined_batches_do_not_deadlock() {
    on_each_backend(|b, ep| {
        // Far more reply bytes than a socket buffer holds.
        let mut batch = ep.batch();
        let slots: Vec<_> = (0..64u64)
            .map(|i| {
                batch.push(Verb::Write { addr: at(i * 8192), data: vec![i as u8; 8192] });
                batch.push(Verb::Read { addr: at(i * 8192), len: 8192 })
            })
            .collect();
        let replies = batch.submit().unwrap();
        for (i, s) in slots.into_iter().enumerate() {
            assert!(replies.data(s).unwrap().iter().all(|&x| x == i as u8), "{b:?}: slot {i}");
        }
    });
}

#[test]
fn counters_count_every_verb() {
    on_each_backend(|b, ep| {
        ep.reset_counts();
        ep.read_u64(at(0)).unwrap();
        ep.write_u64(at(0), 1).unwrap();
        ep.cas(at(0), 1, 2).unwrap();
        ep.faa(at(0), 1).unwrap();
        ep.masked_cas(at(0), 0, 0, 0, 0).unwrap();
        ep.masked_faa(at(0), 0, 0).unwrap();
        ep.ext_cas(at(16), 0, 0, 0, 0).unwrap();
        ep.ext_faa(at(16), 0, 0).unwrap();
        ep.flush(at(0), 8).unwrap();
        let c = ep.counts();
        for k in VerbKind::ALL {
            assert_eq!(c.get(k), 1, "{b:?} {k:?}");
        }
        assert_eq!(c.round_trips, 9);
        assert_eq!(c.bytes_read, 8);
        assert_eq!(c.bytes_written, 8);
    });
}

#[test]
fn two_sided_messages_between_endpoints_and_nodes() {
    on_each_backend(|b, _| {
        let fabric = TestFabric::new(b, REGION_LEN);
        let n1 = Node::join(&fabric.addr).unwrap();
        let n2 = Node::join(&fabric.addr).unwrap();
        assert_ne!(n1.id(), n2.id());
        let a = n1.endpoint().unwrap();
        let a2 = n1.endpoint().unwrap();
        let c = n2.endpoint().unwrap();
        let wait = std::time::Duration::from_secs(5);
        a.send(c.addr(), b"across nodes").unwrap();
        let m = c.recv_timeout(wait).expect("message arrives");
        assert_eq!((m.from, m.payload.as_slice()), (a.addr(), &b"across nodes"[..]), "{b:?}");
        c.send(a.addr(), b"reply").unwrap();
        assert_eq!(a.recv_timeout(wait).unwrap().payload, b"reply");
        a.send(a2.addr(), b"same node").unwrap();
        assert_eq!(a2.recv_timeout(wait).unwrap().payload, b"same node");
        assert!(a.try_recv().is_none(), "nothing is delivered twice or to the wrong mailbox");
        // Order between one pair is kept.
        for i in 0..100u32 {
            a.send(c.addr(), &i.to_le_bytes()).unwrap();
        }
        for i in 0..100u32 {
            assert_eq!(c.recv_timeout(wait).unwrap().payload, i.to_le_bytes());
        }
        assert_eq!(a.counts().messages_sent, 102);
        assert_eq!(c.counts().messages_received, 101);
    });
}

#[test]
fn linearizable_under_multi_process_stress() {
    const PROCESSES: u64 = 3;
    const THREADS: u64 = 4;
    // Remote RMWs yield inside the NIC mutex in the test mode: fewer rounds.
    for (backend, mode, iterations) in [
        (Backend::Shm, RemoteAtomicity::WithHost, 2000),
        (Backend::Tcp, RemoteAtomicity::WithHost, 2000),
        (Backend::Shm, RemoteAtomicity::NicOnly, 300),
        (Backend::Tcp, RemoteAtomicity::NicOnly, 120),
    ] {
        let fabric = TestFabric::with_atomicity(backend, REGION_LEN, mode);
        let started = Instant::now();
        let exe = env!("CARGO_BIN_EXE_verb-stress-worker");
        let args = vec![fabric.addr.to_string(), THREADS.to_string(), iterations.to_string()];
        // Threads of this process join the race too.
        let children: Vec<_> = (0..PROCESSES - 1).map(|_| spawn_worker(exe, &args)).collect();
        let local = std::process::Command::new(exe).args(&args).status().unwrap();
        assert!(local.success());
        wait_all(children);
        let total = PROCESSES * THREADS * iterations;
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        println!("{backend:?} {}: {total} rounds in {:?}", mode.name(), started.elapsed());
        assert_eq!(ep.read_u64(at(0)).unwrap(), total, "{backend:?} {}: faa", mode.name());
        let masked = ep.read_u64(at(8)).unwrap();
        assert_eq!(masked & 0xFFFF_FFFF, total, "{backend:?}: masked faa low field");
        assert_eq!(
            masked >> 32,
            (total as u32).wrapping_neg() as u64,
            "{backend:?}: high field wrapped inside itself"
        );
        assert_eq!(ep.read_u64(at(16)).unwrap(), total, "{backend:?}: cas loop");
        let ext = ep.read_u128(at(32)).unwrap();
        assert_eq!(ext as u64, total, "{backend:?}: ext faa low");
        assert_eq!((ext >> 64) as u64, 3 * total, "{backend:?}: ext faa high");
    }
}

/// Host threads' CPU fetch-and-add and remote FAA verbs on one word, at the
/// same time, `rounds` times `per_side` each. Returns the updates lost.
fn mixed_increments(fabric: &TestFabric, word: RemoteAddr, per_side: u64, remote_threads: usize) -> u64 {
    let region = fabric.region();
    let before = region.word(word).unwrap().load(Ordering::SeqCst);
    std::thread::scope(|s| {
        let w = region.word(word).unwrap();
        s.spawn(move || {
            for _ in 0..per_side {
                w.fetch_add(1, Ordering::SeqCst);
                std::thread::yield_now();
            }
        });
        for _ in 0..remote_threads {
            s.spawn(|| {
                let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
                for _ in 0..per_side {
                    ep.faa(word, 1).unwrap();
                }
            });
        }
    });
    let expected = before + per_side * (1 + remote_threads as u64);
    expected - region.word(word).unwrap().load(Ordering::SeqCst)
}

#[test]
fn nic_only_remote_rmws_race_with_host_atomics() {
    for backend in BACKENDS {
        // Test mode: updates get lost (run rounds until one is, at most 20 s).
        let fabric = TestFabric::with_atomicity(backend, REGION_LEN, RemoteAtomicity::NicOnly);
        let t = Instant::now();
        let mut lost = 0;
        while lost == 0 && t.elapsed() < Duration::from_secs(20) {
            lost = mixed_increments(&fabric, at(64), 200, 1);
        }
        println!("{backend:?} nic-only: {lost} updates lost after {:?}", t.elapsed());
        assert!(lost > 0, "{backend:?}: remote FAAs never raced with the host's fetch_add");
        // Default: remote atomics are CPU atomics, nothing is lost.
        let fabric = TestFabric::new(backend, REGION_LEN);
        assert_eq!(mixed_increments(&fabric, at(64), 2000, 1), 0, "{backend:?}: with-host lost updates");
    }
}

#[test]
fn nic_only_remote_rmws_stay_atomic_among_themselves() {
    for backend in BACKENDS {
        let fabric = TestFabric::with_atomicity(backend, REGION_LEN, RemoteAtomicity::NicOnly);
        let w = at(128);
        let per_thread = 300;
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
                    for _ in 0..per_thread {
                        ep.faa(w, 1).unwrap();
                        ep.masked_faa(w + 8, 1, 0).unwrap();
                    }
                });
            }
        });
        let region = fabric.region();
        assert_eq!(region.word(w).unwrap().load(Ordering::SeqCst), 3 * per_thread, "{backend:?}: faa");
        assert_eq!(region.word(w + 8).unwrap().load(Ordering::SeqCst), 3 * per_thread, "{backend:?}: masked");
    }
}
