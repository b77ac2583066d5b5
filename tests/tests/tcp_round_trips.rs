//! Round trips per operation on the tcp transport, from the client's verb
//! counters: an uncontended fcntl lock and unlock, and reads and writes of
//! 4 KiB and 1 MiB, by one client that reaches every server memory over the
//! software NIC (the default locks: Citron ranges, a ShiftLock inode mutex).
//!
//! Counts, not times: a round trip is one wait for the network (a single
//! verb, or a whole ordered batch). Each operation is done a few times
//! first, so that what is paid once (a layout fetched, an extent
//! allocated, a connection opened) is not counted. A Citron attempt that
//! a busy machine delays past its budget aborts and tries again (more
//! round trips, by design), so the figure checked is the fewest round
//! trips any of [`STEPS`] operations took: the uncontended path. Its
//! ceilings are what the batching gives, and each says which batch a
//! round trip more would have lost.
//!
//! The client takes no lock tokens here: the fcntl figures are those of the
//! table protocol (under a token, a lock and an unlock cost none:
//! `lock_tokens`).

use citron_lock::rdma::{VerbCounts, VerbKind};
use citronfs_core::client::{FsClient, Transport};
use citronfs_core::locks::{ByteRange, LockMode};
use citronfs_core::types::{Caller, FileKind, Ino};
use citronfs_tests::lock_calls::posix_call;
use citronfs_tests::TestCluster;

const ME: Caller = Caller { uid: 0, gid: 0, pid: 1 };
/// Operations done before counting (first-time costs out of the way).
const WARMUP: u32 = 3;
/// Operations counted.
const STEPS: u32 = 20;
const SMALL: usize = 4 << 10;
const LARGE: usize = 1 << 20;
/// The file's chunk size (the default of `citronfs mount`).
const CHUNK: u64 = 1 << 20;

/// An fcntl lock: the Citron ancestor read (Step 2(b)); its lock batch
/// (2(c)+(d)) carrying the table read; the slot claim (CAS); the record
/// written in the release batch.
const LOCK_ROUND_TRIPS: u64 = 4;
/// An fcntl unlock: the ancestor read; the lock batch with the table read;
/// the slot freed in the release batch.
const UNLOCK_ROUND_TRIPS: u64 = 3;
/// A read or write of 4 KiB (its range one leaf of the Citron tree): the
/// inode mutex with the attribute slot read and the read of the leaf's
/// ancestors (Citron's Step 2(b), taken early); the lock batch; the data
/// verbs (one batch to the data server); the range, the mtime store and
/// the inode mutex given back in one batch.
const IO_ROUND_TRIPS: u64 = 4;
/// A read or write of a whole 1 MiB chunk, whose range is an internal node
/// of the tree: as [`IO_ROUND_TRIPS`], but the node's ticket (Step 2(a))
/// comes before its ancestor read, which is then not taken early.
const LARGE_IO_ROUND_TRIPS: u64 = 5;
/// A write that extends the file: as [`IO_ROUND_TRIPS`] up to its data
/// verbs; then the range given back; the attribute ALock with the size
/// read; the size and mtime stored in the ALock's release batch; the inode
/// mutex given back.
const EXTEND_ROUND_TRIPS: u64 = 7;

/// The counts of each of `STEPS` runs of `op` (after `WARMUP` runs).
fn each(client: &FsClient, mut op: impl FnMut()) -> Vec<VerbCounts> {
    for _ in 0..WARMUP {
        op();
    }
    (0..STEPS)
        .map(|_| {
            let before = client.verb_counts();
            op();
            client.verb_counts() - before
        })
        .collect()
}

