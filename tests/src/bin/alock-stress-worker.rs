//! Worker process of the ALock tests (tests/tests/lock_alock.rs): remote
//! clients of an ALock whose host's threads take it locally in the test
//! process. Arguments are `key=value` after the command:
//!
//! ```text
//! alock-stress-worker stress fabric=ADDR threads=N iterations=N lock_at=OFFSET
//!                            oracle_at=OFFSET seed=N [local_budget=N] [remote_budget=N]
//! ```
//!
//! Each of `threads` threads (own endpoint, own [`AlockClient`]) runs
//! `iterations` critical sections on the ALock at `lock_at` of region 1,
//! checked by the oracle at `oracle_at` ([`citronfs_tests::alock_oracle`]):
//! nobody else may be inside, and every entry books whether the local
//! cohort was waiting. A violation panics, so the process fails. At the end
//! it prints `result key=value ...` with the handles' statistics added up.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use citron_lock::alock::{AlockClient, AlockConfig};
use citron_lock::rdma::{FabricAddr, Node, RemoteAddr};
use citronfs_tests::alock_oracle::{self, Access, Oracle};
use citronfs_tests::TEST_REGION;
use rand::{Rng, SeedableRng};

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

fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let args = Args::parse(argv.get(2..).unwrap_or_default())?;
    match argv.get(1).map(String::as_str) {
        Some("stress") => stress(&args),
        _ => bail!("usage: alock-stress-worker stress key=value... (see the source's doc comment)"),
    }
}

fn stress(args: &Args) -> Result<()> {
    let fabric: FabricAddr = args.str("fabric")?.parse().map_err(anyhow::Error::msg)?;
    let node = Node::join(&fabric)?;
    let threads = args.num("threads")?;
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
    let mut totals: Vec<(&'static str, u64)> = Vec::new();
    for r in results {
        for (k, v) in r? {
            match totals.iter_mut().find(|(key, _)| *key == k) {
                Some((_, t)) => *t += v,
                None => totals.push((k, v)),
            }
        }
    }
    let line: Vec<String> = totals.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("result {}", line.join(" "));
    Ok(())
}

fn stress_thread(args: &Args, node: &Node, thread: u64) -> Result<Vec<(&'static str, u64)>> {
    let ep = node.endpoint()?;
    let lock_at = args.num("lock_at")?;
    let lock = RemoteAddr::new(TEST_REGION, lock_at);
    let rtt = ep.measure_rtt(lock, 5)?;
    let config = AlockConfig::from_rtt(rtt).with_budgets(
        u32::try_from(args.num_or("local_budget", 5)?)?,
        u32::try_from(args.num_or("remote_budget", 20)?)?,
    );
    let mut alock = AlockClient::new(lock, config);
    let oracle = Oracle { access: Access::Remote(&ep), base: args.num("oracle_at")? };
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.num("seed")? * 1000 + thread);
    for i in 0..args.num("iterations")? {
        alock.lock(&ep).with_context(|| format!("acquire #{i}"))?;
        let others = oracle.enter();
        assert_eq!(others, 0, "a remote client entered with {others} other holders inside");
        let waiting = oracle.access.other_tail(lock_at) != 0;
        oracle.book(waiting);
        if rng.gen_bool(0.25) {
            std::thread::yield_now();
        }
        oracle.leave();
        alock.unlock(&ep).with_context(|| format!("release #{i}"))?;
        alock_oracle::think(i + thread);
    }
    let s = alock.stats();
    Ok(vec![
        ("acquisitions", s.acquisitions),
        ("uncontended", s.uncontended),
        ("passed", s.passed),
        ("peterson", s.peterson),
        ("reacquires", s.reacquires),
        ("polls", s.polls),
        ("handovers", s.handovers),
        ("timeouts", s.timeouts),
    ])
}
