//! A randomised workload of byte-range locks through [`FsClient`] (no FUSE),
//! with an oracle in shared memory that every process maps: one word per
//! byte of the locked region, holding a writer flag or a reader count.
//!
//! Each thread is one lock owner. It takes, converts, waits for and
//! releases random ranges, and mirrors what it holds in the oracle: before
//! it lets go of a byte it removes its mark; after a grant it adds it. A
//! writer mark is placed with a CAS from zero and a reader mark with an
//! add that must not see the writer flag, so two owners that hold
//! conflicting locks on one byte at once are caught by whichever marks
//! second — across threads, mounts and processes.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use citron_lock::rdma::{RegionId, RegionMemory, RemoteAddr};
use citronfs_core::client::{FsClient, LockCall};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, LockOwner, OFFSET_MAX};
use citronfs_core::types::Ino;
use citronfs_core::FsError;
use rand::{Rng, SeedableRng};

/// Bytes of file the workload locks (8 lock units of 4 KiB).
pub const REGION: u64 = 32 * 1024;
/// Bytes of the oracle file: a word per byte.
pub const ORACLE_BYTES: u64 = REGION * 8;
const WRITER: u64 = 1 << 40;
/// Longest a blocked request may take before the test calls it lost.
pub const WAIT_BOUND: Duration = Duration::from_secs(20);

/// What one owner did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub granted: u64,
    pub refused: u64,
    pub waited: u64,
    pub deadlocks: u64,
    pub unlocks: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Stats) {
        self.granted += o.granted;
        self.refused += o.refused;
        self.waited += o.waited;
        self.deadlocks += o.deadlocks;
        self.unlocks += o.unlocks;
    }
}

/// The oracle file mapped into this process.
pub fn map_oracle(path: &std::path::Path) -> RegionMemory {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).expect("oracle file");
    RegionMemory::from_file(RegionId(1), &file).expect("map the oracle")
}

fn cell(oracle: &RegionMemory, byte: u64) -> &std::sync::atomic::AtomicU64 {
    oracle.word(RemoteAddr::new(RegionId(1), byte * 8)).expect("oracle word")
}

struct Owner<'a> {
    client: &'a FsClient,
    ino: Ino,
    oracle: &'a RegionMemory,
    owner: LockOwner,
    flavor: LockFlavor,
    fh: u64,
    /// What this owner holds, per byte of the region: 0 none, 1 read, 2 write.
    held: Vec<u8>,
    stats: Stats,
}

