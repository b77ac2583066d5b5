//! Two hosts: a cluster and one mount in this network namespace, a second
//! mount (`citronfs mount --transport tcp`) in a network namespace of its own
//! joined by a veth pair. The second mount reaches the servers only over the
//! veth link, through the tcp software NICs.
//!
//! The second mount is started with `nsenter --net`, which changes only the
//! network namespace, so its FUSE mount is visible here and the test can read
//! and write through both.

use citronfs_tests::{ProcessMount, RemoteHost, TestCluster};

const EXE: &str = env!("CARGO_BIN_EXE_citronfs");

#[test]
fn a_mount_in_another_network_namespace_shares_the_file_system_over_tcp() {
    let remote = RemoteHost::create(0);
    let cluster = TestCluster::start_on(remote.host_ip, 1, 64 << 20, 1 << 20);
    let local = cluster.mount();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = remote.command(EXE);
    cmd.args(["mount", "--foreground", "--transport", "tcp", "--timeout", "5", "--meta"])
        .arg(cluster.meta.local_addr().to_string())
        .arg(dir.path());
    let far = ProcessMount::start(cmd, dir, "mounted at");

    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 249) as u8).collect();
    std::fs::write(local.path("from-local"), &data).unwrap();
    assert_eq!(std::fs::read(far.path("from-local")).unwrap(), data);
    std::fs::write(far.path("from-remote"), b"over the veth link").unwrap();
    assert_eq!(std::fs::read(local.path("from-remote")).unwrap(), b"over the veth link");
    std::fs::rename(far.path("from-remote"), far.path("renamed")).unwrap();
    assert!(!local.path("from-remote").exists());
    assert_eq!(std::fs::read(local.path("renamed")).unwrap(), b"over the veth link");
}
