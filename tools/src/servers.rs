//! `citronfs meta-server` and `citronfs data-server`: run one server role in
//! the foreground until SIGINT, SIGTERM or SIGHUP.
//!
//! They are systemd `Type=notify` services (units in `dist/systemd/`): once
//! the server serves (its RPC port and NIC accept, a data server is
//! registered with the meta-server) it sends `READY=1` to `$NOTIFY_SOCKET`,
//! and `STOPPING=1` when a signal ends it.
//!
//! A data server keeps its memory in a data directory unless told
//! `--ephemeral` ([`citronfs_meta_server::data_dir`]): `--data-dir DIR`, or
//! by default `/dev/shm/citronfs.data/NAME`, NAME being its `--shm` name,
//! or else its `--listen` address (`IP:PORT`) when the port is fixed. The
//! name must stay the same across restarts to find the memory again, and
//! those are the names an operator already keeps fixed: a `--listen` on
//! port 0 and no `--shm` has nothing stable, so such a server's memory is
//! not kept (it says so). On SIGTERM a server that keeps its memory just
//! stops (a restart: the meta-server holds its files until it is back); one
//! that does not tells the meta-server it leaves, and its files answer EIO.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::rdma::IbDevice;
use citron_lock::rwlock::Algorithm;
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::ClusterLockParams;
use citronfs_meta_server::data_server::DataServerSetup;
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use clap::Args;

use crate::keys::KeyArgs;
use crate::logging::LogArgs;
use crate::size::ByteSize;

