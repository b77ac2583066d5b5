//! The data server: DRAM for file chunks, one region served by a software NIC
//! and registered with the meta-server. After registration its CPU does no
//! per-I/O work: clients read and write chunk memory with one-sided verbs.
//!
//! Capacity is like tmpfs's: the region is anonymous memory or a sparse shm
//! file, so the host gives it pages only as they are written, and by default
//! it may grow to half of the host's RAM ([`default_capacity`]). A region
//! published as shm lives in `/dev/shm`, a tmpfs of its own size: a write
//! past that file system's free space would kill the writer with SIGBUS, so
//! a capacity beyond it is refused.
//!
//! With a data directory ([`crate::data_dir`]) the region is a file there
//! that outlives the process: a restarted server re-adopts it and
//! registers again under the identity it had ([`DataServer::start_in`]);
//! its SIGTERM is then a restart, not a goodbye (see
//! `service::data_servers` for down and lost servers). Without one the
//! memory dies with the process.
//!
//! With a key file the data server proves the cluster key to the
//! meta-server, lets in only holders of the key and registered clients'
//! sessions, and its NIC enforces the grants the meta-server pushes to it
//! ([`citron_lock::rdma::tcp::access`]).

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::tcp::{AccessTable, RpcClient};
use citron_lock::rdma::{IbDevice, IbHost, RegionId, RegionMemory, RegionTable, ShmHost, TcpHost};
use citron_rpc::auth::{Authority, Credential, Credentials, Keyring};
use citronfs_core::proto::{MetaRequest, MetaResponse};
use citronfs_core::types::DataServerId;
use citronfs_core::FsError;

use crate::data_dir::{DataDir, DataIdentity, IDENTITY_VERSION};

/// The region a data server exports.
pub const DATA_REGION: RegionId = RegionId(1);

pub struct DataServer {
    nic: TcpHost,
    /// The same memory as a shm fabric, for clients on this host.
    _shm: Option<ShmHost>,
    /// The same memory registered with an RNIC, for `ib` clients.
    _ib: Option<IbHost>,
    id: DataServerId,
    rpc: RpcClient<MetaRequest, MetaResponse>,
    /// Where the memory is kept, if it is (locked while we live).
    data_dir: Option<DataDir>,
    capacity: u64,
}

