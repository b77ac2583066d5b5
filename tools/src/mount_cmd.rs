//! `citronfs mount`: mount the cluster at a directory. Without `--meta` it
//! starts an embedded meta-server and data server in the same process, so one
//! command gives a working file system that other mounts can join.
//!
//! Without `--foreground` the command detaches once the file system is
//! mounted ([`crate::daemon`]); `-o` takes mount(8)-style options
//! ([`crate::mount_options`]). The daemon ends on unmount, SIGINT, SIGTERM
//! or SIGHUP, never leaving a stale mount point ([`crate::unmount`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::rdma::IbDevice;
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_meta_server::{DataServer, MetaServer};
use citronfs_mount::{CitronFuse, MountOptions};
use clap::Args;

use crate::daemon::Readiness;
use crate::keys::{EmbeddedKey, KeyArgs};
use crate::logging::LogArgs;
use crate::mount_options::{self, VfsFlag};
use crate::servers::{LockArgs, MetaServerArgs};
use crate::size::ByteSize;
use crate::unmount;

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
    /// Embedded mode: DRAM of the embedded data server, touched only as it is
    /// written, like tmpfs [default: half of the host's RAM, within what
    /// /dev/shm has free].
    #[arg(long)]
    capacity: Option<ByteSize>,
    /// Embedded mode: the most regular files (40 bytes of meta-server memory
    /// each, touched only as files are created).
    #[arg(long, default_value_t = citronfs_meta_server::service::DEFAULT_MAX_FILES)]
    max_files: u64,
    /// Embedded mode: where the file system's state lives (the
    /// meta-server's journal; see `citronfs meta-server --state-dir`)
    /// [default: a scratch directory: the file system ends with the mount].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Embedded mode: client lease in milliseconds.
    #[arg(long, default_value_t = 5000)]
    lease_ms: u64,
    /// Seconds the kernel may cache attributes and entries without asking
    /// the meta-server: NOT coherent across mounts unless 0 (see
    /// --cache-ttl for caching that is).
    #[arg(long, default_value_t = 0.0)]
    attr_ttl: f64,
    /// Coherent caching: seconds the kernel may cache attributes and
    /// entries the meta-server grants; it calls this mount back before
    /// another mount's change of them answers (0: no caching).
    #[arg(long, default_value_t = 0.0)]
    cache_ttl: f64,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// How to reach server memory: auto (shm for servers on this host that
    /// publish it, tcp otherwise), tcp, or ib (RDMA, with --ib-device).
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// The RDMA device of this machine for `--transport ib` (`mlx5_0`,
    /// `mlx5_0:PORT:GID_INDEX`); embedded servers serve ib on it too.
    #[arg(long, value_name = "DEVICE")]
    ib_device: Option<IbDevice>,
    /// Seconds to wait for a server before answering EIO (a meta-server
    /// that still renews this mount's lease is waited for longer, up to a
    /// minute: it is busy or waits for another mount, not gone).
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
    /// Seconds calls wait for a meta-server that stopped answering (it
    /// crashed, or restarts) before they answer EIO: a restart within it
    /// costs applications a pause, and this mount reclaims its opens and
    /// locks from the restarted meta-server.
    #[arg(long, default_value_t = citronfs_core::client::DEFAULT_META_WAIT.as_secs_f64())]
    meta_wait: f64,
    /// Take every fcntl, OFD and flock lock at the cluster's lock table,
    /// with no lock token: a mount that is the only one locking a file
    /// otherwise takes and releases its locks locally, with no round trip.
    #[arg(long)]
    no_lock_tokens: bool,
    /// Test only: microseconds added to every round trip of this mount to
    /// the servers, as if it were that much farther away (implies tcp).
    #[arg(long, default_value_t = 0, hide = true)]
    test_added_rtt_us: u64,
    /// Embedded mode: the cluster's lock settings.
    #[command(flatten)]
    locks: LockArgs,
    /// Stay in the foreground (default: detach once the file system is
    /// mounted, exit status 0 meaning it is, and log to syslog or a file).
    #[arg(long)]
    pub foreground: bool,
    #[command(flatten)]
    pub log: LogArgs,
    /// Options as mount(8) and fstab give them: any flag of this command
    /// without its dashes (attr-ttl=1, transport=tcp), VFS flags (ro,
    /// nosuid, nodev, noexec, noatime, ...), and options for mount(8) or
    /// systemd, which are ignored (_netdev, nofail, x-*).
    #[arg(short = 'o', long = "options", value_name = "OPTIONS")]
    options: Option<String>,
    /// The mount's source as /proc/mounts shows it (the fstab spec).
    #[arg(long, hide = true)]
    source: Option<String>,
    /// A VFS flag of the mount (from -o).
    #[arg(long = "vfs-flag", hide = true)]
    vfs_flags: Vec<VfsFlag>,
    /// With --meta: the cluster's key. Embedded: the key file to use (made
    /// there if missing); without it a new key is made for this cluster.
    #[command(flatten)]
    key: KeyArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TransportArg {
    Auto,
    Tcp,
    Ib,
}

