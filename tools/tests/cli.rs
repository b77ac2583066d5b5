//! The `citronfs` command as a user runs it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use citron_lock::rdma::{FabricAddr, Node, RegionId, RemoteAddr};
use citron_lock::rwlock::Algorithm;

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
        vec!["bench", "ranges", "--lens", "0"],
        vec!["bench", "ranges", "--lens", "16,huge"],
        vec!["bench", "ranges", "--clients", "0"],
        vec!["bench", "ranges", "--units", "100", "--lens", "256"],
        vec!["bench", "ranges", "--locks", "citron,tree"],
        vec!["bench", "locks", "--algorithms", "mcs"],
        vec!["bench", "locks", "--locks", "0"],
        vec!["bench", "locks", "--clients", "0"],
        vec!["bench", "locks", "--secs", "-1"],
        vec!["bench", "fcntl", "--secs", "0"],
        vec!["bench", "fcntl", "--range-locks", "citron,tree"],
        vec!["bench", "fcntl", "--backends", "udp"],
        vec!["bench", "fcntl", "--scenarios", "all"],
        vec!["bench", "fcntl", "--ceiling-threads", "0"],
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
        // Header plus two baseline rows plus three rows for each of the 9
        // verb kinds (flush among them).
        assert_eq!(csv.lines().count(), 1 + 2 + 3 * 9, "{csv}");
    }
    let _ = std::fs::remove_dir_all(out_dir);
}

/// A short `bench ranges` on both backends: every lock at every size gives a
/// row (so every worker process ran and reported), and the false-conflict
/// table holds the §4.6 figure that is exact by construction.
#[test]
fn bench_ranges_prints_a_table_and_writes_csv() {
    let out_dir = std::env::temp_dir().join(format!("citronfs-bench-ranges-{}", std::process::id()));
    for (backend, lens, locks, rows) in [
        ("shm", "16,mixed", "citron,ss-exact,ss-over,ss-under,rpc", 10),
        ("tcp", "16", "citron,ss-over,rpc", 3),
    ] {
        let out = Command::new(EXE)
            .args(["bench", "ranges", "--backend", backend, "--lens", lens, "--locks", locks])
            .args(["--clients", "2", "--seconds", "0.2", "--units", "65536", "--fc-trials", "2000"])
            .arg("--out")
            .arg(&out_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("citron / rpc"), "{stdout}");
        let csv = std::fs::read_to_string(out_dir.join(format!("ranges-{backend}.csv"))).unwrap();
        assert_eq!(csv.lines().count(), 1 + rows, "{csv}");
        for line in csv.lines().skip(1) {
            let ops: u64 = line.split(',').nth(4).unwrap().parse().unwrap();
            assert!(ops > 0, "a configuration completed nothing: {line}");
        }
        let fc = std::fs::read_to_string(out_dir.join("ranges-false-conflicts.csv")).unwrap();
        assert!(fc.lines().any(|l| l.starts_with("16,2,2000,") && l.split(',').nth(5) == Some("0")), "{fc}");
    }
    let _ = std::fs::remove_dir_all(out_dir);
}

