//! The `citronfs` command as a user runs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use citron_lock::rdma::{FabricAddr, Node, RegionId, RemoteAddr};

const EXE: &str = env!("CARGO_BIN_EXE_citronfs");

#[test]
fn region_host_serves_both_backends_and_cleans_up_on_sigterm() {
    let name = format!("cli-{}", std::process::id());
    let mut child = Command::new(EXE)
        .args([
            "region-host",
            "--listen",
            "127.0.0.1:0",
            "--shm",
            &name,
            "--region",
            "1:1MiB",
            "--region",
            "2:64KiB",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let tcp: FabricAddr = loop {
        let line = lines.next().expect("region-host printed its address").unwrap();
        if let Some(a) = line.strip_prefix("serving ").filter(|a| a.starts_with("tcp:")) {
            break a.parse().unwrap();
        }
    };
    let shm_dir = std::path::PathBuf::from(format!("/dev/shm/citronfs-{name}"));
    assert!(shm_dir.exists());
    // The same memory through both backends.
    let over_tcp = Node::join(&tcp).unwrap().endpoint().unwrap();
    let over_shm = Node::join(&FabricAddr::Shm(name.clone())).unwrap().endpoint().unwrap();
    let w = RemoteAddr::new(RegionId(2), 64);
    over_tcp.faa(w, 5).unwrap();
    assert_eq!(over_shm.faa(w, 1).unwrap(), 5);
    assert_eq!(over_tcp.read_u64(w).unwrap(), 6);
    // SIGTERM stops it cleanly.
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!shm_dir.exists(), "the shm fabric is removed on exit");
}

#[test]
fn bad_flags_give_a_one_line_error_and_nonzero_exit() {
    for args in [
        vec!["region-host"],
        vec!["region-host", "--listen", "127.0.0.1:0", "--region", "1:12XB"],
        vec!["region-host", "--listen", "127.0.0.1:0", "--region", "1:100"],
        vec!["bench", "verbs", "--fabric", "udp:1.2.3.4:5"],
        vec!["bench", "verbs", "--threads", "0"],
    ] {
        let out = Command::new(EXE).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.trim().is_empty(), "{args:?}: no message");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn bench_verbs_prints_a_table_and_writes_csv() {
    let out_dir = std::env::temp_dir().join(format!("citronfs-bench-{}", std::process::id()));
    for backend in ["shm", "tcp"] {
        let out = Command::new(EXE)
            .args(["bench", "verbs", "--backend", backend, "--threads", "2", "--ops", "64", "--batch", "4"])
            .arg("--out")
            .arg(&out_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("masked_faa") && stdout.contains("ratio"), "{stdout}");
        let csv = std::fs::read_to_string(out_dir.join(format!("verbs-{backend}.csv"))).unwrap();
        // Header plus two baseline rows plus three rows for each of the 8 verb kinds.
        assert_eq!(csv.lines().count(), 1 + 2 + 3 * 8, "{csv}");
    }
    let _ = std::fs::remove_dir_all(out_dir);
}

#[test]
fn mount_refuses_bad_mount_points_and_unreachable_clusters() {
    let missing = std::env::temp_dir().join(format!("citronfs-missing-{}", std::process::id()));
    let out = Command::new(EXE).arg("mount").arg(&missing).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");

    // A mount point that is already a mount point (/proc is one).
    let out = Command::new(EXE).args(["mount", "/proc"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("busy"));

    // Nobody listens on this port: a prompt error, not a hang.
    let dir = tempfile::tempdir().unwrap();
    let t = std::time::Instant::now();
    let out = Command::new(EXE)
        .args(["mount", "--meta", "127.0.0.1:1", "--timeout", "2"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(15));
}

#[test]
fn mount_serves_until_sigint_and_leaves_no_stale_mount() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(EXE).arg("mount").arg(dir.path()).stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("mounted at"), "{first}");
    std::fs::write(dir.path().join("x"), b"hello").unwrap();
    assert_eq!(std::fs::read(dir.path().join("x")).unwrap(), b"hello");
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    assert!(child.wait().unwrap().success());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(dir.path().to_str().unwrap()), "stale mount left behind");
    assert!(!dir.path().join("x").exists(), "the directory is no longer the file system");
}
