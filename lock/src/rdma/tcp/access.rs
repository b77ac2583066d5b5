//! Per-client access to a software NIC's memory: the software form of RDMA
//! memory keys (an RNIC refuses a verb whose rkey does not cover its
//! address; the NIC refuses a verb that no grant of its client covers).
//!
//! # Model
//!
//! A connection's handshake says who it is ([`Principal`]). Servers (the
//! cluster key, or anyone on a NIC without keys) may touch every region, as
//! a host's own threads do. A registered client ([`Principal::Session`])
//! may touch only the [`Extent`]s granted to it: a verb must lie inside one
//! grant of its region, as an RDMA verb must lie inside one memory region,
//! and only reads may use a read-only grant (an MR registered without
//! `REMOTE_WRITE`/`REMOTE_ATOMIC`). Anything else is refused with
//! [`VerbError::NotGranted`], like an out-of-bounds verb: it changes
//! nothing and the connection goes on.
//!
//! The meta-server is the only authority: it changes the table with
//! [`AccessCommand`]s ([`AccessTable::apply`], over the NIC's own
//! connection from a server principal, or by a direct call for the
//! meta-server's own NIC), and nothing else does.
//!
//! # Ordering: grants may arrive late, revocations may not
//!
//! * **Grants are pushed asynchronously** (opening a file costs no
//!   server-to-server round trip): the meta-server queues the grant to the
//!   NIC before it answers the open, so the grant almost always arrives
//!   first (it travels one hop, the client's verb two). A verb that races
//!   ahead of its grant (or a session that connects before its admission)
//!   is *held*: the connection's thread waits for the table to change, at
//!   most [`AccessTable::hold`] (default [`DEFAULT_HOLD`]), and is refused
//!   only then. Holding costs that connection alone, and only an
//!   out-of-grant verb pays it.
//! * **Revocations are complete when applied**: every verb of a client
//!   runs under a read lock of that client's grant set, checked and
//!   executed together; a revocation or fence takes the write lock, so
//!   when [`AccessTable::apply`] returns (and the NIC acknowledges the
//!   command) no verb that passed under the old grants is still running.
//!   The meta-server waits for that acknowledgement before it reuses the
//!   memory or counts a client as fenced.
//! * **Fencing** forgets the client's grants and admission and cuts its
//!   connections (the software form of destroying its queue pairs, Citron
//!   §3.10 "Detection"); its session can no longer connect.
//!
//! # Clusters without keys: fences without grants
//!
//! Without keys nothing is proved, so grants would protect nothing; but a
//! client that stalled past its lease must still be refused, or its verbs
//! in flight land after its locks were recovered (no takeover before a fence). A registered
//! client of such a cluster names its session when it connects
//! ([`Principal::Claimed`]). Admission and fencing apply to it exactly as
//! to a proved session (the meta-server admits and fences clients of every
//! cluster); grants do not: an admitted, unfenced claimed client may touch
//! every region, as a server may. Its verbs still run under the read lock
//! of its entry, so a fence that returns has waited for them, as above.
//!
//! # Cost per verb
//!
//! For a server principal, one match. For a client: a read lock of the
//! table and of the client's grant set, and one ordered-map lookup (the
//! grant whose start is nearest below the address). No verb is added on
//! the client side, and no message: verbs per lock and per I/O stay what
//! they were (`citronfs bench auth` measures both).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use citron_rpc::auth::{Principal, Role, Status};
use citron_rpc::Connections;
use parking_lot::{Condvar, Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::rdma::addr::{RegionId, RemoteAddr};
use crate::rdma::error::VerbError;
use crate::rdma::verb::{Verb, VerbReply};

/// How long a verb (or a session's connection) waits for a grant (or an
/// admission) that has not arrived yet before it is refused.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(2);

/// A byte range of a region: the unit of grants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Extent {
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    pub fn new(start: RemoteAddr, len: u64) -> Self {
        Self { region: start.region, offset: start.offset, len }
    }

    fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// A registered client, by the id its meta-server gave it.
pub type ClientNumber = u64;

/// What the meta-server tells a NIC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AccessCommand {
    /// A meta-server incarnation takes charge: forget every client (and cut
    /// their connections) unless it is the one already in charge.
    Reset { incarnation: u64 },
    /// A registered client: its session may connect (with no grant yet).
    Admit { client: ClientNumber },
    /// Grants `extents` for reading, and with `write` for every verb. A
    /// grant never loses `write` by being granted again without it.
    Grant { client: ClientNumber, extents: Vec<Extent>, write: bool },
    /// Ends grants made with exactly these extents.
    Revoke { client: ClientNumber, extents: Vec<Extent> },
    /// Before memory is reused: every grant that overlaps these extents,
    /// of every client, ends.
    RevokeEveryone { extents: Vec<Extent> },
    /// The client is gone: its grants, its admission and its connections.
    Fence { client: ClientNumber },
    /// How long a verb or a session may wait for its grant or admission
    /// (the meta-server's setting, so every NIC of a cluster holds alike).
    SetHold { millis: u64 },
}

