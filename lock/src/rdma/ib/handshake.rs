//! The connection setup of the `ib` backend, as messages on the existing tcp
//! control channel ([`crate::rdma::tcp::rpc`]: framed bincode, one thread
//! per connection on the host).
//!
//! A reliable-connected queue pair needs the other side's QP number, its
//! starting packet sequence number and its address (LID on InfiniBand, GID
//! on RoCE) before it can move to RTR; one-sided verbs need the rkey and base
//! address of every region they target. So:
//!
//! | from → to | message | answer |
//! |---|---|---|
//! | endpoint → host | [`HostRequest::Connect`] (the endpoint's [`QpAddress`]) | [`HostResponse::Connected`]: the host's QP for it, and a [`RegionGrant`] per region |
//! | endpoint → host | [`HostRequest::Regions`] (a region it does not know yet) | [`HostResponse::Regions`] |
//! | endpoint → host | [`HostRequest::Execute`] (a 16-byte atomic, see [`super::plan`]) | [`HostResponse::Executed`] |
//! | node → host | [`HostRequest::Join`] (where its peer channel listens) | [`HostResponse::Joined`] (its node id) |
//! | node → host | [`HostRequest::Resolve`] | [`HostResponse::Resolved`] |
//! | node → node | [`PeerRequest::Connect`] (a message QP) | [`PeerResponse::Accepted`] |
//!
//! The host's QP for an endpoint lives as long as the control connection
//! that asked for it: when the connection ends, however it ends, the host
//! destroys the QP (so a crashed client leaves nothing behind), and the
//! endpoint keeps the connection open as long as it uses the QP.
//!
//! Everything that arrives is checked ([`QpAddress::validate`],
//! [`RegionGrant::validate`]) before it reaches the verbs library: a QP
//! number or PSN wider than 24 bits, an unknown MTU, a region whose end
//! overflows, is refused with a [`HandshakeError`], never passed on.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::rdma::addr::{NodeId, RegionId};
use crate::rdma::error::VerbError;
use crate::rdma::verb::{Verb, VerbReply};

/// Version of this protocol; a peer speaking another is refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// QP numbers and packet sequence numbers are 24-bit on the wire.
pub const MAX_QPN: u32 = (1 << 24) - 1;
pub const MAX_PSN: u32 = (1 << 24) - 1;

/// Why a handshake message was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum HandshakeError {
    #[error("protocol version {theirs}, this side speaks {PROTOCOL_VERSION}")]
    Version { theirs: u32 },
    #[error("QP number {0:#x} is not a 24-bit number above 1")]
    BadQpn(u32),
    #[error("packet sequence number {0:#x} is wider than 24 bits")]
    BadPsn(u32),
    #[error("path MTU code {0} is not one of 1 (256 B) .. 5 (4096 B)")]
    BadMtu(u8),
    #[error("the QP address has neither a LID nor a GID")]
    NoAddress,
    #[error("region {id:?}: {why}")]
    BadRegion { id: RegionId, why: String },
    #[error("undecodable handshake message: {0}")]
    Malformed(String),
    #[error("refused by the other side: {0}")]
    Refused(String),
}

/// Path MTU, as the verbs library codes it (`IBV_MTU_256` = 1 .. `IBV_MTU_4096` = 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PathMtu(pub u8);

impl PathMtu {
    pub const MTU_256: PathMtu = PathMtu(1);
    pub const MTU_4096: PathMtu = PathMtu(5);

    pub fn bytes(self) -> Option<u32> {
        (1..=5).contains(&self.0).then(|| 128 << self.0)
    }
}

/// Where one end of a reliable connection can be reached: everything the
/// other end's `ibv_modify_qp` to RTR needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpAddress {
    pub qpn: u32,
    /// The first packet sequence number this side sends.
    pub psn: u32,
    /// The port's LID (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// The GID at the chosen index (RoCE, or routed InfiniBand); all zero if unused.
    pub gid: [u8; 16],
    /// The GID index the sender uses (the receiver needs its own, not this one).
    pub gid_index: Option<u8>,
    /// The active MTU of the sender's port; the connection uses the smaller.
    pub mtu: PathMtu,
}

impl QpAddress {
    pub fn validate(&self) -> Result<(), HandshakeError> {
        // QP 0 and 1 are the subnet management and general services QPs.
        if self.qpn <= 1 || self.qpn > MAX_QPN {
            return Err(HandshakeError::BadQpn(self.qpn));
        }
        if self.psn > MAX_PSN {
            return Err(HandshakeError::BadPsn(self.psn));
        }
        if self.mtu.bytes().is_none() {
            return Err(HandshakeError::BadMtu(self.mtu.0));
        }
        if self.lid == 0 && self.gid == [0; 16] {
            return Err(HandshakeError::NoAddress);
        }
        Ok(())
    }

