//! The handshake every connection starts with: mutual challenge-response
//! over a shared secret, before any frame.
//!
//! ```text
//!  client                                   server
//!  Hello   magic, credential id, nonce_c  ->
//!                                          <-  status, nonce_s, mac_s
//!  Proof   mac_c                          ->
//!                                          <-  verdict
//!
//!  mac_s = HMAC(secret, "server" label | Hello | nonce_s)
//!  mac_c = HMAC(secret, "client" label | Hello | nonce_s)
//! ```
//!
//! Both sides prove they hold the secret named by the credential id
//! without sending it: each MAC covers the other side's fresh nonce, so a
//! recorded handshake proves nothing later, and the two labels keep one
//! side's answer from serving as the other's. Tags are compared in
//! constant time (`hmac`'s `verify_slice`). A server without keys answers a
//! `Hello` that names no credential with [`Status::Open`] and nothing else:
//! one round trip, and a keyed client refuses such a server.
//!
//! What a server spends on a peer that does not complete the handshake is
//! bounded: every message has a fixed size (the only variable part, a key
//! name, is at most [`MAX_NAME_LEN`] bytes), the server reads with
//! [`HANDSHAKE_TIMEOUT`], and a [`HandshakeGate`] caps the connections in
//! the handshake at once. Refusals are answered with a status byte (so the
//! client can say why) and the connection is closed; the caller logs the
//! peer's address. Nothing reaches a service before its verdict.
//!
//! Messages are laid out by hand rather than with bincode: each is a few
//! fixed fields, and fixed sizes make the bound on what is read obvious.
//!
//! This authenticates; it does not encrypt. Someone who can read or inject
//! packets on the path sees data and can take over a connection after its
//! handshake: run a cluster on a network you trust, or under IPsec or
//! WireGuard.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::key::{Key, KeyOptions, Keyring, Role, Secret, MAX_NAME_LEN};

/// First bytes of every connection: the protocol and its version.
pub const MAGIC: [u8; 8] = *b"CITRON\x00\x01";
/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// How long a server waits for each message of a peer's handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections a server lets be in the handshake at once; more are
/// refused at once ([`Status::Busy`]).
pub const MAX_PENDING_HANDSHAKES: usize = 64;

const SERVER_LABEL: &[u8] = b"citron-rpc server proof v1";
const CLIENT_LABEL: &[u8] = b"citron-rpc client proof v1";

/// Fixed part of a `Hello`: magic, kind, name length, incarnation, client, nonce.
const HELLO_FIXED: usize = 8 + 1 + 1 + 8 + 8 + NONCE_LEN;

/// A registered client's identity: the meta-server incarnation that
/// registered it and the client id it gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId {
    pub incarnation: u64,
    pub client: u64,
}

/// Which secret a connection proves, as named in the `Hello`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CredentialId {
    /// None: only a server without keys accepts it.
    Anonymous,
    /// A key of the server's key file, by name.
    Key(String),
    /// A registered client's session secret ([`Keyring::session_secret`]).
    Session(SessionId),
    /// The secret all registered clients share ([`Keyring::member_secret`]).
    Member { incarnation: u64 },
    /// A registered client's session, named without proof: only a server
    /// without keys accepts it ([`Credential::Claim`]).
    Claim(SessionId),
}

impl CredentialId {
    fn kind(&self) -> u8 {
        match self {
            CredentialId::Anonymous => 0,
            CredentialId::Key(_) => 1,
            CredentialId::Session(_) => 2,
            CredentialId::Member { .. } => 3,
            CredentialId::Claim(_) => 4,
        }
    }
}

/// What a client proves: a credential id and its secret.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Credential {
    #[default]
    Anonymous,
    Key(Key),
    Session {
        id: SessionId,
        secret: Secret,
    },
    Member {
        incarnation: u64,
        secret: Secret,
    },
    /// In a cluster without keys, a registered client names its session
    /// (nothing proves it; there is no secret). A server without keys takes
    /// the peer for [`Principal::Claimed`], so that a fence of that client
    /// applies to the connection: this protects the cluster from a stalled
    /// client of its own, not from a hostile one (keys do that).
    Claim(SessionId),
}

