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
use citronfs_tests::posix_stress::{map_oracle, run_owner, run_owner_while, Stats, ORACLE_BYTES};
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

/// Lock tokens taken and revoked again and again while owners on two
/// clients race: client `a`'s two owners lock all along, and take the
/// file's token whenever `b` is away; `b` opens the file, runs an owner
/// for a moment (which has `a`'s token revoked and its records
/// published), releases everything and closes, over and over. The oracle
/// holds throughout, on each transport.
fn tokens_revoked_while_owners_race(a_on: Transport, b_on: Transport) {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let config = |t| {
        let mut c = ClientConfig::new(meta);
        c.transport = t;
        c
    };
    let a = FsClient::connect(config(a_on)).unwrap();
    let b = FsClient::connect(config(b_on)).unwrap();
    let ino = a.create_open(Caller::ROOT, citronfs_core::types::Ino::ROOT, b"locked", 0o644).unwrap().ino;
    let oracle_file = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    oracle_file.as_file().set_len(ORACLE_BYTES).unwrap();
    let oracle = map_oracle(oracle_file.path());
    // At least this long, and until `a`'s token came and went twice: a
    // loaded machine stretches every round.
    let (least, hang) = (Duration::from_millis(5000), Duration::from_secs(120));
    let mut total = Stats::default();
    let mut rounds = 0;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let going = || !stop.load(std::sync::atomic::Ordering::SeqCst);
    std::thread::scope(|s| {
        let owners = [
            s.spawn(|| run_owner_while(&a, ino, &oracle, LockFlavor::Posix, 1, &going, 11)),
            s.spawn(|| run_owner_while(&a, ino, &oracle, LockFlavor::Ofd, 2, &going, 12)),
        ];
        let started = std::time::Instant::now();
        let came_and_went = |t: citronfs_core::client::TokenCounts| t.taken >= 2 && t.given_up >= 2;
        while started.elapsed() < hang && (started.elapsed() < least || !came_and_went(a.lock_token_counts()))
        {
            b.open(ino).unwrap();
            let flavor = if rounds % 2 == 0 { LockFlavor::Posix } else { LockFlavor::Ofd };
            total +=
                run_owner(&b, ino, &oracle, flavor, 100 + rounds, Duration::from_millis(100), 20 + rounds);
            b.release(ino).unwrap();
            rounds += 1;
            // Longer than a given-up token is left alone (1 s), so that `a`
            // takes it again before `b` comes back.
            std::thread::sleep(Duration::from_millis(1300));
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for o in owners {
            total += o.join().unwrap();
        }
    });
    let tokens = a.lock_token_counts();
    eprintln!("{a_on:?}/{b_on:?}: {rounds} rounds of b, {total:?}, a's tokens {tokens:?}");
    assert!(total.granted > 20 && total.refused > 0, "the workload did not contend: {total:?}");
    assert!(tokens.taken >= 2 && tokens.given_up >= 2, "a's token did not come and go: {tokens:?}");
    assert_eq!(a.lock_records(ino).unwrap(), vec![]);
    for byte in 0..ORACLE_BYTES / 8 {
        let w = oracle
            .word(citron_lock::rdma::RemoteAddr::new(citron_lock::rdma::RegionId(1), byte * 8))
            .unwrap();
        assert_eq!(w.load(std::sync::atomic::Ordering::SeqCst), 0, "oracle byte {byte} still marked");
    }
}

#[test]
fn lock_tokens_revoked_again_and_again_while_owners_race_on_tcp() {
    tokens_revoked_while_owners_race(Transport::Tcp, Transport::Tcp);
}

#[test]
fn lock_tokens_revoked_again_and_again_while_owners_race_on_shm_and_tcp() {
    tokens_revoked_while_owners_race(Transport::Auto, Transport::Tcp);
}
