//! One lock-taking process of `bench fcntl`: the `citronfs` binary
//! re-executed as the hidden `citronfs bench fcntl-worker`, because POSIX
//! locks belong to processes (two threads of one process share their locks
//! and never conflict).
//!
//! It opens the file once (so no close, which would release its locks,
//! happens while it measures), says `ready`, then answers one line per
//! command on stdin until stdin closes:
//!
//! | command | what it does | answer |
//! |---|---|---|
//! | `run SECS [HOLD_US]` | loops write lock + unlock of its range for SECS seconds, holding each lock HOLD_US µs (default 0) | `done PAIRS NANOS OVERLAPS` |
//! | `lock` | one write lock of its range | `ok NANOS` |
//! | `unlock` | one unlock of its range | `ok NANOS` |
//! | `refuse N` | N `F_SETLK` write locks of its range that another holds: each must be refused | `done N NANOS` |
//!
//! Any failure answers `err WHAT` (the bench reports it and stops). The
//! lock is `F_SETLK` unless `--wait` asks for `F_SETLKW` (queue behind a
//! holder); the unlock is always `F_SETLK` with `F_UNLCK`.
//!
//! The exclusion oracle (`--oracle FILE`, a file of 8 zero bytes in
//! `/dev/shm` shared by the processes that lock one range): each process
//! adds one to its counter right after its write lock is granted and takes
//! one away right before it unlocks, so a process that finds the counter
//! above zero is inside a write lock that another process holds too.
//! `OVERLAPS` counts those (always 0 without an oracle).
//!
//! The counter (`--counter`): inside each lock of `run` the worker adds one
//! to the 8-byte number at the range's first byte of the file (read, write
//! back), so the file's number after the run is the number of locks only if
//! none excluded nothing.

use std::fs::OpenOptions;
use std::io::{self, BufRead, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct FcntlWorkerArgs {
    /// The file to lock (on a mount).
    #[arg(long)]
    pub path: PathBuf,
    /// First byte of the range.
    #[arg(long)]
    pub start: u64,
    /// Bytes in the range (at least 1).
    #[arg(long)]
    pub len: u64,
    /// Take the lock with F_SETLKW instead of F_SETLK.
    #[arg(long)]
    pub wait: bool,
    /// The exclusion oracle's counter: a file of 8 bytes in /dev/shm that
    /// every process locking the same range maps.
    #[arg(long)]
    pub oracle: Option<PathBuf>,
    /// Add one to the counter in the locked bytes inside each lock of `run`.
    #[arg(long)]
    pub counter: bool,
}

/// The oracle's counter, mapped shared from its file.
struct Oracle {
    map: memmap2::MmapMut,
}

impl Oracle {
    fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open the oracle {}", path.display()))?;
        // SAFETY: the file is the bench's own 8-byte counter in /dev/shm;
        // the processes that share it touch it only through the atomic
        // below, and nobody truncates it while they run.
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }.context("cannot map the oracle")?;
        if map.len() < 8 {
            anyhow::bail!("the oracle {} is smaller than 8 bytes", path.display());
        }
        Ok(Self { map })
    }

    fn counter(&self) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned, at least 8 bytes long and
        // lives as long as `self`; every access to it, in every process,
        // is atomic.
        unsafe { AtomicU64::from_ptr(self.map.as_ptr() as *mut u64) }
    }

    /// Entering the critical section: whether somebody else is in it.
    fn enter(&self) -> bool {
        // SeqCst on both sides: the count is the only shared state, and a
        // total order over the increments and decrements is what makes an
        // overlap visible to at least one of the two processes.
        self.counter().fetch_add(1, Ordering::SeqCst) != 0
    }

    fn leave(&self) {
        self.counter().fetch_sub(1, Ordering::SeqCst);
    }
}

/// One process's lock on one range of one open file.
struct RangeLocker {
    fd: RawFd,
    start: i64,
    len: i64,
    lock_cmd: libc::c_int,
    oracle: Option<Oracle>,
    /// The file, for the counter (`--counter`).
    counter: Option<std::fs::File>,
}

