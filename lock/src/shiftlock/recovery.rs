//! Era-based recovery of ShiftLock entries by the lock host (§3.6, Fig. 2(c)).
//!
//! The lock host keeps 64-bit era counters in its memory ([`EraTable`]),
//! readable by clients with one-sided reads. A client that sees a lock's
//! `RelCnt` stand still for 3 × T_lease reads the lock's era and sends a
//! [`RecoveryRequest::Recover`] with it to the [`RecoveryService`], a thread
//! with its own endpoint in the lock-host process. The service recovers
//! *once per era*: if the era in the request is the counter's current value
//! it resets the entry (every field zero, `RelCnt` + 2^63) with an extended
//! CAS and then increments the era; otherwise it answers `Stale`. So when
//! several waiters time out on the same stall, exactly one reset happens,
//! and a request that was delayed past a recovery (the ABA case of Fig.
//! 2(b)) cannot reset the lock again.
//!
//! Ordering argument (why a client's request can never cause a second reset
//! for one stall): the service resets the entry *before* it increments the
//! era, and a client reads the era *before* it re-reads the entry to confirm
//! the stall. If a reset R happened and the client's re-read did not see its
//! leap, the re-read preceded R's reset, so the client's era read preceded
//! R's era increment: the client holds R's era, and R, handled first by the
//! single service thread, makes the request stale.
//!
//! Beyond the paper, a request also carries the `RelCnt` value the client saw
//! stand still, and the service resets only an entry whose `RelCnt` still has
//! it (the reset's CAS compares the whole entry, so a release racing with it
//! makes it fail and is then seen). Every release, handover and epoch flip
//! changes `RelCnt` with an atomic that a reset makes fail (see the client's
//! fenced checks), so each of them either precedes the reset and prevents it
//! (answer [`RecoveryReply::Progressed`]) or follows it and changes nothing.
//! In particular no `Handover` or `ModeChanged` can be in flight from before
//! a reset: a slow holder that releases just as a waiter gives up cannot
//! pass a lock that is being reset.
//!
//! Choices:
//! * Several era counters (the paper's "improving recovery performance"):
//!   a lock's counter is chosen by hashing its address, so recoveries of
//!   locks under different counters do not reject each other's requests.
//! * The service is the only writer of its era words; exactly one service
//!   must serve an era table.
//! * A request for an era that does not exist yet (greater than the current
//!   one) is answered `Stale` like an old one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::entry::{Entry, ExtCas, RelCnt, ENTRY_ALIGN};
use super::message::{RecoveryReply, RecoveryRequest, Wire};
use crate::rdma::{ClientAddr, Endpoint, Node, NodeId, RdmaError, RemoteAddr};
use crate::rwlock::LockError;

/// The era counters: `count` 8-byte words from `base`, zero at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EraTable {
    pub base: RemoteAddr,
    pub count: u32,
}

impl EraTable {
    /// Bytes of host memory for `count` counters.
    pub const fn bytes(count: u32) -> u64 {
        8 * count as u64
    }

    /// The era counter that governs `lock`.
    pub fn era_of(&self, lock: RemoteAddr) -> RemoteAddr {
        let count = u64::from(self.count.max(1));
        // Entries are 16-aligned: hash the entry index, region included.
        let key = (lock.offset / ENTRY_ALIGN) ^ (u64::from(lock.region.0) << 48);
        let slot = key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        self.base + 8 * (slot % count)
    }
}

/// Where clients find a lock's recovery: the service's mailbox and the era
/// counters it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RecoveryLocator {
    pub service: ClientAddr,
    /// The same service's mailbox on a second fabric, if it has one: a
    /// lock host whose own fabric is shm also serves its NIC's (tcp)
    /// clients, which cannot send to a shm mailbox (near and far clients mixed).
    pub also: Option<ClientAddr>,
    pub eras: EraTable,
}

/// Whether a mailbox is on a shm fabric (node ids from
/// [`NodeId::FIRST_SHM`] up) rather than a NIC's.
fn on_shm(a: ClientAddr) -> bool {
    a.node.0 >= NodeId::FIRST_SHM
}

impl RecoveryLocator {
    /// The service's mailbox that a client at `me` can send to: the one on
    /// its own kind of fabric.
    pub fn service_for(&self, me: ClientAddr) -> ClientAddr {
        match self.also {
            Some(also) if on_shm(also) == on_shm(me) && on_shm(self.service) != on_shm(me) => also,
            _ => self.service,
        }
    }

    /// The current era of `lock`'s counter.
    pub fn current_era(&self, ep: &Endpoint, lock: RemoteAddr) -> Result<u64, LockError> {
        Ok(ep.read_u64(self.eras.era_of(lock))?)
    }

