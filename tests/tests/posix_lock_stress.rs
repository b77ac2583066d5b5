//! Randomised oracle stress of byte-range locks below FUSE: several client
//! processes (each a mount's client) and threads, POSIX and OFD owners,
//! taking, converting, waiting for and releasing random ranges of one file
//! on each transport. The oracle (see `posix_stress`) fails any worker that
//! is granted a lock that conflicts with one held elsewhere; a wait that is
//! never answered fails it too. Afterwards no record, wait or waits-for
//! entry is left.

use std::process::{Command, Stdio};
use std::time::Duration;

use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::locks::LockFlavor;
use citronfs_core::types::Caller;
use citronfs_tests::posix_stress::{map_oracle, run_owner, Stats, ORACLE_BYTES};
use citronfs_tests::TestCluster;

const WORKER: &str = env!("CARGO_BIN_EXE_posix-lock-worker");

fn stress(transport: Transport) {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let mut config = ClientConfig::new(meta);
    config.transport = transport;
    let client = FsClient::connect(config.clone()).unwrap();
    let attr = client.create_open(Caller::ROOT, citronfs_core::types::Ino::ROOT, b"locked", 0o644).unwrap();
    let ino = attr.ino;
    let oracle_file = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    oracle_file.as_file().set_len(ORACLE_BYTES).unwrap();
    let oracle = map_oracle(oracle_file.path());
    let millis = 2500u64;
    let tcp = transport == Transport::Tcp;
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let mut cmd = Command::new(WORKER);
            cmd.arg(meta.to_string())
                .arg(oracle_file.path())
                .arg(ino.0.to_string())
                .arg("3")
                .arg(millis.to_string())
                .arg((w + 1).to_string())
                .stdout(Stdio::piped());
            if tcp {
                cmd.arg("--tcp");
            }
            cmd.spawn().unwrap()
        })
        .collect();
    // Two more owners in this process, on a client of their own.
    let mut here = Stats::default();
    std::thread::scope(|s| {
        let a = s.spawn(|| {
            run_owner(&client, ino, &oracle, LockFlavor::Posix, 1, Duration::from_millis(millis), 7)
        });
        let b = s
            .spawn(|| run_owner(&client, ino, &oracle, LockFlavor::Ofd, 2, Duration::from_millis(millis), 8));
        here += a.join().unwrap();
        here += b.join().unwrap();
    });
    let mut total = here;
    for w in workers {
        let out = w.wait_with_output().unwrap();
        assert!(out.status.success(), "a worker failed: {}", out.status);
        let text = String::from_utf8_lossy(&out.stdout);
        let n: Vec<u64> =
            text.trim().strip_prefix("stats ").unwrap().split(' ').map(|x| x.parse().unwrap()).collect();
        total += Stats { granted: n[0], refused: n[1], waited: n[2], deadlocks: n[3], unlocks: n[4] };
    }
    eprintln!("{transport:?}: {total:?}");
    assert!(
        total.granted > 20 && total.refused > 0 && total.waited > 0,
        "the workload did not contend: {total:?}"
    );
    // Every owner released everything: no record, no wait, no waits-for.
    assert_eq!(client.lock_records(ino).unwrap(), vec![]);
    for b in 0..ORACLE_BYTES / 8 {
        let w =
            oracle.word(citron_lock::rdma::RemoteAddr::new(citron_lock::rdma::RegionId(1), b * 8)).unwrap();
        assert_eq!(w.load(std::sync::atomic::Ordering::SeqCst), 0, "oracle byte {b} still marked");
    }
}

#[test]
fn posix_locks_stay_exclusive_under_contention_on_shm() {
    stress(Transport::Auto);
}

#[test]
fn posix_locks_stay_exclusive_under_contention_on_tcp() {
    stress(Transport::Tcp);
}
