//! `bench fcntl --far-ms … --refusals N`: what a mount far from
//! the servers gets, and what refusals cost.
//!
//! **Distance.** For each `--far-ms` distance, a cluster with a near mount
//! and a far one, both reaching the servers through their NICs (tcp, as
//! mounts on other hosts than the servers do), the far one's every round
//! trip that much longer (the test-only `ClientConfig::added_rtt`). (A near
//! mount on the servers' own host would use shm, and its lock messages
//! cannot reach a tcp mount's mailbox: wake-ups across the two fabrics wait
//! for the waiters' periodic retry. That is not what this measures.)
//! * the lock counter: 2 processes per mount take an `F_SETLKW` write lock,
//!   add one to a counter in the locked bytes (read, write back) and unlock,
//!   for `--far-secs`; pairs per second of the near and the far processes,
//!   and the counter checked against the pairs (a lost update is a lock
//!   that excluded nothing);
//! * torn reads: a writer per mount rewrites 64 KiB (mounts overlapping by
//!   32 KiB) with one byte value each time, a reader per mount reads the
//!   shared 32 KiB and counts reads that mix two writes;
//! * SQLite: 2 processes per mount, one row per transaction (`sqlite.rs`).
//!
//! **Refusals.** A process on a near mount holds a write lock; a process on
//! a tcp mount asks for it with `F_SETLK` `--refusals` times: refusals per
//! second, and the connections the cluster's NICs accepted meanwhile (each
//! one a socket, left in TIME_WAIT once closed).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::range_lock::RangeAlgorithm;

use super::sqlite::{self, SqliteRun};
use super::{
    run_pairs, Cluster, FcntlArgs, Inside, Scenario, Throughput, Worker, LOCK_FILE, MOUNTS, PROCESSES,
};
use crate::bench::verbs::BackendChoice;
use crate::report::Table;

const KIB: usize = 1024;

/// One distance's figures.
pub(super) struct DistanceRow {
    far_ms: f64,
    counter: Throughput,
    /// The counter's value at the end, and the pairs that raised it.
    counted: u64,
    torn: u64,
    reads: u64,
    sqlite: SqliteRun,
}

/// The refusal figures.
pub(super) struct RefusalRow {
    refusals: u64,
    elapsed: Duration,
    connections: u64,
}

/// Readers and writers on two mounts over 96 KiB whose middle 32 KiB both
/// writers cover: (reads checked, torn reads).
fn torn_reads(dirs: &[PathBuf], secs: f64) -> Result<(u64, u64)> {
    let file = |i: usize| dirs[i % dirs.len()].join("torn");
    std::fs::write(file(0), vec![0u8; 96 * KIB]).context("creating the torn-read file")?;
    let stop = AtomicBool::new(false);
    let (reads, torn) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| -> Result<()> {
        let mut threads = Vec::new();
        let (stop, reads, torn) = (&stop, &reads, &torn);
        for i in 0..2 {
            let path = file(i);
            threads.push(s.spawn(move || -> Result<()> {
                let f = std::fs::OpenOptions::new().write(true).open(&path)?;
                let mut v = 1 + i as u8;
                while !stop.load(Ordering::Relaxed) {
                    f.write_all_at(&vec![v; 64 * KIB], (i * 32 * KIB) as u64)?;
                    v = v.wrapping_add(2).max(1);
                }
                Ok(())
            }));
            let path = file(i);
            threads.push(s.spawn(move || -> Result<()> {
                let f = std::fs::File::open(&path)?;
                let mut buf = vec![0u8; 32 * KIB];
                while !stop.load(Ordering::Relaxed) {
                    f.read_exact_at(&mut buf, 32 * KIB as u64)?;
                    if buf.iter().any(|&x| x != buf[0]) {
                        torn.fetch_add(1, Ordering::Relaxed);
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }));
        }
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().map_err(|_| anyhow::anyhow!("a torn-read thread panicked"))??;
        }
        Ok(())
    })?;
    Ok((reads.into_inner(), torn.into_inner()))
}