#[test]
fn bench_locks_refuses_an_algorithm_that_is_not_built() {
    let Some(missing) = Algorithm::ALL.into_iter().find(|a| !a.is_built()) else { return };
    let out = Command::new(EXE).args(["bench", "locks", "--algorithms", missing.name()]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not built") && err.contains(missing.name()), "{err}");
}

/// A tiny sweep on both backends: one row per workload × algorithm × client
/// count; every cycle costs at least its acquire and release atomics; a lone
/// client costs exactly those two round trips; read-only runs send no
/// messages.
#[test]
fn bench_locks_compares_every_built_algorithm_and_writes_csv() {
    let out_dir = std::env::temp_dir().join(format!("citronfs-bench-locks-{}", std::process::id()));
    for backend in ["shm", "tcp"] {
        let out = Command::new(EXE)
            .args(["bench", "locks", "--backend", backend, "--secs", "0.1", "--workloads", "wi,ro"])
            .args(["--locks", "8", "--processes", "2", "--threads", "1", "--clients", "1,2"])
            .arg("--out")
            .arg(&out_dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("ratio goodput shiftlock / dslr"), "{stdout}");
        let csv = std::fs::read_to_string(out_dir.join(format!("locks-{backend}.csv"))).unwrap();
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("{name}"));
        let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
        assert_eq!(rows.len(), 2 * Algorithm::BUILT.len() * 2, "{csv}");
        for r in &rows {
            let num = |name: &str| r[col(name)].parse::<f64>().unwrap();
            // Uncontended cost of each algorithm: (atomics, reads, round trips).
            let alone = match r[col("algorithm")] {
                "dql" => (3.0, 0.0, 3.0),   // starvation-free: FA + CAS + CAS
                "alock" => (2.0, 1.0, 2.0), // swap + read of the other cohort, then release
                "rpc" => (0.0, 0.0, 2.0),   // two calls to the server
                _ => (2.0, 0.0, 2.0),
            };
            assert!(num("cycles") > 0.0, "{r:?}");
            assert!(num("atomics") >= alone.0 && num("rtts") >= alone.2, "cheaper than possible: {r:?}");
            if num("clients") == 1.0 {
                let near = |x: f64, want: f64| (x - want).abs() < 0.01;
                assert!(
                    near(num("atomics"), alone.0)
                        && near(num("reads"), alone.1)
                        && near(num("rtts"), alone.2),
                    "a lone client waited: {r:?}"
                );
            }
            // Mutexes (DQL, ALock) hand the lock over even between readers.
            let mutex = matches!(r[col("algorithm")], "dql" | "alock");
            if r[col("workload")] == "RO" && !mutex {
                assert_eq!(num("msgs"), 0.0, "messages without writers: {r:?}");
            }
        }
        let png = out_dir.join(format!("locks-{backend}-wi-zipf.png"));
        assert!(
            png.exists() || !std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists()
        );
    }
    let _ = std::fs::remove_dir_all(out_dir);
}

/// A CSV written by a bench: its header and rows.
fn read_csv(path: &std::path::Path) -> (Vec<String>, Vec<Vec<String>>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines().map(|l| l.split(',').map(String::from).collect::<Vec<_>>());
    let header = lines.next().expect("a header");
    (header, lines.collect())
}