/// One client's grants: extents by (region, start, end), each writable or
/// not. Granting is idempotent (the meta-server grants an extent to a
/// client once; a command applied twice, a retry after a broken
/// connection, changes nothing).
#[derive(Default, Debug)]
struct GrantSet {
    extents: BTreeMap<(RegionId, u64, u64), Writable>,
}

/// Whether a grant admits verbs other than reads.
type Writable = bool;

/// Grants overlapping each other are not made by the meta-server (its
/// allocations are disjoint); the lookup still looks this many grants back.
const LOOKBACK: usize = 4;

impl GrantSet {
    fn covers(&self, addr: RemoteAddr, len: u64, write: bool) -> bool {
        let Some(end) = addr.offset.checked_add(len) else { return false };
        self.extents
            .range(..=(addr.region, addr.offset, u64::MAX))
            .rev()
            .take(LOOKBACK)
            .take_while(|((region, _, _), _)| *region == addr.region)
            .any(|((_, start, stop), writable)| {
                *start <= addr.offset && end <= *stop && (*writable || !write)
            })
    }

    fn grant(&mut self, e: &Extent, write: bool) {
        *self.extents.entry((e.region, e.offset, e.end())).or_insert(write) |= write;
    }

    fn revoke(&mut self, e: &Extent) {
        self.extents.remove(&(e.region, e.offset, e.end()));
    }

    fn revoke_overlapping(&mut self, e: &Extent) -> usize {
        let before = self.extents.len();
        self.extents.retain(|(region, start, stop), _| {
            !(*region == e.region && *start < e.end() && e.offset < *stop)
        });
        before - self.extents.len()
    }
}

#[derive(Default, Debug)]
struct ClientAccess {
    grants: RwLock<GrantSet>,
    /// Set (under the write lock) when the client is fenced: a verb that
    /// found this entry before it was removed sees it.
    fenced: AtomicBool,
}

#[derive(Default)]
struct Clients {
    incarnation: Option<u64>,
    by_number: HashMap<ClientNumber, Arc<ClientAccess>>,
}

/// Counters of an access table.
#[derive(Debug, Default)]
pub struct AccessStats {
    /// Verbs refused for want of a grant.
    pub refused: AtomicU64,
    /// Verbs that had to wait for their grant (and then got it or not).
    pub held: AtomicU64,
}

/// Which memory each client of one NIC may touch. See the module comment.
pub struct AccessTable {
    clients: RwLock<Clients>,
    /// Bumped (and waiters woken) whenever a grant or admission is added.
    generation: Mutex<u64>,
    changed: Condvar,
    /// The hold, in nanoseconds (set by the meta-server).
    hold_nanos: AtomicU64,
    /// The NIC's connections, to cut a fenced client's.
    connections: OnceLock<Connections>,
    stats: AccessStats,
}

impl std::fmt::Debug for AccessTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.clients.read();
        f.debug_struct("AccessTable")
            .field("incarnation", &c.incarnation)
            .field("clients", &c.by_number.len())
            .finish()
    }
}

impl Default for AccessTable {
    fn default() -> Self {
        Self::new(DEFAULT_HOLD)
    }
}