    /// Sends one recovery request for `lock` under `era`, stuck at `stuck_at`, and waits up to
    /// `timeout` for the service's answer. For tools and tests: it consumes
    /// whatever else arrives at `ep` meanwhile, so use an endpoint that
    /// carries no other traffic (lock handles ask through their postbox).
    pub fn request(
        &self,
        ep: &Endpoint,
        lock: RemoteAddr,
        era: u64,
        stuck_at: RelCnt,
        timeout: Duration,
    ) -> Result<RecoveryReply, LockError> {
        let request = Wire::Request(RecoveryRequest::Recover { lock, era, stuck_at });
        ep.send(self.service_for(ep.addr()), &request.encode())?;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let wait = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(message) = ep.recv_timeout(wait) else { return Err(LockError::Timeout(timeout)) };
            match Wire::decode(&message.payload) {
                Ok(Wire::Reply(reply)) if reply.lock() == lock => return Ok(reply),
                other => log::debug!("ignoring {other:?} from {} while waiting for recovery", message.from),
            }
        }
    }
}

/// What the service has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    /// Locks reset (one per era advanced).
    pub recovered: u64,
    /// Requests with an era that was not current.
    pub stale: u64,
    /// Requests for a lock whose `RelCnt` had moved.
    pub progressed: u64,
    /// Requests refused as invalid.
    pub refused: u64,
}

#[derive(Default)]
struct SharedStats {
    recovered: AtomicU64,
    stale: AtomicU64,
    progressed: AtomicU64,
    refused: AtomicU64,
}

/// The lock host's recovery threads (one per fabric it serves, taking
/// requests one at a time between them). Dropping it stops them.
pub struct RecoveryService {
    locator: RecoveryLocator,
    /// Each thread's node and mailbox, to stop it.
    mailboxes: Vec<(Node, ClientAddr)>,
    stats: Arc<SharedStats>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RecoveryService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryService").field("locator", &self.locator).finish()
    }
}

impl RecoveryService {
    /// Starts the service on `node` (a node of the lock-host process) for
    /// the era counters `eras`, which must be zeroed host memory.
    pub fn spawn(node: &Node, eras: EraTable) -> Result<Self, LockError> {
        Self::spawn_on(std::slice::from_ref(node), eras)
    }

    /// [`RecoveryService::spawn`] with a mailbox on each of `nodes` (at
    /// most two: the lock host's own fabric first, then its NIC's when
    /// that is another), for clients of either. The threads take requests
    /// one at a time between them, so the era check, the reset and the
    /// era increment of one request are never interleaved with another's
    /// (the module comment's argument needs exactly that).
    pub fn spawn_on(nodes: &[Node], eras: EraTable) -> Result<Self, LockError> {
        if eras.count == 0 || !eras.base.is_aligned(8) {
            return Err(LockError::Misuse("an era table needs at least one 8-aligned counter"));
        }
        if nodes.is_empty() || nodes.len() > 2 {
            return Err(LockError::Misuse("a recovery service has one or two mailboxes"));
        }
        let eps = nodes.iter().map(|n| n.endpoint()).collect::<Result<Vec<_>, _>>()?;
        // Fail early if the era table is not readable host memory.
        for i in 0..eras.count {
            eps[0].read_u64(eras.base + 8 * u64::from(i))?;
        }
        let locator = RecoveryLocator { service: eps[0].addr(), also: eps.get(1).map(|e| e.addr()), eras };
        let stats = Arc::new(SharedStats::default());
        let one_at_a_time = Arc::new(parking_lot::Mutex::new(()));
        let mut mailboxes = Vec::new();
        let mut threads = Vec::new();
        for (node, ep) in nodes.iter().zip(eps) {
            mailboxes.push((node.clone(), ep.addr()));
            let (stats, one_at_a_time) = (stats.clone(), one_at_a_time.clone());
            let thread = std::thread::Builder::new()
                .name("shiftlock-recovery".into())
                .spawn(move || serve(&ep, eras, &stats, &one_at_a_time))
                .map_err(|e| LockError::Host(format!("cannot start the recovery thread: {e}")))?;
            threads.push(thread);
        }
        log::info!("ShiftLock recovery service at {} (also {:?})", locator.service, locator.also);
        Ok(Self { locator, mailboxes, stats, threads })
    }

    pub fn locator(&self) -> RecoveryLocator {
        self.locator
    }

    pub fn stats(&self) -> RecoveryStats {
        RecoveryStats {
            recovered: self.stats.recovered.load(Ordering::Relaxed),
            stale: self.stats.stale.load(Ordering::Relaxed),
            progressed: self.stats.progressed.load(Ordering::Relaxed),
            refused: self.stats.refused.load(Ordering::Relaxed),
        }
    }
}

