//! What the worker binaries share: the arguments every lock stress worker
//! takes, and the `result` lines they print.

use anyhow::{Context, Result};
use citron_lock::rwlock::Mode;

/// The shape of a lock stress run, the same for every lock stress worker.
#[derive(clap::Args, Debug)]
pub struct StressShape {
    /// Threads, each with its own endpoint and lock handle.
    #[arg(long)]
    pub threads: u64,
    /// Critical sections per thread.
    #[arg(long)]
    pub iterations: u64,
    /// Seed of the threads' random choices (thread t uses SEED * 1000 + t).
    #[arg(long)]
    pub seed: u64,
    /// Byte offset of the (first) oracle in the test region.
    #[arg(long)]
    pub oracle_at: u64,
}

/// The mode a holding worker holds its lock in.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum HoldMode {
    Shared,
    Exclusive,
}

impl From<HoldMode> for Mode {
    fn from(m: HoldMode) -> Self {
        match m {
            HoldMode::Shared => Mode::Shared,
            HoldMode::Exclusive => Mode::Exclusive,
        }
    }
}

/// Named totals that a worker prints as `result k=v ...` and a test adds up.
#[derive(Default, Debug, Clone)]
pub struct Totals(pub Vec<(String, u64)>);

impl Totals {
    pub fn add(&mut self, key: &str, v: u64) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some((_, total)) => *total += v,
            None => self.0.push((key.to_string(), v)),
        }
    }

    /// Keeps the maximum for keys that start with `max_`, adds up the rest.
    pub fn merge(&mut self, other: &Totals) {
        for (k, v) in &other.0 {
            if k.starts_with("max_") {
                match self.0.iter_mut().find(|(key, _)| key == k) {
                    Some((_, m)) => *m = (*m).max(*v),
                    None => self.0.push((k.clone(), *v)),
                }
            } else {
                self.add(k, *v);
            }
        }
    }

    pub fn get(&self, key: &str) -> u64 {
        self.0.iter().find(|(k, _)| k == key).map_or(0, |(_, v)| *v)
    }

    pub fn line(&self) -> String {
        let kv: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("result {}", kv.join(" "))
    }

    /// Parses the `result` line of a worker's stdout.
    pub fn from_stdout(stdout: &str) -> Result<Totals> {
        let line = stdout.lines().find_map(|l| l.strip_prefix("result ")).context("no result line")?;
        let mut t = Totals::default();
        for kv in line.split_whitespace() {
            let (k, v) = kv.split_once('=').with_context(|| format!("{kv:?} is not key=value"))?;
            t.add(k, v.parse().with_context(|| format!("{kv:?}"))?);
        }
        Ok(t)
    }
}