/// The bytes a verb touches, and whether it may change them.
fn touched(verb: &Verb) -> (RemoteAddr, u64, bool) {
    let len = match verb {
        Verb::Read { len, .. } => u64::from(*len),
        Verb::Write { data, .. } => data.len() as u64,
        Verb::Cas { .. } | Verb::Faa { .. } | Verb::MaskedCas { .. } | Verb::MaskedFaa { .. } => 8,
        Verb::ExtCas { .. } | Verb::ExtFaa { .. } => 16,
        Verb::Flush { len, .. } => *len,
    };
    (verb.addr(), len, !matches!(verb, Verb::Read { .. } | Verb::Flush { .. }))
}

impl AccessTable {
    /// An empty table whose held verbs wait at most `hold`.
    pub fn new(hold: Duration) -> Self {
        Self {
            clients: RwLock::new(Clients::default()),
            generation: Mutex::new(0),
            changed: Condvar::new(),
            hold_nanos: AtomicU64::new(hold.as_nanos().min(u128::from(u64::MAX)) as u64),
            connections: OnceLock::new(),
            stats: AccessStats::default(),
        }
    }

    pub fn hold(&self) -> Duration {
        // Relaxed: a lone setting, read afresh by every wait.
        Duration::from_nanos(self.hold_nanos.load(Ordering::Relaxed))
    }

    pub fn stats(&self) -> &AccessStats {
        &self.stats
    }

    /// Gives the table the NIC's connections (once), so fencing can cut them.
    pub fn attach(&self, connections: Connections) {
        let _ = self.connections.set(connections);
    }

    /// Clients admitted now.
    pub fn clients(&self) -> usize {
        self.clients.read().by_number.len()
    }

    /// The extents granted to `client` now (diagnostics and tests).
    pub fn grants_of(&self, client: ClientNumber) -> Vec<Extent> {
        let Some(c) = self.clients.read().by_number.get(&client).cloned() else { return Vec::new() };
        let g = c.grants.read();
        g.extents
            .keys()
            .map(|&(region, start, stop)| Extent { region, offset: start, len: stop - start })
            .collect()
    }

    fn wake_waiters(&self) {
        *self.generation.lock() += 1;
        self.changed.notify_all();
    }

