//! `citronfs region-host`: serves regions of memory over the tcp software NIC,
//! as a shm fabric and/or to RDMA NICs (`ib`), all at once, until
//! interrupted. The servers of later issues
//! embed the same host; this command exposes it alone, for benchmarks and
//! for clients on other machines.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use citron_lock::rdma::{IbDevice, IbHost, RegionId, RegionMemory, RegionTable, ShmHost, TcpHost};
use clap::Args;

use crate::size::ByteSize;

/// `ID:SIZE`, e.g. `1:64MiB`.
#[derive(Clone, Debug)]
pub struct RegionSpec {
    id: RegionId,
    len: ByteSize,
}

impl FromStr for RegionSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (id, len) =
            s.split_once(':').ok_or_else(|| format!("region {s:?} is not ID:SIZE (e.g. 1:64MiB)"))?;
        let id = id.parse().map_err(|_| format!("region id {id:?} is not a number"))?;
        Ok(Self { id: RegionId(id), len: len.parse()? })
    }
}

#[derive(Args, Debug)]
pub struct RegionHostArgs {
    /// Serve the regions over tcp on this address (e.g. 127.0.0.1:7100).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Also publish the regions as the shm fabric NAME (same memory: shm
    /// clients on this host and tcp clients elsewhere see the same words).
    #[arg(long, value_name = "NAME")]
    shm: Option<String>,
    /// Also serve the regions to RDMA clients: register them with this RDMA
    /// device (`mlx5_0`, `mlx5_0:PORT`, `mlx5_0:PORT:GID_INDEX`; needs a
    /// build with `--features rdma`). Clients join `ib:THEIR_DEVICE@ADDR`
    /// with the control address printed.
    #[arg(long, value_name = "DEVICE")]
    ib: Option<IbDevice>,
    /// Where the ib control channel listens (connection setup).
    #[arg(long, default_value = "0.0.0.0:0")]
    ib_listen: SocketAddr,
    /// A region to register, ID:SIZE; repeatable.
    #[arg(long = "region", default_value = "1:64MiB")]
    regions: Vec<RegionSpec>,
    /// Let in only holders of the cluster key of this file (required to
    /// listen on an address other hosts can reach).
    #[command(flatten)]
    key: crate::keys::KeyArgs,
}

pub fn run(args: RegionHostArgs) -> Result<()> {
    if args.listen.is_none() && args.shm.is_none() && args.ib.is_none() {
        bail!("nothing to serve: give --listen ADDR, --shm NAME, --ib DEVICE, or several");
    }
    // Before anything is served: a signal from then on stops it cleanly.
    let stop = crate::servers::StopSignal::install()?;
    let (shm, table) = match &args.shm {
        Some(name) => {
            let host = ShmHost::create(name).with_context(|| format!("cannot create shm fabric {name}"))?;
            for r in &args.regions {
                host.add_region(r.id, r.len.0).with_context(|| format!("region {}", r.id.0))?;
            }
            let table = host.regions().clone();
            (Some(host), table)
        }
        None => {
            let table = Arc::new(RegionTable::new());
            for r in &args.regions {
                let mem =
                    RegionMemory::anonymous(r.id, r.len.0).with_context(|| format!("region {}", r.id.0))?;
                table.insert(mem)?;
            }
            (None, table)
        }
    };
    let tcp = match args.listen {
        Some(addr) => {
            let keyring = args.key.for_server(addr, "the region host")?;
            let authority = citron_rpc::auth::Authority::from_keyring(keyring);
            let access = Arc::new(citron_lock::rdma::tcp::AccessTable::default());
            Some(
                TcpHost::spawn_with(addr, table.clone(), authority, access)
                    .with_context(|| format!("cannot listen on {addr}"))?,
            )
        }
        None => None,
    };
    let ib = match &args.ib {
        Some(device) => Some({
            let keyring = args.key.for_server(args.ib_listen, "the region host's RDMA channel")?;
            let authority = citron_rpc::auth::Authority::from_keyring(keyring);
            IbHost::spawn(device, args.ib_listen, table.clone(), authority)
                .with_context(|| format!("cannot serve the regions on RDMA device {device}"))?
        }),
        None => None,
    };
    for (id, len) in table.list() {
        println!("region {}: {}", id.0, ByteSize(len));
    }
    if let Some(t) = &tcp {
        println!("serving tcp:{}", t.local_addr());
    }
    if let Some(name) = &args.shm {
        println!("serving shm:{name}");
    }
    if let Some(h) = &ib {
        println!("serving ib:DEVICE@{} (RDMA device {} here)", h.local_addr(), h.device());
    }
    stop.wait();
    println!("stopping");
    drop(tcp);
    drop(shm);
    Ok(())
}
