//! A mount of a cluster in a process of its own (a client node that can be
//! killed or stopped). Prints `mounted` once the file system is served,
//! then serves until killed or unmounted. Logs go to stderr when `RUST_LOG`
//! asks for them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_mount::{spawn_mount, CitronFuse, MountOptions};

#[derive(Parser)]
struct Args {
    /// The meta-server's RPC address.
    meta: SocketAddr,
    /// Where to mount.
    dir: PathBuf,
    /// Reach server memory over tcp even where shm is present.
    #[arg(long)]
    tcp: bool,
    /// Prove the first key of this key file.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Coherent caching with this grant TTL, in ms (0: none).
    #[arg(long, default_value_t = 0)]
    cache_ttl_ms: u64,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("off")).init();
    let args = Args::parse();
    let mut config = ClientConfig::new(args.meta);
    config.timeout = Duration::from_secs(3);
    if args.tcp {
        config.transport = Transport::Tcp;
    }
    if let Some(path) = &args.key_file {
        let ring = citron_rpc::auth::Keyring::load(path)?;
        config.key = Some(ring.first().clone());
    }
    let client = FsClient::connect(config)?;
    let options =
        MountOptions { cache_ttl: Duration::from_millis(args.cache_ttl_ms), ..MountOptions::default() };
    let session = spawn_mount(CitronFuse::new(client, options), &args.dir)?;
    println!("mounted");
    session.join()?;
    Ok(())
}
