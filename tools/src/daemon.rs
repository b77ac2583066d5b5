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
//! kept waiting by the daemon) and logs to syslog (`/dev/log`, where
//! journald also listens; `CITRONFS_SYSLOG_SOCKET` names another socket).
//! Once ready it moves to `/`, so it never keeps the caller's directory
//! busy.
//!
//! The fork happens before any thread exists (right after parsing), which
//! is what makes forking a Rust process sound.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use anyhow::{Context, Result};
use log::{LevelFilter, Log, Metadata, Record};
use nix::unistd::ForkResult;

/// Exit status byte: the mount is ready.
const READY: u8 = b'0';
/// Exit status byte: the mount failed; the reason follows.
const FAILED: u8 = b'1';

/// Environment variable naming the syslog socket of a detached daemon.
pub const SYSLOG_SOCKET_ENV: &str = "CITRONFS_SYSLOG_SOCKET";

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
pub fn detach() -> Result<Readiness> {
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
            become_daemon()?;
            Ok(Readiness { pipe: File::from(write) })
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

fn become_daemon() -> Result<()> {
    DETACHED.store(true, Ordering::Relaxed);
    nix::unistd::setsid().context("setsid")?;
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null").context("/dev/null")?;
    for fd in 0..=2 {
        // SAFETY: dup2 onto the standard descriptors, which we own.
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            return Err(std::io::Error::last_os_error()).context("cannot redirect the standard streams");
        }
    }
    log_to_syslog();
    Ok(())
}

type Syslog = syslog::BasicLogger;

/// The process's logger: env_logger on stderr, until the process detaches;
/// then syslog.
struct ProcessLogger {
    stderr: env_logger::Logger,
    /// After detaching: the syslog writer and its filter (`RUST_LOG`, else
    /// info).
    syslog: OnceLock<(Syslog, env_logger::Logger)>,
}

static LOGGER: OnceLock<ProcessLogger> = OnceLock::new();

impl Log for ProcessLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        match self.syslog.get() {
            Some((_, filter)) => filter.enabled(metadata),
            None => self.stderr.enabled(metadata),
        }
    }

    fn log(&self, record: &Record) {
        match self.syslog.get() {
            Some((syslog, filter)) => {
                if filter.matches(record) {
                    syslog.log(record);
                }
            }
            None => self.stderr.log(record),
        }
    }

    fn flush(&self) {
        match self.syslog.get() {
            Some((syslog, _)) => syslog.flush(),
            None => self.stderr.flush(),
        }
    }
}

/// Installs the process logger (stderr, filtered by `RUST_LOG`).
pub fn init_logging() {
    let stderr =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn,fuser=error"))
            .build();
    let logger = LOGGER.get_or_init(|| ProcessLogger { stderr, syslog: OnceLock::new() });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(logger.stderr.filter());
    }
}

/// From now on, log to syslog (info and above unless `RUST_LOG` says
/// otherwise). Without a syslog socket, log records are dropped.
fn log_to_syslog() {
    let Some(logger) = LOGGER.get() else { return };
    let formatter = syslog::Formatter3164 {
        facility: syslog::Facility::LOG_DAEMON,
        hostname: None,
        process: "citronfs".into(),
        pid: std::process::id(),
    };
    let writer = match std::env::var_os(SYSLOG_SOCKET_ENV) {
        Some(path) => syslog::unix_custom(formatter, path),
        None => syslog::unix(formatter),
    };
    let Ok(writer) = writer else {
        log::set_max_level(LevelFilter::Off);
        return;
    };
    let filter =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info,fuser=warn"))
            .build();
    let level = filter.filter();
    if logger.syslog.set((syslog::BasicLogger::new(writer), filter)).is_ok() {
        log::set_max_level(level);
    }
}
