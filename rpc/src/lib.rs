//! The project's tcp transport: length-prefixed frames with a bincode body,
//! a framed request/response server and client ([`rpc`]), and a multiplexed
//! form with many calls in flight on one connection, answered in any order
//! ([`mux`]). It knows nothing of verbs or locks: the software NIC
//! (`citron_lock::rdma::tcp`), the meta-server, the lock hosts and the lock
//! servers are services on it.

mod accept;
pub mod auth;
pub mod codec;
pub mod error;
pub mod frame;
pub mod mux;
pub mod rpc;

pub use error::RpcError;
pub use mux::{Call, Connection, ConnectionId, MuxChannel, MuxClient, MuxServer, MuxService, PendingCall};
pub use rpc::{Connections, Peer, RpcClient, RpcServer, RpcService, ServerStats, POLL_BUDGET};
