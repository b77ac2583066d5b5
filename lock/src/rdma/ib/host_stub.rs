//! [`IbHost`] in a build without the `rdma` feature: the same interface, so
//! servers and tools need no feature gates of their own, and `spawn` fails
//! with an error that says how to get the backend.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use citron_rpc::auth::Authority;

use super::addr::IbDevice;
use crate::rdma::error::TransportError;
use crate::rdma::memory::RegionTable;

/// Never constructed in this build.
pub struct IbHost {
    never: Infallible,
}

impl IbHost {
    pub fn spawn(
        device: &IbDevice,
        _listen: SocketAddr,
        _regions: Arc<RegionTable>,
        _authority: Authority,
    ) -> Result<Self, TransportError> {
        Err(super::no_backend(device))
    }

    pub fn local_addr(&self) -> SocketAddr {
        match self.never {}
    }

    pub fn device(&self) -> &IbDevice {
        match self.never {}
    }
}
