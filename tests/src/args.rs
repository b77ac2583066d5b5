//! The `result` lines of the worker binaries.

use anyhow::{Context, Result};

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
