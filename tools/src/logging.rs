//! Where a `citronfs` process logs, so that its log always lands somewhere
//! an operator looks.
//!
//! - `--log-file PATH` (mounts and servers): appended to `PATH`, whose
//!   directories are made if missing.
//! - Otherwise a process in the foreground logs to stderr (a server under
//!   systemd: the journal).
//! - Otherwise a detached mount logs to syslog (`/dev/log`, where journald
//!   also listens; [`SYSLOG_SOCKET_ENV`] names another socket), and on a host
//!   without one to a file of its own: `/var/log/citronfs/NAME.log`, NAME
//!   being the mount point with its slashes as dashes, as in systemd's
//!   unit names (`/mnt/citron` is `mnt-citron`), or, where `/var/log` is not writable,
//!   `$XDG_STATE_HOME/citronfs/` (`~/.local/state/citronfs/`), then
//!   `/tmp/citronfs-UID/`. [`LOG_DIR_ENV`] names the directory instead.
//!   The mount prints where its log goes in its ready message.
//!
//! A file log is env_logger itself writing into the file
//! (`Builder::target(Target::Pipe(file))`, with its timestamps and
//! `RUST_LOG` filter): no logging crate of our own. The file is opened for
//! appending, so `logrotate`'s `copytruncate` works on it. A detached
//! daemon logging to a file also puts the file on its stderr, so a panic's
//! message lands there too.

use std::fmt;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result};
use clap::Args;
use log::{Log, Metadata, Record};

/// Environment variable naming the syslog socket of a detached daemon.
pub const SYSLOG_SOCKET_ENV: &str = "CITRONFS_SYSLOG_SOCKET";

/// Environment variable naming the directory of a detached daemon's default
/// log file (instead of `/var/log/citronfs` and its fallbacks).
pub const LOG_DIR_ENV: &str = "CITRONFS_LOG_DIR";

/// The filter of a log that is not a terminal: `RUST_LOG`, else info.
const SERVICE_FILTER: &str = "info,fuser=warn";
/// The filter on stderr: `RUST_LOG`, else warnings.
const TERMINAL_FILTER: &str = "warn,fuser=error";

/// `--log-file`, shared by `citronfs mount` and the servers.
#[derive(Args, Debug, Clone, Default)]
pub struct LogArgs {
    /// Append the log to this file (made, with its directories, if
    /// missing). Without it: stderr in the foreground; a detached mount
    /// logs to syslog, or on a host without /dev/log to
    /// /var/log/citronfs/MOUNTPOINT.log (the path is printed at mount).
    #[arg(long, value_name = "PATH")]
    pub log_file: Option<PathBuf>,
}

/// Where the log goes (after [`to_file`] or [`detached`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// The syslog socket at this path.
    Syslog(PathBuf),
    /// This file.
    File(PathBuf),
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Destination::Syslog(socket) => write!(f, "syslog ({})", socket.display()),
            Destination::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The process's logger: env_logger on stderr until [`to_file`] or
/// [`detached`] redirect it, once.
struct ProcessLogger {
    stderr: env_logger::Logger,
    redirected: OnceLock<Sink>,
}

enum Sink {
    /// The syslog writer and its filter.
    Syslog(syslog::BasicLogger, env_logger::Logger),
    /// env_logger writing into a file.
    File(env_logger::Logger),
}

static LOGGER: OnceLock<ProcessLogger> = OnceLock::new();
static DESTINATION: OnceLock<Destination> = OnceLock::new();

impl Log for ProcessLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        match self.redirected.get() {
            Some(Sink::Syslog(_, filter)) | Some(Sink::File(filter)) => filter.enabled(metadata),
            None => self.stderr.enabled(metadata),
        }
    }

    fn log(&self, record: &Record) {
        match self.redirected.get() {
            Some(Sink::Syslog(writer, filter)) => {
                if filter.matches(record) {
                    writer.log(record);
                }
            }
            Some(Sink::File(file)) => file.log(record),
            None => self.stderr.log(record),
        }
    }

    fn flush(&self) {
        match self.redirected.get() {
            Some(Sink::Syslog(writer, _)) => writer.flush(),
            Some(Sink::File(file)) => file.flush(),
            None => self.stderr.flush(),
        }
    }
}

fn builder(default_filter: &str) -> env_logger::Builder {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default_filter))
}

/// Installs the process logger (stderr, filtered by `RUST_LOG`).
pub fn init() {
    let stderr = builder(TERMINAL_FILTER).build();
    let logger = LOGGER.get_or_init(|| ProcessLogger { stderr, redirected: OnceLock::new() });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(logger.stderr.filter());
    }
}

/// Where the log goes, once redirected (`None`: stderr).
pub fn destination() -> Option<&'static Destination> {
    DESTINATION.get()
}

fn redirect(sink: Sink, destination: Destination) {
    let Some(logger) = LOGGER.get() else { return };
    let level = match &sink {
        Sink::Syslog(_, filter) | Sink::File(filter) => filter.filter(),
    };
    if logger.redirected.set(sink).is_ok() {
        let _ = DESTINATION.set(destination);
        log::set_max_level(level);
    }
}

/// Opens `path` for appending, making its directories.
pub fn open(path: &Path) -> Result<File> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot make the log directory {}", dir.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open the log file {}", path.display()))
}

/// From now on, log into `file` (opened at `path`), info and above unless
/// `RUST_LOG` says otherwise.
pub fn to_file(path: &Path, file: File) {
    let logger = builder(SERVICE_FILTER).target(env_logger::Target::Pipe(Box::new(file))).build();
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    redirect(Sink::File(logger), Destination::File(path));
}

