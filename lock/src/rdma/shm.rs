//! The `shm` backend: every process on one host maps the same region files
//! (under `/dev/shm`) and executes verbs with CPU atomics. No host thread takes
//! part; the "NIC" is the client's own CPU.
//!
//! Layout of a fabric directory `/dev/shm/citronfs-<name>/`:
//!
//! | file | what |
//! |---|---|
//! | `control` | 4 KiB; word 0 is the next node id (taken with fetch-and-add) |
//! | `region-<id>` | one registered region, published by rename once sized, or a symbolic link to a file that outlives the fabric (a data server's data directory, [`ShmHost::add_region_file`]) |
//! | `region-<id>.nic` | only in the test mode [`RemoteAtomicity::NicOnly`]: the page holding the region's NIC mutex, created before the region is published |
//! | `node-<id>.sock` | the node's datagram socket for two-sided messages |
//!
//! Two-sided messages are Unix datagrams, one per message, so a send is one
//! system call and needs no connection.
//!
//! The host holds a lock on the directory for as long as the fabric lives;
//! a fabric whose lock nobody holds is an orphan that the next citronfs
//! start removes ([`super::shm_owner`]).
//!
//! Nothing can be checked here: a process that maps a region file can touch
//! every byte of it, and keys and grants (the tcp backend's
//! [`super::tcp::access`]) do not apply. The shm backend therefore serves
//! processes of one trusted host, as one user: the fabric directory is
//! created mode 700 and its files mode 600, so only the user that runs the
//! servers (root, for a file system) can map them or send messages.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use portable_atomic::AtomicU128;

use super::addr::{ClientAddr, NodeId, RegionId, RemoteAddr};
use super::atomicity::{RemoteAtomicity, NIC_PAGE};
use super::codec;
use super::error::{TransportError, VerbError};
use super::mailbox::{Envelope, MailboxRouter, Message, MAX_MESSAGE};
use super::memory::{RegionMemory, RegionTable};
use super::shm_owner::{self, OwnerLock};

/// How long a message waits for room in its receiver's queue. The queue
/// is short (`net.unix.max_dgram_qlen`) and its receiver thread drains it
/// as messages come, so a queue full for this long belongs to a process
/// that is stopped (SIGSTOP, a debugger) or starved: the send then fails
/// (`WouldBlock`) instead of holding the sender until that process runs
/// again. Messages may be lost anyway, and their senders retry or poll.
const SEND_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

const CONTROL_LEN: u64 = 4096;
const NEXT_NODE_WORD: RemoteAddr = RemoteAddr::new(RegionId(u32::MAX), 0);

/// The directory of the fabric called `name`.
pub fn fabric_dir(name: &str) -> PathBuf {
    PathBuf::from(shm_owner::SHM_ROOT).join(format!("{}{name}", shm_owner::FABRIC_PREFIX))
}

fn shm_err(what: impl std::fmt::Display, path: &Path, e: std::io::Error) -> TransportError {
    TransportError::Shm(format!("{what} {}: {e}", path.display()))
}

fn check_atomics() -> Result<(), TransportError> {
    // Another process must see our 16-byte atomics as atomic, which rules out
    // portable-atomic's in-process lock fallback.
    if AtomicU128::is_lock_free() {
        Ok(())
    } else {
        Err(TransportError::No128BitAtomics)
    }
}

/// The host side of a shm fabric: creates the directory and registers regions.
/// Dropping it removes the directory (clients keep their mappings).
pub struct ShmHost {
    dir: PathBuf,
    regions: Arc<RegionTable>,
    /// The fabric is alive while this is held (released by the kernel if
    /// the process dies).
    _owner: OwnerLock,
}

