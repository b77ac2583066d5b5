//! The client's lock tokens ([`crate::locks::token`] has the protocol): a
//! file's fcntl, OFD and flock locks decided locally while this client is
//! the only one locking it, and the thread that gives a token up when
//! another client asks.
//!
//! # One file's token here
//!
//! [`FileToken`] guards the token with a reader-writer gate:
//! * a lock call reads it: under a token it decides with the records kept
//!   here ([`LocalRecords`], their own mutex); without one it makes its
//!   request against the table *while still holding the read side*, so no
//!   thread of this client takes the token between its look and its
//!   writes (its writes would then be invisible to the records kept here);
//! * taking the token, giving it up (published), and dropping it take the
//!   write side.
//!
//! A token is used only while it is sound: the client is not fenced (3/4
//! of a lease without renewal, so well before the meta-server fences it
//! and clears its word), its registration is the one the token was taken
//! under (a fence took it otherwise: it is dropped, its records gone with
//! the fence), and no restart of the meta-server came since — after a
//! restart the mailbox it named may be gone, so every token is published
//! (the thread's sweep, or the next call on the file) and taken again
//! later naming the thread's new mailbox.
//!
//! # When to take it
//!
//! A lock call (not an unlock, not `F_GETLK`) on a file without a token
//! here tries to take it, unless an attempt failed within [`BACK_OFF`]
//! (a try costs a hold of the whole file's range lock) or the token was
//! given up within [`BACK_OFF_GIVEN_UP`] (two mounts locking one file
//! would otherwise pass the token back and forth at every call).
//!
//! # The token thread
//!
//! Started with the first token, with an endpoint of its own whose mailbox
//! the token word names. It never waits for another client's token (it
//! only publishes, under a range lock), so revocations always make
//! progress, whatever the client's other threads wait for.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::rdma::{ClientAddr, Endpoint, Node, RemoteAddr};
use parking_lot::{Mutex, RwLock};

use super::locks::RpcGrowth;
use super::opens::Pinned;
use super::{FsClient, Shared};
use crate::error::FsError;
use crate::locks::token::LocalRecords;
use crate::locks::{FileLocks, LockArea, LockMessage, LockTiming, WaitsFor};
use crate::types::{ClientId, Ino};

/// How long after a failed attempt a file's lock calls go to the table
/// before they try to take the token again: an attempt holds the range
/// lock over the whole file.
pub const BACK_OFF: Duration = Duration::from_millis(200);
/// How long after a token was given up (asked for by another client, or
/// published to wait) they do: a file two clients lock by turns would
/// otherwise pass its token back and forth at every call.
pub const BACK_OFF_GIVEN_UP: Duration = Duration::from_secs(1);
/// How often the token thread looks for tokens to publish after a restart
/// of the meta-server, and at its stop flag.
const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// How often the token thread reads the asked words of the tokens it
/// holds ([`crate::locks::token`]: a requester its message cannot reach).
const POLL_ASKED: Duration = Duration::from_millis(5);

/// A token this client holds.
pub(super) struct Held {
    client: ClientId,
    registration: u64,
    /// The thread epoch ([`Tokens::mailbox`]) whose mailbox the word names.
    epoch: u64,
    area: LockArea,
    table: RemoteAddr,
    records: Mutex<LocalRecords>,
}

/// One file's token on this client.
#[derive(Default)]
pub(super) struct FileToken {
    gate: RwLock<Option<Held>>,
    /// No attempt to take the token before this.
    not_before: Mutex<Option<Instant>>,
}

impl FileToken {
    fn may_try(&self) -> bool {
        self.not_before.lock().is_none_or(|t| Instant::now() >= t)
    }

    fn back_off(&self, pause: Duration) {
        *self.not_before.lock() = Some(Instant::now() + pause);
    }
}

/// Every token of this client.
#[derive(Default)]
pub(super) struct Tokens {
    files: Mutex<HashMap<Ino, Arc<FileToken>>>,
    /// Whether lock calls take tokens ([`super::ClientConfig::lock_tokens`]).
    enabled: AtomicBool,
    /// The token thread's epoch and mailbox, once started; the epoch moves
    /// when it takes a new endpoint (after a restart of the meta-server).
    mailbox: Mutex<Option<(u64, ClientAddr)>>,
    started: Mutex<bool>,
    /// Tokens taken and given up (published or dropped) so far.
    taken: AtomicU64,
    given_up: AtomicU64,
}

