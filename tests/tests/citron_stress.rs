//! Citron under contention from several processes and threads on both
//! backends, with an oracle: no unit is ever held twice, every request
//! completes, and the tree's words are idle afterwards.

use citron_lock::rdma::Node;
use citronfs_tests::{citron_stress, spawn_worker, wait_all, TestFabric, BACKENDS};

#[test]
fn overlapping_ranges_are_never_held_at_once() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let _t_wait = citron_stress::publish_t_wait(&fabric);
        let iterations = match backend {
            citronfs_tests::Backend::Shm => 400,
            citronfs_tests::Backend::Tcp | citronfs_tests::Backend::Ib => 150,
        };
        let exe = env!("CARGO_BIN_EXE_citron-stress-worker");
        let workers: Vec<_> = (0..2)
            .map(|p| {
                spawn_worker(
                    exe,
                    &[fabric.addr.to_string(), "3".into(), iterations.to_string(), (p + 1).to_string()],
                )
            })
            .collect();
        let node = Node::join(&fabric.addr).unwrap();
        std::thread::scope(|s| {
            for t in 0..2 {
                let node = node.clone();
                s.spawn(move || {
                    let ep = node.endpoint().unwrap();
                    citron_stress::run(&ep, iterations, 100 + t)
                });
            }
        });
        wait_all(workers);
        citron_stress::check_idle(&node.endpoint().unwrap());
    }
}

/// §3.8: with the fast path an uncontended acquisition is two round trips —
/// for a range inside one leaf and for a node whose children are leaves — and
/// a release is one.
#[test]
fn uncontended_acquisition_takes_two_round_trips() {
    use citron_lock::citron::lock::{CitronClient, CitronConfig};
    use citron_lock::rdma::RemoteAddr;
    use citronfs_tests::TEST_REGION;
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5).unwrap());
        let spill = citron_stress::spillover(&ep);
        let mut c = CitronClient::new(citron_stress::layout(), config, Box::new(spill));
        // 16 units inside one leaf; then 256 units = one level-1 node of a depth-2 tree.
        for (l, r) in [(100, 116), (256, 512)] {
            // Warm up: the first verbs map the region and fault pages in,
            // which can exceed T_wait and abort (then retry) an attempt.
            for _ in 0..3 {
                let held = c.acquire(&ep, l, r).unwrap();
                c.release(&ep, held).unwrap();
            }
            // An attempt that is preempted past T_wait aborts and retries
            // (more round trips, by design): judge the attempts that did not.
            let mut judged = 0;
            for _ in 0..50 {
                let (before, stats) = (ep.counts(), c.stats());
                let held = c.acquire(&ep, l, r).unwrap();
                let acquire = ep.counts() - before;
                let retried = c.stats().aborts + c.stats().restarts > stats.aborts + stats.restarts;
                let before = ep.counts();
                c.release(&ep, held).unwrap();
                let release = ep.counts() - before;
                assert_eq!(release.round_trips, 1, "{backend:?} [{l}, {r})");
                if retried {
                    continue;
                }
                if judged == 0 {
                    println!(
                        "{backend:?} [{l}, {r}): acquire {} round trips ({} atomics, {} reads), release {} ({} verbs)",
                        acquire.round_trips,
                        acquire.atomics(),
                        acquire.reads(),
                        release.round_trips,
                        release.verbs()
                    );
                }
                assert_eq!(acquire.round_trips, 2, "{backend:?} [{l}, {r})");
                judged += 1;
            }
            assert!(judged > 0, "every attempt was retried");
        }
        citron_stress::check_idle_tree(&ep);
    }
}

