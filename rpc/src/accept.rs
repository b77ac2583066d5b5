//! The accept loop both servers of this crate run ([`crate::rpc`],
//! [`crate::mux`]): every connection gets a thread of its own, proves who
//! it is ([`crate::auth::handshake`]) and only then reaches the server.
//!
//! Bounds on what a peer that never completes the handshake costs: one
//! place of [`MAX_PENDING_HANDSHAKES`] (beyond them a connection is refused
//! at once with [`Status::Busy`], without a thread), a thread that lives at
//! most [`HANDSHAKE_TIMEOUT`] per message it waits for, and a few hundred
//! bytes of buffers. Every refusal is logged with the peer's address.
//!
//! [`MAX_PENDING_HANDSHAKES`]: crate::auth::MAX_PENDING_HANDSHAKES
//! [`HANDSHAKE_TIMEOUT`]: crate::auth::HANDSHAKE_TIMEOUT

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::auth::{server_handshake, Authority, HandshakeGate, Principal, Status};

/// What a server does with connections that passed the handshake.
pub(crate) trait Accepting: Send + Sync + 'static {
    /// The service's last word on an authenticated peer.
    fn admit(&self, principal: &Principal) -> Result<(), Status>;
    /// Serves connection number `connection` on the calling thread.
    fn serve(&self, connection: u64, stream: TcpStream, principal: Principal);
    /// Counts a refused handshake (already logged).
    fn refused(&self) {}
}

/// Numbers the connections from 1, logs and skips a failed accept, and for
/// each connection starts a thread named `{name}-{number}` that runs the
/// handshake under `authority` and then `server.serve`. Returns when
/// `stopping` is set; the server wakes it with a connection of its own.
pub(crate) fn accept_connections<A: Accepting>(
    listener: TcpListener,
    stopping: &AtomicBool,
    name: &str,
    authority: &Authority,
    server: &Arc<A>,
) {
    let gate = Arc::new(HandshakeGate::default());
    let mut next = 0u64;
    for stream in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("{name}: accept failed: {e}");
                continue;
            }
        };
        next += 1;
        let peer = stream.peer_addr().map_or_else(|_| "an unknown peer".to_string(), |a| a.to_string());
        let Some(pass) = gate.enter() else {
            // Best effort and without waiting: the peer may read nothing.
            let _ = stream.set_nonblocking(true);
            let _ = stream.write_all(&[Status::Busy as u8]);
            log::warn!("{name}: refused connection from {peer}: {}", Status::Busy);
            server.refused();
            continue;
        };
        let (authority, server) = (authority.clone(), server.clone());
        let thread_name = format!("{name}-{next}");
        let connection = next;
        let spawned = std::thread::Builder::new().name(thread_name.clone()).spawn(move || {
            let proved = server_handshake(&mut stream, &authority, |p| server.admit(p));
            drop(pass);
            match proved {
                Ok(principal) => {
                    log::debug!("{thread_name}: {peer} authenticated as {principal:?}");
                    server.serve(connection, stream, principal)
                }
                Err(status) => {
                    // A peer that hung up or went silent before a word
                    // (a port probe, a client giving up) is no intruder.
                    if status == Status::Broken {
                        log::info!("{thread_name}: refused connection from {peer}: {status}");
                    } else {
                        log::warn!("{thread_name}: refused connection from {peer}: {status}");
                    }
                    server.refused();
                }
            }
        });
        if let Err(e) = spawned {
            log::warn!("{name}: cannot start a connection thread: {e}");
        }
    }
}
