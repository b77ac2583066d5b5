//! Why a call could not be completed.

/// Why a call (or a connection) of the RPC transport failed. The service's
/// own refusals travel inside its responses; this is everything else.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("connection to the server failed: {0}")]
    Io(#[from] std::io::Error),
    /// No connection could be made: the request was not sent (the server
    /// is down, or restarts), so asking again cannot apply it twice.
    #[error("cannot connect to the server: {0}")]
    Unreachable(std::io::Error),
    #[error("the server closed the connection")]
    Disconnected,
    #[error("no reply from the server within {0:?}")]
    Timeout(std::time::Duration),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error(transparent)]
    Handshake(#[from] crate::auth::HandshakeError),
}