    /// Waits until the table changes after `seen` or `deadline` passes;
    /// returns the generation now.
    fn wait_for_change(&self, seen: u64, deadline: Instant) -> u64 {
        let mut g = self.generation.lock();
        while *g == seen {
            if self.changed.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        *g
    }

    fn generation(&self) -> u64 {
        *self.generation.lock()
    }

    /// Applies one command of the meta-server. Returns once it holds: a
    /// revocation or fence returns after every verb that passed under the
    /// old grants has finished.
    pub fn apply(&self, command: &AccessCommand) {
        match command {
            AccessCommand::Reset { incarnation } => {
                let gone: Vec<_> = {
                    let mut c = self.clients.write();
                    if c.incarnation == Some(*incarnation) {
                        return;
                    }
                    c.incarnation = Some(*incarnation);
                    c.by_number.drain().map(|(_, a)| a).collect()
                };
                for a in gone {
                    let _g = a.grants.write();
                    a.fenced.store(true, Ordering::Release);
                }
                self.cut(|_| true);
                self.wake_waiters();
            }
            AccessCommand::Admit { client } => {
                self.clients.write().by_number.entry(*client).or_default();
                self.wake_waiters();
            }
            AccessCommand::Grant { client, extents, write } => {
                let a = self.clients.write().by_number.entry(*client).or_default().clone();
                {
                    let mut g = a.grants.write();
                    for e in extents {
                        g.grant(e, *write);
                    }
                }
                self.wake_waiters();
            }
            AccessCommand::Revoke { client, extents } => {
                let Some(a) = self.clients.read().by_number.get(client).cloned() else { return };
                let mut g = a.grants.write();
                for e in extents {
                    g.revoke(e);
                }
            }
            AccessCommand::RevokeEveryone { extents } => {
                let all: Vec<_> = self.clients.read().by_number.values().cloned().collect();
                for a in all {
                    let mut g = a.grants.write();
                    for e in extents {
                        g.revoke_overlapping(e);
                    }
                }
            }
            AccessCommand::SetHold { millis } => {
                let nanos = Duration::from_millis(*millis).as_nanos().min(u128::from(u64::MAX)) as u64;
                self.hold_nanos.store(nanos, Ordering::Relaxed);
            }
            AccessCommand::Fence { client } => {
                let Some(a) = self.clients.write().by_number.remove(client) else {
                    self.cut(|c| c == *client);
                    return;
                };
                {
                    // Waits for the client's verbs in flight.
                    let mut g = a.grants.write();
                    a.fenced.store(true, Ordering::Release);
                    g.extents.clear();
                }
                self.cut(|c| c == *client);
            }
        }
    }

    /// Cuts the connections of the sessions of clients that `which` selects.
    fn cut(&self, which: impl Fn(ClientNumber) -> bool) {
        if let Some(conns) = self.connections.get() {
            let n = conns.close_where(
                |p| matches!(p, Principal::Session(s) | Principal::Claimed(s) if which(s.client)),
            );
            if n > 0 {
                log::info!("cut {n} connections of fenced clients");
            }
        }
    }

    /// Whether a peer that proved `principal` may connect to the NIC:
    /// servers, and sessions (proved or claimed) of admitted clients of the
    /// incarnation in charge (waiting up to the hold for an admission in
    /// flight).
    pub fn admit(&self, principal: &Principal) -> Result<(), Status> {
        match principal {
            p if p.is_server() => Ok(()),
            Principal::Session(s) | Principal::Claimed(s) => {
                let deadline = Instant::now() + self.hold();
                loop {
                    let seen = self.generation();
                    {
                        let c = self.clients.read();
                        if c.incarnation == Some(s.incarnation) && c.by_number.contains_key(&s.client) {
                            return Ok(());
                        }
                    }
                    if Instant::now() >= deadline {
                        return Err(Status::NotAdmitted);
                    }
                    self.wait_for_change(seen, deadline);
                }
            }
            // Client keys register with the meta-server, then connect as
            // sessions; members talk to mailboxes, not to NICs.
            Principal::Key { options, .. } if options.role == Role::Client => Err(Status::NotAdmitted),
            _ => Err(Status::NotAdmitted),
        }
    }

    /// Executes `verb` for `principal` with `run` if its grants allow it;
    /// see the module comment for the hold and the locking.
    pub fn execute(
        &self,
        principal: &Principal,
        verb: &Verb,
        run: impl FnOnce(&Verb) -> Result<VerbReply, VerbError>,
    ) -> Result<VerbReply, VerbError> {
        let (client, needs_grant) = match principal {
            p if p.is_server() => return run(verb),
            Principal::Session(s) => (s.client, true),
            Principal::Claimed(s) => (s.client, false),
            _ => {
                let (addr, len, _) = touched(verb);
                return Err(self.refuse(addr, len));
            }
        };
        let (addr, len, write) = touched(verb);
        let mut deadline = None;
        loop {
            let seen = self.generation();
            let Some(access) = self.clients.read().by_number.get(&client).cloned() else {
                return Err(self.refuse(addr, len));
            };
            {
                let g = access.grants.read();
                if access.fenced.load(Ordering::Acquire) {
                    return Err(self.refuse(addr, len));
                }
                if !needs_grant || g.covers(addr, len, write) {
                    // Executed under the read lock: a revocation or fence
                    // waits for it.
                    return run(verb);
                }
            }
            let deadline = *deadline.get_or_insert_with(|| {
                self.stats.held.fetch_add(1, Ordering::Relaxed);
                Instant::now() + self.hold()
            });
            if Instant::now() >= deadline {
                return Err(self.refuse(addr, len));
            }
            self.wait_for_change(seen, deadline);
        }
    }

    #[cold]
    fn refuse(&self, addr: RemoteAddr, len: u64) -> VerbError {
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
        VerbError::NotGranted { addr, len }
    }
}

#[cfg(test)]
mod tests {
    use citron_rpc::auth::{KeyOptions, SessionId};

    use super::*;

    const R: RegionId = RegionId(1);

    fn session(client: u64) -> Principal {
        Principal::Session(SessionId { incarnation: 7, client })
    }