impl RangeLocker {
    fn fcntl(&self, cmd: libc::c_int, typ: libc::c_int) -> io::Result<()> {
        // SAFETY: `flock` is plain old data; all zeros is a valid value
        // (the fields we do not set stay zero, as fcntl(2) expects).
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = self.start;
        fl.l_len = self.len;
        // SAFETY: `fd` is open for the life of the worker (the `File` lives
        // in `worker`), and `fl` is a valid `struct flock` that outlives
        // the call.
        let r = unsafe { libc::fcntl(self.fd, cmd, &fl as *const libc::flock) };
        if r == -1 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    fn lock(&self) -> io::Result<()> {
        self.fcntl(self.lock_cmd, libc::F_WRLCK)
    }

    fn unlock(&self) -> io::Result<()> {
        self.fcntl(libc::F_SETLK, libc::F_UNLCK)
    }

    /// Lock + unlock pairs until `secs` have passed, each lock held for
    /// `hold` (a busy wait, inside the oracle's count): (pairs, elapsed,
    /// overlaps the oracle saw).
    fn run(&self, secs: Duration, hold: Duration) -> io::Result<(u64, Duration, u64)> {
        let start = Instant::now();
        let mut pairs = 0u64;
        let mut overlaps = 0u64;
        loop {
            self.lock()?;
            let held = Instant::now();
            if let Some(o) = &self.oracle {
                overlaps += u64::from(o.enter());
            }
            if let Some(f) = &self.counter {
                self.count(f)?;
            }
            while held.elapsed() < hold {
                std::hint::spin_loop();
            }
            if let Some(o) = &self.oracle {
                o.leave();
            }
            self.unlock()?;
            pairs += 1;
            let elapsed = start.elapsed();
            if elapsed >= secs {
                return Ok((pairs, elapsed, overlaps));
            }
        }
    }

    /// Adds one to the counter at the range's first byte (0 past the end).
    fn count(&self, f: &std::fs::File) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let at = self.start as u64;
        let mut b = [0u8; 8];
        let n = f.read_at(&mut b, at)?;
        let value = if n == 8 { u64::from_le_bytes(b) } else { 0 };
        f.write_all_at(&(value + 1).to_le_bytes(), at)
    }

    /// `n` write locks that must all be refused: (refusals, elapsed).
    fn refuse(&self, n: u64) -> io::Result<(u64, Duration)> {
        let start = Instant::now();
        for i in 0..n {
            match self.fcntl(libc::F_SETLK, libc::F_WRLCK) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {}
                Err(e) => return Err(e),
                Ok(()) => return Err(io::Error::other(format!("lock {i} was granted, not refused"))),
            }
        }
        Ok((n, start.elapsed()))
    }

    fn answer(&self, command: &str) -> String {
        let timed = |what: &str, f: &dyn Fn() -> io::Result<()>| {
            let t = Instant::now();
            match f() {
                Ok(()) => format!("ok {}", t.elapsed().as_nanos()),
                Err(e) => format!("err {what}: {e}"),
            }
        };
        let seconds = |s: &str| s.parse::<f64>().ok().and_then(|s| Duration::try_from_secs_f64(s).ok());
        let run = |secs: &str, hold_us: &str| {
            let hold = hold_us.parse::<u64>().ok().map(Duration::from_micros);
            match (seconds(secs), hold) {
                (Some(d), Some(hold)) => match self.run(d, hold) {
                    Ok((pairs, elapsed, overlaps)) => {
                        format!("done {pairs} {} {overlaps}", elapsed.as_nanos())
                    }
                    Err(e) => format!("err lock loop: {e}"),
                },
                _ => format!("err bad duration {secs:?} or hold {hold_us:?}"),
            }
        };
        match command.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["run", secs] => run(secs, "0"),
            ["run", secs, hold_us] => run(secs, hold_us),
            ["lock"] => timed("lock", &|| self.lock()),
            ["refuse", n] => match n.parse::<u64>().map(|n| self.refuse(n)) {
                Ok(Ok((n, elapsed))) => format!("done {n} {}", elapsed.as_nanos()),
                Ok(Err(e)) => format!("err refuse: {e}"),
                Err(_) => format!("err bad count {n:?}"),
            },
            ["unlock"] => timed("unlock", &|| self.unlock()),
            _ => format!("err unknown command {command:?}"),
        }
    }
}

pub fn worker(args: FcntlWorkerArgs) -> Result<()> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&args.path)
        .with_context(|| format!("cannot open {}", args.path.display()))?;
    let start = i64::try_from(args.start).context("--start is too large")?;
    let len = i64::try_from(args.len).ok().filter(|l| *l > 0).context("--len must be 1 or more")?;
    let locker = RangeLocker {
        fd: file.as_raw_fd(),
        start,
        len,
        lock_cmd: if args.wait { libc::F_SETLKW } else { libc::F_SETLK },
        oracle: args.oracle.as_deref().map(Oracle::open).transpose()?,
        counter: if args.counter { Some(file.try_clone()?) } else { None },
    };
    let mut out = io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    for line in io::stdin().lock().lines() {
        let answer = locker.answer(&line?);
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    drop(file);
    Ok(())
}