/// The syslog socket to use: [`SYSLOG_SOCKET_ENV`], else the first of the
/// usual ones that exists.
fn syslog_socket() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(SYSLOG_SOCKET_ENV) {
        return Some(PathBuf::from(path));
    }
    ["/dev/log", "/var/run/syslog", "/var/run/log"].into_iter().map(PathBuf::from).find(|p| p.exists())
}

/// From now on, log to syslog if a syslog socket answers; whether one did.
fn to_syslog() -> bool {
    let Some(socket) = syslog_socket() else { return false };
    let formatter = syslog::Formatter3164 {
        facility: syslog::Facility::LOG_DAEMON,
        hostname: None,
        process: "citronfs".into(),
        pid: std::process::id(),
    };
    let Ok(writer) = syslog::unix_custom(formatter, &socket) else { return false };
    redirect(
        Sink::Syslog(syslog::BasicLogger::new(writer), builder(SERVICE_FILTER).build()),
        Destination::Syslog(socket),
    );
    true
}

/// The directories a default log file may go to, in order of preference,
/// from this process's environment.
fn default_dirs() -> Vec<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    dirs_from(var(LOG_DIR_ENV), var("XDG_STATE_HOME"), var("HOME"), &std::env::temp_dir(), uid)
}

/// [`default_dirs`] given [`LOG_DIR_ENV`], `XDG_STATE_HOME`, `HOME`, the
/// temporary directory and the user id.
fn dirs_from(
    log_dir: Option<PathBuf>,
    state_home: Option<PathBuf>,
    home: Option<PathBuf>,
    temp: &Path,
    uid: u32,
) -> Vec<PathBuf> {
    if let Some(dir) = log_dir {
        return vec![dir];
    }
    let mut dirs = vec![PathBuf::from("/var/log/citronfs")];
    match (state_home, home) {
        (Some(state), _) => dirs.push(state.join("citronfs")),
        (None, Some(home)) => dirs.push(home.join(".local/state/citronfs")),
        (None, None) => {}
    }
    dirs.push(temp.join(format!("citronfs-{uid}")));
    dirs
}

/// The file `name` opened in the first of `dirs` where that works; the
/// last failure if none does.
fn open_first(dirs: &[PathBuf], name: &str) -> Result<(PathBuf, File)> {
    let mut last = None;
    for dir in dirs {
        let path = dir.join(name);
        match open(&path) {
            Ok(f) => return Ok((path, f)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no directory for a log file")))
}

/// A file name for the log of `what` (a mount point, or a role): the path
/// with its slashes as dashes (`/mnt/citron` as `mnt-citron`) and any
/// character but letters, digits, `-`, `_` and `.` as `_`.
pub fn file_name(what: &Path) -> String {
    let text = what.to_string_lossy();
    let trimmed = text.trim_matches('/');
    if trimmed.is_empty() {
        return "root.log".into();
    }
    let escaped: String = trimmed
        .chars()
        .map(|c| match c {
            '/' => '-',
            c if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') => c,
            _ => '_',
        })
        .collect();
    format!("{escaped}.log")
}

/// The log of a process that has just detached (its stderr is
/// `/dev/null`): into `file` if `--log-file` gave one, else syslog, else
/// the default file named `name` ([`file_name`]). A file log is also put
/// on the process's stderr.
pub fn detached(file: Option<(PathBuf, File)>, name: &str) -> Result<Destination> {
    let (path, file) = match file {
        Some(f) => f,
        None if to_syslog() => return Ok(destination().cloned().expect("set by to_syslog")),
        None => open_first(&default_dirs(), name).context("no syslog and no log file")?,
    };
    // SAFETY: dup2 onto stderr, which this process owns.
    unsafe { libc::dup2(file.as_raw_fd(), 2) };
    let _ = std::io::stderr().flush();
    to_file(&path, file);
    Ok(destination().cloned().expect("set by to_file"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_log_dirs_fall_back_from_var_log_to_the_user_own() {
        let p = |s: &str| PathBuf::from(s);
        let tmp = Path::new("/tmp");
        assert_eq!(dirs_from(Some(p("/x")), Some(p("/s")), Some(p("/h")), tmp, 7), vec![p("/x")]);
        assert_eq!(
            dirs_from(None, Some(p("/s")), Some(p("/h")), tmp, 7),
            vec![p("/var/log/citronfs"), p("/s/citronfs"), p("/tmp/citronfs-7")]
        );
        assert_eq!(
            dirs_from(None, None, Some(p("/h")), tmp, 7),
            vec![p("/var/log/citronfs"), p("/h/.local/state/citronfs"), p("/tmp/citronfs-7")]
        );
        assert_eq!(dirs_from(None, None, None, tmp, 0), vec![p("/var/log/citronfs"), p("/tmp/citronfs-0")]);
    }

    #[test]
    fn a_default_log_goes_to_the_first_directory_that_can_hold_it() {
        let dir = tempfile::tempdir().unwrap();
        let blocked = dir.path().join("not-a-dir");
        std::fs::write(&blocked, b"a file where a directory should be").unwrap();
        let good = dir.path().join("logs");
        let (path, _file) = open_first(&[blocked.join("citronfs"), good.clone()], "mnt-x.log").unwrap();
        assert_eq!(path, good.join("mnt-x.log"));
        assert!(path.is_file());
        assert!(open_first(&[blocked.join("citronfs")], "mnt-x.log").is_err());
    }

    #[test]
    fn file_names_escape_the_mount_point() {
        assert_eq!(file_name(Path::new("/mnt/citron")), "mnt-citron.log");
        assert_eq!(file_name(Path::new("/mnt/my data/")), "mnt-my_data.log");
        assert_eq!(file_name(Path::new("/")), "root.log");
        assert_eq!(file_name(Path::new("meta-server")), "meta-server.log");
    }
}