    /// Whether the path needs a global route header (GID addressing): always
    /// on RoCE (no LID), and whenever the sender chose a GID index.
    pub fn needs_grh(&self) -> bool {
        self.lid == 0 || self.gid_index.is_some()
    }
}

/// A region the host has registered: what a one-sided verb on it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionGrant {
    pub id: RegionId,
    /// Virtual address of the region's first byte in the host process.
    pub base: u64,
    pub len: u64,
    pub rkey: u32,
}

impl RegionGrant {
    pub fn validate(&self) -> Result<(), HandshakeError> {
        let bad = |why: &str| HandshakeError::BadRegion { id: self.id, why: why.to_string() };
        if self.len == 0 || !self.len.is_multiple_of(16) {
            return Err(bad("length is not a non-zero multiple of 16"));
        }
        if !self.base.is_multiple_of(16) {
            return Err(bad("base is not 16-byte aligned (extended atomics need it)"));
        }
        if self.base.checked_add(self.len).is_none() {
            return Err(bad("base + length overflows"));
        }
        Ok(())
    }
}

/// What a node or endpoint asks the host's control service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostRequest {
    /// Create a QP for this endpoint and connect it to `qp`.
    Connect { version: u32, qp: QpAddress },
    /// The regions registered so far (new ones appear as the host allocates).
    Regions,
    /// Execute `verb` with the host's CPU atomics (16-byte atomics on a device
    /// without extended atomics; see [`super::plan`]).
    Execute(Verb),
    /// A node joins; its peers reach it for message QPs at `peer_listen`.
    Join { version: u32, peer_listen: SocketAddr },
    /// Where node `NodeId`'s peer channel listens.
    Resolve(NodeId),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostResponse {
    Connected { qp: QpAddress, regions: Vec<RegionGrant> },
    Regions(Vec<RegionGrant>),
    Executed(Result<VerbReply, VerbError>),
    Joined(NodeId),
    Resolved(Option<SocketAddr>),
    Refused(HandshakeError),
}

/// What a node asks another node's peer channel: a QP for two-sided messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerRequest {
    Connect { version: u32, from: NodeId, qp: QpAddress },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerResponse {
    Accepted { qp: QpAddress },
    Refused(HandshakeError),
}

/// Checks what a host received before acting on it.
pub fn check_host_request(request: &HostRequest) -> Result<(), HandshakeError> {
    match request {
        HostRequest::Connect { version, qp } => {
            check_version(*version)?;
            qp.validate()
        }
        HostRequest::Join { version, .. } => check_version(*version),
        HostRequest::Regions | HostRequest::Execute(_) | HostRequest::Resolve(_) => Ok(()),
    }
}

/// Checks a host's answer to `Connect` or `Regions`: every address and grant.
pub fn check_host_response(response: &HostResponse) -> Result<(), HandshakeError> {
    match response {
        HostResponse::Connected { qp, regions } => {
            qp.validate()?;
            regions.iter().try_for_each(RegionGrant::validate)
        }
        HostResponse::Regions(regions) => regions.iter().try_for_each(RegionGrant::validate),
        HostResponse::Refused(e) => Err(HandshakeError::Refused(e.to_string())),
        HostResponse::Executed(_) | HostResponse::Joined(_) | HostResponse::Resolved(_) => Ok(()),
    }
}

pub fn check_peer_request(request: &PeerRequest) -> Result<(), HandshakeError> {
    match request {
        PeerRequest::Connect { version, qp, .. } => {
            check_version(*version)?;
            qp.validate()
        }
    }
}

