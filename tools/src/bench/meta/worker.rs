//! One process of `bench meta`: the `citronfs` binary re-executed as the
//! hidden `citronfs bench meta-worker`, so that N processes make metadata
//! calls at once as mdtest's ranks do (a process of its own each: the
//! kernel's per-process state, file tables and credentials, is not shared).
//!
//! It works on `--files` files named `PREFIX.N` in two directories that
//! name the same directory through two mounts: files are created through
//! `--create-dir` and stat'ed, read and unlinked through `--other-dir`, so
//! every phase after the first sees, on one mount, what another mount did.
//! It says `ready`, then answers one line per command on stdin until stdin
//! closes:
//!
//! | command | what it does to each file | answer |
//! |---|---|---|
//! | `create` | `open(O_CREAT \| O_EXCL \| O_WRONLY)`, writes `--payload` bytes, `close` | `ok NANOS` |
//! | `stat` | `stat` | `ok NANOS` |
//! | `read` | `open(O_RDONLY)`, reads `--payload` bytes back and checks them, `close` | `ok NANOS` |
//! | `unlink` | `unlink` | `ok NANOS` |
//!
//! Any failure answers `err WHAT` and the bench stops.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct MetaWorkerArgs {
    /// The directory files are created in.
    #[arg(long)]
    pub create_dir: PathBuf,
    /// The same directory through another mount (stat, read, unlink).
    #[arg(long)]
    pub other_dir: PathBuf,
    /// Files of this process.
    #[arg(long)]
    pub files: u32,
    /// Names are PREFIX.0, PREFIX.1, ...
    #[arg(long)]
    pub prefix: String,
    /// Bytes written into each file at create (0: none).
    #[arg(long, default_value_t = 0)]
    pub payload: usize,
}

/// The phases of the bench, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Create,
    Stat,
    Read,
    Unlink,
}

impl Phase {
    pub const ALL: [Phase; 4] = [Phase::Create, Phase::Stat, Phase::Read, Phase::Unlink];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Create => "create",
            Phase::Stat => "stat",
            Phase::Read => "read",
            Phase::Unlink => "unlink",
        }
    }

    fn parse(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// The bytes of file `i` (recognisable, so a read checks what it got).
fn payload(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i as usize + k) as u8).collect()
}

fn name(dir: &Path, prefix: &str, i: u32) -> PathBuf {
    dir.join(format!("{prefix}.{i}"))
}

/// Runs `phase` over every file of this process.
pub fn run_phase(args: &MetaWorkerArgs, phase: Phase) -> Result<()> {
    let mut buf = vec![0u8; args.payload];
    for i in 0..args.files {
        match phase {
            Phase::Create => {
                let path = name(&args.create_dir, &args.prefix, i);
                let mut f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o644)
                    .open(&path)
                    .with_context(|| format!("create {}", path.display()))?;
                if args.payload > 0 {
                    f.write_all(&payload(i, args.payload))
                        .with_context(|| format!("write {}", path.display()))?;
                }
            }
            Phase::Stat => {
                let path = name(&args.other_dir, &args.prefix, i);
                let m = std::fs::metadata(&path).with_context(|| format!("stat {}", path.display()))?;
                if m.len() != args.payload as u64 {
                    bail!("{} has {} bytes, {} were written", path.display(), m.len(), args.payload);
                }
            }
            Phase::Read => {
                let path = name(&args.other_dir, &args.prefix, i);
                let mut f = File::open(&path).with_context(|| format!("open {}", path.display()))?;
                if args.payload > 0 {
                    f.read_exact(&mut buf).with_context(|| format!("read {}", path.display()))?;
                    if buf != payload(i, args.payload) {
                        bail!("{} does not hold what was written", path.display());
                    }
                }
            }
            Phase::Unlink => {
                let path = name(&args.other_dir, &args.prefix, i);
                std::fs::remove_file(&path).with_context(|| format!("unlink {}", path.display()))?;
            }
        }
    }
    Ok(())
}

pub fn worker(args: MetaWorkerArgs) -> Result<()> {
    let stdout = io::stdout();
    let say = |line: String| -> Result<()> {
        let mut out = stdout.lock();
        writeln!(out, "{line}")?;
        out.flush()?;
        Ok(())
    };
    say("ready".into())?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        let Some(phase) = Phase::parse(line.trim()) else {
            say(format!("err unknown command {line:?}"))?;
            continue;
        };
        let t = Instant::now();
        match run_phase(&args, phase) {
            Ok(()) => say(format!("ok {}", t.elapsed().as_nanos()))?,
            Err(e) => say(format!("err {e:#}"))?,
        }
    }
    Ok(())
}
