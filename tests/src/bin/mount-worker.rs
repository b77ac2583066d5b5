//! A mount of a cluster in a process of its own (a client node that can be
//! killed): `mount-worker META_ADDR DIR [--tcp] [--key-file PATH]` (the
//! first key of the file is the one proved). Prints `mounted` once the file
//! system is served, then serves until killed or unmounted.

use std::time::Duration;

use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_mount::{spawn_mount, CitronFuse, MountOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(meta), Some(dir)) = (args.get(1), args.get(2)) else {
        anyhow::bail!("usage: mount-worker META_ADDR DIR [--tcp] [--key-file PATH]");
    };
    let mut config = ClientConfig::new(meta.parse()?);
    config.timeout = Duration::from_secs(3);
    if args.iter().any(|a| a == "--tcp") {
        config.transport = Transport::Tcp;
    }
    if let Some(i) = args.iter().position(|a| a == "--key-file") {
        let path = args.get(i + 1).ok_or_else(|| anyhow::anyhow!("--key-file needs a path"))?;
        let ring = citron_rpc::auth::Keyring::load(std::path::Path::new(path))?;
        config.key = Some(ring.first().clone());
    }
    let client = FsClient::connect(config)?;
    let session = spawn_mount(CitronFuse::new(client, MountOptions::default()), std::path::Path::new(dir))?;
    println!("mounted");
    session.join()?;
    Ok(())
}
