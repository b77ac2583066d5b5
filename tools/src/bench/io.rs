//! `citronfs bench io`: the file system beside what users would pick instead,
//! measured in one run on this machine:
//! * citronfs: an embedded cluster with a key, as `citronfs mount` starts
//!   one (so the NICs enforce per-client grants and every allocation pays
//!   for them), written through one mount and read through another (two
//!   clients);
//! * bindfs over tmpfs: a passthrough FUSE file system (Debian's bindfs,
//!   single-threaded as its default) — the cost of FUSE itself;
//! * tmpfs: the kernel's own in-memory file system — no FUSE at all.
//!
//! For each: sequential write then read of one file in blocks with O_DIRECT
//! (tmpfs ignores the flag where it does not support it), and create, stat
//! and unlink of many empty files in one directory.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use citron_rpc::auth::Keyring;
use citronfs_core::client::{ClientConfig, FsClient};
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use citronfs_mount::{BackgroundSession, CitronFuse, MountOptions};
use clap::Args;

use crate::report::Table;
use crate::size::ByteSize;

#[derive(Args, Debug)]
pub struct IoArgs {
    /// Bytes written and read sequentially.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Block size of each read and write.
    #[arg(long, default_value = "1MiB")]
    block: ByteSize,
    /// Files created, stated and unlinked.
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Skip bindfs (when it is not installed).
    #[arg(long)]
    no_bindfs: bool,
    /// How the citronfs mounts reach server memory: shm (same host, the
    /// servers publish shm fabrics) or tcp (the software NIC over loopback).
    #[arg(long, value_enum, default_value = "shm")]
    transport: TransportChoice,
    /// Seconds the kernel may cache citronfs attributes and entries (the
    /// mount's --attr-ttl; 0, the default, is strict coherence).
    #[arg(long, default_value_t = 0.0)]
    attr_ttl: f64,
    /// FUSE worker threads of the citronfs mounts.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Directory for io.csv and io.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TransportChoice {
    Shm,
    Tcp,
}

/// One file system under test: where to write and where to read back.
struct Target {
    name: &'static str,
    write_dir: PathBuf,
    read_dir: PathBuf,
}

#[derive(Default)]
struct Figures {
    write_mbps: f64,
    read_mbps: f64,
    creates: f64,
    stats: f64,
    unlinks: f64,
}

/// Everything mounted for the run; unmounted in reverse order on drop.
struct Mounts {
    root: tempfile::TempDir,
    kernel_mounts: Vec<PathBuf>,
    sessions: Vec<BackgroundSession>,
    _cluster: Option<(MetaServer, DataServer)>,
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for s in self.sessions.drain(..) {
            if let Err(e) = s.umount_and_join() {
                log::warn!("unmount failed: {e}");
            }
        }
        for m in self.kernel_mounts.drain(..).rev() {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
        let _ = self.root.path();
    }
}