fn check_version(theirs: u32) -> Result<(), HandshakeError> {
    if theirs == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(HandshakeError::Version { theirs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::codec;
    use crate::rdma::RemoteAddr;

    fn qp() -> QpAddress {
        QpAddress {
            qpn: 0x1234,
            psn: 0xAB_CDEF,
            lid: 7,
            gid: [0; 16],
            gid_index: None,
            mtu: PathMtu::MTU_4096,
        }
    }

    fn grant(id: u32) -> RegionGrant {
        RegionGrant { id: RegionId(id), base: 0x7f00_0000_0000, len: 64 << 20, rkey: 0xdead }
    }

    #[test]
    fn messages_round_trip_through_the_codec() {
        let requests = [
            HostRequest::Connect { version: PROTOCOL_VERSION, qp: qp() },
            HostRequest::Regions,
            HostRequest::Execute(Verb::ExtCas {
                addr: RemoteAddr::new(RegionId(1), 32),
                cmp: 1,
                cmp_mask: u128::MAX,
                swap: 2,
                swap_mask: u128::MAX,
            }),
            HostRequest::Join { version: PROTOCOL_VERSION, peer_listen: "10.0.0.2:4000".parse().unwrap() },
            HostRequest::Resolve(NodeId(3)),
        ];
        for r in requests {
            let back: HostRequest = codec::decode(&codec::encode(&r)).unwrap();
            assert_eq!(back, r);
            check_host_request(&back).unwrap();
        }
        let responses = [
            HostResponse::Connected { qp: qp(), regions: vec![grant(1), grant(2)] },
            HostResponse::Regions(vec![grant(9)]),
            HostResponse::Executed(Ok(VerbReply::Old128(u128::MAX))),
            HostResponse::Executed(Err(VerbError::UnknownRegion(RegionId(4)))),
            HostResponse::Joined(NodeId(5)),
            HostResponse::Resolved(None),
        ];
        for r in responses {
            let back: HostResponse = codec::decode(&codec::encode(&r)).unwrap();
            assert_eq!(back, r);
            check_host_response(&back).unwrap();
        }
        let p = PeerRequest::Connect { version: PROTOCOL_VERSION, from: NodeId(2), qp: qp() };
        let back: PeerRequest = codec::decode(&codec::encode(&p)).unwrap();
        assert_eq!(back, p);
        let a = PeerResponse::Accepted { qp: qp() };
        assert_eq!(codec::decode::<PeerResponse>(&codec::encode(&a)).unwrap(), a);
    }

    #[test]
    fn qp_addresses_out_of_range_are_refused() {
        let cases = [
            (QpAddress { qpn: 0, ..qp() }, HandshakeError::BadQpn(0)),
            (QpAddress { qpn: 1, ..qp() }, HandshakeError::BadQpn(1)),
            (QpAddress { qpn: 1 << 24, ..qp() }, HandshakeError::BadQpn(1 << 24)),
            (QpAddress { psn: 1 << 24, ..qp() }, HandshakeError::BadPsn(1 << 24)),
            (QpAddress { mtu: PathMtu(0), ..qp() }, HandshakeError::BadMtu(0)),
            (QpAddress { mtu: PathMtu(6), ..qp() }, HandshakeError::BadMtu(6)),
            (QpAddress { lid: 0, ..qp() }, HandshakeError::NoAddress),
        ];
        for (addr, want) in cases {
            assert_eq!(addr.validate(), Err(want.clone()));
            let req = HostRequest::Connect { version: PROTOCOL_VERSION, qp: addr };
            assert_eq!(check_host_request(&req), Err(want));
        }
        // RoCE: no LID, a GID.
        let roce = QpAddress {
            lid: 0,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            gid_index: Some(3),
            ..qp()
        };
        roce.validate().unwrap();
        assert!(roce.needs_grh());
        assert!(!qp().needs_grh());
        assert_eq!(PathMtu::MTU_256.bytes(), Some(256));
        assert_eq!(PathMtu::MTU_4096.bytes(), Some(4096));
    }

    #[test]
    fn bad_grants_and_versions_are_refused() {
        for g in [
            RegionGrant { len: 0, ..grant(1) },
            RegionGrant { len: 24, ..grant(1) },
            RegionGrant { base: 8, ..grant(1) },
            RegionGrant { base: u64::MAX - 15, len: 32, ..grant(1) },
        ] {
            assert!(matches!(g.validate(), Err(HandshakeError::BadRegion { .. })), "{g:?}");
            let resp = HostResponse::Connected { qp: qp(), regions: vec![grant(2), g] };
            assert!(check_host_response(&resp).is_err());
        }
        let old = HostRequest::Connect { version: PROTOCOL_VERSION + 1, qp: qp() };
        assert_eq!(check_host_request(&old), Err(HandshakeError::Version { theirs: PROTOCOL_VERSION + 1 }));
        let old = PeerRequest::Connect { version: 0, from: NodeId(1), qp: qp() };
        assert_eq!(check_peer_request(&old), Err(HandshakeError::Version { theirs: 0 }));
        let refused = HostResponse::Refused(HandshakeError::NoAddress);
        assert!(matches!(check_host_response(&refused), Err(HandshakeError::Refused(_))));
    }

    #[test]
    fn truncated_or_garbage_bytes_do_not_decode() {
        let bytes = codec::encode(&HostRequest::Connect { version: PROTOCOL_VERSION, qp: qp() });
        for cut in 0..bytes.len() {
            assert!(codec::decode::<HostRequest>(&bytes[..cut]).is_err(), "prefix of {cut} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(codec::decode::<HostRequest>(&longer).is_err(), "trailing bytes are refused");
        assert!(codec::decode::<HostRequest>(&[0xFF; 64]).is_err());
    }
}