/// Everything a data server is started with besides its memory.
pub struct DataServerSetup<'a> {
    pub listen: SocketAddr,
    pub meta: SocketAddr,
    /// Publish the memory as this shm fabric too (clients on this host).
    pub shm: Option<&'a str>,
    /// Serve RDMA clients through this device too.
    pub ib: Option<&'a IbDevice>,
    /// The cluster's keys (the cluster key), in a cluster with keys.
    pub keyring: Option<Arc<Keyring>>,
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
        Self::start_with(listen, meta, capacity, shm, None, None)
    }

    /// As [`DataServer::start`], also serving the memory to RDMA clients on
    /// `ib` (its control channel listens on `listen`'s address).
    pub fn start_with_ib(
        listen: SocketAddr,
        meta: SocketAddr,
        capacity: u64,
        shm: Option<&str>,
        ib: Option<&IbDevice>,
    ) -> Result<Self, FsError> {
        Self::start_with(listen, meta, capacity, shm, ib, None)
    }

    /// [`DataServer::start`] in a cluster with keys: `keyring` must hold
    /// the cluster key.
    pub fn start_keyed(
        listen: SocketAddr,
        meta: SocketAddr,
        capacity: u64,
        shm: Option<&str>,
        keyring: Option<Arc<Keyring>>,
    ) -> Result<Self, FsError> {
        Self::start_with(listen, meta, capacity, shm, None, keyring)
    }

    /// [`DataServer::start`] with everything: an RNIC to serve `ib`
    /// clients on, and the cluster's keys.
    pub fn start_with(
        listen: SocketAddr,
        meta: SocketAddr,
        capacity: u64,
        shm: Option<&str>,
        ib: Option<&IbDevice>,
        keyring: Option<Arc<Keyring>>,
    ) -> Result<Self, FsError> {
        Self::start_inner(DataServerSetup { listen, meta, shm, ib, keyring }, capacity, None)
    }

    /// Starts a data server whose memory is kept in the data directory
    /// `dir` ([`crate::data_dir`]): re-adopted, with the identity it had,
    /// if the directory holds one; made and recorded there otherwise.
    /// `capacity`: for a new directory (`None`: [`default_capacity`]); a
    /// kept one has its own, which a given one must match.
    pub fn start_in(
        dir: &std::path::Path,
        capacity: Option<u64>,
        setup: DataServerSetup<'_>,
    ) -> Result<Self, FsError> {
        let data_dir = DataDir::open(dir)?;
        let capacity = data_dir.capacity(capacity, || default_capacity_in(dir))?;
        Self::start_inner(setup, capacity, Some(data_dir))
    }

    fn start_inner(
        setup: DataServerSetup<'_>,
        capacity: u64,
        mut data_dir: Option<DataDir>,
    ) -> Result<Self, FsError> {
        let DataServerSetup { listen, meta, shm, ib, keyring } = setup;
        let credentials = match &keyring {
            Some(ring) => {
                let key = ring.cluster_key().ok_or_else(|| {
                    FsError::Invalid("a data server's key file needs the cluster key (role=server)".into())
                })?;
                Credentials::new(Credential::Key(key.clone()))
            }
            None => Credentials::anonymous(),
        };
        let io = |e: std::io::Error| FsError::Io(e.to_string());
        if capacity < 1 << 20 {
            return Err(FsError::Invalid(format!("capacity {capacity} is below 1 MiB")));
        }
        let len = capacity.next_multiple_of(1 << 20);
        let region_file = match &data_dir {
            Some(d) => {
                // The memory lives where the directory is: a capacity beyond
                // what that file system has free (beyond what the kept
                // region already holds) would SIGBUS a writer there.
                if let Some(free) = dir_free_bytes(d.path()) {
                    let held = held_bytes(&d.region_path());
                    if capacity > free + held {
                        return Err(FsError::Invalid(format!(
                            "capacity {capacity} exceeds the {} bytes free in {}, where the data server \
                             keeps its memory: lower --capacity or give it room",
                            free + held,
                            d.path().display()
                        )));
                    }
                }
                Some(d.region(len)?)
            }
            None => None,
        };
        if let (None, Some(_), Some(free)) = (&data_dir, shm, shm_free_bytes()) {
            if capacity > free {
                return Err(FsError::Invalid(format!(
                    "capacity {capacity} exceeds the {free} bytes free in /dev/shm, where the data server \
                     publishes its memory: lower --capacity or enlarge /dev/shm"
                )));
            }
        }
        let (shm_host, regions) = match (shm, &region_file, &data_dir) {
            (Some(name), Some(_), Some(d)) => {
                let host = ShmHost::create(name)?;
                host.add_region_file(DATA_REGION, &d.region_path())?;
                let regions = host.regions().clone();
                (Some(host), regions)
            }
            (Some(name), _, _) => {
                let host = ShmHost::create(name)?;
                host.add_region(DATA_REGION, len)?;
                let regions = host.regions().clone();
                (Some(host), regions)
            }
            (None, Some(file), _) => {
                let regions = Arc::new(RegionTable::new());
                regions.insert(RegionMemory::from_file(DATA_REGION, file).map_err(io)?).map_err(io)?;
                (None, regions)
            }
            (None, None, _) => {
                let regions = Arc::new(RegionTable::new());
                regions.insert(RegionMemory::anonymous(DATA_REGION, len).map_err(io)?).map_err(io)?;
                (None, regions)
            }
        };
        let authority = Authority::from_keyring(keyring);
        let ib_host = match ib {
            Some(device) => Some(IbHost::spawn(
                device,
                SocketAddr::new(listen.ip(), 0),
                regions.clone(),
                authority.clone(),
            )?),
            None => None,
        };
        let access = Arc::new(AccessTable::default());
        let nic = TcpHost::spawn_with(listen, regions, authority, access).map_err(io)?;
        let mut advertised = nic.local_addr();
        let mut advertised_ib = ib_host.as_ref().map(IbHost::local_addr);
        if advertised.ip().is_unspecified() {
            // Tell clients the address this host reaches the meta-server from.
            let probe = TcpStream::connect_timeout(&meta, Duration::from_secs(3)).map_err(io)?;
            let ip = probe.local_addr().map_err(io)?.ip();
            advertised.set_ip(ip);
            if let Some(a) = advertised_ib.as_mut() {
                a.set_ip(ip);
            }
        }
        let rpc: RpcClient<MetaRequest, MetaResponse> =
            RpcClient::new(meta, Duration::from_secs(10)).with_credentials(credentials);
        let request = MetaRequest::RegisterDataServer {
            nic: advertised,
            shm: shm.map(str::to_string),
            ib: advertised_ib,
            region: DATA_REGION.0,
            capacity,
            rejoin: data_dir.as_ref().and_then(DataDir::identity).map(|i| i.server),
            fs: data_dir
                .as_ref()
                .and_then(DataDir::identity)
                .and_then(|i| i.file_system.as_deref()?.parse().ok()),
            kept: data_dir.is_some(),
            durable: data_dir.as_ref().is_some_and(DataDir::is_durable),
        };
        let (id, fs) = match rpc.call(&request)? {
            MetaResponse::DataServerRegistered(id, fs) => (id, fs),
            MetaResponse::Failed(e) => return Err(e),
            other => return Err(FsError::Io(format!("unexpected answer {other:?}"))),
        };
        if let Some(d) = data_dir.as_mut() {
            match d.identity() {
                Some(had) if had.server != id => {
                    return Err(FsError::Io(format!(
                        "the meta-server gave id {} to the data server that was {}",
                        id.0, had.server.0
                    )))
                }
                Some(had) if had.file_system.is_some() => {
                    log::info!("data server {} re-adopted its memory in {}", id.0, d.path().display())
                }
                // A data directory from before file systems had an
                // identity learns it now; a new one records it.
                _ => d.record(DataIdentity {
                    version: IDENTITY_VERSION,
                    server: id,
                    capacity,
                    region: DATA_REGION.0,
                    file_system: Some(fs.to_string()),
                })?,
            }
        }
        log::info!("data server {} serving {capacity} bytes on {advertised}", id.0);
        Ok(Self { nic, _shm: shm_host, _ib: ib_host, id, rpc, data_dir, capacity })
    }

    /// Whether the memory outlives this process (a data directory): then
    /// stopping is a restart, and the server does not leave.
    pub fn keeps_memory(&self) -> bool {
        self.data_dir.is_some()
    }

    /// The region's bytes the host has given pages to (what writes have
    /// touched), for a region published as shm; `None` otherwise.
    pub fn resident_bytes(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        let shm = self._shm.as_ref()?;
        let meta = std::fs::metadata(shm.dir().join(format!("region-{}", DATA_REGION.0))).ok()?;
        Some(meta.blocks() * 512)
    }

    pub fn id(&self) -> DataServerId {
        self.id
    }

    /// Bytes offered.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn nic_addr(&self) -> SocketAddr {
        self.nic.local_addr()
    }

    /// Who may touch which memory through this server's NIC.
    pub fn access(&self) -> &Arc<AccessTable> {
        self.nic.access()
    }

    /// Connections its NIC refused in the handshake.
    pub fn refused_handshakes(&self) -> u64 {
        self.nic.stats().refused_handshakes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Connections and requests the NIC has served.
    pub fn nic_stats(&self) -> &citron_lock::rdma::tcp::ServerStats {
        self.nic.stats()
    }

    /// Cuts every connection, as a crash would.
    pub fn shutdown(&mut self) {
        self.nic.shutdown();
    }

    /// Goes away in order (SIGTERM): tells the meta-server, which stops
    /// allocating here and answers EIO for the files whose data this
    /// server's memory held (their names stay), then stops serving. The
    /// shm fabric goes when the server is dropped.
    pub fn leave(&mut self) -> Result<(), FsError> {
        let told = match self.rpc.call(&MetaRequest::DataServerLeaves { id: self.id }) {
            Ok(MetaResponse::Done) => Ok(()),
            Ok(MetaResponse::Failed(e)) => Err(e),
            Ok(other) => Err(FsError::Io(format!("unexpected answer {other:?}"))),
            Err(e) => Err(e.into()),
        };
        self.shutdown();
        told
    }
}

