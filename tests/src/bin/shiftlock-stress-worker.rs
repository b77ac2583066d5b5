//! Worker process of the ShiftLock tests (tests/tests/lock_shiftlock.rs).
//!
//! ```text
//! shiftlock-stress-worker stress FABRIC LOCK THREADS ITERATIONS READ_PERCENT THRESHOLD LEASE_MS SEED
//! shiftlock-stress-worker hold   FABRIC LOCK shared|exclusive LEASE_MS
//! shiftlock-stress-worker queue  FABRIC LOCK LEASE_MS
//! ```
//!
//! (`--help` describes the arguments.)
//!
//! `LOCK` is `ENTRY:ERAS:ERA_COUNT:SERVICE_NODE:SERVICE_MAILBOX:ORACLE`, the
//! byte offsets in the test region of the lock entry, the era table and the
//! oracle, and the recovery service's mailbox.
//!
//! The oracle (three 8-byte words at `ORACLE`):
//! * `INSIDE`: writers inside in the high 32 bits, readers in the low 32.
//!   A writer enters with `faa(+2^32)` and must see 0; a reader with
//!   `faa(+1)` and must see no writer. A reader that sees other readers has
//!   observed an overlap.
//! * `WRITER_ENTRIES`: writers that have entered, ever. A reader that had to
//!   wait reads it right after joining the lock (after its FAA) and again
//!   inside: no more than N + 1 writers may have entered in between (§3.5.2
//!   with the consecutive-writer threshold N).
//! * `ENTRIES`: every entry, so the test sees progress.
//!
//! `stress` prints one line `RESULT key=value ...` with its totals. `hold`
//! acquires, prints `HOLDING` and sleeps until killed; `queue` enqueues as a
//! writer behind the current holder, prints `QUEUED` and waits until killed.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use citron_lock::rdma::{ClientAddr, Endpoint, FabricAddr, MailboxId, Node, NodeId, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citron_lock::shiftlock::{
    EraTable, Postbox, RecoveryLocator, ShiftLockClient, ShiftLockConfig, ShiftLockRef, ShiftLockStats,
};
use citronfs_tests::TEST_REGION;
use clap::{Parser, ValueEnum};
use rand::{Rng, SeedableRng};

const INSIDE: u64 = 0;
const WRITER_ENTRIES: u64 = 8;
const ENTRIES: u64 = 16;
const ONE_WRITER: u64 = 1 << 32;

struct Spec {
    lock: ShiftLockRef,
    oracle: u64,
}

impl Spec {
    fn parse(s: &str) -> Result<Spec> {
        let f: Vec<u64> = s.split(':').map(str::parse).collect::<Result<_, _>>().context("LOCK fields")?;
        ensure!(f.len() == 6, "LOCK is ENTRY:ERAS:ERA_COUNT:SERVICE_NODE:SERVICE_MAILBOX:ORACLE");
        let recovery = RecoveryLocator {
            service: ClientAddr {
                node: NodeId(u32::try_from(f[3])?),
                mailbox: MailboxId(u32::try_from(f[4])?),
            },
            also: None,
            eras: EraTable { base: RemoteAddr::new(TEST_REGION, f[1]), count: u32::try_from(f[2])? },
        };
        Ok(Spec { lock: ShiftLockRef { entry: RemoteAddr::new(TEST_REGION, f[0]), recovery }, oracle: f[5] })
    }

    fn word(&self, w: u64) -> RemoteAddr {
        RemoteAddr::new(TEST_REGION, self.oracle + w)
    }

    fn client(&self, ep: &Endpoint, lease: Duration, threshold: u32) -> Result<ShiftLockClient> {
        let rtt = ep.measure_rtt(self.word(ENTRIES), 5)?;
        let mut config = ShiftLockConfig::from_rtt(rtt).with_lease(lease);
        config.writer_threshold = threshold;
        Ok(ShiftLockClient::new(self.lock, config, Arc::new(Postbox::new()))?)
    }
}

/// Totals of one thread's run.
#[derive(Default)]
struct Totals {
    lock: ShiftLockStats,
    overlaps: u64,
    max_readers: u64,
    judged_waits: u64,
    max_bypass: u64,
    max_wait: Duration,
}

