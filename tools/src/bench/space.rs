//! `citronfs bench space`: what space and lock memory files take,
//! through a real FUSE mount of an embedded cluster:
//! * `fill`: files of each size written until the data server is full,
//!   as files per GiB of data-server memory;
//! * `create`: the rate of creating and writing small files, one process;
//! * `million`: many distinct files created (an open each), optionally
//!   written, and closed one after another, with the cluster's default lock
//!   memory: the time, and the lock memory in use before, at its peak and at
//!   the end.
//!
//! Sequential bandwidth is `citronfs bench io`'s. The program uses only the
//! file system's public interfaces, so the same source measures an older
//! build for a before/after comparison.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use citronfs_core::client::{ClientConfig, FsClient};
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use citronfs_mount::{BackgroundSession, CitronFuse, MountOptions};
use clap::Args;

use crate::report::Table;
use crate::size::ByteSize;

#[derive(Args, Debug)]
pub struct SpaceArgs {
    /// Phases to run: fill, create, million (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "fill,create,million")]
    phases: Vec<String>,
    /// fill: the data server's capacity.
    #[arg(long, default_value = "256MiB")]
    capacity: ByteSize,
    /// fill: file sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1KiB,4KiB,64KiB,1MiB")]
    sizes: Vec<ByteSize>,
    /// create: files created and written (the data server gets a chunk per
    /// file, as an older build needs).
    #[arg(long, default_value_t = 10_000)]
    files: u64,
    /// create: bytes written into each.
    #[arg(long, default_value = "4KiB")]
    file_size: ByteSize,
    /// million: files created and closed one after another.
    #[arg(long, default_value_t = 1_000_000)]
    million: u64,
    /// million: bytes written into each before it is closed (0: none).
    #[arg(long, default_value = "0")]
    million_write: ByteSize,
    /// Directory for space.csv and space.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

/// An embedded cluster and one mount of it; unmounted on drop.
struct Mounted {
    session: Option<BackgroundSession>,
    dir: tempfile::TempDir,
    meta: MetaServer,
    _data: DataServer,
}

impl Mounted {
    fn start(capacity: u64) -> Result<Self> {
        let tag = format!("bench-space-{}-{}", std::process::id(), rand::random::<u32>());
        let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse()?);
        cfg.shm = Some(format!("{tag}-meta"));
        let meta = MetaServer::start(cfg)?;
        let data = DataServer::start(
            "127.0.0.1:0".parse()?,
            meta.local_addr(),
            capacity,
            Some(&format!("{tag}-data")),
        )?;
        let client = FsClient::connect(ClientConfig {
            timeout: Duration::from_secs(10),
            ..ClientConfig::new(meta.local_addr())
        })?;
        let dir = tempfile::tempdir()?;
        let session =
            citronfs_mount::spawn_mount(CitronFuse::new(client, MountOptions::default()), dir.path())?;
        Ok(Self { session: Some(session), dir, meta, _data: data })
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if let Err(e) = s.umount_and_join() {
                log::warn!("unmount failed: {e}");
            }
        }
    }
}

pub fn run(args: SpaceArgs) -> Result<()> {
    let mut table = Table::new(&["phase", "figure", "value"]);
    let mut bars = Vec::new();
    for phase in &args.phases {
        match phase.as_str() {
            "fill" => {
                for size in &args.sizes {
                    let (files, err) = fill(args.capacity.0, size.0)?;
                    let per_gib = files as f64 * (1u64 << 30) as f64 / args.capacity.0 as f64;
                    println!("fill {size}: {files} files in {} ({err})", args.capacity);
                    table.push(vec![
                        "fill".into(),
                        format!("files per GiB, {size} files"),
                        format!("{per_gib:.0}"),
                    ]);
                    bars.push((format!("{size} files per GiB"), per_gib));
                }
            }
            "create" => {
                let rate = create(args.files, args.file_size.0)?;
                println!("create: {:.0} files of {} per second", rate, args.file_size);
                table.push(vec![
                    "create".into(),
                    format!("create+write+close of {} files per s", args.file_size),
                    format!("{rate:.0}"),
                ]);
            }
            "million" => {
                let m = million(args.million, args.million_write.0)?;
                println!(
                    "million: {} of {} files in {:.1}s ({:.0}/s); lock memory before {} B, peak {} B, end {} B{}",
                    m.done,
                    args.million,
                    m.elapsed.as_secs_f64(),
                    m.done as f64 / m.elapsed.as_secs_f64(),
                    m.before,
                    m.peak,
                    m.end,
                    m.failure.as_ref().map_or(String::new(), |e| format!("; stopped: {e}"))
                );
                let what = if args.million_write.0 > 0 {
                    format!("create+write {}+close", args.million_write)
                } else {
                    "create+close".into()
                };
                table.push(vec!["million".into(), format!("files ({what})"), m.done.to_string()]);
                table.push(vec![
                    "million".into(),
                    "seconds".into(),
                    format!("{:.1}", m.elapsed.as_secs_f64()),
                ]);
                table.push(vec!["million".into(), "lock memory before (bytes)".into(), m.before.to_string()]);
                table.push(vec!["million".into(), "lock memory peak (bytes)".into(), m.peak.to_string()]);
                table.push(vec!["million".into(), "lock memory end (bytes)".into(), m.end.to_string()]);
                table.push(vec![
                    "million".into(),
                    "stopped by".into(),
                    m.failure.unwrap_or_else(|| "-".into()),
                ]);
            }
            other => bail!("unknown phase {other:?} (fill, create, million)"),
        }
    }
    println!();
    table.print();
    fs::create_dir_all(&args.out)?;
    let csv = args.out.join("space.csv");
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());
    if !bars.is_empty() {
        let png = args.out.join("space.png");
        match crate::plot::bars(&png, "files per GiB of data-server memory", "files", &bars) {
            Ok(()) => println!("wrote {}", png.display()),
            Err(e) => log::warn!("no plot: {e}"),
        }
    }
    Ok(())
}