/// The fewest round trips of `runs`, after printing the mean counts.
fn fewest(what: &str, runs: &[VerbCounts]) -> u64 {
    let mut total = VerbCounts::default();
    for r in runs {
        total += *r;
    }
    let n = runs.len() as f64;
    let kinds: Vec<String> = VerbKind::ALL
        .iter()
        .filter(|k| total.get(**k) > 0)
        .map(|k| format!("{k:?} {:.1}", total.get(*k) as f64 / n))
        .collect();
    let min = runs.iter().map(|r| r.round_trips).min().unwrap_or(0);
    println!(
        "{what:>14}: {:.1} verbs in {:.1} round trips, fewest {min} ({})",
        total.verbs() as f64 / n,
        total.round_trips as f64 / n,
        kinds.join(", ")
    );
    min
}

#[test]
fn round_trips_per_operation_on_tcp() {
    let cluster = TestCluster::start(1, 64 << 20, CHUNK);
    let mut config = cluster.client_config(None, Transport::Tcp);
    config.lock_tokens = false;
    let client = FsClient::connect(config).unwrap();
    let ino: Ino = client.create(ME, Ino::ROOT, b"f", FileKind::File, 0o644, 0).unwrap().ino;
    client.open(ino).unwrap();

    let range = ByteRange::new(16 << 10, (20 << 10) - 1).unwrap();
    let lock = posix_call(ino, 7, Some(LockMode::Write), range);
    let unlock = posix_call(ino, 7, None, range);
    for _ in 0..WARMUP {
        client.setlk(&lock).unwrap();
        client.setlk(&unlock).unwrap();
    }
    let (mut locks, mut unlocks) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let before = client.verb_counts();
        client.setlk(&lock).unwrap();
        let held = client.verb_counts();
        client.setlk(&unlock).unwrap();
        locks.push(held - before);
        unlocks.push(client.verb_counts() - held);
    }
    assert_eq!(client.lock_records(ino).unwrap(), vec![], "every lock was given back");

    let small = vec![0x5a; SMALL];
    let large: Vec<u8> = (0..LARGE).map(|i| (i % 251) as u8).collect();
    // The large I/O is one whole chunk, the small one inside another; both
    // within the size, as rewrites are (an extending write publishes its
    // size under the attribute lock, which costs more).
    client.write(ino, CHUNK, &large, false).unwrap();
    let write_large = each(&client, || {
        client.write(ino, CHUNK, &large, false).unwrap();
    });
    let write_small = each(&client, || {
        client.write(ino, 4096, &small, false).unwrap();
    });
    let extend = {
        let ino: Ino = client.create(ME, Ino::ROOT, b"g", FileKind::File, 0o644, 0).unwrap().ino;
        client.open(ino).unwrap();
        // Its chunk allocated whole first: no write needs an extent (which
        // takes the inode mutex exclusive and no range lock).
        client.fallocate(ino, 0, CHUNK, true).unwrap();
        let mut at = 0;
        each(&client, || {
            client.write(ino, at, &small, false).unwrap();
            at += SMALL as u64;
        })
    };
    let read_small = each(&client, || {
        assert_eq!(client.read(ino, 4096, SMALL as u32).unwrap(), small);
    });
    let read_large = each(&client, || {
        assert!(client.read(ino, CHUNK, LARGE as u32).unwrap() == large);
    });

    let figures = [
        ("fcntl lock", fewest("fcntl lock", &locks), LOCK_ROUND_TRIPS),
        ("fcntl unlock", fewest("fcntl unlock", &unlocks), UNLOCK_ROUND_TRIPS),
        ("write 4KiB", fewest("write 4KiB", &write_small), IO_ROUND_TRIPS),
        ("read 4KiB", fewest("read 4KiB", &read_small), IO_ROUND_TRIPS),
        ("extend 4KiB", fewest("extend 4KiB", &extend), EXTEND_ROUND_TRIPS),
        ("write 1MiB", fewest("write 1MiB", &write_large), LARGE_IO_ROUND_TRIPS),
        ("read 1MiB", fewest("read 1MiB", &read_large), LARGE_IO_ROUND_TRIPS),
    ];
    for (what, got, ceiling) in figures {
        assert!(got <= ceiling, "{what}: {got} round trips at the fewest, more than {ceiling}");
    }
}