/// §3.10: clients that die holding a leaf's bits, an internal node (with the
/// whole-children shortcut), and a notification; the survivors get through
/// by lease recovery, and once every place has been visited the tree is idle.
#[test]
fn survivors_recover_what_dead_clients_held() {
    use std::time::{Duration, Instant};

    use citron_lock::citron::lock::{CitronClient, CitronConfig};
    use citron_lock::rdma::RemoteAddr;
    use citronfs_tests::TEST_REGION;
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let lease = Duration::from_millis(150);
        let client = |ep: &citron_lock::rdma::Endpoint| {
            let mut config =
                CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5).unwrap());
            config.lease = lease;
            config.give_up = Duration::from_secs(30);
            let spill = citron_stress::spillover(ep);
            CitronClient::new(citron_stress::layout(), config, Box::new(spill))
        };
        // The dead: each acquires and vanishes without releasing.
        for (l, r) in [(10, 20), (256, 512)] {
            let ep = node.endpoint().unwrap();
            let mut dead = client(&ep);
            std::mem::forget(dead.acquire(&ep, l, r).unwrap());
        }
        let ep = node.endpoint().unwrap();
        let mut survivor = client(&ep);
        for (l, r) in [(15, 25), (300, 310), (0, 1024)] {
            let t = Instant::now();
            let held = survivor.acquire(&ep, l, r).unwrap();
            survivor.release(&ep, held).unwrap();
            println!("{backend:?}: [{l}, {r}) acquired after {:?}", t.elapsed());
        }
        // Visit every leaf once, so any bits left by the dead are repaired.
        for leaf in 0..16 {
            let held = survivor.acquire(&ep, leaf * 64, leaf * 64 + 64).unwrap();
            survivor.release(&ep, held).unwrap();
        }
        let held = survivor.acquire(&ep, 0, 1024).unwrap();
        survivor.release(&ep, held).unwrap();
        assert!(survivor.stats().recoveries > 0, "{:?}", survivor.stats());
        println!("{backend:?}: {:?}", survivor.stats());
        citron_stress::check_idle_tree(&ep);
    }
}

/// §3.10 with real crashes: a process SIGKILLed holding a leaf range and one
/// holding an internal node; a survivor locks across both.
#[test]
fn processes_killed_holding_ranges_are_recovered() {
    use std::time::{Duration, Instant};

    use citron_lock::citron::lock::{CitronClient, CitronConfig};
    use citron_lock::rdma::RemoteAddr;
    use citronfs_tests::{Watched, TEST_REGION};
    let exe = env!("CARGO_BIN_EXE_lock-hold-worker");
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let lease_ms = 150u64;
        let mut dead = Vec::new();
        for (l, r) in [(10u64, 20u64), (256, 512)] {
            let args = [
                "citron".to_string(),
                fabric.addr.to_string(),
                l.to_string(),
                r.to_string(),
                lease_ms.to_string(),
            ];
            let mut w = Watched::spawn(exe, &args);
            w.wait_for("held");
            dead.push(w);
        }
        for w in dead {
            w.kill();
        }
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let mut config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5).unwrap());
        config.lease = Duration::from_millis(lease_ms);
        let mut c =
            CitronClient::new(citron_stress::layout(), config, Box::new(citron_stress::spillover(&ep)));
        for (l, r) in [(15, 300), (0, 1024)] {
            let t = Instant::now();
            let held = c.acquire(&ep, l, r).unwrap();
            c.release(&ep, held).unwrap();
            println!("{backend:?}: [{l}, {r}) after {:?}", t.elapsed());
        }
        assert!(c.stats().recoveries > 0);
    }
}

/// §3.10 mid-notification: a process SIGKILLed while it waits in phase 2(d)
/// — it has occupied an internal node and notified its ancestors, and waits
/// for a leaf holder below it — and then the leaf holder killed too. A
/// survivor locks the node, the leaf and the whole tree; lease recovery
/// (Lines 11, 18, 22, 36) repairs every word they left.
#[test]
fn a_process_killed_mid_notification_is_recovered() {
    use std::time::{Duration, Instant};

    use citron_lock::citron::lock::{CitronClient, CitronConfig};
    use citron_lock::rdma::RemoteAddr;
    use citronfs_tests::{Watched, TEST_REGION};
    let exe = env!("CARGO_BIN_EXE_lock-hold-worker");
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        // The waiter is killed well within the lease, before it could take the
        // living leaf holder for dead.
        let lease_ms = 500u64;
        let hold = |l: u64, r: u64| {
            let args = [
                "citron".to_string(),
                fabric.addr.to_string(),
                l.to_string(),
                r.to_string(),
                lease_ms.to_string(),
            ];
            Watched::spawn(exe, &args)
        };
        let mut leaf = hold(10, 20);
        leaf.wait_for("held");
        // [0, 256) is a node whose children are leaves: its shortcut fails on
        // the held leaf, so it occupies the node, notifies its ancestors and
        // waits for its descendants (phase 2(d)).
        let waiter = hold(0, 256);
        std::thread::sleep(Duration::from_millis(200));
        waiter.kill();
        leaf.kill();
        let ep = Node::join(&fabric.addr).unwrap().endpoint().unwrap();
        let mut config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5).unwrap());
        config.lease = Duration::from_millis(lease_ms);
        config.give_up = Duration::from_secs(30);
        let mut c =
            CitronClient::new(citron_stress::layout(), config, Box::new(citron_stress::spillover(&ep)));
        for (l, r) in [(0, 256), (15, 25), (0, 1024)] {
            let t = Instant::now();
            let held = c.acquire(&ep, l, r).unwrap();
            c.release(&ep, held).unwrap();
            println!("{backend:?}: [{l}, {r}) after {:?}", t.elapsed());
        }
        for leaf in 0..16 {
            let held = c.acquire(&ep, leaf * 64, leaf * 64 + 64).unwrap();
            c.release(&ep, held).unwrap();
        }
        assert!(c.stats().recoveries > 0, "{:?}", c.stats());
        citron_stress::check_idle_tree(&ep);
    }
}

