//! The `tcp` backend: a software NIC on the host ([`host`]) and queue pairs on
//! the clients ([`client`]), speaking the frames of [`wire`].

pub(crate) mod client;
pub mod host;
pub mod mux;
pub mod rpc;
pub mod wire;

pub use client::TcpOptions;
pub use host::TcpHost;
pub use mux::{Call, Connection, ConnectionId, MuxChannel, MuxClient, MuxServer, MuxService, PendingCall};
pub use rpc::{RpcClient, RpcServer, RpcService, ServerStats};
