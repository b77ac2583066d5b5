//! The benchmarks' one harness for worker processes: a child started from
//! this binary (a hidden `bench …-worker` subcommand) that says `ready`,
//! then answers one line per command line. Answers arrive through a reader
//! thread, so every wait for one is bounded; an answer `err …` is an error.
//! Dropping a worker closes its stdin (EOF ends it) and kills one that has
//! not ended within [`EXIT_GRACE`] (stuck in a lock call, say).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// How long a dropped worker has to end after its stdin closes.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// A running worker process.
pub struct WorkerProcess {
    label: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl WorkerProcess {
    /// Starts `command` with piped stdin and stdout and waits (at most
    /// `ready_within`) for its `ready`.
    pub fn spawn(label: String, command: &mut Command, ready_within: Duration) -> Result<Self> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("{label}: cannot start {:?}", command.get_program()))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut worker = Self { label, child, stdin, lines };
        let greeting = worker.answer(ready_within)?;
        if greeting != "ready" {
            bail!("{}: unexpected greeting {greeting:?}", worker.label);
        }
        Ok(worker)
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Sends one command line.
    pub fn send(&mut self, command: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| anyhow!("{}: stdin closed", self.label))?;
        writeln!(stdin, "{command}")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("{}: send", self.label))
    }

    /// The next answer within `within`; an `err` answer is an error.
    pub fn answer(&mut self, within: Duration) -> Result<String> {
        let line = self
            .lines
            .recv_timeout(within)
            .map_err(|_| anyhow!("{} gave no answer within {within:?}", self.label))?;
        match line.strip_prefix("err ") {
            Some(e) => bail!("{}: {e}", self.label),
            None => Ok(line),
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.stdin.take();
        let deadline = Instant::now() + EXIT_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                _ => break,
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