#[derive(Args, Debug)]
pub struct MetaServerArgs {
    /// Address of the RPC service clients and data servers connect to.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Bytes per file chunk (a power of two, at least 4KiB).
    #[arg(long, default_value = "1MiB")]
    pub chunk_size: ByteSize,
    /// Client lease, in milliseconds: a client silent for longer is dropped.
    #[arg(long, default_value_t = 5000)]
    pub lease_ms: u64,
    /// Also publish the meta-server's memory as shm fabric NAME (for
    /// clients on this host).
    #[arg(long, value_name = "NAME")]
    pub shm: Option<String>,
    /// Also serve the meta-server's memory to RDMA clients (`--transport
    /// ib`) through this device (`mlx5_0`, `mlx5_0:PORT:GID_INDEX`; needs a
    /// build with `--features rdma`).
    #[arg(long, value_name = "DEVICE")]
    pub ib: Option<IbDevice>,
    /// The most regular files the file system can hold (40 bytes of the
    /// meta-server's memory each, touched only as files are created).
    #[arg(long, default_value_t = citronfs_meta_server::service::DEFAULT_MAX_FILES)]
    pub max_files: u64,
    /// Where the file system's state lives: the namespace's journal and
    /// snapshots, and the attribute slots. It survives any crash or restart
    /// of the meta-server; on a persistent path (a disk, DAX) a reboot too
    /// [default: /dev/shm/citronfs-state-IP-PORT, lost at reboot like tmpfs;
    /// with --listen port 0, a scratch directory removed at exit].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// After a restart, how long (milliseconds) the mounts of the previous
    /// process have to reclaim their opens and locks; files nobody had
    /// open wait to be opened until then [default: twice --lease-ms; the
    /// period ends early once every old mount is back].
    #[arg(long, value_name = "MS")]
    pub grace_ms: Option<u64>,
    #[command(flatten)]
    pub locks: LockArgs,
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The state directory a meta-server listening on `listen` uses when it is
/// not given one: found again by the same command after a restart. A
/// meta-server on port 0 (any port) could not be found again, so its file
/// system ends with it (`None`: a scratch directory).
pub fn default_state_dir(listen: SocketAddr) -> Option<PathBuf> {
    (listen.port() != 0)
        .then(|| PathBuf::from(format!("/dev/shm/citronfs-state-{}-{}", listen.ip(), listen.port())))
}

/// The cluster's lock settings, which every client must share.
#[derive(Args, Debug, Clone)]
pub struct LockArgs {
    /// Citron's T_wait in microseconds (the meet-in-the-middle wait): its
    /// floor. The meta-server publishes the largest T_wait its clients need
    /// (five round trips of the slowest, up to 100 ms), never less.
    #[arg(long, default_value_t = ClusterLockParams::default().t_wait_us)]
    pub lock_t_wait_us: u64,
    /// Lease of range-lock nodes and mutex tickets, in milliseconds: a
    /// holder silent for longer is taken to be dead.
    #[arg(long, default_value_t = ClusterLockParams::default().lease_ms)]
    pub lock_lease_ms: u64,
    /// Memory for the lock memory of open files (lock areas, Citron trees,
    /// lock-record tables): bounds how many files can be open at once in the
    /// cluster (about 270 bytes each, 2 KiB more with fcntl/flock locks).
    #[arg(long, default_value = "256MiB")]
    pub lock_memory: ByteSize,
    /// Bytes of file per range-lock unit (a power of two).
    #[arg(long, default_value = "4KiB")]
    pub lock_granule: ByteSize,
    /// The range lock of data I/O and lock records: citron, segments
    /// (static segmentation, a DSLR mutex per granule) or rpc (a centralised
    /// range lock server in the meta-server).
    #[arg(long, default_value = "citron")]
    pub range_lock: RangeAlgorithm,
    /// The inode mutex: shiftlock, dslr, dql, cas (or rpc, alock).
    #[arg(long, default_value = "shiftlock")]
    pub inode_lock: Algorithm,
    /// Keep Citron trees fixed at their first size (files that grow past it
    /// lock their tail through the spillover mutex) instead of scaling them
    /// up (the paper's Alg. 4, run by the meta-server's tree host).
    #[arg(long)]
    pub fixed_trees: bool,
    /// Largest tree, in lock units (granules), a file's tree may grow to.
    #[arg(long, default_value_t = citronfs_meta_server::service::DEFAULT_MAX_TREE_UNITS)]
    pub max_tree_units: u64,
}

impl LockArgs {
    pub fn apply(&self, cfg: &mut MetaServerConfig) {
        cfg.lock_params = ClusterLockParams {
            t_wait_us: self.lock_t_wait_us,
            lease_ms: self.lock_lease_ms,
            ..ClusterLockParams::default()
        };
        cfg.lock_bytes = self.lock_memory.0;
        cfg.lock_choice =
            LockChoice { range: self.range_lock, inode: self.inode_lock, granule: self.lock_granule.0 };
    }
}

impl MetaServerArgs {
    pub fn config(&self) -> MetaServerConfig {
        let mut cfg = MetaServerConfig::new(self.listen);
        cfg.chunk_size = self.chunk_size.0;
        cfg.lease = Duration::from_millis(self.lease_ms);
        cfg.shm = self.shm.clone();
        cfg.ib = self.ib.clone();
        cfg.slot_bytes = self.max_files.max(1).saturating_mul(citronfs_core::proto::AttrSlot::BYTES);
        cfg.state_dir = self.state_dir.clone().or_else(|| default_state_dir(self.listen));
        cfg.grace = self.grace_ms.map(Duration::from_millis);
        self.locks.apply(&mut cfg);
        cfg
    }
}

#[derive(Args, Debug)]
pub struct DataServerArgs {
    /// Address of this server's software NIC (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The meta-server to register with.
    #[arg(long)]
    meta: SocketAddr,
    /// DRAM to export for file data, touched only as it is written
    /// [default: half of the host's RAM, and with --shm no more than
    /// /dev/shm has free].
    #[arg(long)]
    capacity: Option<ByteSize>,
    /// Also publish the memory as shm fabric NAME (for clients on this host).
    #[arg(long, value_name = "NAME")]
    shm: Option<String>,
    /// Also serve the memory to RDMA clients through this device.
    #[arg(long, value_name = "DEVICE")]
    ib: Option<IbDevice>,
    /// Keep the memory in DIR (a sparse file and this server's identity):
    /// a restarted server re-adopts it. On a persistent path it survives a
    /// reboot [default: /dev/shm/citronfs.data/NAME, NAME the --shm name,
    /// or the --listen address when its port is fixed].
    #[arg(long, value_name = "DIR", conflicts_with = "ephemeral")]
    data_dir: Option<std::path::PathBuf>,
    /// Keep no memory across a restart: when this server stops, the data
    /// of its files is lost.
    #[arg(long)]
    ephemeral: bool,
    #[command(flatten)]
    key: KeyArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

impl DataServerArgs {
    /// Where the memory is kept ([`DataServerArgs::data_dir`]), if it is.
    fn memory_dir(&self) -> Option<std::path::PathBuf> {
        use citronfs_meta_server::data_dir::DataDir;
        if self.ephemeral {
            return None;
        }
        if let Some(dir) = &self.data_dir {
            return Some(dir.clone());
        }
        if let Some(name) = &self.shm {
            return Some(DataDir::default_path(name));
        }
        if self.listen.port() != 0 {
            return Some(DataDir::default_path(&self.listen.to_string()));
        }
        log::warn!(
            "this data server's memory is not kept across a restart: it listens on port 0 and has no \
             --shm name to find it again by; give --data-dir, --shm or a fixed --listen port"
        );
        None
    }
}

/// Tells the service manager (if `$NOTIFY_SOCKET` names one) that the
/// service is ready, with `status` as its status line.
pub fn notify_ready(status: &str) {
    use sd_notify::NotifyState;
    if let Err(e) = sd_notify::notify(false, &[NotifyState::Ready, NotifyState::Status(status)]) {
        log::warn!("cannot notify the service manager: {e}");
    }
}

/// Tells the service manager that the service is stopping.
pub fn notify_stopping() {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
}

/// The end of a server's life: SIGINT, SIGTERM or SIGHUP, caught from the
/// moment it is made. Make it before announcing readiness: a service
/// manager may send SIGTERM as soon as it hears `READY=1`, and a signal
/// that came before the handler would kill the server without `STOPPING=1`
/// and without the clean shutdown.
pub struct StopSignal {
    received: std::sync::mpsc::Receiver<()>,
}

impl StopSignal {
    pub fn install() -> Result<Self> {
        let (tx, received) = std::sync::mpsc::channel();
        ctrlc::set_handler(move || {
            let _ = tx.send(());
        })
        .context("cannot install the signal handler")?;
        Ok(Self { received })
    }

