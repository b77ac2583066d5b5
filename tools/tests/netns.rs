//! Two hosts: a cluster and one mount in this network namespace, a second
//! mount (`citronfs mount --transport tcp`) in a network namespace of its own
//! joined by a veth pair. The second mount reaches the servers only over the
//! veth link, through the tcp software NICs.
//!
//! The second mount is started with `nsenter --net`, which changes only the
//! network namespace, so its FUSE mount is visible here and the test can read
//! and write through both.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::process::{Child, Command, Stdio};

use citronfs_tests::TestCluster;

const EXE: &str = env!("CARGO_BIN_EXE_citronfs");

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A network namespace with a veth link to this one; removed on drop.
struct RemoteHost {
    ns: String,
    host_if: String,
    pub host_ip: IpAddr,
}

impl RemoteHost {
    fn create() -> Self {
        let id = std::process::id() % 50_000;
        let (ns, host_if, ns_if) = (format!("citron{id}"), format!("vch{id}"), format!("vcn{id}"));
        let octet = 1 + id % 250;
        let host_ip = format!("10.213.{octet}.1");
        let ns_ip = format!("10.213.{octet}.2");
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        sh(&["ip", "netns", "add", &ns]);
        let host = Self { ns: ns.clone(), host_if: host_if.clone(), host_ip: host_ip.parse().unwrap() };
        sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if]);
        sh(&["ip", "link", "set", &ns_if, "netns", &ns]);
        sh(&["ip", "addr", "add", &format!("{host_ip}/24"), "dev", &host_if]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        sh(&["ip", "-n", &ns, "addr", "add", &format!("{ns_ip}/24"), "dev", &ns_if]);
        sh(&["ip", "-n", &ns, "link", "set", &ns_if, "up"]);
        sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        host
    }
}

impl Drop for RemoteHost {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// `citronfs mount` running in the other namespace; unmounted on drop.
struct RemoteMount {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for RemoteMount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(self.dir.path()).output();
        let _ = self.child.wait();
    }
}

#[test]
fn a_mount_in_another_network_namespace_shares_the_file_system_over_tcp() {
    let remote = RemoteHost::create();
    let cluster = TestCluster::start_on(remote.host_ip, 1, 64 << 20, 1 << 20);
    let local = cluster.mount();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", remote.ns))
        .arg(EXE)
        .args(["mount", "--transport", "tcp", "--timeout", "5", "--meta"])
        .arg(cluster.meta.local_addr().to_string())
        .arg(dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mounted = BufReader::new(stdout).lines().next().and_then(Result::ok).unwrap_or_default();
    let far = RemoteMount { child, dir };
    assert!(mounted.contains("mounted at"), "remote mount failed: {mounted:?}");

    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 249) as u8).collect();
    std::fs::write(local.path("from-local"), &data).unwrap();
    assert_eq!(std::fs::read(far.dir.path().join("from-local")).unwrap(), data);
    std::fs::write(far.dir.path().join("from-remote"), b"over the veth link").unwrap();
    assert_eq!(std::fs::read(local.path("from-remote")).unwrap(), b"over the veth link");
    std::fs::rename(far.dir.path().join("from-remote"), far.dir.path().join("renamed")).unwrap();
    assert!(!local.path("from-remote").exists());
    assert_eq!(std::fs::read(local.path("renamed")).unwrap(), b"over the veth link");
}
