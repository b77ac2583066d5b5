//! `citronfs meta-server` and `citronfs data-server`: run one server role in
//! the foreground until interrupted.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
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
}

impl MetaServerArgs {
    pub fn config(&self) -> MetaServerConfig {
        let mut cfg = MetaServerConfig::new(self.listen);
        cfg.chunk_size = self.chunk_size.0;
        cfg.lease = Duration::from_millis(self.lease_ms);
        cfg.shm = self.shm.clone();
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