/// The counter in the locked bytes (0 if never written).
fn read_counter(path: &Path, at: u64) -> Result<u64> {
    let f = std::fs::File::open(path)?;
    let mut b = [0u8; 8];
    let n = f.read_at(&mut b, at)?;
    Ok(if n == 8 { u64::from_le_bytes(b) } else { 0 })
}

pub(super) fn measure(exe: &Path, args: &FcntlArgs, far_ms: f64) -> Result<DistanceRow> {
    let far = Duration::try_from_secs_f64(far_ms / 1000.0).context("--far-ms must be non-negative")?;
    let label = format!("+{far_ms} ms");
    let cluster = Cluster::start(
        RangeAlgorithm::Citron,
        BackendChoice::Tcp,
        args.threads,
        MOUNTS,
        args.capacity.0,
        Some(far),
    )
    .with_context(|| format!("starting the {label} cluster"))?;
    let lock_file = cluster.dirs[0].join(LOCK_FILE);
    std::fs::write(&lock_file, b"").with_context(|| format!("{label}: creating {LOCK_FILE}"))?;
    let lock = (args.lock_offset.0, args.lock_len.0.max(8));
    let counter =
        run_pairs(exe, &cluster.dirs, Scenario::Shared, lock, args.far_secs, Inside::COUNT, &label)?;
    let counted = read_counter(&lock_file, lock.0)?;
    println!(
        "  {label} counter: {:.0} increments/s (near {:.0}, far {:.0}), counter {counted} after {} increments",
        counter.per_s,
        near_far(&counter).0,
        near_far(&counter).1,
        counter.pairs
    );
    let (reads, torn) = torn_reads(&cluster.dirs, args.far_secs)?;
    println!("  {label} torn reads: {torn} of {reads}");
    let sqlite = sqlite::run(&cluster.dirs, "far.db", PROCESSES, args.far_sqlite_tx, args.sqlite_journal)
        .with_context(|| format!("{label}: SQLite"))?;
    println!("  {label} sqlite: {:.1} tx/s", sqlite.tx_per_s());
    Ok(DistanceRow { far_ms, counter, counted, torn, reads, sqlite })
}

/// Pairs per second of the near processes and of the far ones (process i
/// works on mount i % 2; mount 1 is the far one).
fn near_far(t: &Throughput) -> (f64, f64) {
    let sum = |parity| t.rates.iter().enumerate().filter(|(i, _)| i % 2 == parity).map(|(_, r)| r).sum();
    (sum(0), sum(1))
}

pub(super) fn refusals(exe: &Path, args: &FcntlArgs) -> Result<RefusalRow> {
    let cluster = Cluster::start(
        RangeAlgorithm::Citron,
        BackendChoice::Tcp,
        args.threads,
        MOUNTS,
        args.capacity.0,
        None,
    )
    .context("starting the refusal cluster")?;
    std::fs::write(cluster.dirs[0].join(LOCK_FILE), b"").context("creating the lock file")?;
    let range = (args.lock_offset.0, args.lock_len.0);
    let mut holder =
        Worker::spawn(exe, &cluster.dirs[0].join(LOCK_FILE), range, false, None, false, "holder".into())?;
    holder.ask_timed("lock")?;
    let mut refused =
        Worker::spawn(exe, &cluster.dirs[1].join(LOCK_FILE), range, false, None, false, "refused".into())?;
    // Warm up: the first refusal opens the endpoints the mount keeps.
    refused.send("refuse 1")?;
    refused.answer(Duration::from_secs(30))?;
    let before = cluster.nic_connections();
    refused.send(&format!("refuse {}", args.refusals))?;
    let a = refused.answer(Duration::from_secs(3600))?;
    let connections = cluster.nic_connections() - before;
    let parsed = a.strip_prefix("done ").and_then(|rest| {
        let mut it = rest.split(' ').map(|x| x.parse::<u64>().ok());
        Some((it.next()??, it.next()??))
    });
    let Some((n, ns)) = parsed else { bail!("refused: bad answer {a:?}") };
    if n != args.refusals {
        bail!("{n} of {} F_SETLK were refused", args.refusals);
    }
    let elapsed = Duration::from_nanos(ns);
    println!(
        "  refusals: {n} in {elapsed:?} ({:.0}/s), {connections} connections opened at the NICs",
        n as f64 / elapsed.as_secs_f64()
    );
    Ok(RefusalRow { refusals: n, elapsed, connections })
}

