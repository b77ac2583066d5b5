//! Who may touch which server memory: the meta-server's side of the
//! per-client grants that every software NIC enforces
//! ([`citron_lock::rdma::tcp::access`], the software form of RDMA memory
//! keys).
//!
//! # The API
//!
//! The meta-server is the only authority over grants, and this is its one
//! interface to them, generic over [`Placed`] extents (a server and a
//! region range), so any allocator's reclamation can call it:
//!
//! * [`Access::admit`]: a registered client may connect to every NIC and
//!   holds the *membership* extents (lock memory every client uses: the
//!   waits-for table, the lock host's area, the Citron tree host's arena).
//! * [`Access::opened`] / [`Access::closed`]: a client's grants of one open
//!   file (attribute slot, lock area and record blocks, chunks) begin at its
//!   first open and end at its last close; [`Access::file_allocated`] and
//!   [`Access::file_changed`] follow the file's memory while it is open
//!   (chunks allocated or freed, record blocks added) for every client that
//!   has it open.
//! * [`Access::revoke_everyone`]: before memory is reused, nobody keeps a
//!   grant on it. Synchronous.
//! * [`Access::fence`]: a client is gone: its grants and admission end at
//!   every NIC and its connections there are cut (Citron §3.10
//!   "Detection": destroying its queue pairs). Synchronous.
//!
//! # Why grants are pushed, and what is synchronous
//!
//! Opening a file must not wait for a server-to-server round trip. Grants
//! on the meta-server's own NIC (slots, lock memory) are applied in-process,
//! at once; grants on a data server's NIC are queued to that NIC's pusher
//! thread before the open is answered, and a verb that outruns its grant is
//! held by the NIC until it arrives ([`citron_lock::rdma::tcp::access`]).
//! Meta-server-signed capabilities presented by clients were the
//! alternative: they cost nothing at open either, but a capability cannot
//! be taken back without telling every NIC anyway, so revocation would need
//! this channel too, and replayed capabilities would need a revocation list
//! that grows with every close.
//!
//! Revocation must be complete before memory is reused or a client counts
//! as fenced. Local revocations are complete when applied. Remote ones at
//! close are queued (a close waits for nothing); each NIC's pusher sends in
//! order and every command is acknowledged, so when a synchronous
//! [`Access::revoke_everyone`] or [`Access::fence`] is acknowledged, every
//! earlier command to that NIC holds too. Chunks are only reused after the
//! allocator hands out a recycled chunk, which [`crate::service`] revokes
//! from everyone before it zeroes it (a server-to-server round trip it
//! already makes to zero the chunk).
//!
//! # Without keys: admission and fences only
//!
//! Without keys (a loopback or trusted cluster) nothing is proved, so this
//! module grants nothing: servers, and clients before they register, are
//! anonymous, and anonymous peers may touch everything. But a registered
//! client names its session to the NICs ([`Credential::Claim`]), and
//! admission and fences apply to it as in a keyed cluster: a client whose
//! lease ran out is refused at every NIC and its connections there are
//! cut, so its verbs still in flight cannot land on memory whose locks were
//! recovered (no takeover before a fence). It costs a command per NIC at each registration
//! and each fence, nothing per open or per verb beyond the NIC's lookup.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::tcp::wire::{Request, Response};
use citron_lock::rdma::tcp::{AccessCommand, AccessTable, Extent, RpcClient, RpcError};
use citron_rpc::auth::{Credential, Credentials, Keyring, Secret, SessionId};
use citronfs_core::types::{ClientId, DataServerId, Ino};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

/// Which server's NIC an extent is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ServerRef {
    /// The meta-server's own NIC (attribute slots, lock memory).
    Meta,
    Data(DataServerId),
}

/// What an extent holds, which decides who may write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// A file's bytes or attribute slot: writable for the clients that
    /// opened it for writing, readable for the others.
    Data,
    /// Lock memory: writable for everyone who has it (readers lock too).
    Lock,
}

/// An extent of one server's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Placed {
    pub server: ServerRef,
    pub extent: Extent,
    pub class: Class,
}

impl Placed {
    pub fn new(server: ServerRef, extent: Extent, class: Class) -> Self {
        Self { server, extent, class }
    }
}