impl ShmHost {
    /// Creates the fabric `name`. First removes every fabric of this host
    /// that no live process owns (a crashed host's, this name's included);
    /// a live fabric of the same name is an error.
    pub fn create(name: &str) -> Result<Self, TransportError> {
        check_atomics()?;
        let dir = fabric_dir(name);
        if let Err(e) = shm_owner::remove_orphans() {
            log::warn!("cannot sweep orphaned shm fabrics: {e}");
        }
        let owner = shm_owner::create_owned(&dir).map_err(|e| shm_err("cannot create", &dir, e))?;
        let host = Self { dir, regions: Arc::new(RegionTable::new()), _owner: owner };
        let control = host.dir.join("control");
        create_sized(&control, CONTROL_LEN)?;
        let ctl = RegionMemory::from_file(NEXT_NODE_WORD.region, &open_rw(&control)?)
            .map_err(|e| shm_err("cannot map", &control, e))?;
        // Node ids start at NodeId::FIRST_SHM (apart from a NIC's; 0 is
        // never a node).
        ctl.write_from(NEXT_NODE_WORD, &u64::from(NodeId::FIRST_SHM).to_le_bytes())
            .map_err(|e| TransportError::Shm(e.to_string()))?;
        Ok(host)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Registers a zeroed region of `len` bytes (a multiple of 16).
    pub fn add_region(&self, id: RegionId, len: u64) -> Result<Arc<RegionMemory>, TransportError> {
        self.add_region_with(id, len, RemoteAtomicity::WithHost)
    }

    /// Registers a zeroed region whose remote RMW verbs have `atomicity`
    /// ([`RemoteAtomicity::NicOnly`] is a test mode: every process that maps
    /// the region shares one NIC mutex, in the file `region-<id>.nic`).
    pub fn add_region_with(
        &self,
        id: RegionId,
        len: u64,
        atomicity: RemoteAtomicity,
    ) -> Result<Arc<RegionMemory>, TransportError> {
        let path = self.dir.join(format!("region-{}", id.0));
        if path.exists() {
            return Err(TransportError::Shm(format!("region {id:?} already exists")));
        }
        let tmp = self.dir.join(format!(".region-{}.tmp", id.0));
        create_sized(&tmp, len)?;
        let mut mem =
            RegionMemory::from_file(id, &open_rw(&tmp)?).map_err(|e| shm_err("cannot map", &tmp, e))?;
        if atomicity == RemoteAtomicity::NicOnly {
            // The NIC page exists before the region is published, so every
            // process that finds the region finds its NIC mutex too.
            let nic = nic_path(&self.dir, id);
            create_sized(&nic, NIC_PAGE)?;
            mem = mem.with_shared_nic_mutex(&open_rw(&nic)?).map_err(|e| shm_err("cannot map", &nic, e))?;
        }
        // Publish only once the file has its full size, so a client never maps a short file.
        fs::rename(&tmp, &path).map_err(|e| shm_err("cannot publish", &path, e))?;
        self.regions.insert(mem).map_err(|e| TransportError::Shm(e.to_string()))
    }

    /// Registers the memory of `file`, a file that outlives the fabric (a
    /// data server's data directory), as region `id`: published as a
    /// symbolic link `region-<id>` to it, so that clients map the file
    /// itself and removing the fabric (by its host, or a sweep of orphans)
    /// removes the link, never the memory.
    pub fn add_region_file(&self, id: RegionId, file: &Path) -> Result<Arc<RegionMemory>, TransportError> {
        let path = self.dir.join(format!("region-{}", id.0));
        if path.exists() {
            return Err(TransportError::Shm(format!("region {id:?} already exists")));
        }
        let target = fs::canonicalize(file).map_err(|e| shm_err("cannot resolve", file, e))?;
        let mem =
            RegionMemory::from_file(id, &open_rw(&target)?).map_err(|e| shm_err("cannot map", &target, e))?;
        std::os::unix::fs::symlink(&target, &path).map_err(|e| shm_err("cannot publish", &path, e))?;
        self.regions.insert(mem).map_err(|e| TransportError::Shm(e.to_string()))
    }

    /// The regions, as the host's own threads see them.
    pub fn regions(&self) -> &Arc<RegionTable> {
        &self.regions
    }
}

impl Drop for ShmHost {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            log::warn!("cannot remove shm fabric {}: {e}", self.dir.display());
        }
    }
}

fn nic_path(dir: &Path, id: RegionId) -> PathBuf {
    dir.join(format!("region-{}.nic", id.0))
}

fn open_rw(path: &Path) -> Result<File, TransportError> {
    OpenOptions::new().read(true).write(true).open(path).map_err(|e| shm_err("cannot open", path, e))
}

fn create_sized(path: &Path, len: u64) -> Result<(), TransportError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| shm_err("cannot create", path, e))?;
    f.set_len(len).map_err(|e| shm_err("cannot size", path, e))
}

/// A process's attachment to a shm fabric.
pub(crate) struct ShmNode {
    pub id: NodeId,
    dir: PathBuf,
    socket: Arc<UnixDatagram>,
    mapped: Mutex<HashMap<RegionId, Arc<RegionMemory>>>,
    stopping: Arc<AtomicBool>,
}

