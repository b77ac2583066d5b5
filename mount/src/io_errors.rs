//! The log of the errors an application receives as EIO: each with its
//! cause, at warn level, once per cause and rate-limited.
//!
//! EIO tells an application nothing about why (a data server gone, a
//! meta-server that does not answer, this mount fenced), so the mount says
//! it in its log, from the one place errors become errno ([`crate::errno`]).
//! A cause is logged the first time it reaches an application; repeats of it
//! within [`WINDOW`] are counted, not logged, and the next line of that
//! cause after the window says how many there were. At most
//! [`MAX_LINES`] causes are logged per window (a lost data server makes
//! one cause per file); the rest are counted and the count is logged with
//! the first line of the next window.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use citronfs_core::FsError;
use parking_lot::Mutex;

/// How long a logged cause stays quiet.
pub const WINDOW: Duration = Duration::from_secs(60);
/// The most causes logged per window.
pub const MAX_LINES: u32 = 20;
/// The most causes remembered at once.
const MAX_CAUSES: usize = 1024;

/// Causes seen and what has been logged of them.
#[derive(Debug)]
pub struct IoErrorLog {
    causes: HashMap<String, Cause>,
    window_start: Option<Instant>,
    lines_in_window: u32,
    /// EIOs of causes not logged because the window's lines were used up.
    unlogged: u64,
}

#[derive(Debug)]
struct Cause {
    logged_at: Instant,
    /// Repeats since it was last logged.
    repeats: u64,
}

impl Default for IoErrorLog {
    fn default() -> Self {
        Self::new()
    }
}

impl IoErrorLog {
    pub fn new() -> Self {
        Self { causes: HashMap::new(), window_start: None, lines_in_window: 0, unlogged: 0 }
    }

    /// An EIO of `cause` at `now`: the line to log, if one is due.
    pub fn record(&mut self, cause: &str, now: Instant) -> Option<String> {
        if !matches!(self.window_start, Some(s) if now.duration_since(s) < WINDOW) {
            self.window_start = Some(now);
            self.lines_in_window = 0;
        }
        if let Some(c) = self.causes.get_mut(cause) {
            if now.duration_since(c.logged_at) < WINDOW {
                c.repeats += 1;
                return None;
            }
        }
        if self.lines_in_window >= MAX_LINES {
            self.unlogged += 1;
            return None;
        }
        if self.causes.len() >= MAX_CAUSES && !self.causes.contains_key(cause) {
            self.causes.retain(|_, c| now.duration_since(c.logged_at) < WINDOW);
            if self.causes.len() >= MAX_CAUSES {
                self.unlogged += 1;
                return None;
            }
        }
        self.lines_in_window += 1;
        let repeats = self
            .causes
            .insert(cause.to_string(), Cause { logged_at: now, repeats: 0 })
            .map_or(0, |c| c.repeats);
        let mut line = format!("an application got EIO: {cause}");
        if repeats > 0 {
            line += &format!(" ({repeats} more of this cause since it was last logged)");
        }
        if self.unlogged > 0 {
            line +=
                &format!(" ({} EIOs of other causes were not logged)", std::mem::take(&mut self.unlogged));
        }
        Some(line)
    }
}

static LOG: LazyLock<Mutex<IoErrorLog>> = LazyLock::new(|| Mutex::new(IoErrorLog::new()));

/// Logs `e`, which an application is about to receive as EIO, if its cause
/// is due ([`IoErrorLog::record`]).
pub fn report(e: &FsError) {
    let line = LOG.lock().record(&e.to_string(), Instant::now());
    if let Some(line) = line {
        log::warn!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_logged_once_per_window_with_its_repeats() {
        let mut log = IoErrorLog::new();
        let t = Instant::now();
        let first = log.record("data server 1 is gone", t).expect("the first is logged");
        assert!(first.contains("data server 1 is gone"), "{first}");
        assert!(log.record("data server 1 is gone", t + Duration::from_secs(1)).is_none());
        assert!(log.record("data server 1 is gone", t + Duration::from_secs(2)).is_none());
        let other = log.record("the meta-server does not answer", t + Duration::from_secs(3));
        assert!(other.is_some_and(|l| l.contains("meta-server")), "another cause is logged");
        let again = log
            .record("data server 1 is gone", t + WINDOW + Duration::from_secs(1))
            .expect("after the window");
        assert!(again.contains("2 more"), "{again}");
    }

    #[test]
    fn at_most_max_lines_causes_per_window() {
        let mut log = IoErrorLog::new();
        let t = Instant::now();
        let logged =
            (0..MAX_LINES + 10).filter(|i| log.record(&format!("inode {i} lost"), t).is_some()).count();
        assert_eq!(logged, MAX_LINES as usize);
        let next = log.record("inode 999 lost", t + WINDOW).expect("a new window");
        assert!(next.contains("10 EIOs of other causes were not logged"), "{next}");
    }
}
