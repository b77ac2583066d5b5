//! SQLite as a workload on mounts: `sqlite3` processes (Debian's sqlite3
//! package; `.ci/run` installs it) inserting rows one transaction each, and
//! the check that every committed row is there and the database is intact.
//! SQLite's locks are POSIX byte-range locks near 1 GiB of the database
//! file, so writers on several mounts exercise fcntl locks across mounts.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::TestMount;

/// Writers inserting rows into `test.db` of two mounts.
pub struct SqliteWriters {
    children: Vec<Child>,
    per_writer: usize,
    started: Instant,
}

/// Runs one `sqlite3` process on `db` with `script` on stdin.
pub fn sqlite(db: &Path, script: &str) -> Child {
    let mut child = Command::new("sqlite3")
        .arg(db)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sqlite3 (Debian's sqlite3 package; .ci/run installs it)");
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    child
}

impl SqliteWriters {
    /// Creates the table, then starts four writers, two on each mount,
    /// each inserting `per_writer` rows one per transaction.
    pub fn start(a: &TestMount, b: &TestMount, per_writer: usize) -> Self {
        let create = sqlite(&a.path("test.db"), "CREATE TABLE t(writer INTEGER, n INTEGER, pad TEXT);\n");
        let out = create.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let children = (0..4)
            .map(|w| {
                let mount = if w % 2 == 0 { a } else { b };
                let mut script = String::from(".timeout 120000\n");
                for n in 0..per_writer {
                    script += &format!(
                        "BEGIN IMMEDIATE; INSERT INTO t VALUES({w}, {n}, hex(randomblob(100))); COMMIT;\n"
                    );
                }
                sqlite(&mount.path("test.db"), &script)
            })
            .collect();
        Self { children, per_writer, started: Instant::now() }
    }

    /// Rows committed so far, read through `m`.
    pub fn rows(&self, m: &TestMount) -> usize {
        let out = sqlite(&m.path("test.db"), ".timeout 120000\nSELECT count(*) FROM t;\n")
            .wait_with_output()
            .unwrap();
        assert!(out.status.success(), "a reader failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0)
    }

    /// Waits for every writer: none may fail or say anything on stderr;
    /// then every row is there (read through `check_on`) and the database
    /// passes its integrity check. Returns how long the writers took.
    pub fn finish(self, check_on: &TestMount) -> Duration {
        for w in self.children {
            let out = w.wait_with_output().unwrap();
            assert!(
                out.status.success() && out.stderr.is_empty(),
                "a writer failed: {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let elapsed = self.started.elapsed();
        let check = sqlite(
            &check_on.path("test.db"),
            "SELECT count(*), count(DISTINCT writer * 1000000 + n) FROM t;\nPRAGMA integrity_check;\n",
        );
        let out = check.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let want = 4 * self.per_writer;
        assert_eq!(
            text.trim(),
            format!("{want}|{want}\nok"),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        elapsed
    }
}