fn payload(i: u64, len: u64) -> Vec<u8> {
    let tag = format!("{i:010} ");
    tag.bytes().cycle().take(len as usize).collect()
}

/// Files of `size` written until the data server of `capacity` is full:
/// how many fit, and the error that stopped them.
fn fill(capacity: u64, size: u64) -> Result<(u64, String)> {
    let m = Mounted::start(capacity)?;
    fs::create_dir(m.path("d"))?;
    let limit = capacity / size.clamp(1, 512) + 16;
    let mut n = 0;
    let err = loop {
        if n > limit {
            bail!("{n} files of {size} bytes in {capacity} bytes: the data server never filled");
        }
        match fs::write(m.path(&format!("d/{n}")), payload(n, size)) {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
    };
    if err.raw_os_error() != Some(libc::ENOSPC) {
        return Err(err).context(format!("file {n} of {size} bytes"));
    }
    Ok((n, "then ENOSPC".into()))
}

/// Files of `size` created, written and closed per second (one process).
fn create(files: u64, size: u64) -> Result<f64> {
    let m = Mounted::start(files * (1 << 20) + (256 << 20))?;
    fs::create_dir(m.path("d"))?;
    let started = Instant::now();
    for i in 0..files {
        fs::write(m.path(&format!("d/{i}")), payload(i, size)).with_context(|| format!("file {i}"))?;
    }
    Ok(files as f64 / started.elapsed().as_secs_f64())
}

struct Million {
    done: u64,
    elapsed: Duration,
    before: u64,
    peak: u64,
    end: u64,
    failure: Option<String>,
}

/// `files` distinct files created (each an open), written with `write`
/// bytes, and closed one after another with the default lock memory. The
/// peak is read while each file is open.
fn million(files: u64, write: u64) -> Result<Million> {
    let capacity = (files * write.max(1).next_power_of_two().max(4096)).max(1 << 30);
    let capacity = if write == 0 { 1 << 30 } else { capacity + (256 << 20) };
    let m = Mounted::start(capacity)?;
    let dirs = 1000;
    for d in 0..dirs {
        fs::create_dir(m.path(&format!("d{d}")))?;
    }
    let before = m.meta.lock_memory_in_use();
    let mut peak = before;
    let data = payload(0, write);
    let started = Instant::now();
    let mut failure = None;
    let mut done = 0;
    for i in 0..files {
        let path = m.path(&format!("d{}/f{i}", i % dirs));
        let opened = fs::File::create(&path).and_then(|mut f| {
            peak = peak.max(m.meta.lock_memory_in_use());
            if write > 0 {
                use std::io::Write;
                f.write_all(&data)?;
            }
            Ok(())
        });
        if let Err(e) = opened {
            failure = Some(format!("file {i}: {e}"));
            break;
        }
        done += 1;
        if i % 100_000 == 99_999 {
            eprintln!("  {} files, {:.0}s", i + 1, started.elapsed().as_secs_f64());
        }
    }
    let elapsed = started.elapsed();
    // Releases are sent after close(2) returns: let the last ones land.
    std::thread::sleep(Duration::from_millis(500));
    Ok(Million { done, elapsed, before, peak, end: m.meta.lock_memory_in_use(), failure })
}
