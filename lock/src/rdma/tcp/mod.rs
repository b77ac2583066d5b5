//! The `tcp` backend: a software NIC on the host ([`host`]) and queue pairs on
//! the clients ([`client`]), speaking the frames of [`wire`].

pub(crate) mod client;
pub mod host;
pub mod wire;

pub use client::TcpOptions;
pub use host::{HostStats, TcpHost};