/// A tiny `bench fcntl` through real mounts (needs root and /dev/fuse):
/// every scenario of every range lock on both backends, and every FUSE
/// ceiling row, locked and unlocked at a nonzero rate in every process;
/// the verbs per lock and per unlock were counted (the RPC range lock's
/// two calls per operation among the round trips, none for Citron); no
/// two processes were ever inside one write lock at once (while the
/// daemon without locks is caught by the same oracle); and SQLite kept
/// every row and its integrity.
#[test]
fn bench_fcntl_measures_every_configuration_and_writes_csv() {
    let out_dir = std::env::temp_dir().join(format!("citronfs-bench-fcntl-{}", std::process::id()));
    let out = Command::new(EXE)
        .args(["bench", "fcntl", "--secs", "0.2", "--check-secs", "0.3", "--steps", "5", "--sqlite-tx", "3"])
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("citron_over_rpc") && stdout.contains("citron_over_ceiling"), "{stdout}");
    // A peer's figure appears only when the peer was measured in this run
    // (`--peer`), never one from elsewhere.
    assert!(!stdout.contains("MooseFS") && !stdout.contains("moosefs"), "{stdout}");

    let (h, rows) = read_csv(&out_dir.join("fcntl.csv"));
    let col = |name: &str| h.iter().position(|c| c == name).unwrap_or_else(|| panic!("{name} in {h:?}"));
    let num = |r: &[String], name: &str| -> f64 {
        r[col(name)].parse().unwrap_or_else(|_| panic!("{name}: {r:?}"))
    };
    let mut expected = Vec::new();
    for backend in ["shm", "tcp"] {
        for system in ["citron", "rpc"] {
            for scenario in ["one", "disjoint", "shared"] {
                expected.push((system.to_string(), backend.to_string(), scenario.to_string()));
            }
        }
    }
    for t in [1, 2] {
        for scenario in ["one", "disjoint"] {
            expected.push((format!("fuse-ceiling-{t}t"), "-".to_string(), scenario.to_string()));
        }
    }
    let got: Vec<_> = rows
        .iter()
        .map(|r| (r[col("system")].clone(), r[col("backend")].clone(), r[col("scenario")].clone()))
        .collect();
    assert_eq!(got, expected);
    for r in &rows {
        assert!(
            num(r, "pairs_per_s") > 0.0 && num(r, "proc_min_per_s") > 0.0,
            "a process did nothing: {r:?}"
        );
        if r[col("backend")] != "-" && r[col("scenario")] == "one" {
            // A lone process locks under a lock token: no verb, no call.
            assert_eq!((num(r, "verbs_per_pair"), num(r, "rpc_calls_per_pair")), (0.0, 0.0), "{r:?}");
        } else if r[col("backend")] != "-" {
            assert!(num(r, "verbs_per_pair") > 0.0 && num(r, "rtts_per_pair") > 0.0, "{r:?}");
            let rpc_calls = num(r, "rpc_calls_per_pair");
            match r[col("system")].as_str() {
                // Acquire and release of the range, for the lock and the
                // unlock (4 a pair), but for pairs a process took under a
                // lock token in a moment the other mount held nothing.
                "rpc" => assert!(rpc_calls > 0.0, "{r:?}"),
                _ => assert_eq!(rpc_calls, 0.0, "{r:?}"),
            }
        }
    }

    let (h, rows) = read_csv(&out_dir.join("fcntl-verbs.csv"));
    let col = |name: &str| h.iter().position(|c| c == name).unwrap_or_else(|| panic!("{name} in {h:?}"));
    assert_eq!(rows.len(), 2 * 2 * 2, "range lock x backend x (lock, unlock): {rows:?}");
    for r in &rows {
        let num = |name: &str| -> f64 { r[col(name)].parse().unwrap() };
        assert!(num("verbs") > 0.0 && num("rtts") > 0.0 && num("p50_us") > 0.0, "{r:?}");
        // Uncontended, the RPC range lock is one call to acquire and one
        // to release; Citron calls nobody.
        let calls = if r[col("range_lock")] == "rpc" { 2.0 } else { 0.0 };
        assert_eq!(num("rpc_calls"), calls, "{r:?}");
        assert_eq!(num("msgs"), 0.0, "nobody waits, nobody is woken: {r:?}");
    }

    let (h, rows) = read_csv(&out_dir.join("fcntl-sqlite.csv"));
    let col = |name: &str| h.iter().position(|c| c == name).unwrap_or_else(|| panic!("{name} in {h:?}"));
    assert_eq!(rows.len(), 4, "{rows:?}");
    for r in &rows {
        assert!(r[col("tx_per_s")].parse::<f64>().unwrap() > 0.0, "{r:?}");
        assert_eq!(r[col("rows")], "12", "{r:?}");
        assert_eq!(r[col("expected_rows")], "12", "{r:?}");
        assert_eq!(r[col("integrity")], "ok", "{r:?}");
    }
    // The exclusion check: no two processes ever inside one write lock on
    // citronfs, while the daemon that excludes nothing is caught (so the
    // oracle can see a violation).
    let (h, rows) = read_csv(&out_dir.join("fcntl-exclusion.csv"));
    let col = |name: &str| h.iter().position(|c| c == name).unwrap_or_else(|| panic!("{name} in {h:?}"));
    assert_eq!(rows.len(), 2 * 2 + 1, "{rows:?}");
    for r in &rows {
        let (locks, overlaps): (u64, u64) =
            (r[col("locks")].parse().unwrap(), r[col("overlaps")].parse().unwrap());
        assert!(locks > 0, "{r:?}");
        if r[col("backend")] == "-" {
            assert!(overlaps > 0, "the no-lock daemon went unnoticed: {r:?}");
        } else {
            assert_eq!(overlaps, 0, "two holders of one write lock: {r:?}");
        }
    }
    let (_, rows) = read_csv(&out_dir.join("fcntl-ratios.csv"));
    assert_eq!(rows.len(), 2 * 3, "{rows:?}");
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
    let mut child = Command::new(EXE)
        .args(["mount", "--foreground"])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
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

