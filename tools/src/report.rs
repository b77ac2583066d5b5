//! Benchmark output: an aligned table on stdout and the same rows as CSV.

use std::path::Path;

use anyhow::{Context, Result};

/// Rows of named columns, printed aligned and written as CSV.
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Self { headers: headers.iter().map(|h| h.to_string()).collect(), rows: Vec::new() }
    }

    pub fn push(&mut self, row: Vec<String>) {
        assert_eq!(row.len(), self.headers.len(), "row width");
        self.rows.push(row);
    }

    pub fn print(&self) {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| self.rows.iter().map(|r| r[i].len()).chain([self.headers[i].len()]).max().unwrap_or(0))
            .collect();
        let line = |cells: Vec<&str>| {
            let parts: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
            println!("{}", parts.join("  "));
        };
        line(self.headers.iter().map(String::as_str).collect());
        for r in &self.rows {
            line(r.iter().map(String::as_str).collect());
        }
    }

    pub fn write_csv(&self, path: &Path) -> Result<()> {
        let mut w =
            csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
        w.write_record(&self.headers)?;
        for r in &self.rows {
            w.write_record(r)?;
        }
        w.flush()?;
        Ok(())
    }
}

/// Nanoseconds as a short human figure.
pub fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2}ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2}us", ns / 1e3)
    } else {
        format!("{ns:.1}ns")
    }
}
