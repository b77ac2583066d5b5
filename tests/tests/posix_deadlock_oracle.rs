//! `EDEADLK` is never spurious: POSIX owners on several
//! clients wait for random spots of several files while holding others,
//! so cycles form and dissolve all the time; every `EDEADLK` is checked
//! against the wait-for graph the test keeps itself
//! ([`citronfs_tests::deadlock_oracle`]), and every wait must end (a
//! deadlock that is never reported would hang a waiter).
//!
//! The run is bounded by counts, not by time: it stops once enough
//! deadlocks were reported or after a fixed number of requests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use citronfs_core::client::{ClientConfig, FsClient, LockCall, Transport};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, LockOwner};
use citronfs_core::types::{Caller, Ino};
use citronfs_core::FsError;
use citronfs_tests::deadlock_oracle::{Spot, WaitGraph};
use citronfs_tests::TestCluster;
use rand::{Rng, SeedableRng};

const FILES: usize = 3;
const SLOTS: usize = 3;
const CLIENTS: usize = 3;
const OWNERS_PER_CLIENT: usize = 3;
/// Requests per owner at most.
const REQUESTS: usize = 5000;
/// Deadlocks after which every owner stops.
const ENOUGH_DEADLOCKS: u64 = 3000;
/// Longest a wait may take before the test calls it lost (a failure bound
/// only: no passing run comes near it).
const LOST_AFTER: Duration = Duration::from_secs(120);

/// A spot's bytes: one byte at the start of a lock unit.
fn range(spot: Spot) -> ByteRange {
    let at = spot.slot as u64 * 4096;
    ByteRange::new(at, at).expect("one byte")
}

struct Owner<'a> {
    index: usize,
    client: &'a FsClient,
    files: &'a [Ino],
    owner: LockOwner,
    graph: &'a WaitGraph,
    spurious: &'a std::sync::Mutex<Vec<String>>,
}

impl Owner<'_> {
    fn call(&self, spot: Spot, mode: Option<LockMode>) -> LockCall {
        LockCall {
            ino: self.files[spot.file],
            owner: self.owner,
            flavor: LockFlavor::Posix,
            mode,
            range: range(spot),
            pid: 1000 + self.index as u32,
            fh: 1,
        }
    }

    /// `F_SETLKW`; `Ok(true)` granted, `Ok(false)` EDEADLK.
    fn wait_for(&self, spot: Spot, mode: LockMode) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        self.graph.begin(self.index, spot, mode);
        self.client.setlkw(
            &self.call(spot, Some(mode)),
            Box::new(|| false),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        match rx.recv_timeout(LOST_AFTER) {
            Ok(Ok(())) => {
                self.graph.granted(self.index);
                true
            }
            Ok(Err(FsError::Deadlock)) => {
                if !self.graph.refused(self.index) {
                    // Reported at the end: panicking here, holding locks,
                    // would leave the other owners waiting for ever.
                    self.spurious.lock().unwrap().push(format!(
                        "owner {} got EDEADLK for {spot:?} ({mode:?}) but was on no cycle:\n{}",
                        self.index,
                        self.graph.dump()
                    ));
                }
                false
            }
            Ok(Err(e)) => panic!("owner {}: F_SETLKW {spot:?}: {e}", self.index),
            Err(_) => {
                panic!("owner {}: F_SETLKW {spot:?} never answered:\n{}", self.index, self.graph.dump())
            }
        }
    }

    fn unlock(&self, spot: Spot) {
        self.client.setlk(&self.call(spot, None)).expect("unlock");
        self.graph.released(self.index, spot);
    }

    fn run(&self, seed: u64, deadlocks: &AtomicU64) -> (u64, u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut held: Vec<Spot> = Vec::new();
        let (mut granted, mut refused) = (0, 0);
        for _ in 0..REQUESTS {
            if deadlocks.load(Ordering::Relaxed) >= ENOUGH_DEADLOCKS {
                break;
            }
            if held.len() >= 2 || (!held.is_empty() && rng.gen_ratio(1, 4)) {
                let i = rng.gen_range(0..held.len());
                self.unlock(held.swap_remove(i));
                continue;
            }
            let spot = Spot { file: rng.gen_range(0..FILES), slot: rng.gen_range(0..SLOTS) };
            if held.contains(&spot) {
                continue;
            }
            let mode = if rng.gen_ratio(3, 4) { LockMode::Write } else { LockMode::Read };
            if self.wait_for(spot, mode) {
                granted += 1;
                held.push(spot);
            } else {
                refused += 1;
                deadlocks.fetch_add(1, Ordering::Relaxed);
                // As a program would: back off by letting go of everything.
                for s in held.drain(..) {
                    self.unlock(s);
                }
            }
        }
        for s in held.drain(..) {
            self.unlock(s);
        }
        (granted, refused)
    }
}

#[test]
fn edeadlk_is_never_spurious_across_clients_and_files_on_shm() {
    stress(Transport::Auto);
}

#[test]
fn edeadlk_is_never_spurious_across_clients_and_files_on_tcp() {
    stress(Transport::Tcp);
}

fn stress(transport: Transport) {
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let meta = cluster.meta.local_addr();
    let mut config = ClientConfig::new(meta);
    config.transport = transport;
    let clients: Vec<FsClient> =
        (0..CLIENTS).map(|_| FsClient::connect(config.clone()).expect("connect")).collect();
    let files: Vec<Ino> = (0..FILES)
        .map(|f| {
            clients[0]
                .create_open(Caller::ROOT, Ino::ROOT, format!("f{f}").as_bytes(), 0o644)
                .expect("create")
                .ino
        })
        .collect();
    for c in &clients[1..] {
        for &f in &files {
            c.open(f).expect("open");
        }
    }
    let graph = WaitGraph::new(CLIENTS * OWNERS_PER_CLIENT);
    let deadlocks = AtomicU64::new(0);
    let spurious = std::sync::Mutex::new(Vec::new());
    let (granted, refused) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..CLIENTS * OWNERS_PER_CLIENT)
            .map(|i| {
                let owner = Owner {
                    index: i,
                    client: &clients[i / OWNERS_PER_CLIENT],
                    files: &files,
                    owner: LockOwner(0x5000 + i as u64),
                    graph: &graph,
                    spurious: &spurious,
                };
                let deadlocks = &deadlocks;
                s.spawn(move || owner.run(0xdead_0000 + i as u64, deadlocks))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("owner")).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    eprintln!("{transport:?}: granted {granted}, EDEADLK {refused}");
    let spurious = spurious.into_inner().unwrap();
    assert!(spurious.is_empty(), "{} spurious EDEADLK; the first: {}", spurious.len(), spurious[0]);
    assert!(granted > 0 && refused > 0, "the workload formed no cycle: granted {granted}, EDEADLK {refused}");
    for &f in &files {
        assert_eq!(clients[0].lock_records(f).expect("records"), vec![], "records left on {f:?}");
    }
}
