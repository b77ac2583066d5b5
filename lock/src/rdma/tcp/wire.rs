//! The tcp backend's wire format, split from the code that drives it.
//!
//! Frames are those of the project's RPC transport ([`citron_rpc::frame`]:
//! `[u32 len][u64 seq][body]`), re-exported here; the body is a bincode
//! [`Request`] or [`Response`] (see [`crate::rdma::codec`]).
//!
//! Messages between nodes use the same framing with a zero `seq` and an
//! [`crate::rdma::mailbox::Envelope`] body.

use std::net::SocketAddr;

pub use citron_rpc::frame::{poll_readable, read_frame, write_frame, FrameError, HEADER_LEN};
use serde::{Deserialize, Serialize};

use super::access::AccessCommand;
use crate::rdma::addr::{NodeId, RegionId};
use crate::rdma::error::VerbError;
use crate::rdma::verb::{Verb, VerbReply};

/// Client to host.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// Join the fabric as a new node whose mailbox listener is at `mailbox`.
    Join {
        mailbox: SocketAddr,
    },
    /// Where does this node receive messages?
    Resolve(NodeId),
    /// The regions this host serves.
    ListRegions,
    Verb(Verb),
    /// The meta-server changes who may touch what (servers only).
    Access(Vec<AccessCommand>),
}

/// Host to client.
#[derive(Debug, Serialize, Deserialize)]
pub enum Response {
    Joined(NodeId),
    Resolved(Option<SocketAddr>),
    Regions(Vec<(RegionId, u64)>),
    Verb(Result<VerbReply, VerbError>),
    /// The request could not be decoded; the connection stays usable.
    Refused(VerbError),
    /// The access commands hold (revocations are complete).
    AccessApplied,
}