    /// Blocks until one of the signals arrives (or has arrived).
    pub fn wait(self) {
        let _ = self.received.recv();
    }
}

pub fn run_meta(args: MetaServerArgs) -> Result<()> {
    let mut config = args.config();
    config.keyring = args.key.for_server(args.listen, "the meta-server")?;
    let stop = StopSignal::install()?;
    let server = MetaServer::start(config).with_context(|| format!("cannot start on {}", args.listen))?;
    let status = format!("meta-server listening on {} (nic {})", server.local_addr(), server.nic_addr());
    println!("{status}");
    log::info!("{status}");
    notify_ready(&status);
    stop.wait();
    notify_stopping();
    drop(server);
    Ok(())
}

pub fn run_data(args: DataServerArgs) -> Result<()> {
    let keyring = args.key.for_server(args.listen, "the data server")?;
    let stop = StopSignal::install()?;
    let (mut server, capacity) = match args.memory_dir() {
        Some(dir) => {
            let setup = DataServerSetup {
                listen: args.listen,
                meta: args.meta,
                shm: args.shm.as_deref(),
                ib: args.ib.as_ref(),
                keyring,
            };
            let server =
                DataServer::start_in(&dir, args.capacity.map(|c| c.0), setup).with_context(|| {
                    format!(
                        "cannot start a data server keeping its memory in {}, registered with {}",
                        dir.display(),
                        args.meta
                    )
                })?;
            let capacity = ByteSize(server.capacity());
            (server, capacity)
        }
        None => {
            let capacity = args.capacity.unwrap_or_else(|| {
                ByteSize(citronfs_meta_server::data_server::default_capacity(args.shm.is_some(), 0))
            });
            let server = DataServer::start_with(
                args.listen,
                args.meta,
                capacity.0,
                args.shm.as_deref(),
                args.ib.as_ref(),
                keyring,
            )
            .with_context(|| format!("cannot start a data server registered with {}", args.meta))?;
            (server, capacity)
        }
    };
    let status = format!("data server {} exporting {} on {}", server.id().0, capacity, server.nic_addr());
    println!("{status}");
    log::info!("{status}");
    notify_ready(&status);
    stop.wait();
    notify_stopping();
    if server.keeps_memory() {
        // A restart: the meta-server keeps its files until it is back.
        server.shutdown();
    } else if let Err(e) = server.leave() {
        // It stops all the same; the meta-server finds out when its probes fail.
        log::warn!("cannot tell the meta-server that this data server leaves: {e}");
    }
    drop(server);
    Ok(())
}