/// §3.10, Line 22: a request that gives up on a refusing leaf and locks its
/// parent clears only the leaf bits that stay put for T_lease. Bits a live
/// client rolls back meanwhile (one whose notification came too late) are
/// left to its masked-CAS — zeroing them at once would let that roll-back
/// clear a later holder's bits — and a dead client's bits are cleared once
/// they have not moved for T_lease.
#[test]
fn a_leaf_escalation_leaves_live_bits_alone_and_clears_dead_ones() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use citron_lock::citron::lock::{CitronClient, CitronConfig};
    use citron_lock::citron::tree::TreeShape;
    use citron_lock::rdma::RemoteAddr;
    use citronfs_tests::TEST_REGION;
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let mut config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5).unwrap());
        // Long enough that the roll-back 100 ms in comes well within it on a
        // loaded machine (with 2 s, a busy CI machine once delayed it past
        // the lease, and bits unchanged for T_lease are rightly dead bits).
        config.lease = Duration::from_secs(6);
        config.leaf_patience = 2;
        let layout = citron_stress::layout();
        let shape = TreeShape::new(citron_stress::DEPTH);
        let leaf = shape.node_at(citron_stress::DEPTH, 0);
        let leaf_addr = layout.node(leaf);
        let late_bits = shape.leaf_mask(leaf, 10, 20);
        let mut c = CitronClient::new(layout, config, Box::new(citron_stress::spillover(&ep)));

        // A live late client's bits, rolled back 100 ms later.
        ep.write_u64(leaf_addr, late_bits).unwrap();
        // Set just before the roll-back, not after: set after it, a late
        // thread preempted between the two let the acquisition, rightly
        // granted once the bits were gone, see it unset (a CI failure). An
        // acquisition that cleared the bits itself fails the late thread's
        // own check instead.
        let rolling_back = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let late = node.endpoint().unwrap();
                std::thread::sleep(Duration::from_millis(100));
                rolling_back.store(true, Ordering::SeqCst);
                let old = late.masked_cas(leaf_addr, late_bits, late_bits, 0, late_bits).unwrap();
                assert_eq!(
                    old & late_bits,
                    late_bits,
                    "{backend:?}: the late client's bits were cleared by another"
                );
            });
            let held = c.acquire(&ep, 15, 25).unwrap();
            assert!(
                rolling_back.load(Ordering::SeqCst),
                "{backend:?}: acquired while the late bits were set: {:?}",
                c.stats()
            );
            c.release(&ep, held).unwrap();
        });
        assert!(c.stats().leaf_escalations > 0, "{:?}", c.stats());
        assert_eq!(c.stats().recoveries, 0, "{backend:?}: live bits taken for dead: {:?}", c.stats());

        // A dead client's bits: never rolled back.
        ep.write_u64(leaf_addr, late_bits).unwrap();
        let held = c.acquire(&ep, 15, 25).unwrap();
        c.release(&ep, held).unwrap();
        assert_eq!(c.stats().recoveries, 1, "{backend:?}: {:?}", c.stats());
        citron_stress::check_idle_tree(&ep);
    }
}