    fn read(offset: u64, len: u32) -> Verb {
        Verb::Read { addr: RemoteAddr::new(R, offset), len }
    }

    fn ok(_: &Verb) -> Result<VerbReply, VerbError> {
        Ok(VerbReply::Written)
    }

    fn table() -> AccessTable {
        let t = AccessTable::new(Duration::from_millis(30));
        t.apply(&AccessCommand::Reset { incarnation: 7 });
        t.apply(&AccessCommand::Admit { client: 1 });
        t
    }

    #[test]
    fn a_verb_must_lie_inside_one_grant() {
        let t = table();
        t.apply(&AccessCommand::Grant {
            client: 1,
            extents: vec![
                Extent { region: R, offset: 4096, len: 4096 },
                Extent { region: R, offset: 8192, len: 64 },
            ],
            write: true,
        });
        assert!(t.execute(&session(1), &read(4096, 4096), ok).is_ok());
        assert!(t.execute(&session(1), &read(8192 + 56, 8), ok).is_ok());
        for bad in [read(4095, 8), read(8190, 8), read(8192 + 60, 8), read(0, 8), read(u64::MAX - 3, 8)] {
            assert!(matches!(t.execute(&session(1), &bad, ok), Err(VerbError::NotGranted { .. })), "{bad:?}");
        }
        // Another client, another region: nothing.
        t.apply(&AccessCommand::Admit { client: 2 });
        assert!(t.execute(&session(2), &read(4096, 8), ok).is_err());
        let other = Verb::Faa { addr: RemoteAddr::new(RegionId(2), 4096), add: 1 };
        assert!(t.execute(&session(1), &other, ok).is_err());
        // Servers and tables without keys are not checked.
        assert!(t.execute(&Principal::Anonymous, &read(0, 8), ok).is_ok());
        let server = Principal::Key { name: "c".into(), options: KeyOptions::default() };
        assert!(t.execute(&server, &read(0, 8), ok).is_ok());
        assert_eq!(t.stats().refused.load(Ordering::Relaxed), 7);
    }

