//! Who may talk to a server: cluster keys, the handshake that proves them,
//! and the identities it yields.
//!
//! * [`key`]: keys, key files and their options, and the secrets derived
//!   from the cluster key (a registered client's session secret, the
//!   secret registered clients share for their mailboxes).
//! * [`handshake`]: mutual challenge-response (HMAC-SHA256 over both sides'
//!   nonces) that every connection of [`crate::rpc`] and [`crate::mux`]
//!   starts with, and the bounds on what an unauthenticated peer costs.
//!
//! A server is given an [`Authority`] (whom it lets in) and hands its
//! service the [`Principal`] each connection proved; a client is given
//! [`Credentials`] (what its connections prove). Without keys
//! ([`Authority::Open`], [`Credential::Anonymous`]) everyone is let in as
//! [`Principal::Anonymous`], which is how a loopback test cluster runs.

pub mod handshake;
pub mod key;

pub use handshake::{
    client_handshake, server_handshake, Authority, Credential, CredentialId, Credentials, GatePass,
    HandshakeError, HandshakeGate, Principal, SessionId, Status, HANDSHAKE_TIMEOUT, MAX_PENDING_HANDSHAKES,
};
pub use key::{Key, KeyError, KeyOptions, Keyring, Role, Secret, Squash};
