//! One host's memory served both as a shm fabric and through its NIC (what
//! the meta-server does, so that mounts on its host and mounts far away
//! share its locks): the lock words then hold node ids of both fabrics, and
//! a message addressed to a node of one must never reach a node of the
//! other that happens to have the same number (once, a near and a far
//! mount's lock handovers reached the wrong process).

use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::{Node, RegionId, ShmHost, TcpHost, TcpOptions};

#[test]
fn a_message_never_reaches_a_node_of_the_other_fabric() {
    let name = format!("mixed-{}", std::process::id());
    let shm = ShmHost::create(&name).unwrap();
    shm.add_region(RegionId(1), 1 << 16).unwrap();
    let nic = TcpHost::spawn("127.0.0.1:0".parse().unwrap(), Arc::clone(shm.regions())).unwrap();
    let near = Node::join_shm(&name).unwrap();
    let near_ep = near.endpoint().unwrap();
    let far = Node::join_tcp(nic.local_addr(), TcpOptions::default()).unwrap();
    let far_ep = far.endpoint().unwrap();
    let other_near = Node::join_shm(&name).unwrap();
    let other_ep = other_near.endpoint().unwrap();
    assert_ne!(near.id(), far.id(), "node ids of the two fabrics collide");
    // A message from a shm node to the tcp node: it cannot get there (no
    // common fabric), and must not land anywhere else.
    let sent = other_ep.send(far_ep.addr(), b"for the far node");
    assert!(sent.is_err(), "a shm node reached a tcp node: {sent:?}");
    // And the other way round.
    let sent = far_ep.send(near_ep.addr(), b"for the near node");
    assert!(sent.is_err(), "a tcp node reached a shm node: {sent:?}");
    std::thread::sleep(Duration::from_millis(100));
    for (ep, who) in
        [(&near_ep, "the near node"), (&far_ep, "the far node"), (&other_ep, "the other near node")]
    {
        assert!(ep.try_recv().is_none(), "{who} received a message meant for another node");
    }
}
