//! `citronfs meta-server` and `citronfs data-server`: run one server role in
//! the foreground until interrupted.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use citron_lock::range_lock::RangeAlgorithm;
use citron_lock::rwlock::Algorithm;
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::ClusterLockParams;
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use clap::Args;

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
    #[command(flatten)]
    pub locks: LockArgs,
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
    /// Memory for lock areas and lock-record tables.
    #[arg(long, default_value = "64MiB")]
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
    /// DRAM to export for file data.
    #[arg(long, default_value = "1GiB")]
    capacity: ByteSize,
    /// Also publish the memory as shm fabric NAME (for clients on this host).
    #[arg(long, value_name = "NAME")]
    shm: Option<String>,
}

/// Blocks until SIGINT or SIGTERM.
pub fn wait_for_signal() -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("cannot install the signal handler")?;
    let _ = rx.recv();
    Ok(())
}

pub fn run_meta(args: MetaServerArgs) -> Result<()> {
    let server =
        MetaServer::start(args.config()).with_context(|| format!("cannot start on {}", args.listen))?;
    println!("meta-server listening on {} (nic {})", server.local_addr(), server.nic_addr());
    wait_for_signal()?;
    drop(server);
    Ok(())
}

pub fn run_data(args: DataServerArgs) -> Result<()> {
    let server = DataServer::start(args.listen, args.meta, args.capacity.0, args.shm.as_deref())
        .with_context(|| format!("cannot start a data server registered with {}", args.meta))?;
    println!("data server {} exporting {} on {}", server.id().0, args.capacity, server.nic_addr());
    wait_for_signal()?;
    drop(server);
    Ok(())
}
