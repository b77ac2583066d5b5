//! Errors of the verbs layer.

use serde::{Deserialize, Serialize};

use super::addr::{ClientAddr, RegionId, RemoteAddr};

/// Why a single verb failed. These travel on the wire, so a remote host's
/// refusal reaches the client as the same value a local check would give.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum VerbError {
    #[error("no region {0:?} is registered on this host")]
    UnknownRegion(RegionId),
    #[error("{addr} + {len} bytes is outside the region ({region_len} bytes)")]
    OutOfBounds { addr: RemoteAddr, len: u64, region_len: u64 },
    #[error("{addr} is not aligned to {align} bytes")]
    Misaligned { addr: RemoteAddr, align: u64 },
    #[error("transfer of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: u64, max: u64 },
    #[error("the host could not decode the request: {0}")]
    Malformed(String),
    /// No grant of this client covers the bytes (see `rdma::tcp::access`).
    #[error("{addr} + {len} bytes is not granted to this client")]
    NotGranted { addr: RemoteAddr, len: u64 },
    /// The host could not back the bytes with memory: the file system that
    /// holds its shm region is full (`ENOSPC`, `ENOMEM`, `EDQUOT`). A write
    /// through the mapping would have killed the writer with `SIGBUS`.
    #[error("the host has no memory left for {len} bytes at {addr}: {reason}")]
    NoMemory { addr: RemoteAddr, len: u64, reason: String },
    /// Writing the host's region file failed otherwise.
    #[error("writing {len} bytes at {addr} into the host's region failed: {reason}")]
    HostIo { addr: RemoteAddr, len: u64, reason: String },
}

/// Why a round trip (a verb, a batch or a message) could not be completed at
/// all. Distinct from [`VerbError`], which is a verb the host refused.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("connection to the host failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the host closed the connection")]
    Disconnected,
    #[error("no reply from the host within {0:?}")]
    Timeout(std::time::Duration),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("no route to client {0}")]
    UnknownClient(ClientAddr),
    #[error("shared-memory fabric: {0}")]
    Shm(String),
    #[error("the host has no lock-free 16-byte atomics; the shm backend needs them")]
    No128BitAtomics,
    /// The `ib` backend: no such device, a verbs call failed, a work request
    /// completed with an error, or the build has no `rdma` feature.
    #[error("ib: {0}")]
    Ib(String),
    /// The connection's handshake failed (no key, wrong key, not admitted).
    #[error(transparent)]
    Handshake(#[from] citron_rpc::auth::HandshakeError),
}

impl From<citron_rpc::RpcError> for TransportError {
    fn from(e: citron_rpc::RpcError) -> Self {
        use citron_rpc::RpcError;
        match e {
            RpcError::Io(e) | RpcError::Unreachable(e) => TransportError::Io(e),
            RpcError::Disconnected => TransportError::Disconnected,
            RpcError::Timeout(t) => TransportError::Timeout(t),
            RpcError::Protocol(p) => TransportError::Protocol(p),
            RpcError::Handshake(h) => TransportError::Handshake(h),
        }
    }
}

/// The error of a single-verb convenience call: either the round trip failed
/// or the host refused the verb.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    #[error(transparent)]
    Verb(#[from] VerbError),
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl From<std::io::Error> for RdmaError {
    fn from(e: std::io::Error) -> Self {
        RdmaError::Transport(TransportError::Io(e))
    }
}