/// Why a synchronous revocation could not be confirmed.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("data server {0:?} did not confirm the access change: {1}")]
    Unconfirmed(DataServerId, String),
}

/// How long a synchronous change waits for a data server's confirmation.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// What one file's openers hold.
#[derive(Default)]
struct FileGrants {
    /// Each opener, and whether any of its opens writes.
    openers: HashMap<ClientId, bool>,
    extents: HashSet<Placed>,
}

#[derive(Default)]
struct Ledger {
    admitted: HashSet<ClientId>,
    files: HashMap<Ino, FileGrants>,
}

/// The meta-server's grants. See the module comment.
pub struct Access {
    /// How long NICs hold a verb for its grant, in milliseconds.
    hold_ms: u64,
    /// This meta-server's incarnation: part of every session id, so a
    /// session of an earlier run is worthless.
    incarnation: u64,
    /// `None`: no keys, no grants (admission and fences still hold).
    keyring: Option<Arc<Keyring>>,
    local: Arc<AccessTable>,
    remotes: Mutex<HashMap<DataServerId, Pusher>>,
    membership: Mutex<Vec<Placed>>,
    ledger: Mutex<Ledger>,
}

impl Access {
    /// Grants of a meta-server with `keyring` (or none), whose own NIC's
    /// table is `local`; every NIC holds a verb that outruns its grant for
    /// at most `hold`.
    pub fn new(keyring: Option<Arc<Keyring>>, local: Arc<AccessTable>, hold: Duration) -> Self {
        use rand::RngCore;
        let incarnation = rand::rngs::OsRng.next_u64();
        let hold_ms = hold.as_millis().min(u128::from(u64::MAX)) as u64;
        local.apply(&AccessCommand::Reset { incarnation });
        local.apply(&AccessCommand::SetHold { millis: hold_ms });
        Self {
            hold_ms,
            incarnation,
            keyring,
            local,
            remotes: Mutex::new(HashMap::new()),
            membership: Mutex::new(Vec::new()),
            ledger: Mutex::new(Ledger::default()),
        }
    }

