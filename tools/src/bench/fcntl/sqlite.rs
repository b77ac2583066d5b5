//! SQLite on the file system (the fcntl benchmark's application figure): several
//! processes on several mounts insert rows into one database, one row per
//! transaction, through Debian's `sqlite3` command-line shell.
//!
//! Each process runs its own `sqlite3` on its mount's path of the database
//! with a script of `BEGIN IMMEDIATE; INSERT …; COMMIT;` lines (`-bail`: the
//! first error stops it and fails the run). SQLite's defaults otherwise:
//! rollback journal (`journal_mode=DELETE`, a journal file created and
//! deleted per transaction, unless the bench asks for another
//! [`JournalMode`]), `synchronous=FULL`, and the shell's busy
//! handler (`.timeout`), which sleeps 1, 2, 5, 10 … ms between tries while
//! another process holds the database. SQLite serialises writers with
//! `fcntl` locks on single bytes at 1 GiB (`PENDING_BYTE` and the bytes
//! after it), so every transaction takes and drops several byte-range
//! locks, cluster-wide here.
//!
//! Afterwards a fresh `sqlite3` on another mount checks that every row of
//! every process is there (once: the primary key) and that
//! `PRAGMA integrity_check` says `ok`.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// SQLite's rollback-journal modes (`PRAGMA journal_mode`). WAL is left
/// out: its shared-memory index needs `mmap` of a file shared between
/// processes, which FUSE direct I/O does not give across mounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum JournalMode {
    /// SQLite's default: the journal is created and deleted per transaction.
    Delete,
    /// The journal is truncated to zero bytes instead of deleted.
    Truncate,
    /// The journal stays; its header is zeroed.
    Persist,
}

impl JournalMode {
    pub fn pragma(self) -> &'static str {
        match self {
            JournalMode::Delete => "delete",
            JournalMode::Truncate => "truncate",
            JournalMode::Persist => "persist",
        }
    }
}

/// What one SQLite run gave.
#[derive(Clone, Debug)]
pub struct SqliteRun {
    pub processes: usize,
    pub mounts: usize,
    /// Transactions committed, all processes.
    pub transactions: u64,
    pub elapsed: Duration,
    /// Rows found afterwards, and how many there must be.
    pub rows: u64,
    pub expected_rows: u64,
    /// Processes whose rows are not all there.
    pub incomplete: Vec<usize>,
    /// What `PRAGMA integrity_check` answered.
    pub integrity: String,
}

impl SqliteRun {
    pub fn tx_per_s(&self) -> f64 {
        self.transactions as f64 / self.elapsed.as_secs_f64()
    }

    /// Every row there and the database intact.
    pub fn is_intact(&self) -> bool {
        self.rows == self.expected_rows && self.incomplete.is_empty() && self.integrity == "ok"
    }
}

/// The `sqlite3` shell, or a clear error saying how to get it.
pub fn check_installed() -> Result<()> {
    let ok = Command::new("sqlite3").arg("-version").output().map(|o| o.status.success()).unwrap_or(false);
    if !ok {
        bail!("the SQLite figure needs Debian's sqlite3 shell (apt-get install sqlite3); --sqlite-tx 0 skips it");
    }
    Ok(())
}