impl MountArgs {
    /// The mount point as given, made absolute (it is checked later).
    pub fn mountpoint(&self) -> PathBuf {
        std::path::absolute(&self.mountpoint).unwrap_or_else(|_| self.mountpoint.clone())
    }
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

/// Why the serving loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The kernel ended the session (umount).
    Unmounted,
    /// The mount point was detached with the file system still in use.
    Detached,
    /// SIGINT, SIGTERM or SIGHUP.
    Signal,
}

/// Mounts and serves until unmounted or signalled. With `readiness` (the
/// detached daemon), the waiting parent is told once the file system is
/// mounted; on an error before that, the caller reports it there.
pub fn run(args: MountArgs, readiness: &mut Option<Readiness>) -> Result<()> {
    debug_assert!(args.options.is_none(), "-o is expanded before parsing");
    let attr_ttl = seconds(args.attr_ttl, "attr-ttl")?;
    let cache_ttl = seconds(args.cache_ttl, "cache-ttl")?;
    if !attr_ttl.is_zero() && !cache_ttl.is_zero() {
        bail!("--attr-ttl (incoherent caching) and --cache-ttl (coherent caching) exclude each other");
    }
    let timeout = seconds(args.timeout, "timeout")?;
    let mountpoint = std::fs::canonicalize(&args.mountpoint)
        .with_context(|| format!("mount point {} does not exist", args.mountpoint.display()))?;
    if !mountpoint.is_dir() {
        bail!("mount point {} is not a directory", mountpoint.display());
    }
    if is_mount_point(&mountpoint)? {
        bail!("mount point {} is busy: something is already mounted there", mountpoint.display());
    }
    let ib_device = match (args.transport, &args.ib_device) {
        (TransportArg::Ib, None) => {
            bail!("--transport ib needs --ib-device DEVICE (this machine's RDMA device)")
        }
        (TransportArg::Ib, Some(d)) => Some(d.clone()),
        (_, Some(_)) => bail!("--ib-device is for --transport ib"),
        (_, None) => None,
    };
    // Embedded servers (and their key) live as long as this function.
    let mut embedded: Option<(MetaServer, DataServer, EmbeddedKey)> = None;
    let meta = match args.meta {
        Some(m) => m,
        None => {
            let key = EmbeddedKey::obtain(args.key.key_file.as_deref())?;
            // The embedded servers also publish their memory as shm
            // fabrics, for mounts on this host.
            let pid = std::process::id();
            let meta_args = MetaServerArgs {
                listen: args.listen,
                chunk_size: ByteSize(1 << 20),
                lease_ms: args.lease_ms,
                shm: Some(format!("{pid}-meta")),
                ib: ib_device.clone(),
                max_files: args.max_files,
                state_dir: args.state_dir.clone(),
                grace_ms: None,
                locks: args.locks.clone(),
                key: KeyArgs::default(),
                log: LogArgs::default(),
            };
            let mut config = meta_args.config();
            config.keyring = Some(key.keyring.clone());
            // The meta-server's regions share /dev/shm with the data server's.
            let reserve = config.slot_bytes + config.lock_bytes;
            let meta = MetaServer::start(config).context("cannot start the embedded meta-server")?;
            let capacity = args
                .capacity
                .map_or_else(|| citronfs_meta_server::data_server::default_capacity(true, reserve), |c| c.0);
            let data_shm = format!("{pid}-data");
            let data_listen = SocketAddr::new(args.listen.ip(), 0);
            let data = DataServer::start_with(
                data_listen,
                meta.local_addr(),
                capacity,
                Some(&data_shm),
                ib_device.as_ref(),
                Some(key.keyring.clone()),
            )
            .context("cannot start the embedded data server")?;
            log::info!("embedded data server: {}", ByteSize(capacity));
            let addr = meta.local_addr();
            embedded = Some((meta, data, key));
            addr
        }
    };
    let key = match &embedded {
        Some((_, _, k)) => Some(k.keyring.first().clone()),
        None => args.key.load()?.map(|ring| ring.first().clone()),
    };
    let transport = match args.transport {
        TransportArg::Auto => Transport::Auto,
        TransportArg::Tcp => Transport::Tcp,
        TransportArg::Ib => Transport::Ib,
    };
    let mut config = ClientConfig::new(meta);
    config.timeout = timeout;
    config.meta_wait = seconds(args.meta_wait, "meta-wait")?;
    config.lock_tokens = !args.no_lock_tokens;
    config.transport = transport;
    config.ib_device = ib_device;
    config.key = key;
    config.added_rtt = Duration::from_micros(args.test_added_rtt_us);
    let client = FsClient::connect(config).with_context(|| format!("cannot join the cluster at {meta}"))?;
    let fs = CitronFuse::new(client, MountOptions { attr_ttl, cache_ttl, threads: args.threads });
    let client = fs.client();
    let source = args.source.clone().unwrap_or_else(|| {
        if embedded.is_some() {
            "citronfs".into()
        } else {
            meta.to_string()
        }
    });
    let session = citronfs_mount::spawn_mount_with(
        fs,
        &mountpoint,
        &source,
        &mount_options::vfs_mount_options(&args.vfs_flags),
    )
    .with_context(|| format!("cannot mount at {}", mountpoint.display()))?;
    // Signals from here on end the mount cleanly.
    let (tx, rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("cannot install the signal handler")?;
    let mut message = format!("citronfs mounted at {} (meta-server {meta})\n", mountpoint.display());
    if let Some((_, _, key)) = &embedded {
        let file = key.path.display();
        let lifetime = if key.is_temporary() { "; removed when this mount ends" } else { "" };
        message += &format!("cluster key: {file} (mode 600{lifetime})\n");
        message += "other nodes join with a copy of that file (keep it mode 600):\n";
        message += &format!("  citronfs mount DIR --meta {meta} --key-file {file}\n");
        message += &format!("  citronfs data-server --meta {meta} --key-file {file} --listen ADDR:0\n");
    }
    if let Some(log) = crate::logging::destination() {
        message += &format!("log: {log}\n");
    }
    match readiness.take() {
        Some(r) => {
            log::info!("{}", message.trim_end());
            r.ready(&message);
        }
        None => {
            print!("{message}");
            let _ = std::io::Write::flush(&mut std::io::stdout());
        }
    }

    let ended = loop {
        if session.guard.is_finished() {
            // Unmounted from outside (umount, fusermount -u).
            break End::Unmounted;
        }
        if rx.recv_timeout(Duration::from_millis(100)).is_ok() {
            break End::Signal;
        }
        if unmount::mounted_type(&mountpoint).ok().flatten().as_deref() != Some("fuse.citronfs") {
            // Detached from outside (umount -l) with files still open: the
            // session would go on until they close. Unmounting means stop
            // serving, so those files get ENOTCONN and blocked lock calls
            // EIO, as with a signal.
            break End::Detached;
        }
    };
    if ended == End::Detached {
        log::info!("{} was detached (lazy unmount); ending the session", mountpoint.display());
        client.shutdown();
        std::mem::forget(session);
        drop(embedded);
        return Ok(());
    }
    if ended == End::Unmounted {
        log::info!("{} was unmounted", mountpoint.display());
        drop(client);
        let result = session.join();
        if result.is_err()
            && unmount::mounted_type(&mountpoint).ok().flatten().as_deref() == Some("fuse.citronfs")
        {
            // The session failed with the file system still mounted: never
            // leave it behind dead.
            let _ = unmount::unmount(&mountpoint);
        }
        drop(embedded);
        return result.with_context(|| format!("session at {} ended with an error", mountpoint.display()));
    }
    log::info!("unmounting {}", mountpoint.display());
    println!("unmounting {}", mountpoint.display());
    // Blocked lock calls get an error now, and the cluster forgets our
    // locks (waking whoever waits for them) instead of waiting a lease.
    client.shutdown();
    let left =
        unmount::unmount(&mountpoint).with_context(|| format!("cannot unmount {}", mountpoint.display()))?;
    match left {
        unmount::Unmounted::Clean | unmount::Unmounted::Gone => {
            drop(client);
            let result = session.join();
            drop(embedded);
            result.with_context(|| format!("session at {} ended with an error", mountpoint.display()))
        }
        unmount::Unmounted::Detached => {
            // The session serves the detached file system's open files
            // until we exit, which ends the connection. Dropping the
            // session would try to unmount the path again, where something
            // else may be mounted by now.
            std::mem::forget(session);
            drop(embedded);
            Ok(())
        }
    }
}