impl Owner<'_> {
    fn call(&self, mode: Option<LockMode>, range: ByteRange) -> LockCall {
        LockCall {
            ino: self.ino,
            owner: self.owner,
            flavor: self.flavor,
            mode,
            range,
            pid: std::process::id(),
            fh: self.fh,
        }
    }

    fn bytes(range: ByteRange) -> std::ops::Range<u64> {
        range.start.min(REGION)..(range.last.min(REGION - 1) + 1).max(range.start.min(REGION))
    }

    /// Removes this owner's marks from `range` (before releasing it).
    fn unmark(&mut self, range: ByteRange) {
        for b in Self::bytes(range) {
            let c = cell(self.oracle, b);
            match self.held[b as usize] {
                1 => {
                    c.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
                2 => {
                    let old = c.swap(0, std::sync::atomic::Ordering::SeqCst);
                    assert_eq!(
                        old,
                        self.writer_mark(),
                        "byte {b}: writer mark disturbed while held ({old:#x})"
                    );
                }
                _ => {}
            }
            self.held[b as usize] = 0;
        }
    }

    /// Before a read request over `range`: turns this owner's writer marks
    /// there into reader marks, because the table downgrades them the moment
    /// it grants (before this owner could change its marks afterwards).
    /// Returns the bytes changed, for [`Owner::restore`] if refused.
    fn weaken_before(&mut self, mode: LockMode, range: ByteRange) -> Vec<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        if mode != LockMode::Read {
            return Vec::new();
        }
        let mut changed = Vec::new();
        for b in Self::bytes(range) {
            if self.held[b as usize] == 2 {
                let c = cell(self.oracle, b);
                let old = c.swap(1, SeqCst);
                assert_eq!(old, self.writer_mark(), "byte {b}: writer mark disturbed while held");
                self.held[b as usize] = 1;
                changed.push(b);
            }
        }
        changed
    }

    /// A refused request left the locks as they were: back to writer marks.
    /// No other owner can have joined meanwhile: the table still says write.
    fn restore(&mut self, changed: Vec<u64>) {
        use std::sync::atomic::Ordering::SeqCst;
        for b in changed {
            let c = cell(self.oracle, b);
            let old = c.compare_exchange(1, self.writer_mark(), SeqCst, SeqCst);
            assert!(old.is_ok(), "byte {b}: another owner marked it while we held it for write: {old:x?}");
            self.held[b as usize] = 2;
        }
    }

    /// Adds this owner's marks for a granted `mode` over `range`.
    fn mark(&mut self, mode: LockMode, range: ByteRange) {
        use std::sync::atomic::Ordering::SeqCst;
        for b in Self::bytes(range) {
            let c = cell(self.oracle, b);
            let want = if mode == LockMode::Write { 2 } else { 1 };
            match (self.held[b as usize], want) {
                (x, y) if x == y => continue,
                (1, 2) => {
                    c.fetch_sub(1, SeqCst);
                }
                (2, 1) => {
                    c.swap(0, SeqCst);
                }
                _ => {}
            }
            if want == 2 {
                let old = c.compare_exchange(0, self.writer_mark(), SeqCst, SeqCst);
                if let Err(other) = old {
                    self.violation(b, mode, range, other);
                }
            } else {
                let old = c.fetch_add(1, SeqCst);
                if old & WRITER != 0 {
                    self.violation(b, mode, range, old);
                }
            }
            self.held[b as usize] = want;
        }
    }

    /// The oracle value of this owner's write lock: the flag and who.
    fn writer_mark(&self) -> u64 {
        WRITER | (self.owner.0 & 0x7fff_ffff)
    }

    fn violation(&self, byte: u64, mode: LockMode, range: ByteRange, seen: u64) -> ! {
        let mut dump = String::new();
        for r in self.client.lock_records(self.ino).unwrap_or_default() {
            dump += &format!(
                "\n  {:?} {:?} {:?} c{} o{:x} {}..={}",
                r.state, r.flavor, r.mode, r.owner.client.0, r.owner.owner.0, r.range.start, r.range.last
            );
        }
        panic!(
            "byte {byte}: {mode:?} lock on {range:?} granted to c{} o{:x} while the oracle holds {seen:#x} \
             (writer tag {:x}); records:{dump}",
            self.client.client_id().0,
            self.owner.0,
            seen & 0x7fff_ffff
        )
    }

    /// Checks that this owner's records in the table say exactly what it
    /// believes it holds (its records are stable: only it changes them).
    fn check_own(&self, after: &str) {
        let mut table = vec![0u8; REGION as usize];
        for r in self.client.lock_records(self.ino).expect("records") {
            if r.owner.owner != self.owner || r.state != citronfs_core::locks::record::RecordState::Held {
                continue;
            }
            for b in Self::bytes(r.range) {
                assert_eq!(
                    table[b as usize],
                    0,
                    "after {after}: two records of c{} o{:x} overlap at {b}",
                    self.client.client_id().0,
                    self.owner.0
                );
                table[b as usize] = if r.mode == LockMode::Write { 2 } else { 1 };
            }
        }
        if let Some(b) = (0..REGION as usize).find(|&b| table[b] != self.held[b]) {
            panic!(
                "after {after}: c{} o{:x} believes it holds {} at byte {b}, its records say {}",
                self.client.client_id().0,
                self.owner.0,
                self.held[b],
                table[b]
            );
        }
    }

    fn release_all(&mut self) {
        self.unmark(ByteRange::whole_file());
        let r = match self.flavor {
            LockFlavor::Posix => self.client.release_owner_locks(self.ino, self.owner),
            _ => self.client.release_handle_locks(self.ino, self.fh),
        };
        r.expect("release all");
        self.stats.unlocks += 1;
    }

    /// `Err` if refused with `EDEADLK`.
    fn wait_for(&mut self, mode: LockMode, range: ByteRange) -> Result<(), ()> {
        let (tx, rx) = mpsc::channel();
        self.client.setlkw(
            &self.call(Some(mode), range),
            Box::new(|| false),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        match rx.recv_timeout(WAIT_BOUND) {
            Ok(Ok(())) => {
                self.stats.waited += 1;
                self.mark(mode, range);
            }
            Ok(Err(FsError::Deadlock)) => {
                self.stats.deadlocks += 1;
                return Err(());
            }
            Ok(Err(e)) => panic!("setlkw {range:?}: {e}"),
            Err(_) => {
                let records = self.client.lock_records(self.ino).unwrap_or_default();
                let mut dump = String::new();
                for r in &records {
                    dump += &format!(
                        "\n  {:?} {:?} {:?} c{} o{:x} {}..={}",
                        r.state,
                        r.flavor,
                        r.mode,
                        r.owner.client.0,
                        r.owner.owner.0,
                        r.range.start,
                        r.range.last
                    );
                }
                panic!(
                    "setlkw {range:?} of owner c{} o{:x} was never answered (lost wake-up?); records:{dump}",
                    self.client.client_id().0,
                    self.owner.0
                )
            }
        }
        Ok(())
    }
}

