//! Locks across two hosts: the cluster and one mount here, a second mount
//! in a network namespace of its own (a veth link), reaching server memory
//! only through the tcp software NICs. Lock calls made through the far
//! mount are decided by the far client, over the link.

use std::time::Duration;

use citronfs_tests::probe::Probe;
use citronfs_tests::{ProcessMount, RemoteHost, TestCluster};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const MOUNT_WORKER: &str = env!("CARGO_BIN_EXE_mount-worker");

#[test]
fn locks_are_exact_between_a_mount_here_and_one_on_another_host() {
    let remote = RemoteHost::create(1);
    let cluster = TestCluster::start_on(remote.host_ip, 1, 64 << 20, 1 << 20);
    let here = cluster.mount();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = remote.command(MOUNT_WORKER);
    cmd.arg(cluster.meta.local_addr().to_string()).arg(dir.path()).arg("--tcp");
    let far = ProcessMount::start(cmd, dir, "mounted");

    std::fs::write(here.path("f"), b"").unwrap();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&here.path("f"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&far.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 100")), "ok");
    assert_eq!(q.ask(&format!("setlk {qf} r 50 1")), "err EAGAIN");
    assert_eq!(q.ask(&format!("getlk {qf} r 50 1")), format!("w 0 100 {}", p.pid));
    q.send(&format!("setlkw {qf} w 99 2"));
    assert_eq!(q.answer_within(Duration::from_millis(400)), None);
    assert_eq!(p.ask(&format!("setlk {pf} u 0 100")), "ok");
    assert_eq!(q.answer(), "ok", "woken over the link");
    assert_eq!(p.ask(&format!("getlk {pf} w 0 0")), format!("w 99 2 {}", q.pid));
    assert_eq!(p.ask(&format!("flock {pf} ex nb")), "ok");
    assert_eq!(q.ask(&format!("flock {qf} sh nb")), "err EAGAIN");
    // A counter incremented from both hosts under F_SETLKW.
    assert_eq!(q.ask(&format!("setlk {qf} u 0 0")), "ok");
    for _ in 0..40 {
        for (probe, fd) in [(&mut p, pf), (&mut q, qf)] {
            probe.send(&format!("setlkw {fd} w 1000 1"));
            probe.send(&format!("incr {fd} 2000"));
            probe.send(&format!("setlk {fd} u 1000 1"));
        }
    }
    for probe in [&p, &q] {
        for _ in 0..40 {
            assert_eq!(probe.answer(), "ok");
            assert!(probe.answer().starts_with("ok "));
            assert_eq!(probe.answer(), "ok");
        }
    }
    let bytes = std::fs::read(far.path("f")).unwrap();
    let counter = String::from_utf8_lossy(&bytes[2000..2020]).to_string();
    assert_eq!(counter.parse::<u64>().unwrap(), 80);
}
