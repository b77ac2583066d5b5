//! Citron's leases (§3.10): a release that comes after the lease
//! never undoes what a recovery did, and a client that is alive — waiting
//! in Step 2(d) for a dead descendant to be recovered — is never taken over
//! by a waiter that thinks it dead. Each test has an oracle (a counter in
//! the fabric that every holder raises from 0 while it holds) and runs on
//! both backends.

use std::sync::mpsc;
use std::time::Duration;

use citron_lock::citron::lock::{CitronClient, CitronConfig, CitronLayout, HeldRange};
use citron_lock::citron::tree::TreeShape;
use citron_lock::citron::word::Internal;
use citron_lock::rdma::{Endpoint, Node, RemoteAddr};
use citron_lock::rwlock::LockError;
use citronfs_tests::{citron_stress, TestFabric, BACKENDS, TEST_REGION};

/// Where the oracle counts holders.
const ORACLE: RemoteAddr = RemoteAddr::new(TEST_REGION, 1 << 19);

fn client(ep: &Endpoint, lease: Duration) -> CitronClient {
    client_of(ep, lease, citron_stress::layout())
}

fn client_of(ep: &Endpoint, lease: Duration, layout: CitronLayout) -> CitronClient {
    let mut config = CitronConfig::from_rtt(ep.measure_rtt(ORACLE, 5).unwrap());
    config.lease = lease;
    config.leaf_patience = 2;
    config.give_up = Duration::from_secs(60);
    CitronClient::new(layout, config, Box::new(citron_stress::spillover(ep)))
}

/// Enters the oracle: nobody else may be inside.
fn enter(ep: &Endpoint, who: &str) {
    let inside = ep.faa(ORACLE, 1).unwrap();
    assert_eq!(inside, 0, "{who} was granted a range someone else holds");
}

fn leave(ep: &Endpoint) {
    ep.faa(ORACLE, u64::MAX).unwrap();
}

/// Acquires `[l, r)` on a thread of its own; `Ok` once granted.
fn acquire_on(
    node: &Node,
    lease: Duration,
    (l, r): (u64, u64),
) -> (mpsc::Receiver<()>, mpsc::Sender<()>, std::thread::JoinHandle<Result<(), LockError>>) {
    let (granted_tx, granted) = mpsc::channel();
    let (go_tx, go) = mpsc::channel::<()>();
    let node = node.clone();
    let thread = std::thread::spawn(move || {
        let ep = node.endpoint().unwrap();
        let mut c = client(&ep, lease);
        let held = c.acquire(&ep, l, r)?;
        enter(&ep, &format!("[{l}, {r})"));
        granted_tx.send(()).unwrap();
        let _ = go.recv();
        leave(&ep);
        c.release(&ep, held)
    });
    (granted, go_tx, thread)
}

/// Visits every leaf and the whole tree, so recovery repairs whatever was
/// left behind, then checks that the tree is idle.
fn repair_and_check_idle(ep: &Endpoint, lease: Duration) {
    let mut c = client(ep, lease);
    for leaf in 0..16 {
        let held = c.acquire(ep, leaf * 64, leaf * 64 + 64).unwrap();
        c.release(ep, held).unwrap();
    }
    let held = c.acquire(ep, 0, 1024).unwrap();
    c.release(ep, held).unwrap();
    citron_stress::check_idle_tree(ep);
}

/// An internal node held past its lease is taken over (Line 11) by R, and
/// W queues behind R. The late holder's release must not vacate R's
/// occupation (the paper's Algorithm 3 would: Occ − 1 and TCnt + 1, which
/// serves W while R holds).
#[test]
fn a_late_release_never_vacates_a_node_taken_over() {
    // R holds for half of it while the test looks (R must keep its lease).
    let lease = Duration::from_millis(400);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let mut late = client(&ep, lease);
        let held: HeldRange = late.acquire(&ep, 0, 256).unwrap();
        // The holder stalls past its lease; R takes the node over.
        let (r_granted, r_go, r) = acquire_on(&node, lease, (0, 256));
        r_granted.recv().expect("R granted after the holder's lease");
        // W queues behind R.
        let (w_granted, w_go, w) = acquire_on(&node, lease, (0, 256));
        std::thread::sleep(lease / 4);
        // The stalled holder comes back and releases.
        let released = late.release(&ep, held);
        assert!(
            w_granted.recv_timeout(lease / 4).is_err(),
            "{backend:?}: W was granted while R holds (the late release vacated R's node)"
        );
        assert!(
            matches!(released, Err(LockError::Fenced)),
            "{backend:?}: a late release says so: {released:?}"
        );
        r_go.send(()).unwrap();
        r.join().unwrap().unwrap();
        w_granted.recv().expect("W granted once R released");
        w_go.send(()).unwrap();
        w.join().unwrap().unwrap();
        assert!(late.stats().late_releases > 0);
        repair_and_check_idle(&ep, lease);
    }
}