impl ShmNode {
    pub fn join(name: &str, router: Arc<MailboxRouter>) -> Result<Self, TransportError> {
        check_atomics()?;
        let dir = fabric_dir(name);
        // Never map the memory of a host that is gone.
        match shm_owner::owner_is_alive(&dir) {
            Ok(true) => {}
            Ok(false) => return Err(TransportError::Shm(format!("shm fabric {name} has no live host"))),
            Err(e) => return Err(shm_err("cannot open", &dir, e)),
        }
        let control = dir.join("control");
        let ctl = RegionMemory::from_file(NEXT_NODE_WORD.region, &open_rw(&control)?)
            .map_err(|e| shm_err("cannot map", &control, e))?;
        let id = ctl.faa(NEXT_NODE_WORD, 1).map_err(|e| TransportError::Shm(e.to_string()))?;
        let id = NodeId(u32::try_from(id).map_err(|_| TransportError::Shm("node ids exhausted".into()))?);
        let sock_path = dir.join(format!("node-{}.sock", id.0));
        let _ = fs::remove_file(&sock_path);
        let socket = UnixDatagram::bind(&sock_path).map_err(|e| shm_err("cannot bind", &sock_path, e))?;
        socket.set_write_timeout(Some(SEND_PATIENCE)).map_err(|e| shm_err("cannot set up", &sock_path, e))?;
        let socket = Arc::new(socket);
        let stopping = Arc::new(AtomicBool::new(false));
        {
            let socket = socket.clone();
            let stopping = stopping.clone();
            std::thread::Builder::new()
                .name(format!("shm-mbox-{}", id.0))
                .spawn(move || receive_loop(&socket, &router, &stopping))
                .map_err(TransportError::Io)?;
        }
        Ok(Self { id, dir, socket, mapped: Mutex::new(HashMap::new()), stopping })
    }

    /// The mapping of region `id`, mapping it on first use.
    pub fn region(&self, id: RegionId) -> Result<Arc<RegionMemory>, VerbError> {
        if let Some(r) = self.mapped.lock().get(&id) {
            return Ok(r.clone());
        }
        let path = self.dir.join(format!("region-{}", id.0));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|_| VerbError::UnknownRegion(id))?;
        let mut mem = RegionMemory::from_file(id, &file).map_err(|e| {
            log::warn!("cannot map {}: {e}", path.display());
            VerbError::UnknownRegion(id)
        })?;
        let nic = nic_path(&self.dir, id);
        if let Ok(nic_file) = OpenOptions::new().read(true).write(true).open(&nic) {
            mem = mem.with_shared_nic_mutex(&nic_file).map_err(|e| {
                log::warn!("cannot map {}: {e}", nic.display());
                VerbError::UnknownRegion(id)
            })?;
        }
        let mem = Arc::new(mem);
        self.mapped.lock().insert(id, mem.clone());
        Ok(mem)
    }

    pub fn send(&self, to: ClientAddr, message: Message) -> Result<(), TransportError> {
        if message.payload.len() > MAX_MESSAGE {
            return Err(TransportError::Protocol(format!(
                "message of {} bytes exceeds {MAX_MESSAGE}",
                message.payload.len()
            )));
        }
        let bytes = codec::encode(&Envelope { to: to.mailbox, message });
        let path = self.dir.join(format!("node-{}.sock", to.node.0));
        match self.socket.send_to(&bytes, &path) {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                Err(TransportError::UnknownClient(to))
            }
            Err(e) => Err(TransportError::Io(e)),
        }
    }
}

impl Drop for ShmNode {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the receive loop with an empty datagram, then remove our name.
        let path = self.dir.join(format!("node-{}.sock", self.id.0));
        let _ = self.socket.send_to(&[], &path);
        let _ = fs::remove_file(&path);
    }
}

fn receive_loop(socket: &UnixDatagram, router: &MailboxRouter, stopping: &AtomicBool) {
    let mut buf = vec![0u8; MAX_MESSAGE + 1024];
    loop {
        let n = match socket.recv(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                log::warn!("shm mailbox socket failed: {e}");
                return;
            }
        };
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        match codec::decode::<Envelope>(&buf[..n]) {
            Ok(env) => router.deliver(env),
            Err(e) => log::warn!("dropping malformed message ({n} bytes): {e}"),
        }
    }
}

/// The per-endpoint queue pair of the shm backend: a cache of region mappings
/// so a verb costs a vector index, not a lock.
pub(crate) struct ShmQp {
    node: Arc<ShmNode>,
    cache: RefCell<Vec<Option<Arc<RegionMemory>>>>,
}

impl ShmQp {
    pub fn new(node: Arc<ShmNode>) -> Self {
        Self { node, cache: RefCell::new(Vec::new()) }
    }

    #[inline]
    pub fn with_region<R>(
        &self,
        id: RegionId,
        f: impl FnOnce(&RegionMemory) -> Result<R, VerbError>,
    ) -> Result<R, VerbError> {
        let idx = id.0 as usize;
        {
            let cache = self.cache.borrow();
            if let Some(Some(r)) = cache.get(idx) {
                return f(r);
            }
        }
        self.with_region_slow(id, f)
    }

    #[cold]
    fn with_region_slow<R>(
        &self,
        id: RegionId,
        f: impl FnOnce(&RegionMemory) -> Result<R, VerbError>,
    ) -> Result<R, VerbError> {
        let region = self.node.region(id)?;
        let idx = id.0 as usize;
        // Small ids (the common case) are cached in the vector; a huge id from
        // a buggy caller must not make us allocate gigabytes.
        if idx < 4096 {
            let mut cache = self.cache.borrow_mut();
            if cache.len() <= idx {
                cache.resize(idx + 1, None);
            }
            cache[idx] = Some(region.clone());
        }
        f(&region)
    }
}