pub(super) fn run_cmd(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

pub(super) fn mount_tmpfs(dir: &Path, size: u64) -> Result<()> {
    fs::create_dir_all(dir)?;
    run_cmd(
        Command::new("mount").args(["-t", "tmpfs", "-o"]).arg(format!("size={size}")).arg("tmpfs").arg(dir),
    )
}

pub fn run(args: IoArgs) -> Result<()> {
    if args.block.0 == 0 || !args.size.0.is_multiple_of(args.block.0) {
        bail!("--size must be a positive multiple of --block");
    }
    let root = tempfile::tempdir()?;
    let mut mounts = Mounts { root, kernel_mounts: Vec::new(), sessions: Vec::new(), _cluster: None };
    let base = mounts.root.path().to_path_buf();
    let room = args.size.0 + (256 << 20);
    let mut targets = Vec::new();

    // citronfs: embedded cluster with a key, two mounts.
    let keyring = Arc::new(Keyring::generate("cluster")?);
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse()?);
    cfg.slot_bytes = 16 << 20;
    cfg.keyring = Some(keyring.clone());
    let tag = std::process::id();
    if args.transport == TransportChoice::Shm {
        cfg.shm = Some(format!("bench-meta-{tag}"));
    }
    let shm_data = (args.transport == TransportChoice::Shm).then(|| format!("bench-data-{tag}"));
    let meta = MetaServer::start(cfg)?;
    let data = DataServer::start_with(
        "127.0.0.1:0".parse()?,
        meta.local_addr(),
        room.next_multiple_of(1 << 20),
        shm_data.as_deref(),
        None,
        Some(keyring.clone()),
    )?;
    let meta_addr = meta.local_addr();
    mounts._cluster = Some((meta, data));
    let mut citron_dirs = Vec::new();
    for i in 0..2 {
        let dir = base.join(format!("citronfs-{i}"));
        fs::create_dir_all(&dir)?;
        let mut config = ClientConfig::new(meta_addr);
        config.timeout = Duration::from_secs(10);
        config.key = Some(keyring.first().clone());
        let client = FsClient::connect(config)?;
        let attr_ttl = Duration::try_from_secs_f64(args.attr_ttl).context("--attr-ttl")?;
        let options = MountOptions { attr_ttl, threads: args.threads, ..MountOptions::default() };
        let fs = CitronFuse::new(client, options);
        mounts.sessions.push(citronfs_mount::spawn_mount(fs, &dir)?);
        citron_dirs.push(dir);
    }
    let citron_name = match args.transport {
        TransportChoice::Shm => "citronfs(shm)",
        TransportChoice::Tcp => "citronfs(tcp)",
    };
    targets.push(Target {
        name: citron_name,
        write_dir: citron_dirs[0].clone(),
        read_dir: citron_dirs[1].clone(),
    });

    if !args.no_bindfs {
        let backing = base.join("bindfs-backing");
        mount_tmpfs(&backing, room)?;
        mounts.kernel_mounts.push(backing.clone());
        let mnt = base.join("bindfs");
        fs::create_dir_all(&mnt)?;
        run_cmd(Command::new("bindfs").arg(&backing).arg(&mnt))
            .context("bindfs is needed for the comparison (apt-get install bindfs), or pass --no-bindfs")?;
        mounts.kernel_mounts.push(mnt.clone());
        targets.push(Target { name: "bindfs(tmpfs)", write_dir: mnt.clone(), read_dir: mnt });
    }

    let tmp = base.join("tmpfs");
    mount_tmpfs(&tmp, room)?;
    mounts.kernel_mounts.push(tmp.clone());
    targets.push(Target { name: "tmpfs", write_dir: tmp.clone(), read_dir: tmp });

    println!(
        "bench io: {} sequential in {} blocks (O_DIRECT), {} files; citronfs written on one mount, read on another",
        args.size, args.block, args.files
    );
    let mut table =
        Table::new(&["fs", "write_MBps", "read_MBps", "creates_per_s", "stats_per_s", "unlinks_per_s"]);
    let mut results = Vec::new();
    for t in &targets {
        let f = measure(t, &args).with_context(|| format!("measuring {}", t.name))?;
        table.push(vec![
            t.name.into(),
            format!("{:.0}", f.write_mbps),
            format!("{:.0}", f.read_mbps),
            format!("{:.0}", f.creates),
            format!("{:.0}", f.stats),
            format!("{:.0}", f.unlinks),
        ]);
        results.push((t.name, f));
    }
    println!();
    table.print();
    fs::create_dir_all(&args.out)?;
    let csv = args.out.join("io.csv");
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());
    let bars: Vec<(String, f64)> = results
        .iter()
        .flat_map(|(n, f)| {
            [
                (format!("{n} write MB/s"), f.write_mbps),
                (format!("{n} read MB/s"), f.read_mbps),
                (format!("{n} creates/s"), f.creates),
                (format!("{n} stats/s"), f.stats),
                (format!("{n} unlinks/s"), f.unlinks),
            ]
        })
        .collect();
    let png = args.out.join("io.png");
    match crate::plot::bars(&png, "file systems side by side", "MB/s or ops/s", &bars) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => log::warn!("no plot: {e}"),
    }
    if let (Some((_, c)), Some((_, b))) =
        (results.iter().find(|r| r.0 == citron_name), results.iter().find(|r| r.0 == "bindfs(tmpfs)"))
    {
        println!(
            "\nratio citronfs / bindfs: write {:.2}, read {:.2}, creates {:.2}, stats {:.2}, unlinks {:.2}",
            c.write_mbps / b.write_mbps,
            c.read_mbps / b.read_mbps,
            c.creates / b.creates,
            c.stats / b.stats,
            c.unlinks / b.unlinks
        );
    }
    drop(mounts);
    Ok(())
}

/// Opens with O_DIRECT, or without it where the file system refuses it.
fn open_direct(path: &Path, write: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    if write {
        o.write(true).create(true).truncate(true);
    } else {
        o.read(true);
    }
    match o.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(o.open(path)?),
        Err(e) => Err(e.into()),
    }
}

/// A block-aligned buffer, as O_DIRECT needs.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Self { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

fn measure(t: &Target, args: &IoArgs) -> Result<Figures> {
    let block = args.block.0 as usize;
    let blocks = args.size.0 / args.block.0;
    let mut buf = Aligned::new(block);
    for (i, b) in buf.as_mut().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let file_w = t.write_dir.join("seq.bin");
    let file_r = t.read_dir.join("seq.bin");
    let mb = args.size.0 as f64 / 1e6;

    let mut f = open_direct(&file_w, true)?;
    let start = Instant::now();
    for _ in 0..blocks {
        f.write_all(&buf.as_mut()[..block])?;
    }
    f.sync_all()?;
    let write_mbps = mb / start.elapsed().as_secs_f64();
    drop(f);

    let mut f = open_direct(&file_r, false)?;
    let start = Instant::now();
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf.as_mut()[..block])?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let read_mbps = mb / start.elapsed().as_secs_f64();
    if total != args.size.0 {
        bail!("read back {total} bytes of {}", args.size.0);
    }
    fs::remove_file(&file_w)?;

    let dir_w = t.write_dir.join("files");
    let dir_r = t.read_dir.join("files");
    fs::create_dir(&dir_w)?;
    let names: Vec<String> = (0..args.files).map(|i| format!("f{i:06}")).collect();
    let start = Instant::now();
    for n in &names {
        File::create(dir_w.join(n))?;
    }
    let creates = args.files as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    for n in &names {
        fs::metadata(dir_r.join(n))?;
    }
    let stats = args.files as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    for n in &names {
        fs::remove_file(dir_w.join(n))?;
    }
    let unlinks = args.files as f64 / start.elapsed().as_secs_f64();
    fs::remove_dir(&dir_w)?;
    Ok(Figures { write_mbps, read_mbps, creates, stats, unlinks })
}