impl Credential {
    pub fn id(&self) -> CredentialId {
        match self {
            Credential::Anonymous => CredentialId::Anonymous,
            Credential::Key(k) => CredentialId::Key(k.name.clone()),
            Credential::Session { id, .. } => CredentialId::Session(*id),
            Credential::Member { incarnation, .. } => CredentialId::Member { incarnation: *incarnation },
            Credential::Claim(id) => CredentialId::Claim(*id),
        }
    }

    fn secret(&self) -> Option<&Secret> {
        match self {
            Credential::Anonymous | Credential::Claim(_) => None,
            Credential::Key(k) => Some(&k.secret),
            Credential::Session { secret, .. } | Credential::Member { secret, .. } => Some(secret),
        }
    }
}

/// The credential a client's connections prove, shared by every client
/// object of one identity and replaceable (a mount proves its key to
/// register, then its session; again its key after it was fenced).
/// Connections opened after [`Credentials::set`] prove the new one.
#[derive(Clone, Default)]
pub struct Credentials(Arc<RwLock<(Credential, u64)>>);

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Credentials").field(&self.0.read().0.id()).finish()
    }
}

impl Credentials {
    pub fn new(credential: Credential) -> Self {
        Self(Arc::new(RwLock::new((credential, 0))))
    }

    /// No credential: for clusters without keys.
    pub fn anonymous() -> Self {
        Self::default()
    }

    /// Proving `key`, or none (a cluster without keys).
    pub fn of_key(key: Option<&Key>) -> Self {
        key.map_or_else(Self::anonymous, |k| Self::new(Credential::Key(k.clone())))
    }

    pub fn get(&self) -> Credential {
        self.0.read().0.clone()
    }

    /// The credential and its version (bumped by every [`Credentials::set`]),
    /// so a connection can tell it proved an older one.
    pub fn versioned(&self) -> (Credential, u64) {
        self.0.read().clone()
    }

    pub fn version(&self) -> u64 {
        self.0.read().1
    }

    pub fn set(&self, credential: Credential) {
        let mut c = self.0.write();
        *c = (credential, c.1 + 1);
    }
}

/// Who the peer of an accepted connection proved to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// Anyone: the server has no keys (loopback clusters, tests).
    Anonymous,
    /// The holder of a key of the server's keyring.
    Key { name: String, options: KeyOptions },
    /// A registered client of the meta-server.
    Session(SessionId),
    /// One of the registered clients (traffic between clients' mailboxes).
    Member { incarnation: u64 },
    /// A registered client of a server without keys, by the session it
    /// named ([`Credential::Claim`]): trusted as [`Principal::Anonymous`] is
    /// by services that check no identity, but a NIC refuses it once that
    /// client is fenced.
    Claimed(SessionId),
}

impl Principal {
    /// Whether the peer is trusted as a server is: the cluster key, or
    /// anyone on a server without keys.
    pub fn is_server(&self) -> bool {
        match self {
            Principal::Anonymous => true,
            Principal::Key { options, .. } => options.role == Role::Server,
            Principal::Session(_) | Principal::Member { .. } | Principal::Claimed(_) => false,
        }
    }
}

/// Whom a server lets in.
#[derive(Clone, Debug, Default)]
pub enum Authority {
    /// No keys: anyone, as [`Principal::Anonymous`] (or, naming its
    /// session, [`Principal::Claimed`]); keyed clients are told the server
    /// has none.
    #[default]
    Open,
    /// Holders of the keyring's keys, and (with its cluster key) the
    /// sessions and members derived from it.
    Keyring(Arc<Keyring>),
    /// Only the registered clients of one meta-server incarnation (a
    /// client's mailbox listener, which holds no key of its own).
    Members { incarnation: u64, secret: Secret },
}