impl Totals {
    fn merge(&mut self, o: &Totals) {
        let (a, b) = (&mut self.lock, &o.lock);
        a.shared += b.shared;
        a.exclusive += b.exclusive;
        a.waited += b.waited;
        a.handovers_sent += b.handovers_sent;
        a.mode_changes_sent += b.mode_changes_sent;
        a.max_cons_wrt = a.max_cons_wrt.max(b.max_cons_wrt);
        a.reader_polls += b.reader_polls;
        a.writer_polls += b.writer_polls;
        a.restarts += b.restarts;
        a.recovery_requests += b.recovery_requests;
        a.recoveries += b.recoveries;
        a.stale_recoveries += b.stale_recoveries;
        a.dropped += b.dropped;
        a.stale_messages += b.stale_messages;
        a.fenced += b.fenced;
        self.overlaps += o.overlaps;
        self.max_readers = self.max_readers.max(o.max_readers);
        self.judged_waits += o.judged_waits;
        self.max_bypass = self.max_bypass.max(o.max_bypass);
        self.max_wait = self.max_wait.max(o.max_wait);
    }
}

fn stress_thread(
    spec: &Spec,
    ep: &Endpoint,
    iterations: u64,
    read_percent: u32,
    threshold: u32,
    lease: Duration,
    seed: u64,
) -> Result<Totals> {
    let mut client = spec.client(ep, lease, threshold)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = Totals::default();
    for i in 0..iterations {
        let mode = if rng.gen_range(0..100) < read_percent { Mode::Shared } else { Mode::Exclusive };
        let started = Instant::now();
        let restarts = client.stats().restarts;
        let held = client.begin(ep, mode).with_context(|| format!("begin #{i}"))?;
        // Writers entered since we joined the lock (after our FAA).
        let joined =
            if !held && mode == Mode::Shared { Some(ep.read_u64(spec.word(WRITER_ENTRIES))?) } else { None };
        if !held {
            client.complete(ep).with_context(|| format!("acquisition #{i} ({mode:?})"))?;
        }
        t.max_wait = t.max_wait.max(started.elapsed());
        match mode {
            Mode::Exclusive => {
                let old = ep.faa(spec.word(INSIDE), ONE_WRITER)?;
                ensure!(
                    old == 0,
                    "writer entered with {} writers and {} readers inside",
                    old >> 32,
                    old as u32
                );
                ep.faa(spec.word(WRITER_ENTRIES), 1)?;
            }
            Mode::Shared => {
                let old = ep.faa(spec.word(INSIDE), 1)?;
                ensure!(old >> 32 == 0, "reader entered with {} writers inside", old >> 32);
                if old as u32 > 0 {
                    t.overlaps += 1;
                }
                t.max_readers = t.max_readers.max(u64::from(old as u32) + 1);
                if let (Some(w0), true) = (joined, client.stats().restarts == restarts) {
                    let bypass = ep.read_u64(spec.word(WRITER_ENTRIES))? - w0;
                    ensure!(
                        bypass <= u64::from(threshold) + 1,
                        "{bypass} writers entered while a reader waited (threshold {threshold})"
                    );
                    t.judged_waits += 1;
                    t.max_bypass = t.max_bypass.max(bypass);
                }
            }
        }
        ep.faa(spec.word(ENTRIES), 1)?;
        if rng.gen_bool(0.3) {
            std::thread::yield_now();
        }
        match mode {
            Mode::Exclusive => {
                let old = ep.faa(spec.word(INSIDE), ONE_WRITER.wrapping_neg())?;
                ensure!(old == ONE_WRITER, "writer left with {:#x} inside", old);
            }
            Mode::Shared => {
                let old = ep.faa(spec.word(INSIDE), u64::MAX)?;
                ensure!(old >> 32 == 0 && old as u32 >= 1, "reader left with {:#x} inside", old);
            }
        }
        client.release(ep).with_context(|| format!("release #{i} ({mode:?})"))?;
    }
    t.lock = client.stats();
    Ok(t)
}