fn random_range(rng: &mut impl Rng, max_len: u64) -> ByteRange {
    let start = rng.gen_range(0..REGION);
    if rng.gen_ratio(1, 20) {
        return ByteRange::to_eof(start);
    }
    let len = rng.gen_range(1..=max_len);
    ByteRange::new(start, (start + len - 1).min(OFFSET_MAX)).expect("non-empty")
}

/// One owner's run for `duration`; returns what it did. Panics (failing the
/// test or the worker) on any oracle violation or unanswered wait.
pub fn run_owner(
    client: &FsClient,
    ino: Ino,
    oracle: &RegionMemory,
    flavor: LockFlavor,
    fh: u64,
    duration: Duration,
    seed: u64,
) -> Stats {
    let end = Instant::now() + duration;
    run_owner_while(client, ino, oracle, flavor, fh, &|| Instant::now() < end, seed)
}

/// [`run_owner`] for as long as `going` says.
pub fn run_owner_while(
    client: &FsClient,
    ino: Ino,
    oracle: &RegionMemory,
    flavor: LockFlavor,
    fh: u64,
    going: &dyn Fn() -> bool,
    seed: u64,
) -> Stats {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut o = Owner {
        client,
        ino,
        oracle,
        owner: LockOwner(rng.gen()),
        flavor,
        fh,
        held: vec![0; REGION as usize],
        stats: Stats::default(),
    };
    while going() {
        let mode = if rng.gen_bool(0.5) { LockMode::Read } else { LockMode::Write };
        let op = rng.gen_range(0..100);
        let last_op;
        match op {
            0..40 => {
                let range = random_range(&mut rng, 6000);
                // A request is atomic (granted whole, or refused with our
                // locks unchanged), so marks change only after the answer.
                last_op = format!("setlk {mode:?} {range:?}");
                let weakened = o.weaken_before(mode, range);
                match client.setlk(&o.call(Some(mode), range)) {
                    Ok(()) => {
                        o.stats.granted += 1;
                        o.mark(mode, range);
                    }
                    Err(FsError::WouldBlock) => {
                        o.stats.refused += 1;
                        o.restore(weakened);
                    }
                    Err(e) => panic!("setlk {range:?}: {e}"),
                }
            }
            40..65 => {
                let range = random_range(&mut rng, 6000);
                last_op = format!("unlock {range:?}");
                o.unmark(range);
                client.setlk(&o.call(None, range)).expect("unlock");
                o.stats.unlocks += 1;
            }
            65..80 => {
                // Waiting while holding: POSIX owners rely on EDEADLK for
                // cycles; OFD owners are not checked (as on Linux), so they
                // wait holding nothing.
                if flavor != LockFlavor::Posix {
                    o.release_all();
                }
                let range = random_range(&mut rng, 600);
                last_op = format!("setlkw {mode:?} {range:?}");
                let weakened = o.weaken_before(mode, range);
                if o.wait_for(mode, range).is_err() {
                    o.restore(weakened);
                }
            }
            80..90 => {
                last_op = "release all".to_string();
                o.release_all()
            }
            _ => {
                let range = random_range(&mut rng, 6000);
                last_op = format!("getlk {range:?}");
                client.getlk(&o.call(Some(mode), range)).expect("getlk");
            }
        }
        if std::env::var_os("POSIX_STRESS_CHECK_OWN").is_some() {
            o.check_own(&format!("op {last_op}"));
        }
        if rng.gen_ratio(1, 8) {
            std::thread::yield_now();
        }
    }
    o.release_all();
    o.stats
}
