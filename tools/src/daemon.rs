//! Running detached: `citronfs mount` without `--foreground` forks once the
//! command line is parsed, and the parent waits for the child's word over a
//! pipe. The child mounts and reports [`Readiness::ready`] (the parent then
//! prints the message and exits 0: the file system is mounted) or
//! [`Readiness::failed`] (the parent prints the reason and exits 1); a child
//! that dies before either leaves the parent an empty pipe, also a failure.
//! So whoever ran the command (a shell, mount(8), systemd) learns from the
//! exit status whether the mount is there.
//!
//! The child starts a session of its own (no controlling terminal, not in
//! the caller's process group), puts `/dev/null` on its standard streams
//! at once (so a caller that reads the parent's output to its end is not
//! kept waiting by the daemon) and logs to its `--log-file`, else syslog,
//! else a default file ([`crate::logging::detached`]).
//! Once ready it moves to `/`, so it never keeps the caller's directory
//! busy.
//!
//! The fork happens before any thread exists (right after parsing), which
//! is what makes forking a Rust process sound.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use nix::unistd::ForkResult;

use crate::logging;

/// Exit status byte: the mount is ready.
const READY: u8 = b'0';
/// Exit status byte: the mount failed; the reason follows.
const FAILED: u8 = b'1';

/// Where a detached daemon logs: the `--log-file` opened before forking
/// (so a bad path fails on the caller's terminal), or the name of its
/// default log file ([`logging::file_name`]).
pub struct LogPlan {
    pub file: Option<(PathBuf, File)>,
    pub default_name: String,
}

/// The detached child's end of the readiness pipe.
pub struct Readiness {
    pipe: File,
}

impl Readiness {
    /// Tells the waiting parent that the service is up; it prints `message`
    /// and exits 0. The daemon then leaves the caller's directory.
    pub fn ready(mut self, message: &str) {
        let _ = self.pipe.write_all(&[READY]);
        let _ = self.pipe.write_all(message.as_bytes());
        if let Err(e) = nix::unistd::chdir("/") {
            log::warn!("cannot change to /: {e}");
        }
    }

    /// Tells the waiting parent that the service could not start; it prints
    /// `reason` and exits 1.
    pub fn failed(mut self, reason: &str) {
        let _ = self.pipe.write_all(&[FAILED]);
        let _ = self.pipe.write_all(reason.as_bytes());
    }
}

/// Forks. The parent waits for the child's word and exits with it (this
/// function never returns there); the child returns its [`Readiness`].
/// Must be called before any thread is started.
pub fn detach(log: LogPlan) -> Result<Readiness> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("cannot create a pipe")?;
    // SAFETY: no other thread exists yet (the caller's contract), so the
    // child's copy of the process is consistent.
    match unsafe { nix::unistd::fork() }.context("cannot fork")? {
        ForkResult::Parent { .. } => {
            drop(write);
            parent_waits(read)
        }
        ForkResult::Child => {
            drop(read);
            let readiness = Readiness { pipe: File::from(write) };
            if let Err(e) = become_daemon(log) {
                readiness.failed(&format!("{e:#}"));
                std::process::exit(1);
            }
            Ok(readiness)
        }
    }
}

fn parent_waits(read: OwnedFd) -> ! {
    let mut word = Vec::new();
    let _ = File::from(read).read_to_end(&mut word);
    let text = String::from_utf8_lossy(word.get(1..).unwrap_or_default());
    match word.first() {
        Some(&READY) => {
            print!("{text}");
            let _ = std::io::stdout().flush();
            std::process::exit(0)
        }
        Some(_) => {
            eprintln!("citronfs: {}", text.trim_end());
            std::process::exit(1)
        }
        None => {
            eprintln!("citronfs: the mount daemon exited before the file system was ready");
            std::process::exit(1)
        }
    }
}

static DETACHED: AtomicBool = AtomicBool::new(false);

/// Whether this process is a detached daemon (its stderr goes nowhere).
pub fn is_detached() -> bool {
    DETACHED.load(Ordering::Relaxed)
}

fn become_daemon(log: LogPlan) -> Result<()> {
    DETACHED.store(true, Ordering::Relaxed);
    nix::unistd::setsid().context("setsid")?;
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").context("/dev/null")?;
    for fd in 0..=2 {
        // SAFETY: dup2 onto the standard descriptors, which we own.
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            return Err(std::io::Error::last_os_error()).context("cannot redirect the standard streams");
        }
    }
    logging::detached(log.file, &log.default_name)?;
    Ok(())
}