impl Authority {
    /// `Open` without a keyring.
    pub fn from_keyring(keyring: Option<Arc<Keyring>>) -> Self {
        keyring.map_or(Authority::Open, Authority::Keyring)
    }

    pub fn is_open(&self) -> bool {
        matches!(self, Authority::Open)
    }

    /// The secret of `id` and who proving it makes the peer.
    fn secret_of(&self, id: &CredentialId) -> Result<(Secret, Principal), Status> {
        match (self, id) {
            (Authority::Open, _) => Err(Status::NoKeys),
            (_, CredentialId::Anonymous | CredentialId::Claim(_)) => Err(Status::KeyRequired),
            (Authority::Keyring(ring), CredentialId::Key(name)) => {
                let key = ring.get(name).ok_or(Status::UnknownCredential)?;
                Ok((key.secret.clone(), Principal::Key { name: key.name.clone(), options: key.options }))
            }
            (Authority::Keyring(ring), CredentialId::Session(s)) => ring
                .session_secret(s.incarnation, s.client)
                .map(|secret| (secret, Principal::Session(*s)))
                .ok_or(Status::UnknownCredential),
            (Authority::Keyring(ring), CredentialId::Member { incarnation }) => ring
                .member_secret(*incarnation)
                .map(|secret| (secret, Principal::Member { incarnation: *incarnation }))
                .ok_or(Status::UnknownCredential),
            (Authority::Members { incarnation, secret }, CredentialId::Member { incarnation: i })
                if i == incarnation =>
            {
                Ok((secret.clone(), Principal::Member { incarnation: *i }))
            }
            (Authority::Members { .. }, _) => Err(Status::UnknownCredential),
        }
    }
}

/// The server's answer, one byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[repr(u8)]
pub enum Status {
    /// Go on: the challenge follows / you are in.
    #[error("accepted")]
    Accepted = 0,
    /// In, without keys (a server that has none).
    #[error("accepted without a key")]
    Open = 1,
    #[error("not a CitronFS handshake (wrong protocol or version, or data before the handshake)")]
    BadHello = 2,
    #[error("this server requires a key")]
    KeyRequired = 3,
    #[error("this server has no keys (it is not part of a keyed cluster)")]
    NoKeys = 4,
    #[error("the server does not know this credential")]
    UnknownCredential = 5,
    #[error("wrong key: the proof does not verify")]
    BadProof = 6,
    #[error("the server does not admit this identity (not registered, fenced, or not allowed here)")]
    NotAdmitted = 7,
    #[error("the server is busy with other handshakes")]
    Busy = 8,
    #[error("the handshake timed out or the connection broke")]
    Broken = 9,
}