/// Prints the tables and writes their CSV (and a plot of the counter).
pub(super) fn report(rows: &[DistanceRow], refusal: Option<&RefusalRow>, out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    if !rows.is_empty() {
        println!(
            "\na near mount and a far one (both tcp, the far one +far_ms per round trip): F_SETLKW counter of {PROCESSES} \
             processes (2 per mount), torn reads, SQLite ({PROCESSES} processes, 2 per mount):"
        );
        let base = rows.iter().find(|r| r.far_ms == 0.0).map(|r| r.counter.per_s);
        let mut table = Table::new(&[
            "far_ms",
            "counter_per_s",
            "near_per_s",
            "far_per_s",
            "of_plus_0",
            "lost_updates",
            "overlaps",
            "reads",
            "torn_reads",
            "sqlite_tx",
            "sqlite_tx_per_s",
            "sqlite_rows_ok",
        ]);
        for r in rows {
            let (near, far) = near_far(&r.counter);
            table.push(vec![
                format!("{}", r.far_ms),
                format!("{:.0}", r.counter.per_s),
                format!("{near:.0}"),
                format!("{far:.0}"),
                base.map_or("-".into(), |b| format!("{:.2}", r.counter.per_s / b)),
                (r.counter.pairs as i64 - r.counted as i64).to_string(),
                r.counter.overlaps.unwrap_or(0).to_string(),
                r.reads.to_string(),
                r.torn.to_string(),
                r.sqlite.transactions.to_string(),
                format!("{:.1}", r.sqlite.tx_per_s()),
                r.sqlite.is_intact().to_string(),
            ]);
        }
        table.print();
        let path = out.join("fcntl-far.csv");
        table.write_csv(&path)?;
        written.push(path);
        let bars: Vec<(String, f64)> =
            rows.iter().map(|r| (format!("+{} ms", r.far_ms), r.counter.per_s)).collect();
        let png = out.join("fcntl-far.png");
        match crate::plot::bars(&png, "F_SETLKW counter, near + far mount", "increments/s", &bars) {
            Ok(()) => written.push(png),
            Err(e) => log::warn!("no plot: {e}"),
        }
    }
    if let Some(r) = refusal {
        println!("\nrefused F_SETLK through a tcp mount (a process on another mount holds the lock):");
        let mut table = Table::new(&["refusals", "secs", "refusals_per_s", "nic_connections_opened"]);
        table.push(vec![
            r.refusals.to_string(),
            format!("{:.2}", r.elapsed.as_secs_f64()),
            format!("{:.0}", r.refusals as f64 / r.elapsed.as_secs_f64()),
            r.connections.to_string(),
        ]);
        table.print();
        let path = out.join("fcntl-refusals.csv");
        table.write_csv(&path)?;
        written.push(path);
    }
    Ok(written)
}

/// Fails the run if a distance lost data or tore a read.
pub(super) fn check(rows: &[DistanceRow]) -> Result<()> {
    for r in rows {
        if r.counted != r.counter.pairs || r.counter.overlaps.unwrap_or(0) > 0 {
            bail!(
                "+{} ms: the counter is {} after {} locked increments ({} overlaps)",
                r.far_ms,
                r.counted,
                r.counter.pairs,
                r.counter.overlaps.unwrap_or(0)
            );
        }
        if r.torn > 0 {
            bail!("+{} ms: {} torn reads of {}", r.far_ms, r.torn, r.reads);
        }
        if !r.sqlite.is_intact() {
            bail!("+{} ms: SQLite lost data: {} rows of {}", r.far_ms, r.sqlite.rows, r.sqlite.expected_rows);
        }
    }
    Ok(())
}