    #[test]
    fn read_only_grants_admit_reads_only_and_are_upgraded_not_downgraded() {
        let t = table();
        let e = Extent { region: R, offset: 0, len: 64 };
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e], write: false });
        assert!(t.execute(&session(1), &read(0, 64), ok).is_ok());
        let writes = [
            Verb::Write { addr: RemoteAddr::new(R, 0), data: vec![1] },
            Verb::Faa { addr: RemoteAddr::new(R, 8), add: 1 },
            Verb::ExtCas { addr: RemoteAddr::new(R, 16), cmp: 0, cmp_mask: 0, swap: 1, swap_mask: 1 },
        ];
        for w in &writes {
            assert!(matches!(t.execute(&session(1), w, ok), Err(VerbError::NotGranted { .. })), "{w:?}");
        }
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e], write: true });
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e], write: false });
        for w in &writes {
            assert!(t.execute(&session(1), w, ok).is_ok(), "{w:?}");
        }
    }

    #[test]
    fn commands_are_idempotent_and_everyone_loses_overlaps() {
        let t = table();
        let e = Extent { region: R, offset: 0, len: 64 };
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e, e], write: true });
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e], write: true });
        t.apply(&AccessCommand::Revoke { client: 1, extents: vec![e] });
        assert!(t.execute(&session(1), &read(0, 8), ok).is_err(), "a grant applied twice is one grant");
        t.apply(&AccessCommand::Revoke { client: 1, extents: vec![e] });
        t.apply(&AccessCommand::Admit { client: 2 });
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e], write: true });
        t.apply(&AccessCommand::Grant {
            client: 2,
            extents: vec![Extent { region: R, offset: 32, len: 64 }],
            write: true,
        });
        t.apply(&AccessCommand::RevokeEveryone { extents: vec![Extent { region: R, offset: 60, len: 1 }] });
        assert!(t.grants_of(1).is_empty() && t.grants_of(2).is_empty());
    }

    #[test]
    fn a_verb_ahead_of_its_grant_is_held_until_it_arrives() {
        let t = Arc::new(AccessTable::new(Duration::from_secs(30)));
        t.apply(&AccessCommand::Reset { incarnation: 7 });
        t.apply(&AccessCommand::Admit { client: 1 });
        let granting = {
            let t = t.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                t.apply(&AccessCommand::Grant {
                    client: 1,
                    extents: vec![Extent { region: R, offset: 0, len: 8 }],
                    write: true,
                });
            })
        };
        assert!(t.execute(&session(1), &read(0, 8), ok).is_ok());
        granting.join().unwrap();
        assert_eq!(t.stats().held.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_revocation_waits_for_the_verb_in_flight() {
        let t = Arc::new(table());
        let e = Extent { region: R, offset: 0, len: 8 };
        t.apply(&AccessCommand::Grant { client: 1, extents: vec![e], write: true });
        let (inside, go) = (Arc::new(std::sync::Barrier::new(2)), Arc::new(AtomicBool::new(false)));
        let verb = {
            let (t, inside, go) = (t.clone(), inside.clone(), go.clone());
            std::thread::spawn(move || {
                t.execute(&session(1), &read(0, 8), |_| {
                    inside.wait();
                    std::thread::sleep(Duration::from_millis(50));
                    go.store(true, Ordering::SeqCst);
                    Ok(VerbReply::Written)
                })
            })
        };
        inside.wait();
        t.apply(&AccessCommand::Revoke { client: 1, extents: vec![e] });
        assert!(go.load(Ordering::SeqCst), "the revocation returned before the verb finished");
        verb.join().unwrap().unwrap();
        assert!(t.execute(&session(1), &read(0, 8), ok).is_err());
    }

    #[test]
    fn fencing_ends_grants_and_admission_and_a_new_incarnation_forgets_all() {
        let t = table();
        t.apply(&AccessCommand::Grant {
            client: 1,
            extents: vec![Extent { region: R, offset: 0, len: 8 }],
            write: true,
        });
        assert_eq!(t.admit(&session(1)), Ok(()));
        t.apply(&AccessCommand::Fence { client: 1 });
        assert!(t.grants_of(1).is_empty());
        assert!(t.execute(&session(1), &read(0, 8), ok).is_err());
        assert_eq!(t.admit(&session(1)), Err(Status::NotAdmitted));
        t.apply(&AccessCommand::Admit { client: 3 });
        assert_eq!(t.admit(&session(3)), Ok(()));
        let stale = Principal::Session(SessionId { incarnation: 6, client: 3 });
        assert_eq!(t.admit(&stale), Err(Status::NotAdmitted));
        t.apply(&AccessCommand::Reset { incarnation: 8 });
        assert_eq!(t.clients(), 0);
        assert_eq!(t.admit(&Principal::Member { incarnation: 8 }), Err(Status::NotAdmitted));
    }
    /// A claimed session (a cluster without keys) needs no grant, but must
    /// be admitted, and a fence refuses it as it refuses a proved session.
    #[test]
    fn a_claimed_session_needs_admission_not_grants_and_is_fenced() {
        let t = table();
        let claimed = |client| Principal::Claimed(SessionId { incarnation: 7, client });
        assert_eq!(t.admit(&claimed(1)), Ok(()));
        let faa = Verb::Faa { addr: RemoteAddr::new(RegionId(9), 1 << 20), add: 1 };
        assert!(t.execute(&claimed(1), &read(0, 8), ok).is_ok());
        assert!(t.execute(&claimed(1), &faa, ok).is_ok());
        // Not admitted, or of another incarnation: refused.
        assert_eq!(t.admit(&claimed(2)), Err(Status::NotAdmitted));
        assert!(t.execute(&claimed(2), &read(0, 8), ok).is_err());
        let stale = Principal::Claimed(SessionId { incarnation: 6, client: 1 });
        assert_eq!(t.admit(&stale), Err(Status::NotAdmitted));
        t.apply(&AccessCommand::Fence { client: 1 });
        assert!(matches!(t.execute(&claimed(1), &faa, ok), Err(VerbError::NotGranted { .. })));
        assert_eq!(t.admit(&claimed(1)), Err(Status::NotAdmitted));
    }
}