/// `citronfs locks PATH` lists the holders and waiters of a file's locks,
/// cluster-wide, with the node and pid of each.
#[test]
fn locks_lists_holders_and_waiters_of_a_file() {
    use std::os::fd::AsRawFd;
    let cluster = citronfs_tests::TestCluster::start(1, 64 << 20, 1 << 20);
    let a = cluster.mount();
    let b = cluster.mount();
    std::fs::write(a.path("f"), b"x").unwrap();
    let posix = std::fs::OpenOptions::new().read(true).write(true).open(a.path("f")).unwrap();
    let ofd = std::fs::OpenOptions::new().read(true).write(true).open(b.path("f")).unwrap();
    let lock = |fd: i32, cmd: i32, typ: i32, start: i64, len: i64| {
        // SAFETY: an all-zero flock is valid; the struct outlives the call.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_start = start;
        fl.l_len = len;
        // SAFETY: fcntl on an open descriptor with a valid flock.
        unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) }
    };
    assert_eq!(lock(posix.as_raw_fd(), libc::F_SETLK, libc::F_WRLCK, 10, 90), 0);
    assert_eq!(lock(posix.as_raw_fd(), libc::F_SETLK, libc::F_RDLCK, 1000, 0), 0);
    // An OFD lock on the other mount that must wait for ours.
    std::thread::scope(|s| {
        let waiter = s.spawn(|| lock(ofd.as_raw_fd(), libc::F_OFD_SETLKW, libc::F_WRLCK, 50, 1));
        let path = b.path("f");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let listing = loop {
            let out = Command::new(EXE).arg("locks").arg(&path).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if text.contains("waiting") || std::time::Instant::now() > deadline {
                break text;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let me = std::process::id().to_string();
        let rows: Vec<Vec<&str>> = listing.lines().skip(1).map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(rows.len(), 3, "{listing}");
        let has = |want: &[&str]| rows.iter().any(|r| want.iter().all(|w| r.contains(w)));
        assert!(has(&[&me, "POSIX", "WRITE", "10", "99", "held"]), "{listing}");
        assert!(has(&[&me, "POSIX", "READ", "1000", "EOF", "held"]), "{listing}");
        assert!(has(&["OFDLCK", "WRITE", "50", "waiting"]), "{listing}");
        assert_eq!(lock(posix.as_raw_fd(), libc::F_SETLK, libc::F_UNLCK, 0, 0), 0);
        assert_eq!(waiter.join().unwrap(), 0, "the OFD waiter is granted once we unlock");
    });
    let out = Command::new(EXE).arg("locks").arg(b.path("f")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("OFDLCK") && text.contains("held") && !text.contains("POSIX"), "{text}");
    // Not a citronfs file: a clear one-line error.
    let out = Command::new(EXE).args(["locks", "/proc/version"]).output().unwrap();
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim().lines().count(), 1);
}

/// Whether `citronfs status` answered: 0 (healthy) or 3 (needs an
/// operator; a client's renewal may lag on a loaded machine), not 1 (the
/// command failed). Health itself is tested in `tests/service.rs`.
fn answered(out: &std::process::Output) -> bool {
    matches!(out.status.code(), Some(0) | Some(3))
}