impl Status {
    fn from_byte(b: u8) -> Option<Self> {
        use Status::*;
        [
            Accepted,
            Open,
            BadHello,
            KeyRequired,
            NoKeys,
            UnknownCredential,
            BadProof,
            NotAdmitted,
            Busy,
            Broken,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }
}

/// Why a client's handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("handshake refused by the server: {0}")]
    Refused(Status),
    #[error("the server did not prove the key: it is not a member of this cluster")]
    ServerNotAuthenticated,
    #[error("the server has no keys; refusing to talk to an unauthenticated server with a key")]
    ServerUnkeyed,
    #[error("the server requires a key; none is configured here (--key-file)")]
    KeyRequired,
    #[error("handshake: {0}")]
    Io(#[from] std::io::Error),
    #[error("handshake: unexpected answer byte {0}")]
    Garbled(u8),
}

impl HandshakeError {
    /// Whether the server did not answer in time (a vanished or frozen
    /// host, not a refusal).
    pub fn is_timeout(&self) -> bool {
        matches!(self, HandshakeError::Io(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    use rand::RngCore;
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

fn encode_hello(id: &CredentialId, nonce_c: &[u8; NONCE_LEN]) -> Vec<u8> {
    let (name, incarnation, client): (&[u8], u64, u64) = match id {
        CredentialId::Anonymous => (b"", 0, 0),
        CredentialId::Key(n) => (n.as_bytes(), 0, 0),
        CredentialId::Session(s) | CredentialId::Claim(s) => (b"", s.incarnation, s.client),
        CredentialId::Member { incarnation } => (b"", *incarnation, 0),
    };
    let mut out = Vec::with_capacity(HELLO_FIXED + name.len());
    out.extend_from_slice(&MAGIC);
    out.push(id.kind());
    out.push(name.len() as u8);
    out.extend_from_slice(&incarnation.to_le_bytes());
    out.extend_from_slice(&client.to_le_bytes());
    out.extend_from_slice(nonce_c);
    out.extend_from_slice(name);
    out
}

/// Reads a `Hello`; returns its bytes (for the MACs) and the credential id.
fn read_hello(r: &mut impl Read) -> Result<(Vec<u8>, CredentialId), Status> {
    let mut fixed = [0u8; HELLO_FIXED];
    // The magic first, alone: a peer that speaks something else is told so
    // without waiting for bytes it will never send.
    r.read_exact(&mut fixed[..8]).map_err(|_| Status::Broken)?;
    if fixed[..8] != MAGIC {
        return Err(Status::BadHello);
    }
    r.read_exact(&mut fixed[8..]).map_err(|_| Status::Broken)?;
    let kind = fixed[8];
    let name_len = fixed[9] as usize;
    let word = |at: usize| u64::from_le_bytes(fixed[at..at + 8].try_into().expect("8 bytes"));
    let (incarnation, client) = (word(10), word(18));
    if name_len > MAX_NAME_LEN || (kind != 1 && name_len != 0) {
        return Err(Status::BadHello);
    }
    let mut hello = Vec::with_capacity(HELLO_FIXED + name_len);
    hello.extend_from_slice(&fixed);
    hello.resize(HELLO_FIXED + name_len, 0);
    r.read_exact(&mut hello[HELLO_FIXED..]).map_err(|_| Status::Broken)?;
    let id = match kind {
        0 => CredentialId::Anonymous,
        1 => {
            let name = std::str::from_utf8(&hello[HELLO_FIXED..]).map_err(|_| Status::BadHello)?;
            CredentialId::Key(name.to_string())
        }
        2 => CredentialId::Session(SessionId { incarnation, client }),
        3 => CredentialId::Member { incarnation },
        4 => CredentialId::Claim(SessionId { incarnation, client }),
        _ => return Err(Status::BadHello),
    };
    Ok((hello, id))
}

/// Runs the client's side on a fresh connection, waiting at most `timeout`
/// for each answer. Leaves the stream's read timeout as it was.
pub fn client_handshake(
    stream: &mut TcpStream,
    credential: &Credential,
    timeout: Duration,
) -> Result<(), HandshakeError> {
    let previous = stream.read_timeout()?;
    stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    let result = client_exchange(stream, credential);
    stream.set_read_timeout(previous)?;
    result
}

fn client_exchange(stream: &mut TcpStream, credential: &Credential) -> Result<(), HandshakeError> {
    let nonce_c = nonce();
    let hello = encode_hello(&credential.id(), &nonce_c);
    stream.write_all(&hello)?;
    let status = read_status(stream)?;
    let Some(secret) = credential.secret() else {
        return match status {
            Status::Open => Ok(()),
            Status::KeyRequired => Err(HandshakeError::KeyRequired),
            s => Err(HandshakeError::Refused(s)),
        };
    };
    match status {
        Status::Accepted => {}
        Status::Open => return Err(HandshakeError::ServerUnkeyed),
        s => return Err(HandshakeError::Refused(s)),
    }
    let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
    stream.read_exact(&mut challenge)?;
    let (nonce_s, mac_s) = challenge.split_at(NONCE_LEN);
    if !secret.verify(&[SERVER_LABEL, &hello, nonce_s], mac_s) {
        return Err(HandshakeError::ServerNotAuthenticated);
    }
    stream.write_all(&secret.mac(&[CLIENT_LABEL, &hello, nonce_s]))?;
    match read_status(stream)? {
        Status::Accepted => Ok(()),
        s => Err(HandshakeError::Refused(s)),
    }
}

fn read_status(stream: &mut TcpStream) -> Result<Status, HandshakeError> {
    let mut b = [0u8; 1];
    stream.read_exact(&mut b)?;
    Status::from_byte(b[0]).ok_or(HandshakeError::Garbled(b[0]))
}

/// Runs the server's side on an accepted connection: who the peer is, or
/// why it was refused (already told to the peer, best effort). `admit`
/// is the service's last word on an authenticated principal. Reads wait at
/// most [`HANDSHAKE_TIMEOUT`] each; the stream's timeouts are restored.
pub fn server_handshake(
    stream: &mut TcpStream,
    authority: &Authority,
    admit: impl FnOnce(&Principal) -> Result<(), Status>,
) -> Result<Principal, Status> {
    let restore = (stream.read_timeout(), stream.write_timeout());
    if stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).is_err()
        || stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).is_err()
    {
        return Err(Status::Broken);
    }
    let result = server_exchange(stream, authority, admit);
    if let Err(s) = result {
        if s != Status::Broken {
            let _ = stream.write_all(&[s as u8]);
        }
    }
    if let (Ok(r), Ok(w)) = restore {
        if stream.set_read_timeout(r).is_err() || stream.set_write_timeout(w).is_err() {
            return Err(Status::Broken);
        }
    }
    result
}

fn server_exchange(
    stream: &mut TcpStream,
    authority: &Authority,
    admit: impl FnOnce(&Principal) -> Result<(), Status>,
) -> Result<Principal, Status> {
    let (hello, id) = read_hello(stream)?;
    if authority.is_open() {
        let principal = match id {
            CredentialId::Anonymous => Principal::Anonymous,
            CredentialId::Claim(s) => Principal::Claimed(s),
            _ => return Err(Status::NoKeys),
        };
        admit(&principal)?;
        stream.write_all(&[Status::Open as u8]).map_err(|_| Status::Broken)?;
        return Ok(principal);
    }
    let (secret, principal) = authority.secret_of(&id)?;
    let nonce_s = nonce();
    let mut challenge = Vec::with_capacity(1 + NONCE_LEN + MAC_LEN);
    challenge.push(Status::Accepted as u8);
    challenge.extend_from_slice(&nonce_s);
    challenge.extend_from_slice(&secret.mac(&[SERVER_LABEL, &hello, &nonce_s]));
    stream.write_all(&challenge).map_err(|_| Status::Broken)?;
    let mut mac_c = [0u8; MAC_LEN];
    stream.read_exact(&mut mac_c).map_err(|_| Status::Broken)?;
    if !secret.verify(&[CLIENT_LABEL, &hello, &nonce_s], &mac_c) {
        return Err(Status::BadProof);
    }
    admit(&principal)?;
    stream.write_all(&[Status::Accepted as u8]).map_err(|_| Status::Broken)?;
    Ok(principal)
}

/// Caps the connections of one server that are in the handshake at once.
#[derive(Debug)]
pub struct HandshakeGate {
    pending: AtomicUsize,
    limit: usize,
}

impl Default for HandshakeGate {
    fn default() -> Self {
        Self::new(MAX_PENDING_HANDSHAKES)
    }
}

impl HandshakeGate {
    pub fn new(limit: usize) -> Self {
        Self { pending: AtomicUsize::new(0), limit }
    }

    /// A place in the handshake, or `None` when all are taken.
    pub fn enter(self: &Arc<Self>) -> Option<GatePass> {
        // Relaxed: the counter only bounds how many are in; it orders
        // nothing else.
        let mut now = self.pending.load(Ordering::Relaxed);
        loop {
            if now >= self.limit {
                return None;
            }
            match self.pending.compare_exchange_weak(now, now + 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(GatePass(self.clone())),
                Err(actual) => now = actual,
            }
        }
    }

    /// Connections in the handshake now.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }
}

/// A connection's place in the handshake; given back on drop.
#[derive(Debug)]
pub struct GatePass(Arc<HandshakeGate>);

impl Drop for GatePass {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::auth::key::KeyOptions;

    /// Runs one server handshake on a loopback connection against
    /// `client`, returning both sides' results.
    fn run(
        authority: Authority,
        client: impl FnOnce(&mut TcpStream) -> Result<(), HandshakeError> + Send + 'static,
    ) -> (Result<Principal, Status>, Result<(), HandshakeError>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let c = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            client(&mut s)
        });
        let (mut s, _) = listener.accept().unwrap();
        let server = server_handshake(&mut s, &authority, |_| Ok(()));
        drop(s);
        (server, c.join().unwrap())
    }

