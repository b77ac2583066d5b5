//! The meta-server's own access to a data server's memory, for the few
//! things it does there itself: zeroing an extent's old bytes before a
//! client may read it, copying a chunk that moves to a bigger extent, and
//! giving a whole free chunk's pages back to the host ([`Discard`]).
//!
//! It reaches the memory like a client on its host would: through the data
//! server's shm fabric when that is published on this host (then a zero or a
//! copy is a memcpy), through its NIC otherwise. Giving pages back needs the
//! region's file, so only a data server whose shm region is on this host —
//! an embedded one above all — returns deleted files' memory to the host; on
//! others a freed extent is zeroed when it is handed out again.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use citron_lock::rdma::shm::fabric_dir;
use citron_lock::rdma::{Endpoint, Node, NodeCredentials, RegionId, RemoteAddr, TcpOptions};
use citronfs_core::proto::DataServerInfo;
use citronfs_core::FsError;
use parking_lot::Mutex;

use crate::extents::Discard;

/// Largest piece of one zero or copy verb.
const PIECE: u64 = 4 << 20;

/// What a round of probes found ([`DataServerLink::probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Answered,
    /// Failed, but not yet for a whole lease.
    Failing,
    /// Failed every probe for a whole lease.
    Silent,
}

pub struct DataServerLink {
    pub info: DataServerInfo,
    /// Whether the server keeps its memory across its own restart (see
    /// `service::data_servers` for what that changes).
    pub kept: bool,
    /// Whether it is down: silent for a lease, not re-registered since.
    pub down: std::sync::atomic::AtomicBool,
    endpoint: Mutex<Endpoint>,
    /// The region's file, when the data server publishes it as shm here.
    region_file: Option<File>,
    /// Its region (probed for liveness).
    region: RegionId,
    /// Liveness probes ([`DataServerLink::probe`]): an endpoint on the
    /// server's NIC (never its shm fabric, whose mapping outlives a dead
    /// server), and since when probes have failed.
    prober: Mutex<(Option<Endpoint>, Option<Instant>)>,
    /// What the meta-server proves to the server (a keyed cluster).
    credentials: NodeCredentials,
}

impl DataServerLink {
    /// Joins the data server of `info`, whose memory is region `region`,
    /// proving `credentials`.
    pub fn connect(
        info: DataServerInfo,
        region: RegionId,
        kept: bool,
        credentials: NodeCredentials,
    ) -> Result<Self, FsError> {
        let local = info.shm.as_deref().map(fabric_dir).filter(|d| d.exists());
        let (node, region_file) = match (&info.shm, local) {
            (Some(name), Some(dir)) => {
                let node = Node::join_shm_as(name, credentials.clone())?;
                let path = dir.join(format!("region-{}", region.0));
                let file = std::fs::OpenOptions::new().read(true).write(true).open(&path);
                let file = file
                    .map_err(|e| log::warn!("cannot open {} to give pages back: {e}", path.display()))
                    .ok();
                (node, file)
            }
            _ => (Node::join_tcp_as(info.nic, TcpOptions::default(), credentials.clone())?, None),
        };
        // The probe connection is made now, while the server registers, not
        // at the first probe: a mount's work must not see the cluster open
        // connections at some later moment of its own (they are counted).
        // A server that does not answer yet is probed over a fresh
        // connection later, like one whose connection broke.
        let probe = Self::probe_endpoint(&info, &credentials, TcpOptions::default().connect_timeout)
            .map_err(|e| log::info!("data server {}: no probe connection yet: {e}", info.id.0))
            .ok();
        Ok(Self {
            info,
            kept,
            down: std::sync::atomic::AtomicBool::new(false),
            endpoint: Mutex::new(node.endpoint()?),
            region_file,
            region,
            prober: Mutex::new((probe, None)),
            credentials,
        })
    }

    /// A fresh endpoint on the server's NIC whose waits last at most `wait`.
    fn probe_endpoint(
        info: &DataServerInfo,
        credentials: &NodeCredentials,
        wait: Duration,
    ) -> Result<Endpoint, FsError> {
        let options = TcpOptions::with_timeouts(wait, wait);
        Ok(Node::join_tcp_as(info.nic, options, credentials.clone())?.endpoint()?)
    }

    /// Reads one word of the server's memory through its NIC, over a fresh
    /// connection after a failure (a server that died refuses it at once),
    /// waiting at most `wait`. Tells whether the server answered, and if
    /// not whether it has now failed every probe for `lease`.
    pub fn probe(&self, wait: Duration, lease: Duration) -> Probe {
        let word = RemoteAddr::new(self.region, 0);
        let mut prober = self.prober.lock();
        let (endpoint, failing_since) = &mut *prober;
        let answered = endpoint.as_ref().is_some_and(|ep| ep.read_u64(word).is_ok()) || {
            match Self::probe_endpoint(&self.info, &self.credentials, wait) {
                Ok(fresh) if fresh.read_u64(word).is_ok() => {
                    *endpoint = Some(fresh);
                    true
                }
                _ => {
                    *endpoint = None;
                    false
                }
            }
        };
        if answered {
            *failing_since = None;
            Probe::Answered
        } else if failing_since.get_or_insert_with(Instant::now).elapsed() >= lease {
            Probe::Silent
        } else {
            Probe::Failing
        }
    }

    /// How long the server has failed every probe, if its last one failed.
    pub fn unanswered_for(&self) -> Option<Duration> {
        self.prober.lock().1.map(|since| since.elapsed())
    }

    /// Writes zeros over `[addr, addr + len)`.
    pub fn zero(&self, addr: RemoteAddr, len: u64) -> Result<(), FsError> {
        let zeros = vec![0u8; len.min(PIECE) as usize];
        let ep = self.endpoint.lock();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PIECE);
            ep.write(addr + done, &zeros[..n as usize])?;
            done += n;
        }
        Ok(())
    }

    /// Copies `len` bytes from `from` on this server to `to` on `dest`.
    pub fn copy(
        &self,
        from: RemoteAddr,
        len: u64,
        dest: &DataServerLink,
        to: RemoteAddr,
    ) -> Result<(), FsError> {
        let mut buf = vec![0u8; len.min(PIECE) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PIECE) as usize;
            self.endpoint.lock().read(from + done, &mut buf[..n])?;
            dest.endpoint.lock().write(to + done, &buf[..n])?;
            done += n as u64;
        }
        Ok(())
    }

    /// How the allocator gives this server's pages back, if it can: punching
    /// a hole in the region's file frees the pages in every process that
    /// maps it, and they read zero after.
    pub fn discard(&self) -> Option<Discard> {
        let file = self.region_file.as_ref()?.try_clone().ok()?;
        let server = self.info.id;
        Some(Box::new(move |offset: u64, len: u64| {
            // SAFETY: fallocate(2) on a descriptor we own, with no memory
            // arguments; a mapping of the range stays valid (it reads zero).
            let r = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if r != 0 {
                log::warn!(
                    "cannot give back pages of data server {} at {offset:#x}: {}",
                    server.0,
                    std::io::Error::last_os_error()
                );
            }
            r == 0
        }))
    }
}