/// How many lock tokens a client took and gave up ([`FsClient::lock_token_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenCounts {
    pub taken: u64,
    pub given_up: u64,
}

impl Tokens {
    pub fn set_enabled(&self, on: bool) {
        // Relaxed: a switch read at each lock call; nothing rides on it.
        self.enabled.store(on, Ordering::Relaxed);
    }

    fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    fn file(&self, ino: Ino) -> Arc<FileToken> {
        self.files.lock().entry(ino).or_default().clone()
    }

    fn get(&self, ino: Ino) -> Option<Arc<FileToken>> {
        self.files.lock().get(&ino).cloned()
    }

    fn epoch(&self) -> Option<u64> {
        self.mailbox.lock().map(|(e, _)| e)
    }
}

/// What a local decision says.
pub(super) enum Local<R> {
    Done(R),
    /// The records must go to the table first (a request that must wait).
    Publish,
}

/// Whether a held token may be used now.
enum Standing {
    Usable,
    /// Not now: the client is fenced (its lease may have run out).
    Fenced,
    /// Of an older registration: the fence took its word and records.
    Gone,
    /// Named a mailbox of before a restart: to be published.
    Stale,
}

fn standing(shared: &Shared, held: &Held) -> Standing {
    if held.registration != shared.registration.load(Ordering::Relaxed) || held.client != shared.client_id() {
        Standing::Gone
    } else if shared.fenced() {
        Standing::Fenced
    } else if shared.tokens.epoch() != Some(held.epoch) {
        Standing::Stale
    } else {
        Standing::Usable
    }
}

fn fenced_error() -> FsError {
    FsError::Io("this client's lease expired; it is fenced until it re-registers".into())
}

/// Gives `held` up: its records into the table, its word freed.
fn publish(
    shared: &Shared,
    ep: &Endpoint,
    timing: &LockTiming,
    waits_for: WaitsFor,
    ino: Ino,
    held: &Held,
) -> Result<(), FsError> {
    let growth = RpcGrowth { shared, ino };
    let locks = FileLocks {
        ep,
        client: held.client,
        ino,
        area: held.area,
        table: held.table,
        timing,
        waits_for,
        growth: &growth,
    };
    let records = held.records.lock().clone();
    locks.publish_token(&records)
}

impl FsClient {
    /// Runs a lock call on `ino`: decided by `local` under this client's
    /// token if it holds one (taking it first when `take` and it may), or
    /// by `remote` against the table otherwise, which runs holding the
    /// token's gate (see the module header).
    pub(super) fn under_token<R>(
        &self,
        ino: Ino,
        pin: &Pinned,
        take: bool,
        local: impl Fn(&mut LocalRecords) -> Local<R>,
        remote: impl FnOnce() -> Result<R, FsError>,
    ) -> Result<R, FsError> {
        if !self.shared.tokens.enabled() || self.waiters.is_none() {
            return remote();
        }
        let token = self.shared.tokens.file(ino);
        loop {
            // Why the write side is needed: to give the token up (`true`),
            // or to take it.
            let give_up = {
                let gate = token.gate.read();
                match gate.as_ref() {
                    Some(held) => match standing(&self.shared, held) {
                        Standing::Usable => match local(&mut held.records.lock()) {
                            Local::Done(r) => return Ok(r),
                            Local::Publish => true,
                        },
                        Standing::Fenced => return Err(fenced_error()),
                        Standing::Gone | Standing::Stale => true,
                    },
                    None if !(take && token.may_try()) => return remote(),
                    None => false,
                }
            };
            let mut gate = token.gate.write();
            match gate.as_ref().map(|h| standing(&self.shared, h)) {
                Some(Standing::Gone) => *gate = None,
                Some(Standing::Fenced) => return Err(fenced_error()),
                // Taken by another thread meanwhile: decide under it.
                Some(Standing::Usable) if !give_up => {}
                Some(Standing::Usable | Standing::Stale) => {
                    let held = gate.as_ref().expect("a token");
                    self.with_endpoints(|eps| {
                        publish(&self.shared, &eps.meta, &self.timing, self.waits_for, ino, held)
                    })?;
                    *gate = None;
                    self.shared.tokens.given_up.fetch_add(1, Ordering::Relaxed);
                    token.back_off(BACK_OFF_GIVEN_UP);
                }
                None if take && token.may_try() => match self.take_token(ino, pin) {
                    Ok(Some(held)) => {
                        // Relaxed: statistics.
                        self.shared.tokens.taken.fetch_add(1, Ordering::Relaxed);
                        *gate = Some(held);
                    }
                    Ok(None) => token.back_off(BACK_OFF),
                    Err(e) => {
                        log::debug!("taking the lock token of inode {}: {e}", ino.0);
                        token.back_off(BACK_OFF);
                    }
                },
                None => {}
            }
        }
    }