/// Bytes free in `/dev/shm` (where shm regions live), if it can be asked.
pub fn shm_free_bytes() -> Option<u64> {
    dir_free_bytes(std::path::Path::new("/dev/shm"))
}

/// Bytes the file at `path` holds (0 if it is not there).
fn held_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// Bytes free in the file system of `dir`, if it can be asked.
pub fn dir_free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is a valid out-pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The host's RAM in bytes.
pub fn host_ram_bytes() -> u64 {
    // SAFETY: sysconf has no memory preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages.max(0) as u64).saturating_mul(page.max(0) as u64)
}

/// The capacity a data server keeping its memory in `dir` takes when none
/// is given: half of the host's RAM, and no more than `dir`'s file system
/// has free, in whole MiB.
pub fn default_capacity_in(dir: &std::path::Path) -> u64 {
    let mut capacity = host_ram_bytes() / 2;
    if let Some(free) = dir_free_bytes(dir) {
        capacity = capacity.min(free);
    }
    (capacity & !((1 << 20) - 1)).max(1 << 20)
}

/// The capacity a data server takes when none is given, as tmpfs does: half
/// of the host's RAM (touched only as files are written), and for a region
/// published as shm no more than `/dev/shm` has free (less `reserve`, the
/// room other shm regions of the process need), in whole MiB.
pub fn default_capacity(shm: bool, reserve: u64) -> u64 {
    let mut capacity = host_ram_bytes() / 2;
    if shm {
        if let Some(free) = shm_free_bytes() {
            capacity = capacity.min(free.saturating_sub(reserve));
        }
    }
    (capacity & !((1 << 20) - 1)).max(1 << 20)
}