    fn ring() -> Arc<Keyring> {
        Arc::new(Keyring::generate("cluster").unwrap())
    }

    #[test]
    fn the_right_key_is_accepted_both_ways() {
        let ring = ring();
        let key = ring.first().clone();
        let (s, c) = run(Authority::Keyring(ring), move |st| {
            client_handshake(st, &Credential::Key(key), Duration::from_secs(5))
        });
        assert!(matches!(s, Ok(Principal::Key { ref name, .. }) if name == "cluster"), "{s:?}");
        c.unwrap();
    }

    #[test]
    fn a_wrong_key_of_the_same_name_is_refused_by_the_client_first() {
        let theirs = ring();
        let (s, c) = run(Authority::Keyring(theirs), move |st| {
            let mine = Key::generate("cluster", KeyOptions::default()).unwrap();
            client_handshake(st, &Credential::Key(mine), Duration::from_secs(5))
        });
        // The client finds the server's proof wrong and hangs up.
        assert!(matches!(c, Err(HandshakeError::ServerNotAuthenticated)), "{c:?}");
        assert_eq!(s, Err(Status::Broken));
    }

    #[test]
    fn a_client_that_cannot_prove_the_key_is_refused() {
        let ring = ring();
        let key = ring.first().clone();
        let (s, c) = run(Authority::Keyring(ring), move |st| {
            // A peer that replays the server's challenge MAC as its proof.
            st.write_all(&encode_hello(&CredentialId::Key(key.name), &[7; NONCE_LEN]))?;
            let mut answer = [0u8; 1 + NONCE_LEN + MAC_LEN];
            st.read_exact(&mut answer)?;
            st.write_all(&answer[1 + NONCE_LEN..])?;
            match read_status(st)? {
                Status::Accepted => Ok(()),
                s => Err(HandshakeError::Refused(s)),
            }
        });
        assert_eq!(s, Err(Status::BadProof));
        assert!(matches!(c, Err(HandshakeError::Refused(Status::BadProof))), "{c:?}");
    }

