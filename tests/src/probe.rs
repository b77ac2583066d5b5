//! Driving `lock-probe` processes (one lock owner each) from a test.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::Duration;

/// How long a test waits for an answer it expects.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// One `lock-probe` process.
pub struct Probe {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
    pub pid: u32,
}

impl Probe {
    pub fn spawn(exe: &str) -> Self {
        let mut child = Command::new(exe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {exe}: {e}"));
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, answers) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        Self { child, stdin, answers, pid }
    }

    /// Sends a command without waiting for its answer.
    pub fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").and_then(|_| self.stdin.flush()).expect("probe stdin");
    }

    /// The next answer, if one comes within `wait`.
    pub fn answer_within(&self, wait: Duration) -> Option<String> {
        match self.answers.recv_timeout(wait) {
            Ok(a) => Some(a),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => panic!("probe {} exited", self.pid),
        }
    }

    /// The next answer; fails the test if none comes in time.
    pub fn answer(&self) -> String {
        self.answer_within(ANSWER_WITHIN).unwrap_or_else(|| panic!("probe {} did not answer", self.pid))
    }

    /// Sends a command and returns its answer.
    pub fn ask(&mut self, command: &str) -> String {
        self.send(command);
        self.answer()
    }

    /// Opens `path` read-write (creating it) and returns the descriptor.
    pub fn open(&mut self, path: &std::path::Path) -> i32 {
        let a = self.ask(&format!("open {}", path.display()));
        a.strip_prefix("fd ").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("open: {a}"))
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: sends a signal to our own child process.
        let r = unsafe { libc::kill(self.pid as i32, sig) };
        assert_eq!(r, 0, "kill {} {sig}", self.pid);
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