    /// Whether grants are enforced (the cluster has a key). Admission and
    /// fences are, always.
    pub fn enforcing(&self) -> bool {
        self.keyring.is_some()
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub fn keyring(&self) -> Option<&Arc<Keyring>> {
        self.keyring.as_ref()
    }

    /// What client `client` proves after it registered: its session.
    pub fn session_credential(&self, client: ClientId) -> Option<Credential> {
        let id = SessionId { incarnation: self.incarnation, client: client.0 };
        let secret = self.keyring.as_ref()?.session_secret(id.incarnation, id.client)?;
        Some(Credential::Session { id, secret })
    }

    /// The secret every registered client proves to the others' mailboxes.
    pub fn member_secret(&self) -> Option<Secret> {
        self.keyring.as_ref()?.member_secret(self.incarnation)
    }

    /// Extents every registered client may use (set once, at start).
    pub fn set_membership(&self, extents: Vec<Placed>) {
        *self.membership.lock() = extents;
    }

    /// Extents every client may use from now on (a new waits-for block):
    /// granted to every admitted client before this returns (lock memory
    /// is on our own NIC, changed at once), and to later ones at admission.
    /// Appended under the membership lock, and the admitted set read under
    /// it: a client admitted meanwhile is either in that set or reads the
    /// membership after the append (it joins the set before it reads).
    pub fn extend_membership(&self, extents: Vec<Placed>) {
        let admitted: Vec<ClientId> = {
            let mut membership = self.membership.lock();
            membership.extend(extents.iter().copied());
            self.ledger.lock().admitted.iter().copied().collect()
        };
        if !self.enforcing() {
            return;
        }
        for c in admitted {
            self.grant(c, &extents, false);
        }
    }

    /// A data server registered: its NIC is told who is in charge, which
    /// clients are admitted and, for one that came back with its memory
    /// (registered again under its id), what the openers of files with
    /// extents there hold; later changes follow in order. The ledger stays
    /// locked until the new pusher is in place, so a change is either in
    /// this first batch or sent through the new pusher (or both: a grant
    /// twice is a grant).
    pub fn add_data_server(&self, id: DataServerId, nic: SocketAddr) {
        let credentials = match &self.keyring {
            None => Credentials::anonymous(),
            Some(ring) => match ring.cluster_key() {
                Some(key) => Credentials::new(Credential::Key(key.clone())),
                None => {
                    log::error!(
                        "no cluster key: the NIC of data server {} cannot be told who is admitted",
                        id.0
                    );
                    return;
                }
            },
        };
        let pusher = Pusher::spawn(id, nic, credentials);
        let mut first = vec![
            AccessCommand::Reset { incarnation: self.incarnation },
            AccessCommand::SetHold { millis: self.hold_ms },
        ];
        let ledger = self.ledger.lock();
        first.extend(ledger.admitted.iter().map(|c| AccessCommand::Admit { client: c.0 }));
        if self.enforcing() {
            for file in ledger.files.values() {
                let here: Vec<&Placed> =
                    file.extents.iter().filter(|p| p.server == ServerRef::Data(id)).collect();
                if here.is_empty() {
                    continue;
                }
                for (client, writer) in &file.openers {
                    for (class, write) in [(Class::Lock, true), (Class::Data, *writer)] {
                        let extents: Vec<Extent> =
                            here.iter().filter(|p| p.class == class).map(|p| p.extent).collect();
                        if !extents.is_empty() {
                            first.push(AccessCommand::Grant { client: client.0, extents, write });
                        }
                    }
                }
            }
        }
        pusher.send(first, None);
        self.remotes.lock().insert(id, pusher);
        drop(ledger);
    }

    /// A client registered: it may connect, and holds the membership extents.
    pub fn admit(&self, client: ClientId) {
        self.ledger.lock().admitted.insert(client);
        self.local.apply(&AccessCommand::Admit { client: client.0 });
        if self.enforcing() {
            let membership = self.membership.lock().clone();
            self.grant(client, &membership, false);
        }
        for pusher in self.remotes.lock().values() {
            pusher.send(vec![AccessCommand::Admit { client: client.0 }], None);
        }
    }

    /// `client` opened `ino` (for writing with `write`), whose memory is
    /// `memory` now. A client keeps write access to a file until its last
    /// close of it, once any of its opens wrote.
    pub fn opened(&self, client: ClientId, ino: Ino, memory: Vec<Placed>, write: bool) {
        if !self.enforcing() {
            return;
        }
        let mut ledger = self.ledger.lock();
        let file = ledger.files.entry(ino).or_default();
        let fresh: Vec<Placed> = memory.iter().filter(|p| !file.extents.contains(p)).copied().collect();
        file.extents.extend(fresh.iter().copied());
        let others: Vec<(ClientId, bool)> =
            file.openers.iter().filter(|(c, _)| **c != client).map(|(c, w)| (*c, *w)).collect();
        let before = file.openers.get(&client).copied();
        let writes = before.unwrap_or(false) || write;
        file.openers.insert(client, writes);
        // All of it at a first open or an upgrade to writing, else what is new.
        let mine: Vec<Placed> =
            if before != Some(writes) { file.extents.iter().copied().collect() } else { fresh.clone() };
        drop(ledger);
        self.grant(client, &mine, writes);
        for (c, w) in others {
            self.grant(c, &fresh, w);
        }
    }

    /// An allocation gave `ino` the extents `gained` and took `lost` (the
    /// old extent of a chunk it moved to a bigger one): its openers are
    /// granted what is new to them and lose what they had of `lost`. Costs
    /// what the two lists hold, not what the file does, so a writer that
    /// extends a file chunk by chunk pays the same for its thousandth
    /// chunk as for its first.
    pub fn file_allocated(&self, ino: Ino, gained: Vec<Placed>, lost: Vec<Placed>) {
        if !self.enforcing() {
            return;
        }
        let (openers, fresh, gone) = {
            let mut ledger = self.ledger.lock();
            let Some(file) = ledger.files.get_mut(&ino) else { return };
            let gone: Vec<Placed> = lost.into_iter().filter(|p| file.extents.remove(p)).collect();
            let fresh: Vec<Placed> = gained.into_iter().filter(|p| file.extents.insert(*p)).collect();
            (file.openers.iter().map(|(c, w)| (*c, *w)).collect::<Vec<_>>(), fresh, gone)
        };
        for (c, w) in openers {
            self.grant(c, &fresh, w);
            self.revoke(c, &gone);
        }
    }

    /// The memory of `ino` is now `memory` (chunks allocated or freed, a
    /// record block added): its openers gain what is new and lose what is
    /// gone.
    pub fn file_changed(&self, ino: Ino, memory: Vec<Placed>) {
        if !self.enforcing() {
            return;
        }
        let (openers, gained, lost) = {
            let mut ledger = self.ledger.lock();
            let Some(file) = ledger.files.get_mut(&ino) else { return };
            let now: HashSet<Placed> = memory.into_iter().collect();
            let gained: Vec<Placed> = now.difference(&file.extents).copied().collect();
            let lost: Vec<Placed> = file.extents.difference(&now).copied().collect();
            file.extents = now;
            (file.openers.iter().map(|(c, w)| (*c, *w)).collect::<Vec<_>>(), gained, lost)
        };
        for (c, w) in openers {
            self.grant(c, &gained, w);
            self.revoke(c, &lost);
        }
    }

    /// Whether `client` has `ino` open (and, with `write`, any of its opens
    /// writes). Always true without keys (nothing is enforced then).
    pub fn holds_open(&self, client: ClientId, ino: Ino, write: bool) -> bool {
        if !self.enforcing() {
            return true;
        }
        let ledger = self.ledger.lock();
        matches!(ledger.files.get(&ino).and_then(|f| f.openers.get(&client)), Some(&w) if w || !write)
    }

    /// `client` closed `ino`; `still_open` if it has other opens of it.
    pub fn closed(&self, client: ClientId, ino: Ino, still_open: bool) {
        if !self.enforcing() || still_open {
            return;
        }
        let lost = {
            let mut ledger = self.ledger.lock();
            let Some(file) = ledger.files.get_mut(&ino) else { return };
            if file.openers.remove(&client).is_none() {
                return;
            }
            let lost: Vec<Placed> = file.extents.iter().copied().collect();
            if file.openers.is_empty() {
                ledger.files.remove(&ino);
            }
            lost
        };
        self.revoke(client, &lost);
    }

    /// Before `extents` are reused: no client keeps a grant on them, at any
    /// NIC, confirmed.
    pub fn revoke_everyone(&self, extents: &[Placed]) -> Result<(), AccessError> {
        if !self.enforcing() || extents.is_empty() {
            return Ok(());
        }
        {
            let mut ledger = self.ledger.lock();
            for file in ledger.files.values_mut() {
                file.extents.retain(|p| !extents.contains(p));
            }
        }
        let mut waits = Vec::new();
        for (server, list) in by_server(extents) {
            let command = AccessCommand::RevokeEveryone { extents: list };
            match server {
                ServerRef::Meta => self.local.apply(&command),
                ServerRef::Data(id) => {
                    if let Some(pusher) = self.remotes.lock().get(&id) {
                        waits.push((id, pusher.send_confirmed(vec![command])));
                    }
                }
            }
        }
        confirm(waits)
    }

    /// `client` is gone: at every NIC its grants and admission end and its
    /// connections are cut, confirmed.
    pub fn fence(&self, client: ClientId) -> Result<(), AccessError> {
        {
            let mut ledger = self.ledger.lock();
            ledger.admitted.remove(&client);
            ledger.files.retain(|_, f| {
                f.openers.remove(&client);
                !f.openers.is_empty()
            });
        }
        let command = AccessCommand::Fence { client: client.0 };
        self.local.apply(&command);
        let waits: Vec<_> = self
            .remotes
            .lock()
            .iter()
            .map(|(id, p)| (*id, p.send_confirmed(vec![command.clone()])))
            .collect();
        confirm(waits)
    }

    /// Grants `extents` to `client`: lock memory writable, data writable
    /// if `writer`.
    fn grant(&self, client: ClientId, extents: &[Placed], writer: bool) {
        let (locks, data): (Vec<Placed>, Vec<Placed>) = extents.iter().partition(|p| p.class == Class::Lock);
        let grant = |write| move |list| AccessCommand::Grant { client: client.0, extents: list, write };
        self.change(&locks, grant(true));
        self.change(&data, grant(writer));
    }

    fn revoke(&self, client: ClientId, extents: &[Placed]) {
        self.change(extents, |list| AccessCommand::Revoke { client: client.0, extents: list });
    }

    /// Applies a change at once on our NIC and queues it to data servers'.
    fn change(&self, extents: &[Placed], command: impl Fn(Vec<Extent>) -> AccessCommand) {
        if extents.is_empty() {
            return;
        }
        for (server, list) in by_server(extents) {
            match server {
                ServerRef::Meta => self.local.apply(&command(list)),
                ServerRef::Data(id) => match self.remotes.lock().get(&id) {
                    Some(pusher) => pusher.send(vec![command(list)], None),
                    None => log::error!("access change for unknown data server {id:?} dropped"),
                },
            }
        }
    }
}

fn by_server(extents: &[Placed]) -> HashMap<ServerRef, Vec<Extent>> {
    let mut out: HashMap<ServerRef, Vec<Extent>> = HashMap::new();
    for p in extents {
        out.entry(p.server).or_default().push(p.extent);
    }
    out
}

fn confirm(waits: Vec<(DataServerId, Receiver<Result<(), String>>)>) -> Result<(), AccessError> {
    for (id, rx) in waits {
        match rx.recv_timeout(CONFIRM_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(AccessError::Unconfirmed(id, e)),
            Err(_) => {
                return Err(AccessError::Unconfirmed(id, format!("no answer within {CONFIRM_TIMEOUT:?}")))
            }
        }
    }
    Ok(())
}

type Job = (Vec<AccessCommand>, Option<Sender<Result<(), String>>>);

/// One data server NIC's queue of access changes: a thread sends them in
/// order, batching whatever has queued up into one request, and confirms
/// each batch to whoever waits for it.
struct Pusher {
    queue: Sender<Job>,
}

/// Attempts per batch before it is given up (the data server is gone).
const ATTEMPTS: u32 = 3;

impl Pusher {
    fn spawn(id: DataServerId, nic: SocketAddr, credentials: Credentials) -> Self {
        let (queue, jobs) = crossbeam_channel::unbounded::<Job>();
        let rpc: RpcClient<Request, Response> =
            RpcClient::new(nic, CONFIRM_TIMEOUT).with_credentials(credentials);
        let spawned = std::thread::Builder::new()
            .name(format!("access-push-{}", id.0))
            .spawn(move || Self::run(id, &rpc, &jobs));
        if let Err(e) = spawned {
            log::error!("cannot start the access pusher of data server {}: {e}", id.0);
        }
        Self { queue }
    }