    #[test]
    fn keys_and_no_keys_do_not_mix() {
        let (s, c) = run(Authority::Keyring(ring()), |st| {
            client_handshake(st, &Credential::Anonymous, Duration::from_secs(5))
        });
        assert_eq!(s, Err(Status::KeyRequired));
        assert!(matches!(c, Err(HandshakeError::KeyRequired)), "{c:?}");
        let key = ring().first().clone();
        let (s, c) = run(Authority::Open, move |st| {
            client_handshake(st, &Credential::Key(key), Duration::from_secs(5))
        });
        assert_eq!(s, Err(Status::NoKeys));
        assert!(matches!(c, Err(HandshakeError::Refused(Status::NoKeys))), "{c:?}");
        let (s, c) =
            run(Authority::Open, |st| client_handshake(st, &Credential::Anonymous, Duration::from_secs(5)));
        assert_eq!(s, Ok(Principal::Anonymous));
        c.unwrap();
    }

    /// A session claimed without proof is taken at its word by a server
    /// without keys (so that fences apply to it), and refused by a keyed
    /// one, which wants the session proved.
    #[test]
    fn a_claimed_session_is_for_servers_without_keys() {
        let id = SessionId { incarnation: 5, client: 12 };
        let (s, c) = run(Authority::Open, move |st| {
            client_handshake(st, &Credential::Claim(id), Duration::from_secs(5))
        });
        assert_eq!(s, Ok(Principal::Claimed(id)));
        assert!(!Principal::Claimed(id).is_server());
        c.unwrap();
        let (s, c) = run(Authority::Keyring(ring()), move |st| {
            client_handshake(st, &Credential::Claim(id), Duration::from_secs(5))
        });
        assert_eq!(s, Err(Status::KeyRequired));
        assert!(matches!(c, Err(HandshakeError::KeyRequired)), "{c:?}");
    }

