//! Citron under contention from several processes and threads on both
//! backends, with an oracle: no unit is ever held twice, every request
//! completes, and the tree's words are idle afterwards.

use citron_lock::rdma::Node;
use citronfs_tests::{citron_stress, spawn_worker, wait_all, TestFabric, BACKENDS};

#[test]
fn overlapping_ranges_are_never_held_at_once() {
    for backend in BACKENDS {
        let fabric = TestFabric::new(backend, 1 << 20);
        let iterations = match backend {
            citronfs_tests::Backend::Shm => 400,
            citronfs_tests::Backend::Tcp => 150,
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
