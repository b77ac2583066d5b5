//! `citronfs mount`: mount the cluster at a directory. Without `--meta` it
//! starts an embedded meta-server and data server in the same process, so one
//! command gives a working file system that other mounts can join.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_meta_server::{DataServer, MetaServer};
use citronfs_mount::{CitronFuse, MountOptions};
use clap::Args;

use crate::servers::{LockArgs, MetaServerArgs};
use crate::size::ByteSize;

#[derive(Args, Debug)]
pub struct MountArgs {
    /// An existing, empty directory that is not already a mount point.
    mountpoint: PathBuf,
    /// Join the cluster of this meta-server; without it, start one here.
    #[arg(long)]
    meta: Option<SocketAddr>,
    /// Embedded mode: where the meta-server listens.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Embedded mode: DRAM of the embedded data server.
    #[arg(long, default_value = "1GiB")]
    capacity: ByteSize,
    /// Embedded mode: client lease in milliseconds.
    #[arg(long, default_value_t = 5000)]
    lease_ms: u64,
    /// Seconds the kernel may cache attributes and entries (0: strict coherence).
    #[arg(long, default_value_t = 0.0)]
    attr_ttl: f64,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// How to reach server memory: auto (shm for servers on this host that
    /// publish it, tcp otherwise) or tcp.
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// Seconds to wait for a server before answering EIO.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
    /// Test only: microseconds added to every round trip of this mount to
    /// the servers, as if it were that much farther away (implies tcp).
    #[arg(long, default_value_t = 0, hide = true)]
    test_added_rtt_us: u64,
    /// Embedded mode: the cluster's lock settings.
    #[command(flatten)]
    locks: LockArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TransportArg {
    Auto,
    Tcp,
}

fn is_mount_point(path: &Path) -> Result<bool> {
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").context("cannot read /proc/self/mountinfo")?;
    let target = path.to_string_lossy();
    // Field 5 is the mount point, with spaces escaped as \040.
    Ok(mountinfo.lines().any(|l| l.split(' ').nth(4).is_some_and(|m| m.replace("\\040", " ") == target)))
}

fn seconds(s: f64, what: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .with_context(|| format!("--{what} must be a non-negative number of seconds"))
}

pub fn run(args: MountArgs) -> Result<()> {
    let attr_ttl = seconds(args.attr_ttl, "attr-ttl")?;
    let timeout = seconds(args.timeout, "timeout")?;
    let mountpoint = std::fs::canonicalize(&args.mountpoint)
        .with_context(|| format!("mount point {} does not exist", args.mountpoint.display()))?;
    if !mountpoint.is_dir() {
        bail!("mount point {} is not a directory", mountpoint.display());
    }
    if is_mount_point(&mountpoint)? {
        bail!("mount point {} is busy: something is already mounted there", mountpoint.display());
    }
    // Embedded servers live as long as this function.
    let mut embedded: Option<(MetaServer, DataServer)> = None;
    let meta = match args.meta {
        Some(m) => m,
        None => {
            // The embedded servers also publish their memory as shm
            // fabrics, for mounts on this host.
            let pid = std::process::id();
            let meta_args = MetaServerArgs {
                listen: args.listen,
                chunk_size: ByteSize(1 << 20),
                lease_ms: args.lease_ms,
                shm: Some(format!("{pid}-meta")),
                locks: args.locks.clone(),
            };
            let meta =
                MetaServer::start(meta_args.config()).context("cannot start the embedded meta-server")?;
            let data_shm = format!("{pid}-data");
            let data_listen = SocketAddr::new(args.listen.ip(), 0);
            let data = DataServer::start(data_listen, meta.local_addr(), args.capacity.0, Some(&data_shm))
                .context("cannot start the embedded data server")?;
            let addr = meta.local_addr();
            embedded = Some((meta, data));
            addr
        }
    };
    let transport = match args.transport {
        TransportArg::Auto => Transport::Auto,
        TransportArg::Tcp => Transport::Tcp,
    };
    let mut config = ClientConfig::new(meta);
    config.timeout = timeout;
    config.transport = transport;
    config.added_rtt = Duration::from_micros(args.test_added_rtt_us);
    let client = FsClient::connect(config).with_context(|| format!("cannot join the cluster at {meta}"))?;
    let fs = CitronFuse::new(client, MountOptions { attr_ttl, threads: args.threads });
    let session = citronfs_mount::spawn_mount(fs, &mountpoint)
        .with_context(|| format!("cannot mount at {}", mountpoint.display()))?;
    println!("citronfs mounted at {} (meta-server {meta})", mountpoint.display());
    if embedded.is_some() {
        println!("other mounts can join with: citronfs mount DIR --meta {meta}");
    }

    let (tx, rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("cannot install the signal handler")?;
    let unmounted_outside = loop {
        if session.guard.is_finished() {
            // Unmounted from outside (umount, fusermount -u).
            break true;
        }
        if rx.recv_timeout(Duration::from_millis(100)).is_ok() {
            println!("unmounting {}", mountpoint.display());
            break false;
        }
    };
    let result = if unmounted_outside { session.join() } else { session.umount_and_join() };
    drop(embedded);
    result.with_context(|| format!("session at {} ended with an error", mountpoint.display()))
}