    #[test]
    fn sessions_and_members_are_derived_from_the_cluster_key() {
        let ring = ring();
        let id = SessionId { incarnation: 9, client: 4 };
        let secret = ring.session_secret(9, 4).unwrap();
        let (s, c) = run(Authority::Keyring(ring.clone()), move |st| {
            client_handshake(st, &Credential::Session { id, secret }, Duration::from_secs(5))
        });
        assert_eq!(s, Ok(Principal::Session(id)));
        c.unwrap();
        // Another client's id with this secret: refused.
        let secret = ring.session_secret(9, 4).unwrap();
        let other = SessionId { incarnation: 9, client: 5 };
        let (s, _) = run(Authority::Keyring(ring.clone()), move |st| {
            client_handshake(st, &Credential::Session { id: other, secret }, Duration::from_secs(5))
        });
        assert!(s.is_err());
        // A mailbox listener knows only the member secret of its incarnation.
        let members = Authority::Members { incarnation: 9, secret: ring.member_secret(9).unwrap() };
        let secret = ring.member_secret(9).unwrap();
        let (s, c) = run(members.clone(), move |st| {
            client_handshake(st, &Credential::Member { incarnation: 9, secret }, Duration::from_secs(5))
        });
        assert_eq!(s, Ok(Principal::Member { incarnation: 9 }));
        c.unwrap();
        let key = ring.first().clone();
        let (s, _) =
            run(members, move |st| client_handshake(st, &Credential::Key(key), Duration::from_secs(5)));
        assert_eq!(s, Err(Status::UnknownCredential));
    }

    #[test]
    fn garbage_and_silence_are_refused_in_bounded_time() {
        let (s, c) = run(Authority::Keyring(ring()), |st| {
            st.write_all(&[0, 0, 0, 9, 1, 0, 0, 0, 0, 0, 0, 0])?;
            read_status(st).map(|_| ())
        });
        assert_eq!(s, Err(Status::BadHello));
        assert!(c.is_ok(), "the peer is told: {c:?}");
        // A name longer than allowed.
        let (s, _) = run(Authority::Keyring(ring()), |st| {
            let mut hello = encode_hello(&CredentialId::Key("x".into()), &[0; NONCE_LEN]);
            hello[9] = 200;
            st.write_all(&hello)?;
            Ok(())
        });
        assert_eq!(s, Err(Status::BadHello));
    }

    #[test]
    fn the_gate_bounds_pending_handshakes() {
        let gate = Arc::new(HandshakeGate::new(2));
        let a = gate.enter().unwrap();
        let _b = gate.enter().unwrap();
        assert!(gate.enter().is_none());
        drop(a);
        assert_eq!(gate.pending(), 1);
        assert!(gate.enter().is_some());
    }
}