    fn run(id: DataServerId, rpc: &RpcClient<Request, Response>, jobs: &Receiver<Job>) {
        while let Ok(first) = jobs.recv() {
            let mut commands = first.0;
            let mut waiters: Vec<_> = first.1.into_iter().collect();
            while let Ok((more, w)) = jobs.try_recv() {
                commands.extend(more);
                waiters.extend(w);
            }
            let result = Self::deliver(rpc, commands);
            if let Err(e) = &result {
                log::error!("access changes for data server {} not delivered: {e}", id.0);
            }
            for w in waiters {
                let _ = w.send(result.clone());
            }
        }
    }

    fn deliver(rpc: &RpcClient<Request, Response>, commands: Vec<AccessCommand>) -> Result<(), String> {
        if commands.is_empty() {
            return Ok(());
        }
        let request = Request::Access(commands);
        let mut last = String::new();
        for attempt in 0..ATTEMPTS {
            // Commands are idempotent: resending a batch that arrived is harmless.
            match rpc.call(&request) {
                Ok(Response::AccessApplied) => return Ok(()),
                Ok(other) => return Err(format!("unexpected answer {other:?}")),
                Err(
                    e @ (RpcError::Io(_)
                    | RpcError::Unreachable(_)
                    | RpcError::Disconnected
                    | RpcError::Timeout(_)),
                ) => {
                    last = e.to_string();
                    std::thread::sleep(Duration::from_millis(50 << attempt));
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(last)
    }

    fn send(&self, commands: Vec<AccessCommand>, waiter: Option<Sender<Result<(), String>>>) {
        // The pusher thread lives as long as the queue's sender.
        let _ = self.queue.send((commands, waiter));
    }

    /// Queues `commands`; the receiver gets the confirmation of their batch
    /// (and so of every earlier command).
    fn send_confirmed(&self, commands: Vec<AccessCommand>) -> Receiver<Result<(), String>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send(commands, Some(tx));
        rx
    }
}