/// `citronfs status`, given a mount point or the meta-server's address:
/// space per data server, files and opens, lock memory and its limit,
/// clients and their leases; as tables, or as JSON.
#[test]
fn status_reports_space_files_lock_memory_and_clients() {
    let cluster = citronfs_tests::TestCluster::start(1, 64 << 20, 1 << 20);
    let a = cluster.mount();
    std::fs::write(a.path("small"), vec![1u8; 5000]).unwrap();
    let held = std::fs::File::open(a.path("small")).unwrap();
    let out = Command::new(EXE).args(["status", "--json"]).arg(a.dir.path()).output().unwrap();
    assert!(answered(&out), "{}", String::from_utf8_lossy(&out.stderr));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["meta_server"], cluster.meta.local_addr().to_string());
    let d = &s["data_servers"][0];
    assert_eq!((d["capacity"].as_u64(), d["used"].as_u64()), (Some(64 << 20), Some(8192)), "{s:#}");
    assert_eq!(d["extents"], 1);
    assert_eq!((s["files"]["regular_files"].as_u64(), s["files"]["open_files"].as_u64()), (Some(1), Some(1)));
    assert_eq!(s["lock_memory"]["limit"], 16 << 20);
    assert_eq!(s["lock_memory"]["files"], 1, "the open file has lock memory");
    let clients = s["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 1);
    assert_eq!(clients[0]["opens"], 1);
    assert!(clients[0]["renewed_ms_ago"].as_u64().unwrap() <= clients[0]["lease_ms"].as_u64().unwrap());
    drop(held);
    // Tables, from the meta-server's address.
    let meta = cluster.meta.local_addr().to_string();
    let out = Command::new(EXE).args(["status", "--meta", &meta]).output().unwrap();
    assert!(answered(&out), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for section in ["data servers", "files:", "lock memory:", "clients", "CAPACITY", "LEASE"] {
        assert!(text.contains(section), "{section} missing from:\n{text}");
    }
    // Not a citronfs path, or nothing at all: a clear one-line error.
    for args in
        [vec!["status", "/proc"], vec!["status"], vec!["status", "--meta", "127.0.0.1:1", "--timeout", "1"]]
    {
        let out = Command::new(EXE).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `citronfs status` of a cluster with a key (every `citronfs mount` without
/// `--meta` makes one): with `--key-file` it reports, given a mount point
/// or the meta-server's address; without, a one-line error that says which
/// option is missing.
#[test]
fn status_of_a_cluster_with_a_key_takes_the_key_file() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("cluster.key");
    let out = Command::new(EXE).args(["key", "new"]).arg(&key_file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let keyring = std::sync::Arc::new(citron_rpc::auth::Keyring::load(&key_file).unwrap());
    let cluster = citronfs_tests::TestCluster::keyed(keyring, 1);
    let m = cluster.mount_tcp();
    std::fs::write(m.path("f"), b"x").unwrap();
    let meta = cluster.meta.local_addr().to_string();
    for target in [vec![m.dir.path().to_str().unwrap()], vec!["--meta", &meta]] {
        let out = Command::new(EXE).args(["status", "--json"]).args(&target).output().unwrap();
        assert!(!out.status.success(), "{target:?}: no key, no status");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--key-file") && err.trim().lines().count() == 1, "{target:?}: {err}");
        let out = Command::new(EXE)
            .args(["status", "--json", "--key-file"])
            .arg(&key_file)
            .args(&target)
            .output()
            .unwrap();
        assert!(answered(&out), "{target:?}: {}", String::from_utf8_lossy(&out.stderr));
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(s["files"]["regular_files"], 1, "{target:?}: {s:#}");
        assert_eq!(s["clients"].as_array().unwrap().len(), 1, "{target:?}: {s:#}");
    }
}

/// `citronfs mount` without `--capacity` sizes its data server like tmpfs:
/// half of the host's RAM (within what /dev/shm has free), of which it takes
/// pages only as files are written.
#[test]
fn mount_takes_half_of_ram_like_tmpfs_and_touches_only_what_is_written() {
    use std::os::unix::fs::MetadataExt;
    let ram = citronfs_meta_server::data_server::host_ram_bytes();
    let shm_free = citronfs_meta_server::data_server::shm_free_bytes().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(EXE)
        .arg("mount")
        .arg(dir.path())
        .arg("--foreground")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().contains("mounted at"));
    let c = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
    // SAFETY: an all-zero statvfs is valid; `c` is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` is a valid out-pointer.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    let size = st.f_blocks as u64 * st.f_frsize as u64;
    assert!(size <= ram / 2, "{size} bytes is more than half of {ram}");
    assert!(size + (1 << 30) >= (ram / 2).min(shm_free), "{size} bytes, RAM {ram}, /dev/shm free {shm_free}");
    let region = std::path::PathBuf::from(format!("/dev/shm/citronfs-{}-data/region-1", child.id()));
    let touched = || std::fs::metadata(&region).unwrap().blocks() * 512;
    assert!(touched() < 1 << 20, "an empty file system holds {} bytes", touched());
    std::fs::write(dir.path().join("four"), vec![9u8; 4 << 20]).unwrap();
    assert!((4 << 20..5 << 20).contains(&touched()), "4 MiB written, {} bytes touched", touched());
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    assert!(child.wait().unwrap().success());
    assert!(!region.exists(), "the data server's memory is gone with it");
}

/// A tiny `bench meta` through real mounts (needs root and /dev/fuse): every
/// phase of every process count and tree has a nonzero rate for CitronFS
/// and for bindfs where it is installed; CitronFS rows say what a call cost
/// in meta-server RPCs and FUSE requests (every call is at least one of
/// each), and the plot is written.
#[test]
fn bench_meta_measures_every_phase_and_counts_round_trips() {
    let out_dir = std::env::temp_dir().join(format!("citronfs-bench-meta-{}", std::process::id()));
    let out = Command::new(EXE)
        .args(["bench", "meta", "--files", "20", "--processes", "1,2"])
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let (h, rows) = read_csv(&out_dir.join("meta.csv"));
    let col = |name: &str| h.iter().position(|c| c == name).unwrap_or_else(|| panic!("{name} in {h:?}"));
    let citron: Vec<_> = rows.iter().filter(|r| r[col("fs")].starts_with("citronfs")).collect();
    // 2 process counts x 2 trees x 4 phases, without caching and with the
    // coherent cache (`--coherent-ttl`, 1 s by default).
    assert_eq!(citron.len(), 32, "{rows:?}");
    let (uncached, coherent): (Vec<&Vec<String>>, Vec<&Vec<String>>) =
        citron.iter().copied().partition(|r| r[col("fs")] == "citronfs(shm)");
    assert_eq!(coherent.len(), 16, "{rows:?}");
    // A stat through the coherent cache skips the GETATTRs of the path
    // (5 calls a stat without caching, 1 with).
    let rpcs = |r: &Vec<String>| r[col("rpcs_per_op")].parse::<f64>().unwrap();
    for c in coherent.iter().filter(|r| r[col("phase")] == "stat") {
        let u = uncached
            .iter()
            .find(|u| {
                u[col("phase")] == "stat"
                    && u[col("processes")] == c[col("processes")]
                    && u[col("tree")] == c[col("tree")]
            })
            .expect("the uncached row");
        assert!(rpcs(c) < rpcs(u), "coherent {c:?} against uncached {u:?}");
    }
    for r in &rows {
        let per_s: f64 = r[col("ops_per_s")].parse().unwrap();
        assert!(per_s > 0.0, "{r:?}");
    }
    for r in &citron {
        let fuse: f64 = r[col("fuse_per_op")].parse().unwrap();
        assert!(fuse >= 1.0, "every call reaches the daemon: {r:?}");
    }
    // Without caching every call reaches the meta-server too. A coherent
    // mount answers creates and unlinks in a directory it made before it
    // sends them, many in one call, which may go after the phase.
    for r in &uncached {
        assert!(rpcs(r) >= 1.0, "every call reaches the meta-server: {r:?}");
    }
    assert!(coherent.iter().map(|r| rpcs(r)).sum::<f64>() > 0.0, "{coherent:?}");
    assert!(out_dir.join("meta.png").exists());
    let _ = std::fs::remove_dir_all(out_dir);
}