/// A client far away: over tcp with 1 ms more per round trip, one
/// client shares the tree with near ones, all under the near clients' T_wait,
/// which its two round trips between t1 and t2 always exceed. Its attempts
/// abort, back off and, after a bounded number of aborts, lock the root
/// (which notifies nobody and cannot abort): every request completes and no
/// unit is ever held twice. Then the same with a published T_wait that
/// covers it (what the cluster manager does), changed while the clients run.
#[test]
fn a_far_client_gets_every_lock_beside_near_ones() {
    use std::time::Duration;

    use citron_lock::citron::lock::CitronConfig;
    use citron_lock::citron::tuning::TWaitPublisher;
    use citron_lock::rdma::{RemoteAddr, TcpOptions};
    use citronfs_tests::{Backend, TEST_REGION};
    let fabric = TestFabric::new(Backend::Tcp, 1 << 20);
    let citron_lock::rdma::FabricAddr::Tcp(host) = fabric.addr.clone() else { unreachable!("a tcp fabric") };
    let near = Node::join(&fabric.addr).unwrap();
    let far_options = TcpOptions { added_rtt: Duration::from_millis(1), ..TcpOptions::default() };
    let far = Node::join_tcp(host, far_options).unwrap();
    let probe = RemoteAddr::new(TEST_REGION, citron_stress::ORACLE_AT);
    let near_rtt = near.endpoint().unwrap().measure_rtt(probe, 5).unwrap();
    let far_rtt = far.endpoint().unwrap().measure_rtt(probe, 5).unwrap();
    println!("near RTT {near_rtt:?}, far RTT {far_rtt:?}");
    let mut config = CitronConfig::from_rtt(near_rtt);
    config.give_up = Duration::from_secs(60);
    // The word the "cluster manager" publishes T_wait in: unused memory of
    // the test region, zero until published.
    let word = RemoteAddr::new(TEST_REGION, 1 << 19);
    for published in [false, true] {
        let mut config = config;
        let mut publisher = None;
        if published {
            let ep = near.endpoint().unwrap();
            publisher = Some((TWaitPublisher::start(&ep, word, config.t_wait).unwrap(), ep));
            config.published_t_wait = Some(word);
        }
        let stats = std::thread::scope(|s| {
            let mut near_threads = Vec::new();
            for t in 0..2 {
                let near = near.clone();
                near_threads.push(s.spawn(move || {
                    let ep = near.endpoint().unwrap();
                    citron_stress::run_with(&ep, config, 150, 500 + t)
                }));
            }
            let far_thread = s.spawn(|| {
                let ep = far.endpoint().unwrap();
                citron_stress::run_with(&ep, config, 40, 900)
            });
            // The cluster manager follows the far client up while they run.
            if let Some((p, ep)) = publisher.as_mut() {
                p.set(ep, far_rtt * 5).unwrap();
            }
            for t in near_threads {
                t.join().unwrap();
            }
            far_thread.join().unwrap()
        });
        println!("far client, T_wait published: {published}: {stats:?}");
        assert_eq!(stats.acquisitions, 40);
        citron_stress::check_idle_tree(&near.endpoint().unwrap());
    }
}

/// Bounded aborts (a lock at any round trip): with a T_wait no round trip can meet, every
/// attempt below the root aborts, so after `max_aborts` each request locks
/// the root (which notifies nobody and cannot abort) — and gets every lock,
/// under the oracle. A leaf left full by a dead client, which a request
/// gave up on before it escalated, is recovered from the root (Line 22).
#[test]
fn requests_that_keep_aborting_lock_the_root_and_still_recover_dead_leaves() {
    use std::time::Duration;

    use citron_lock::citron::lock::{CitronClient, CitronConfig};
    use citron_lock::rdma::RemoteAddr;
    use citronfs_tests::TEST_REGION;
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let mut config = CitronConfig::from_rtt(ep.measure_rtt(RemoteAddr::new(TEST_REGION, 0), 5).unwrap());
        config.t_wait = Duration::from_nanos(1);
        config.max_aborts = 2;
        config.leaf_patience = 2;
        config.lease = Duration::from_millis(200);
        config.give_up = Duration::from_secs(30);
        // A dead client's bits in the leaf of [0, 64) (set by hand: a
        // client of this configuration would itself escalate to the root).
        let shape = citron_lock::citron::tree::TreeShape::new(citron_stress::DEPTH);
        ep.write_u64(citron_stress::layout().node(shape.node_at(2, 0)), u64::MAX).unwrap();
        let mut c =
            CitronClient::new(citron_stress::layout(), config, Box::new(citron_stress::spillover(&ep)));
        let held = c.acquire(&ep, 10, 20).unwrap();
        c.release(&ep, held).unwrap();
        let st = c.stats();
        assert!(st.root_escalations > 0 && st.recoveries > 0, "{backend:?}: {st:?}");
        citron_stress::check_idle_tree(&ep);
        // And the stress oracle holds with every request escalating.
        std::thread::scope(|s| {
            for t in 0..2 {
                let node = node.clone();
                s.spawn(move || {
                    let ep = node.endpoint().unwrap();
                    citron_stress::run_with(&ep, config, 40, 700 + t)
                });
            }
        });
        citron_stress::check_idle_tree(&ep);
    }
}