fn stress(node: &Node, spec: &Spec, run: &Run) -> Result<()> {
    let Run { threads, iterations, read_percent, threshold, lease_ms, seed } = *run;
    let lease = Duration::from_millis(lease_ms);
    let results: Vec<Result<Totals>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let ep = node.endpoint()?;
                    stress_thread(spec, &ep, iterations, read_percent, threshold, lease, seed * 1000 + t)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("stress thread panicked")).collect()
    });
    let mut all = Totals::default();
    for r in results {
        all.merge(&r?);
    }
    let l = &all.lock;
    println!(
        "RESULT shared={} exclusive={} waited={} overlaps={} max_readers={} judged_waits={} max_bypass={} \
         handovers={} mode_changes={} max_cons_wrt={} restarts={} recovery_requests={} recoveries={} \
         stale_recoveries={} dropped={} stale_messages={} fenced={} reader_polls={} writer_polls={} max_wait_us={}",
        l.shared,
        l.exclusive,
        l.waited,
        all.overlaps,
        all.max_readers,
        all.judged_waits,
        all.max_bypass,
        l.handovers_sent,
        l.mode_changes_sent,
        l.max_cons_wrt,
        l.restarts,
        l.recovery_requests,
        l.recoveries,
        l.stale_recoveries,
        l.dropped,
        l.stale_messages,
        l.fenced,
        l.reader_polls,
        l.writer_polls,
        all.max_wait.as_micros()
    );
    Ok(())
}

fn announce_and_sleep(what: &str) -> ! {
    println!("{what}");
    std::io::stdout().flush().ok();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[derive(Parser)]
enum Args {
    /// Runs critical sections under the oracle; prints `RESULT key=value ...`.
    Stress {
        #[command(flatten)]
        lock: LockArgs,
        #[command(flatten)]
        run: Run,
    },
    /// Acquires, prints `HOLDING` and sleeps until killed.
    Hold {
        #[command(flatten)]
        lock: LockArgs,
        /// The mode to hold the lock in.
        mode: HoldMode,
        /// The lock's lease, in milliseconds.
        lease_ms: u64,
    },
    /// Enqueues as a writer behind the current holder, prints `QUEUED` and waits until killed.
    Queue {
        #[command(flatten)]
        lock: LockArgs,
        /// The lock's lease, in milliseconds.
        lease_ms: u64,
    },
}

/// The lock every command starts with.
#[derive(clap::Args)]
struct LockArgs {
    /// The fabric to join.
    fabric: String,
    /// `ENTRY:ERAS:ERA_COUNT:SERVICE_NODE:SERVICE_MAILBOX:ORACLE` (see the module's doc comment).
    lock: String,
}

/// What `stress` runs.
#[derive(clap::Args, Clone, Copy)]
struct Run {
    /// Threads, each with its own endpoint and client.
    threads: u64,
    /// Critical sections per thread.
    iterations: u64,
    /// Percent of the critical sections that are shared.
    read_percent: u32,
    /// The consecutive-writer threshold N.
    threshold: u32,
    /// The lock's lease, in milliseconds.
    lease_ms: u64,
    /// Seed of the threads' random choices (thread t uses SEED * 1000 + t).
    seed: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum HoldMode {
    Shared,
    Exclusive,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (Args::Stress { lock, .. } | Args::Hold { lock, .. } | Args::Queue { lock, .. }) = &args;
    let fabric: FabricAddr = lock.fabric.parse().map_err(anyhow::Error::msg)?;
    let spec = Spec::parse(&lock.lock)?;
    let node = Node::join(&fabric)?;
    match args {
        Args::Stress { run, .. } => stress(&node, &spec, &run),
        Args::Hold { mode, lease_ms, .. } => {
            let mode = match mode {
                HoldMode::Shared => Mode::Shared,
                HoldMode::Exclusive => Mode::Exclusive,
            };
            let ep = node.endpoint()?;
            let mut client = spec.client(&ep, Duration::from_millis(lease_ms), 16)?;
            client.acquire(&ep, mode)?;
            announce_and_sleep("HOLDING")
        }
        Args::Queue { lease_ms, .. } => {
            let ep = node.endpoint()?;
            let mut client = spec.client(&ep, Duration::from_millis(lease_ms), 16)?;
            ensure!(!client.begin(&ep, Mode::Exclusive)?, "the lock was free: nothing to queue behind");
            println!("QUEUED");
            std::io::stdout().flush().ok();
            client.complete(&ep)?;
            bail!("acquired the lock although its holder never released it")
        }
    }
}