impl Drop for RecoveryService {
    fn drop(&mut self) {
        let mut stopped = true;
        for (node, service) in &self.mailboxes {
            let sent = node
                .endpoint()
                .map_err(LockError::from)
                .and_then(|ep| Ok(ep.send(*service, &Wire::Request(RecoveryRequest::Shutdown).encode())?));
            if let Err(e) = sent {
                // That thread stays parked on its mailbox; it holds no lock state.
                log::warn!("cannot stop the recovery service at {service}: {e}");
                stopped = false;
            }
        }
        if stopped {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// The service loop of one mailbox: one request at a time (with the other
/// mailbox's thread too, through `one_at_a_time`), so the era check, the
/// reset and the era increment of one request are never interleaved with
/// another's.
fn serve(ep: &Endpoint, eras: EraTable, stats: &SharedStats, one_at_a_time: &parking_lot::Mutex<()>) {
    loop {
        let Some(message) = ep.recv_timeout(Duration::from_secs(3600)) else { continue };
        let request = match Wire::decode(&message.payload) {
            Ok(Wire::Request(r)) => r,
            Ok(other) => {
                log::warn!("recovery service: ignoring {other:?} from {}", message.from);
                continue;
            }
            Err(e) => {
                log::warn!("recovery service: malformed message from {}: {e}", message.from);
                continue;
            }
        };
        let reply = match request {
            RecoveryRequest::Shutdown if message.from.node == ep.addr().node => return,
            RecoveryRequest::Shutdown => {
                log::warn!("recovery service: shutdown from foreign node {} refused", message.from);
                continue;
            }
            RecoveryRequest::Recover { lock, era, stuck_at } => {
                let _serial = one_at_a_time.lock();
                match recover(ep, eras, lock, era, stuck_at) {
                    Ok(reply) => reply,
                    Err(e) => RecoveryReply::Refused { lock, reason: e.to_string() },
                }
            }
        };
        let counter = match reply {
            RecoveryReply::Recovered { .. } => &stats.recovered,
            RecoveryReply::Stale { .. } => &stats.stale,
            RecoveryReply::Progressed { .. } => &stats.progressed,
            RecoveryReply::Refused { .. } => &stats.refused,
        };
        // Relaxed: statistics only.
        counter.fetch_add(1, Ordering::Relaxed);
        log::info!("recovery service: {reply:?} for {}", message.from);
        if let Err(e) = ep.send(message.from, &Wire::Reply(reply).encode()) {
            log::warn!("recovery service: cannot answer {}: {e}", message.from);
        }
    }
}

/// One recovery request (§3.6): reject an era that is not current and an
/// entry that has moved since the client saw it stuck; else reset the entry,
/// then advance the era.
fn recover(
    ep: &Endpoint,
    eras: EraTable,
    lock: RemoteAddr,
    era: u64,
    stuck_at: RelCnt,
) -> Result<RecoveryReply, RdmaError> {
    if !lock.is_aligned(ENTRY_ALIGN) {
        return Ok(RecoveryReply::Refused { lock, reason: format!("{lock} is not 16-aligned") });
    }
    let era_word = eras.era_of(lock);
    let current = ep.read_u64(era_word)?;
    if era != current {
        return Ok(RecoveryReply::Stale { lock, requested: era, current });
    }
    // The reset: an extended CAS from the value last seen, retried with the
    // value the failed CAS returned (clients may still be changing fields),
    // as long as RelCnt has not moved.
    let mut seen = Entry::from_le_bytes(ep.read_u128(lock)?.to_le_bytes());
    loop {
        if seen.rel_cnt() != stuck_at {
            return Ok(RecoveryReply::Progressed { lock, era, rel_cnt: seen.rel_cnt() });
        }
        let cas = ExtCas::recover(seen);
        let old = Entry(ep.ext_cas(lock, cas.cmp, cas.cmp_mask, cas.swap, cas.swap_mask)?);
        if old == seen {
            log::warn!("recovered ShiftLock {lock} (was {seen:?}) in era {era}");
            break;
        }
        seen = old;
    }
    // Only after the reset (see the module comment).
    ep.write_u64(era_word, era + 1)?;
    Ok(RecoveryReply::Recovered { lock, era: era + 1 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::RegionId;

    #[test]
    fn a_client_is_sent_to_the_mailbox_on_its_own_fabric() {
        let at = |node| ClientAddr { node: NodeId(node), mailbox: crate::rdma::MailboxId(1) };
        let eras = EraTable { base: RemoteAddr::new(RegionId(1), 4096), count: 8 };
        let (shm, nic) = (at(NodeId::FIRST_SHM), at(1));
        let both = RecoveryLocator { service: shm, also: Some(nic), eras };
        assert_eq!(both.service_for(at(7)), nic, "a tcp client");
        assert_eq!(both.service_for(at(NodeId::FIRST_SHM + 3)), shm, "a shm client");
        let one = RecoveryLocator { service: shm, also: None, eras };
        assert_eq!(one.service_for(at(7)), shm, "only one mailbox: that one");
    }

    #[test]
    fn era_of_spreads_locks_and_stays_in_the_table() {
        let t = EraTable { base: RemoteAddr::new(RegionId(1), 4096), count: 8 };
        let mut used = std::collections::HashSet::new();
        for i in 0..256u64 {
            let e = t.era_of(RemoteAddr::new(RegionId(1), 16 * i));
            assert!(e.offset >= 4096 && e.offset < 4096 + EraTable::bytes(8) && e.is_aligned(8));
            used.insert(e.offset);
        }
        assert_eq!(used.len(), 8, "every counter serves some lock");
        let one = EraTable { base: RemoteAddr::new(RegionId(1), 64), count: 1 };
        assert_eq!(one.era_of(RemoteAddr::new(RegionId(9), 1 << 20)), one.base);
    }
}
