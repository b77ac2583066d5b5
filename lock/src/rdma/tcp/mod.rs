//! The `tcp` backend: a software NIC on the host ([`host`]) and queue pairs on
//! the clients ([`client`]), speaking the verbs protocol of [`wire`] over the
//! project's RPC transport (crate `citron_rpc`, re-exported here as [`rpc`]
//! and [`mux`]).

pub mod access;
pub(crate) mod client;
pub mod host;
pub mod wire;

pub use citron_rpc::{mux, rpc};

pub use access::{AccessCommand, AccessTable, Extent};
pub use citron_rpc::{
    Call, Connection, ConnectionId, Connections, MuxChannel, MuxClient, MuxServer, MuxService, Peer,
    PendingCall, RpcClient, RpcError, RpcServer, RpcService, ServerStats,
};
pub use client::{NodeCredentials, TcpOptions};
pub use host::TcpHost;
