//! Worker process of the DSLR and CAS spin lock tests (tests/tests/lock_dslr.rs,
//! tests/tests/lock_cas.rs). Arguments are `key=value` after a command:
//!
//! ```text
//! dslr-stress-worker stress algo=dslr|cas fabric=ADDR threads=N iterations=N read=PERCENT
//!                           seed=N lock_at=OFFSET oracle_at=OFFSET
//!                           [count_max=N] [lease_ms=N] [fifo=0|1]
//! dslr-stress-worker hold   algo=dslr fabric=ADDR mode=shared|exclusive lock_at=OFFSET
//!                           [count_max=N] [lease_ms=N]
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
//! the earlier: a writer must see nobody, a reader no writer. With `fifo=1`
//! (DSLR, no resets expected) a writer also checks the bakery's order
//! (Appendix A.2): when the ticket at position p enters, exactly p critical
//! sections have completed — everything before it, nothing after it.
//! A violation panics, so the process exits with failure. At the end the
//! worker prints one line `result key=value ...` with its totals (the
//! oracle's observations and the lock's own statistics).
//!
//! `hold`: acquires, prints `held`, and never releases; the failure tests
//! SIGKILL it there, or while it still waits (queued).

use std::collections::HashMap;
use std::io::Write;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use citron_lock::cas_spin::{CasSpinConfig, CasSpinLock};
use citron_lock::dslr::{DslrConfig, DslrLimits, DslrLock, COUNT_MAX};
use citron_lock::rdma::{Endpoint, FabricAddr, Node, RemoteAddr};
use citron_lock::rwlock::{Mode, RwLockClient};
use citronfs_tests::TEST_REGION;
use rand::{Rng, SeedableRng};

const WRITERS: u64 = 0;
const READERS: u64 = 8;
const DONE: u64 = 16;

struct Args(HashMap<String, String>);

impl Args {
    fn parse(items: &[String]) -> Result<Self> {
        let mut map = HashMap::new();
        for item in items {
            let (k, v) = item.split_once('=').ok_or_else(|| anyhow!("argument {item:?} is not key=value"))?;
            map.insert(k.to_string(), v.to_string());
        }
        Ok(Self(map))
    }

    fn str(&self, key: &str) -> Result<&str> {
        self.0.get(key).map(String::as_str).ok_or_else(|| anyhow!("missing {key}="))
    }

    fn num(&self, key: &str) -> Result<u64> {
        self.str(key)?.parse().with_context(|| format!("{key}="))
    }

    fn num_or(&self, key: &str, default: u64) -> Result<u64> {
        if self.0.contains_key(key) {
            self.num(key)
        } else {
            Ok(default)
        }
    }
}

/// The lock under test, by name.
enum Lock {
    Dslr(DslrLock),
    Cas(CasSpinLock),
}

impl Lock {
    fn open(args: &Args, ep: &Endpoint, addr: RemoteAddr) -> Result<Lock> {
        let rtt = ep.measure_rtt(addr, 5)?;
        match args.str("algo")? {
            "dslr" => {
                let mut config = DslrConfig::from_rtt(rtt);
                if args.0.contains_key("lease_ms") {
                    config = config.with_lease(Duration::from_millis(args.num("lease_ms")?));
                }
                let count_max = u16::try_from(args.num_or("count_max", u64::from(COUNT_MAX))?)?;
                let limits = DslrLimits::new(count_max, 1)?;
                Ok(Lock::Dslr(DslrLock::with_limits(addr, config, limits)))
            }
            "cas" => Ok(Lock::Cas(CasSpinLock::new(addr, CasSpinConfig::from_rtt(rtt)))),
            other => bail!("unknown algo {other:?} (dslr or cas)"),
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
    let argv: Vec<String> = std::env::args().collect();
    let command = argv.get(1).cloned().unwrap_or_default();
    let args = Args::parse(argv.get(2..).unwrap_or_default())?;
    match command.as_str() {
        "stress" => stress(&args),
        "hold" => hold(&args),
        _ => bail!("usage: dslr-stress-worker stress|hold key=value... (see the source's doc comment)"),
    }
}

fn stress(args: &Args) -> Result<()> {
    let fabric: FabricAddr = args.str("fabric")?.parse().map_err(anyhow::Error::msg)?;
    let threads = args.num("threads")?;
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

fn stress_thread(args: &Args, node: &Node, thread: u64) -> Result<Totals> {
    let ep = node.endpoint()?;
    let lock_at = RemoteAddr::new(TEST_REGION, args.num("lock_at")?);
    let oracle_at = args.num("oracle_at")?;
    let word = |i: u64| RemoteAddr::new(TEST_REGION, oracle_at + i);
    let iterations = args.num("iterations")?;
    let read_percent = args.num("read")?;
    let fifo = args.num_or("fifo", 0)? == 1;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.num("seed")? * 1000 + thread);
    let mut lock = Lock::open(args, &ep, lock_at)?;
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
                    let position = lock.position().context("fifo=1 needs algo=dslr")?;
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

fn hold(args: &Args) -> Result<()> {
    let fabric: FabricAddr = args.str("fabric")?.parse().map_err(anyhow::Error::msg)?;
    let mode = match args.str("mode")? {
        "shared" => Mode::Shared,
        "exclusive" => Mode::Exclusive,
        other => bail!("mode={other:?}: shared or exclusive"),
    };
    let node = Node::join(&fabric)?;
    let ep = node.endpoint()?;
    let mut lock = Lock::open(args, &ep, RemoteAddr::new(TEST_REGION, args.num("lock_at")?))?;
    lock.client().acquire(&ep, mode)?;
    println!("held");
    std::io::stdout().flush()?;
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