/// A leaf held past its lease: R gives up on the leaf, locks its parent,
/// and the parent's recovery levels the late holder's notification (Line
/// 36) and clears its bits (Line 22). The late release must then not add
/// its notification's DCnt (the paper's Algorithm 3 would, leaving DCnt one
/// above DMax: a later descendant's notification then reads as none, and
/// the parent's next holder does not wait for it).
#[test]
fn a_late_release_never_adds_a_levelled_notification() {
    let lease = Duration::from_millis(200);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        let mut late = client(&ep, lease);
        let held = late.acquire(&ep, 10, 20).unwrap();
        let (r_granted, r_go, r) = acquire_on(&node, lease, (10, 20));
        r_granted.recv().expect("R granted through the leaf's parent");
        let released = late.release(&ep, held);
        r_go.send(()).unwrap();
        r.join().unwrap().unwrap();
        // X holds a unit of another leaf under the same parent; Y asks for
        // the whole parent and must wait for X.
        let (x_granted, x_go, x) = acquire_on(&node, lease, (100, 110));
        x_granted.recv().unwrap();
        let (y_granted, y_go, y) = acquire_on(&node, lease, (0, 256));
        assert!(
            y_granted.recv_timeout(lease / 2).is_err(),
            "{backend:?}: the parent was granted while a leaf below it is held"
        );
        x_go.send(()).unwrap();
        x.join().unwrap().unwrap();
        y_granted.recv().unwrap();
        y_go.send(()).unwrap();
        y.join().unwrap().unwrap();
        let parent = citron_stress::layout().node(TreeShape::new(citron_stress::DEPTH).node_at(1, 0));
        let w = Internal(ep.read_u64(parent).unwrap());
        assert!(w.descendants_quiet(), "{backend:?}: the parent's counters are off: {w:?}");
        assert!(
            matches!(released, Err(LockError::Fenced)),
            "{backend:?}: a late release says so: {released:?}"
        );
        repair_and_check_idle(&ep, lease);
    }
}

/// X locks the root of a depth-3 tree while a dead client's notification
/// is pending below it: X waits in Step 2(d) until Line 36 levels it, H·T
/// = 3 leases. Meanwhile W, below the root, sees it occupied and unmoving:
/// the paper's Line 18 and Line 11 take it over after two leases, and both
/// hold. X's progress marks must keep W waiting until X releases.
#[test]
fn a_live_holder_waiting_for_a_dead_descendant_is_never_taken_over() {
    let lease = Duration::from_millis(300);
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let node = Node::join(&fabric.addr).unwrap();
        let ep = node.endpoint().unwrap();
        // A depth-3 tree (4096 units) of its own, past the stress layout.
        let layout = CitronLayout { base: RemoteAddr::new(TEST_REGION, 65536), shape: TreeShape::new(3) };
        // The dead: holds a leaf range and never releases.
        let mut dead = client_of(&ep, lease, layout);
        std::mem::forget(dead.acquire(&ep, 0, 10).unwrap());
        let root = layout.node(citron_lock::citron::tree::NodeIndex::ROOT);
        let run = |range: (u64, u64), who: &'static str| {
            let node = node.clone();
            std::thread::spawn(move || {
                let ep = node.endpoint().unwrap();
                let mut c = client_of(&ep, lease, layout);
                let held = c.acquire(&ep, range.0, range.1).unwrap();
                enter(&ep, who);
                std::thread::sleep(lease / 3);
                leave(&ep);
                c.release(&ep, held).unwrap();
                c.stats()
            })
        };
        let x = run((0, 4096), "X (the root)");
        // W asks once X occupies the root.
        while !Internal(ep.read_u64(root).unwrap()).occupied() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let w = run((3000, 3010), "W (a leaf below the root)");
        let xs = x.join().unwrap();
        let ws = w.join().unwrap();
        println!("{backend:?}: X {xs:?}\n{backend:?}: W {ws:?}");
        assert!(xs.recoveries > 0, "X levelled the dead client's notification");
        assert_eq!(ws.recoveries, 0, "{backend:?}: W took a live holder for dead");
    }
}
