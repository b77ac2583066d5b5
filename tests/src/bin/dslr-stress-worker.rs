//! Worker process of the DSLR and CAS spin lock tests (tests/tests/lock_dslr.rs,
//! tests/tests/lock_cas.rs). Arguments are options after a command (see
//! `--help`):
//!
//! ```text
//! dslr-stress-worker stress --algo=dslr|cas --fabric=ADDR --threads=N --iterations=N
//!                           --read=PERCENT --seed=N --lock-at=OFFSET --oracle-at=OFFSET
//!                           [--count-max=N] [--lease-ms=N] [--fifo=0|1]
//! dslr-stress-worker hold   --algo=dslr --fabric=ADDR --mode=shared|exclusive --lock-at=OFFSET
//!                           [--count-max=N] [--lease-ms=N]
//! ```
//!
//! `stress`: each of `threads` threads (own endpoint, own lock handle) runs
//! `iterations` critical sections on the lock at `lock_at` of region 1,
//! `read` percent of them shared, under an oracle of three words at
//! `oracle_at` that every process updates with fetch-and-add:
//!
//! | word | meaning |
//! |---|---|
//! | `oracle_at + 0`  | writers inside |
//! | `oracle_at + 8`  | readers inside |
//! | `oracle_at + 16` | critical sections completed |
//!
//! A writer adds itself to the writers and then reads the readers; a reader
//! adds itself to the readers and then reads the writers. Verbs are
//! sequentially consistent, so of two holders that overlap the later one sees
//! the earlier: a writer must see nobody, a reader no writer. With `--fifo=1`
//! (DSLR, no resets expected) a writer also checks the bakery's order
//! (Appendix A.2): when the ticket at position p enters, exactly p critical
//! sections have completed — everything before it, nothing after it.
//! A violation panics, so the process exits with failure. At the end the
//! worker prints one line `result key=value ...` with its totals (the
//! oracle's observations and the lock's own statistics).
//!
//! `hold`: acquires, prints `held`, and never releases; the failure tests
//! SIGKILL it there, or while it still waits (queued).

use std::io::Write;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use citron_lock::cas_spin::{CasSpinConfig, CasSpinLock};
use citron_lock::dslr::{DslrConfig, DslrLimits, DslrLock, COUNT_MAX};
use citron_lock::rdma::{Endpoint, FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::args::{HoldMode, StressShape};
use citronfs_tests::TEST_REGION;
use clap::{Parser, ValueEnum};
use rand::{Rng, SeedableRng};

const WRITERS: u64 = 0;
const READERS: u64 = 8;
const DONE: u64 = 16;

#[derive(Parser)]
enum Command {
    /// Runs critical sections under the oracle; prints `result key=value ...`.
    Stress(StressArgs),
    /// Acquires, prints `held`, and never releases.
    Hold(HoldArgs),
}

/// The lock every command takes.
#[derive(clap::Args)]
struct LockArgs {
    /// The lock algorithm.
    #[arg(long, value_enum)]
    algo: Algo,
    /// The fabric to join.
    #[arg(long)]
    fabric: String,
    /// Byte offset of the lock in the test region.
    #[arg(long)]
    lock_at: u64,
    /// DSLR: the counters' maximum before an overflow reset.
    #[arg(long, default_value_t = COUNT_MAX)]
    count_max: u16,
    /// DSLR: the lease in milliseconds (default: the configuration's).
    #[arg(long)]
    lease_ms: Option<u64>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Algo {
    /// DSLR.
    Dslr,
    /// The CAS spin lock.
    Cas,
}

#[derive(clap::Args)]
struct StressArgs {
    #[command(flatten)]
    lock: LockArgs,
    #[command(flatten)]
    shape: StressShape,
    /// Percent of the critical sections that are shared.
    #[arg(long)]
    read: u64,
    /// 1: writers also check the bakery's order (DSLR, no resets expected).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    fifo: u8,
}

#[derive(clap::Args)]
struct HoldArgs {
    #[command(flatten)]
    lock: LockArgs,
    /// The mode to hold the lock in.
    #[arg(long, value_enum)]
    mode: HoldMode,
}

/// The lock under test, by name.
enum Lock {
    Dslr(DslrLock),
    Cas(CasSpinLock),
}

impl Lock {
    fn open(args: &LockArgs, ep: &Endpoint, addr: RemoteAddr) -> Result<Lock> {
        let rtt = ep.measure_rtt(addr, 5)?;
        match args.algo {
            Algo::Dslr => {
                let mut config = DslrConfig::from_rtt(rtt);
                if let Some(lease_ms) = args.lease_ms {
                    config = config.with_lease(Duration::from_millis(lease_ms));
                }
                let limits = DslrLimits::new(args.count_max, 1)?;
                Ok(Lock::Dslr(DslrLock::with_limits(addr, config, limits)))
            }
            Algo::Cas => Ok(Lock::Cas(CasSpinLock::new(addr, CasSpinConfig::from_rtt(rtt)))),
        }
    }

    fn client(&mut self) -> &mut dyn RwLockClient {
        match self {
            Lock::Dslr(l) => l,
            Lock::Cas(l) => l,
        }
    }

    /// The bakery position of the ticket held now (DSLR only).
    fn position(&self) -> Option<u32> {
        match self {
            Lock::Dslr(l) => l.ticket().map(|t| t.position()),
            Lock::Cas(_) => None,
        }
    }

    fn report(&self, out: &mut Totals) {
        match self {
            Lock::Dslr(l) => {
                let s = l.stats();
                out.add("acquisitions", s.acquisitions);
                out.add("conflicts", s.conflicts);
                out.add("polls", s.polls);
                out.add("canary_backoffs", s.canary_backoffs);
                out.add("passed", s.passed);
                out.add("lease_resets", s.lease_resets);
                out.add("overflow_resets", s.overflow_resets);
                out.add("stuck_resets", s.stuck_resets);
                out.add("late_releases", s.late_releases);
                out.add("fenced", s.fenced);
            }
            Lock::Cas(l) => {
                let s = l.stats();
                out.add("acquisitions", s.acquisitions);
                out.add("failed_cas", s.failed_cas);
                out.add("backoffs", s.backoffs);
            }
        }
    }
}

#[derive(Default)]
struct Totals(Vec<(&'static str, u64)>);

impl Totals {
    fn add(&mut self, key: &'static str, v: u64) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, total)) => *total += v,
            None => self.0.push((key, v)),
        }
    }

    fn max(&mut self, key: &'static str, v: u64) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, m)) => *m = (*m).max(v),
            None => self.0.push((key, v)),
        }
    }
}

fn main() -> Result<()> {
    match Command::parse() {
        Command::Stress(args) => stress(&args),
        Command::Hold(args) => hold(&args),
    }
}

fn stress(args: &StressArgs) -> Result<()> {
    let fabric: FabricAddr = args.lock.fabric.parse().map_err(anyhow::Error::msg)?;
    let threads = args.shape.threads;
    let node = Node::join(&fabric)?;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let node = node.clone();
                s.spawn(move || stress_thread(args, &node, t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow!("a stress thread panicked"))?)
            .collect::<Vec<_>>()
    });
    let mut totals = Totals::default();
    for r in results {
        for (k, v) in r?.0 {
            if k == "max_readers" {
                totals.max(k, v);
            } else {
                totals.add(k, v);
            }
        }
    }
    let line: Vec<String> = totals.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("result {}", line.join(" "));
    Ok(())
}

