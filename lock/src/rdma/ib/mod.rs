//! The `ib` backend: one-sided verbs on a real RDMA NIC through libibverbs
//! (crate `rdma-sys`, cargo feature `rdma`), DESIGN.md §3.
//!
//! * **Connections.** Every [`Endpoint`](crate::rdma::Endpoint) owns a
//!   reliable-connected queue pair to the host, set up over the tcp control
//!   channel ([`handshake`]): QP number, PSN, LID/GID and MTU one way, the
//!   host's QP and a [`handshake::RegionGrant`] (base, length, rkey) per
//!   region the other. A node has one protection domain and one device
//!   context; a host registers each region's memory once as a memory region
//!   with remote read, write and atomic access.
//! * **Batches.** A batch is planned ([`plan`]) into doorbells of work
//!   requests, only the last signalled, executed in order; completions are
//!   polled.
//! * **Verbs.** READ, WRITE, CAS and FAA are native. The masked forms are
//!   emulated by a CAS loop ([`emulate`]) through the same `rdma::arith` as
//!   every backend: `rdma-sys` binds `verbs.h` and `rdma_cma.h` only, not
//!   the vendor's masked atomics (`mlx5dv.h` defines the opcodes
//!   `MLX5_OPCODE_ATOMIC_MASKED_CS/FA` and a raw-WQE post, but upstream
//!   rdma-core has no capability query for them, and the old
//!   `ibv_exp_*` API that had one is gone). 16-byte atomics are executed by
//!   the host's CPU over the control channel (see [`plan`] for why).
//! * **Messages.** Two-sided SEND/RECV on a queue pair per pair of nodes,
//!   with receive buffers posted in advance.
//!
//! What compiles without the feature, and is tested on any machine: the
//! fabric address ([`addr`]), the handshake's messages and checks
//! ([`handshake`]), the local checks of verbs against granted regions
//! ([`remote`]), the emulation ([`emulate`]) and the batch planner
//! ([`plan`]). With the feature: the thin FFI layer (`ffi`: RAII wrappers of
//! device, PD, CQ, QP and MR, every `unsafe` call argued), the host
//! ([`IbHost`]) and the client side (queue pairs and messages).

pub mod addr;
pub mod emulate;
pub mod handshake;
pub mod plan;
pub mod remote;

#[cfg(feature = "rdma")]
mod ffi;
#[cfg(feature = "rdma")]
mod host;
#[cfg(not(feature = "rdma"))]
mod host_stub;
#[cfg(feature = "rdma")]
pub(crate) mod node;

pub use addr::{IbDevice, IbFabric, DEVICE_ENV};
#[cfg(feature = "rdma")]
pub use host::IbHost;
#[cfg(not(feature = "rdma"))]
pub use host_stub::IbHost;

/// Whether this build has the `ib` backend (cargo feature `rdma`).
pub const ENABLED: bool = cfg!(feature = "rdma");

/// The error of a build without the backend.
#[cfg_attr(feature = "rdma", allow(dead_code))]
pub(crate) fn no_backend(device: &IbDevice) -> crate::rdma::TransportError {
    crate::rdma::TransportError::Ib(format!(
        "cannot open RDMA device {device}: this build has no ib backend (build with --features rdma)"
    ))
}
