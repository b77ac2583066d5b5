//! The data server: DRAM for file chunks, one region served by a software NIC
//! and registered with the meta-server. After registration its CPU does no
//! per-I/O work: clients read and write chunk memory with one-sided verbs.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::tcp::RpcClient;
use citron_lock::rdma::{RegionId, RegionMemory, RegionTable, ShmHost, TcpHost};
use citronfs_core::proto::{MetaRequest, MetaResponse};
use citronfs_core::types::DataServerId;
use citronfs_core::FsError;

/// The region a data server exports.
pub const DATA_REGION: RegionId = RegionId(1);

pub struct DataServer {
    nic: TcpHost,
    /// The same memory as a shm fabric, for clients on this host.
    _shm: Option<ShmHost>,
    id: DataServerId,
}

impl DataServer {
    /// Exports `capacity` bytes on `listen` (and, with `shm`, as the shm
    /// fabric of that name: the same memory) and registers with `meta`.
    pub fn start(
        listen: SocketAddr,
        meta: SocketAddr,
        capacity: u64,
        shm: Option<&str>,
    ) -> Result<Self, FsError> {
        let io = |e: std::io::Error| FsError::Io(e.to_string());
        if capacity < 1 << 20 {
            return Err(FsError::Invalid(format!("capacity {capacity} is below 1 MiB")));
        }
        let len = capacity.next_multiple_of(1 << 20);
        let (shm_host, regions) = match shm {
            Some(name) => {
                let host = ShmHost::create(name)?;
                host.add_region(DATA_REGION, len)?;
                let regions = host.regions().clone();
                (Some(host), regions)
            }
            None => {
                let regions = Arc::new(RegionTable::new());
                regions.insert(RegionMemory::anonymous(DATA_REGION, len).map_err(io)?).map_err(io)?;
                (None, regions)
            }
        };
        let nic = TcpHost::spawn(listen, regions).map_err(io)?;
        let mut advertised = nic.local_addr();
        if advertised.ip().is_unspecified() {
            // Tell clients the address this host reaches the meta-server from.
            let probe = TcpStream::connect_timeout(&meta, Duration::from_secs(3)).map_err(io)?;
            advertised.set_ip(probe.local_addr().map_err(io)?.ip());
        }
        let rpc: RpcClient<MetaRequest, MetaResponse> = RpcClient::new(meta, Duration::from_secs(10));
        let request = MetaRequest::RegisterDataServer {
            nic: advertised,
            shm: shm.map(str::to_string),
            region: DATA_REGION.0,
            capacity,
        };
        let id = match rpc.call(&request)? {
            MetaResponse::DataServerRegistered(id) => id,
            MetaResponse::Failed(e) => return Err(e),
            other => return Err(FsError::Io(format!("unexpected answer {other:?}"))),
        };
        log::info!("data server {} serving {capacity} bytes on {advertised}", id.0);
        Ok(Self { nic, _shm: shm_host, id })
    }

    pub fn id(&self) -> DataServerId {
        self.id
    }

    pub fn nic_addr(&self) -> SocketAddr {
        self.nic.local_addr()
    }

    /// Connections and requests the NIC has served.
    pub fn nic_stats(&self) -> &citron_lock::rdma::tcp::ServerStats {
        self.nic.stats()
    }

    /// Cuts every connection, as a crash would.
    pub fn shutdown(&mut self) {
        self.nic.shutdown();
    }
}
