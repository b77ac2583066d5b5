//! Refusals cost nothing lasting: a refused F_SETLK is an
//! answer, not a failure. The mount keeps its endpoints (no new connection,
//! no new mailbox id), so a long-lived mount refused again and again — the
//! polling loop of a program that retries F_SETLK — never runs out of
//! anything, whatever its inode mutex. (Before: every refusal dropped the
//! mount's endpoints and opened a TCP connection; with DQL, whose client
//! ids hold a 16-bit mailbox, every write failed with EIO after 65,536.)
//!
//! Below FUSE (`FsClient::setlk`, what the mount calls) so the counts are
//! large; through FUSE in `mount_locks.rs`.

use std::time::{Duration, Instant};

use citron_lock::rwlock::Algorithm;
use citronfs_core::client::{ClientConfig, FsClient, LockCall, Transport};
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, LockOwner};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::TestCluster;

/// The count: fifteen times what DQL's 16-bit mailbox field holds.
const MILLION: u64 = 1_000_000;
/// Over tcp a refusal is five round trips (~100 µs): a million each would
/// add many minutes to CI, and the connections are counted exactly anyway.
const REFUSALS: u64 = 20_000;

fn client(cluster: &TestCluster, transport: Transport) -> FsClient {
    let mut config = ClientConfig::new(cluster.meta.local_addr());
    config.transport = transport;
    config.timeout = Duration::from_secs(3);
    FsClient::connect(config).expect("join the cluster")
}

/// Connections accepted so far by the cluster's NICs.
fn nic_connections(cluster: &TestCluster) -> u64 {
    use std::sync::atomic::Ordering::Relaxed;
    cluster.meta.nic_stats().connections.load(Relaxed)
        + cluster.data.iter().map(|d| d.nic_stats().connections.load(Relaxed)).sum::<u64>()
}

fn call(ino: Ino, owner: u64, mode: Option<LockMode>) -> LockCall {
    LockCall {
        ino,
        owner: LockOwner(owner),
        flavor: LockFlavor::Posix,
        mode,
        range: ByteRange::new(0, 99).unwrap(),
        pid: 4242,
        fh: 1,
    }
}

/// `n` refused F_SETLK on a client (on `transport`), then it writes and
/// reads the file (under the inode mutex) and locks it once its holder
/// lets go; no connection was opened at the NICs meanwhile.
fn refusals_cost_nothing(inode: Algorithm, transport: Transport, n: u64) {
    let cluster = TestCluster::with_locks(LockChoice { inode, ..LockChoice::default() });
    let holder = client(&cluster, Transport::Auto);
    let refused = client(&cluster, transport);
    let attr = holder.create_open(Caller::ROOT, Ino(1), b"f", 0o644).unwrap();
    let ino = attr.ino;
    holder.setlk(&call(ino, 1, Some(LockMode::Write))).unwrap();
    refused.open(ino).unwrap();
    // Warm up: the first calls open the endpoints the client keeps.
    assert_eq!(refused.setlk(&call(ino, 2, Some(LockMode::Write))), Err(FsError::WouldBlock));
    refused.write(ino, 0, b"warm", false).unwrap();
    let before = nic_connections(&cluster);
    let t = Instant::now();
    for i in 0..n {
        let mode = if i % 2 == 0 { LockMode::Write } else { LockMode::Read };
        assert_eq!(refused.setlk(&call(ino, 2, Some(mode))), Err(FsError::WouldBlock), "refusal {i}");
    }
    let elapsed = t.elapsed();
    let opened = nic_connections(&cluster) - before;
    // I/O works on the refused client (the inode mutex is taken for it).
    refused
        .write(ino, 0, b"still works", false)
        .unwrap_or_else(|e| panic!("{inode}: write after refusals: {e}"));
    assert_eq!(refused.read(ino, 0, 11).unwrap(), b"still works");
    holder.setlk(&call(ino, 1, None)).unwrap();
    refused.setlk(&call(ino, 2, Some(LockMode::Write))).unwrap();
    assert_eq!(opened, 0, "{inode}: {n} refusals opened {opened} connections at the NICs");
    eprintln!(
        "--inode-lock {inode}: {n} refusals in {elapsed:?} ({:.0}/s), {opened} connections opened",
        n as f64 / elapsed.as_secs_f64()
    );
}

/// The count with every inode mutex, on shm (a few µs each): what
/// a refusal must not use up there is mailbox ids — DQL's client ids hold
/// 16 bits of it, ShiftLock's 24.
#[test]
fn a_million_refused_setlk_cost_nothing_with_every_inode_lock() {
    for inode in Algorithm::BUILT {
        refusals_cost_nothing(inode, Transport::Auto, MILLION);
    }
}

/// Over tcp, where every endpoint dropped would also be a new connection
/// (and a socket left in TIME_WAIT).
#[test]
fn refused_setlk_over_tcp_opens_no_connection_with_every_inode_lock() {
    for inode in Algorithm::BUILT {
        refusals_cost_nothing(inode, Transport::Tcp, REFUSALS);
    }
}