/// Runs `sqlite3 -batch -bail db sql` and returns its output.
fn query(db: &Path, sql: &str) -> Result<String> {
    let out = Command::new("sqlite3")
        .args(["-batch", "-bail"])
        .arg(db)
        .arg(sql)
        .output()
        .context("cannot run sqlite3")?;
    if !out.status.success() {
        bail!("sqlite3 {} {sql:?} failed: {}", db.display(), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Waits for `child` until `deadline`, killing it past that.
fn wait_until(child: &mut Child, deadline: Instant, what: &str) -> Result<std::process::ExitStatus> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not finish in time (killed)");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `processes` sqlite3 shells, process `w` on mount `dirs[w % dirs.len()]`,
/// each committing `tx_per_process` one-row transactions into `name` (a
/// fresh database), then the check.
pub fn run(
    dirs: &[PathBuf],
    name: &str,
    processes: usize,
    tx_per_process: u32,
    journal: JournalMode,
) -> Result<SqliteRun> {
    let db = |w: usize| dirs[w % dirs.len()].join(name);
    // A database left by an earlier run (a peer's mount outlives the bench)
    // would fail the CREATE: start from nothing.
    for suffix in ["", "-journal", "-wal", "-shm"] {
        let stale = dirs[0].join(format!("{name}{suffix}"));
        match std::fs::remove_file(&stale) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", stale.display()))
            }
            _ => {}
        }
    }
    query(
        &db(0),
        "CREATE TABLE rows(worker INTEGER NOT NULL, seq INTEGER NOT NULL, pad TEXT NOT NULL, \
         PRIMARY KEY(worker, seq));",
    )
    .context("creating the database")?;
    // The scripts live outside the file system under test.
    let scripts = tempfile::tempdir()?;
    let pad = "x".repeat(100);
    let mut paths = Vec::new();
    for w in 0..processes {
        let path = scripts.path().join(format!("worker-{w}.sql"));
        let mut f = std::io::BufWriter::new(File::create(&path)?);
        writeln!(f, ".timeout 60000")?;
        // Prints the mode it set (to /dev/null).
        writeln!(f, "PRAGMA journal_mode={};", journal.pragma())?;
        for i in 0..tx_per_process {
            writeln!(f, "BEGIN IMMEDIATE; INSERT INTO rows VALUES({w}, {i}, '{pad}'); COMMIT;")?;
        }
        f.flush()?;
        paths.push(path);
    }
    let deadline = Instant::now() + Duration::from_secs(60) + Duration::from_millis(500) * tx_per_process;
    let start = Instant::now();
    let mut children = Vec::new();
    for (w, script) in paths.iter().enumerate() {
        let child = Command::new("sqlite3")
            .args(["-batch", "-bail"])
            .arg(db(w))
            .stdin(Stdio::from(File::open(script)?))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start sqlite3")?;
        children.push(child);
    }
    let mut failures = Vec::new();
    for (w, c) in children.iter_mut().enumerate() {
        let status = wait_until(c, deadline, &format!("sqlite3 process {w}"))?;
        let mut err = String::new();
        if let Some(mut e) = c.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        if !status.success() || !err.trim().is_empty() {
            failures.push(format!("process {w} ({status}): {}", err.trim()));
        }
    }
    let elapsed = start.elapsed();
    if !failures.is_empty() {
        bail!("sqlite3 failed: {}", failures.join("; "));
    }
    // Checked through the last mount: what the others wrote must be there.
    let check = dirs[dirs.len() - 1].join(name);
    let per_worker = query(&check, "SELECT worker, count(*), min(seq), max(seq) FROM rows GROUP BY worker;")?;
    let mut rows = 0u64;
    let mut incomplete = Vec::new();
    for w in 0..processes {
        // The primary key makes (worker, seq) unique, so N rows from 0 to
        // N - 1 are exactly every row.
        let want = format!("{w}|{tx_per_process}|0|{}", tx_per_process.saturating_sub(1));
        if tx_per_process > 0 && !per_worker.lines().any(|l| l == want) {
            incomplete.push(w);
        }
    }
    for l in per_worker.lines() {
        let n: u64 = l.split('|').nth(1).and_then(|n| n.parse().ok()).context("bad count from sqlite3")?;
        rows += n;
    }
    let integrity = query(&check, "PRAGMA integrity_check;")?;
    Ok(SqliteRun {
        processes,
        mounts: dirs.len().min(processes),
        transactions: u64::from(tx_per_process) * processes as u64,
        elapsed,
        rows,
        expected_rows: u64::from(tx_per_process) * processes as u64,
        incomplete,
        integrity,
    })
}