    /// Tries to take `ino`'s token (see [`FileLocks::take_token`]).
    fn take_token(&self, ino: Ino, pin: &Pinned) -> Result<Option<Held>, FsError> {
        let (epoch, mailbox) = self.token_mailbox()?;
        let (client, registration) = (self.client_id(), pin.registration);
        self.with_endpoints(|eps| {
            let Some((area, table)) = self.lock_table(&eps.meta, pin, ino, true)? else {
                return Ok(None);
            };
            let growth = RpcGrowth { shared: &self.shared, ino };
            let locks = self.file_locks(&eps.meta, ino, area, table, &growth);
            Ok(locks.take_token(mailbox)?.map(|records| Held {
                client,
                registration,
                epoch,
                area,
                table,
                records: Mutex::new(records),
            }))
        })
    }

    /// Gives up `ino`'s token, if held here, before the client's last
    /// release of the file: its records (normally none: every close
    /// released them) go to the table.
    pub(super) fn drop_token(&self, ino: Ino) {
        let Some(token) = self.shared.tokens.files.lock().remove(&ino) else { return };
        let mut gate = token.gate.write();
        let Some(held) = gate.take() else { return };
        if !matches!(standing(&self.shared, &held), Standing::Usable | Standing::Stale) {
            return;
        }
        let given_up = self
            .with_endpoints(|eps| publish(&self.shared, &eps.meta, &self.timing, self.waits_for, ino, &held));
        match given_up {
            Ok(()) => {
                self.shared.tokens.given_up.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => log::warn!("inode {}: giving up its lock token at the last close: {e}", ino.0),
        }
    }

    /// How many lock tokens this client took and gave up so far.
    pub fn lock_token_counts(&self) -> TokenCounts {
        let t = &self.shared.tokens;
        TokenCounts { taken: t.taken.load(Ordering::Relaxed), given_up: t.given_up.load(Ordering::Relaxed) }
    }

    /// Whether lock calls take lock tokens from now on (a client's
    /// [`super::ClientConfig::lock_tokens`]); tokens held stay until asked
    /// for or closed.
    pub fn set_lock_tokens(&self, on: bool) {
        self.shared.tokens.set_enabled(on);
    }

    /// The records this client keeps for `ino` under its token, if it
    /// holds one now.
    pub(super) fn token_records(&self, ino: Ino) -> Option<Vec<crate::locks::LockRecord>> {
        let token = self.shared.tokens.get(ino)?;
        let gate = token.gate.read();
        let held = gate.as_ref()?;
        let records = held.records.lock().records().to_vec();
        Some(records)
    }

    /// The token thread's epoch and mailbox, starting it if need be.
    fn token_mailbox(&self) -> Result<(u64, ClientAddr), FsError> {
        let tokens = &self.shared.tokens;
        let mut started = tokens.started.lock();
        if !*started {
            let ep = self.meta_node.endpoint()?;
            *tokens.mailbox.lock() = Some((0, ep.addr()));
            let thread = TokenThread {
                shared: self.shared.clone(),
                node: self.meta_node.clone(),
                timing: self.timing.clone(),
                waits_for: self.waits_for,
                ep,
                epoch: 0,
                reclaims: self.reclaims(),
            };
            std::thread::Builder::new()
                .name("citronfs-lock-tokens".into())
                .spawn(move || thread.run())
                .map_err(|e| FsError::Io(format!("starting the lock token thread: {e}")))?;
            *started = true;
        }
        tokens.mailbox.lock().ok_or_else(|| FsError::Io("no lock token mailbox".into()))
    }
}

/// The thread that gives tokens up when asked (see the module header).
struct TokenThread {
    shared: Arc<Shared>,
    node: Node,
    timing: LockTiming,
    waits_for: WaitsFor,
    ep: Endpoint,
    epoch: u64,
    /// The client's reclaims when its endpoint was made.
    reclaims: u64,
}

impl TokenThread {
    fn run(mut self) {
        while !self.shared.stop.load(Ordering::Relaxed) {
            if self.shared.renewal_paused.load(Ordering::Relaxed) {
                // The test hook of a client cut off: it hears nothing.
                std::thread::sleep(POLL_ASKED);
                continue;
            }
            let held = self.held();
            let nap = if held.is_empty() { SWEEP_EVERY } else { POLL_ASKED };
            match self.ep.inbox().recv_timeout(nap) {
                // Cut off meanwhile: not heard (the asked word stays).
                Ok(_) if self.shared.renewal_paused.load(Ordering::Relaxed) => continue,
                Ok(m) => {
                    self.ep.count_received();
                    match LockMessage::decode(&m.payload) {
                        Ok(LockMessage::Revoke { ino }) => self.revoke(ino, false),
                        Ok(LockMessage::Wake { ino }) => {
                            log::debug!("a wake-up for inode {} at the token mailbox", ino.0)
                        }
                        Err(e) => log::warn!("from {}: {e}", m.from),
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            }
            self.poll_asked(&held);
            self.after_restart();
        }
    }

    /// The files whose token this client holds, with their tables.
    fn held(&self) -> Vec<(Ino, RemoteAddr)> {
        let files: Vec<(Ino, Arc<FileToken>)> =
            self.shared.tokens.files.lock().iter().map(|(i, t)| (*i, t.clone())).collect();
        files
            .into_iter()
            .filter_map(|(ino, t)| {
                // One being taken or given up now is looked at next time.
                let gate = t.gate.try_read()?;
                gate.as_ref().map(|h| (ino, h.table))
            })
            .collect()
    }

    /// Gives up the tokens among `held` that another client asked for in
    /// their asked word: one batch of reads.
    fn poll_asked(&self, held: &[(Ino, RemoteAddr)]) {
        if held.is_empty() || self.shared.fenced() {
            return;
        }
        let reads: Vec<_> = held.iter().map(|(_, table)| crate::locks::token::asked_read(*table)).collect();
        let replies = match self.ep.execute(&reads) {
            Ok(r) => r,
            Err(e) => {
                log::debug!("polling the lock tokens' asked words: {e}");
                return;
            }
        };
        for ((ino, _), reply) in held.iter().zip(replies) {
            if let Ok(citron_lock::rdma::VerbReply::Data(bytes)) = reply {
                if bytes.len() == 8 && bytes.iter().any(|&b| b != 0) {
                    self.revoke(*ino, false);
                }
            }
        }
    }

    /// Gives up `ino`'s token if this client holds it (`only_stale`: if it
    /// names a mailbox of before a restart).
    fn revoke(&self, ino: Ino, only_stale: bool) {
        let Some(token) = self.shared.tokens.get(ino) else { return };
        let mut gate = token.gate.write();
        let Some(held) = gate.as_ref() else { return };
        match standing(&self.shared, held) {
            Standing::Gone => *gate = None,
            // Its records are not ours to publish now; the fence, or a
            // renewal and the requester's next message, decides.
            Standing::Fenced => {}
            Standing::Usable if only_stale => {}
            Standing::Usable | Standing::Stale => {
                match publish(&self.shared, &self.ep, &self.timing, self.waits_for, ino, held) {
                    Ok(()) => {
                        *gate = None;
                        self.shared.tokens.given_up.fetch_add(1, Ordering::Relaxed);
                        token.back_off(BACK_OFF_GIVEN_UP);
                    }
                    Err(e) => log::warn!("inode {}: giving up its lock token: {e}", ino.0),
                }
            }
        }
    }

    /// After a restart of the meta-server: a new endpoint (its mailbox is
    /// the one new tokens name), then every token named the old one is
    /// published.
    fn after_restart(&mut self) {
        let reclaims = self.shared.reclaims.load(Ordering::SeqCst);
        if reclaims == self.reclaims || self.shared.fenced() {
            return;
        }
        match self.node.endpoint() {
            Ok(ep) => {
                self.epoch += 1;
                *self.shared.tokens.mailbox.lock() = Some((self.epoch, ep.addr()));
                self.ep = ep;
                self.reclaims = reclaims;
            }
            Err(e) => {
                log::warn!("a new endpoint for the lock token thread: {e}");
                return;
            }
        }
        let files: Vec<Ino> = self.shared.tokens.files.lock().keys().copied().collect();
        for ino in files {
            self.revoke(ino, true);
        }
    }
}