fn stress_thread(args: &StressArgs, node: &Node, thread: u64) -> Result<Totals> {
    let ep = node.endpoint()?;
    let lock_at = RemoteAddr::new(TEST_REGION, args.lock.lock_at);
    let oracle_at = args.shape.oracle_at;
    let word = |i: u64| RemoteAddr::new(TEST_REGION, oracle_at + i);
    let iterations = args.shape.iterations;
    let read_percent = args.read;
    let fifo = args.fifo == 1;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.shape.seed * 1000 + thread);
    let mut lock = Lock::open(&args.lock, &ep, lock_at)?;
    let mut out = Totals::default();
    for i in 0..iterations {
        let mode = if rng.gen_range(0..100) < read_percent { Mode::Shared } else { Mode::Exclusive };
        lock.client().acquire(&ep, mode).with_context(|| format!("acquire #{i} ({mode:?})"))?;
        match mode {
            Mode::Exclusive => {
                let w = ep.faa(word(WRITERS), 1)?;
                let r = ep.read_u64(word(READERS))?;
                assert_eq!((w, r), (0, 0), "a writer entered with {w} writers and {r} readers inside");
                if fifo {
                    let done = ep.read_u64(word(DONE))?;
                    let position = lock.position().context("--fifo=1 needs --algo=dslr")?;
                    assert_eq!(
                        done,
                        u64::from(position),
                        "the writer at bakery position {position} entered after {done} critical sections"
                    );
                    out.add("fifo_checked", 1);
                }
                linger(&mut rng);
                ep.faa(word(WRITERS), u64::MAX)?;
                out.add("exclusive", 1);
            }
            Mode::Shared => {
                let r = ep.faa(word(READERS), 1)?;
                let w = ep.read_u64(word(WRITERS))?;
                assert_eq!(w, 0, "a reader entered with {w} writers inside");
                out.add("overlaps", u64::from(r > 0));
                out.max("max_readers", r + 1);
                linger(&mut rng);
                ep.faa(word(READERS), u64::MAX)?;
                out.add("shared", 1);
            }
        }
        ep.faa(word(DONE), 1)?;
        lock.client().release(&ep).with_context(|| format!("release #{i}"))?;
        out.add("done", 1);
    }
    lock.report(&mut out);
    Ok(out)
}

/// Stays in the critical section a little, sometimes giving the core away.
fn linger(rng: &mut impl Rng) {
    if rng.gen_bool(0.25) {
        std::thread::yield_now();
    }
}

fn hold(args: &HoldArgs) -> Result<()> {
    let fabric: FabricAddr = args.lock.fabric.parse().map_err(anyhow::Error::msg)?;
    let mode = Mode::from(args.mode);
    let node = Node::join(&fabric)?;
    let ep = node.endpoint()?;
    let mut lock = Lock::open(&args.lock, &ep, RemoteAddr::new(TEST_REGION, args.lock.lock_at))?;
    lock.client().acquire(&ep, mode)?;
    println!("held");
    std::io::stdout().flush()?;
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
