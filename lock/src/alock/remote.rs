//! The remote cohort: a client taking an ALock with verbs only (Alg. 2,
//! Alg. 3 as listed, Alg. 4 for the leader), its MCS descriptor replaced by
//! handover messages ([`super::message`]; the choice is argued in [`super`]).
//!
//! Verbs, uncontended: acquire is one batch (the swap of Alg. 3 line 3 and
//! the read of the local flag and `victim`), release one CAS (line 15): 3
//! verbs, 2 round trips, no messages. Passing the lock inside the remote
//! cohort costs two messages (`Successor`, `Handover`), the failed CAS, and
//! the successor's entry record (one masked-FAA, for recovery).

use std::sync::Arc;
use std::time::Instant;

use super::message::{AlockPostbox, Handoff, HandoffKind, Letter};
use super::{passed_budget, AlockConfig, Cohort, RemoteTail, Stall, TAIL_LOCAL, TAIL_REMOTE, VICTIM};
use crate::dslr::pause;
use crate::rdma::{ClientAddr, Endpoint, RdmaError, RemoteAddr, Verb};
use crate::rwlock::{LockError, Mode, Riders, RwLockClient};

/// Counters of one client handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AlockClientStats {
    pub acquisitions: u64,
    /// Acquisitions that found both queues empty (one batch, no wait).
    pub uncontended: u64,
    /// Acquisitions handed over by a remote predecessor with budget > 0.
    pub passed: u64,
    /// Acquisitions that ran Alg. 4 (leader with the local flag up, or a
    /// successor handed budget 0).
    pub peterson: u64,
    /// Of those, successors handed budget 0 (`pReacquire`).
    pub reacquires: u64,
    /// Reads of the Peterson words while waiting (remote spinning, §6.1).
    pub polls: u64,
    /// Releases that handed the lock to a remote successor.
    pub handovers: u64,
    /// Acquisitions that gave up ([`LockError::Timeout`]).
    pub timeouts: u64,
    /// Stalled remote queues this handle recovered (see "Recovery" in [`super`]).
    pub recoveries: u64,
    /// Times it found its queue recovered and enqueued again.
    pub requeues: u64,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    me: ClientAddr,
    /// The epoch of the queue we entered in.
    epoch: u8,
    budget: u32,
}

/// One client's handle to one ALock: the remote cohort's side, and the
/// [`RwLockClient`] the file system uses (a mutex: `Shared` is taken as
/// `Exclusive`).
///
/// The handle's queue identity is the mailbox of the endpoint it acquires
/// with: release through the same endpoint, never let two handles of one
/// lock use one endpoint at the same time, and give every ALock handle used
/// with one endpoint the same [`AlockPostbox`].
#[derive(Debug)]
pub struct AlockClient {
    lock: RemoteAddr,
    config: AlockConfig,
    postbox: Arc<AlockPostbox>,
    held: Option<Held>,
    poisoned: Option<&'static str>,
    stats: AlockClientStats,
    /// Reads riding on the enqueue of the acquisition under way, and their
    /// replies once it took the lock on the fast path
    /// ([`AlockClient::lock_with_reads`]).
    riders: Vec<Verb>,
    rider_replies: Riders,
}

/// The three words, from one 24-byte read at `lock + TAIL_REMOTE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PetersonView {
    tail_r: RemoteTail,
    tail_l: u64,
    victim: u64,
}

impl PetersonView {
    fn parse(bytes: &[u8]) -> Result<Self, LockError> {
        let word = |i: usize| -> Result<u64, LockError> {
            let b: [u8; 8] = bytes
                .get(8 * i..8 * i + 8)
                .and_then(|s| s.try_into().ok())
                .ok_or(LockError::Misuse("short read of the ALock words"))?;
            Ok(u64::from_le_bytes(b))
        };
        Ok(Self { tail_r: RemoteTail(word(0)?), tail_l: word(1)?, victim: word(2)? })
    }

    /// Alg. 4 line 5, negated: may the remote leader enter?
    fn remote_may_enter(self) -> bool {
        self.victim != Cohort::Remote.word() || self.tail_l == 0
    }
}

const _: () = assert!(TAIL_LOCAL == TAIL_REMOTE + 8 && VICTIM == TAIL_LOCAL + 8, "one read covers all three");

/// How a wait of a queued client ended.
enum Waited<T> {
    Got(T),
    /// The queue was recovered (its epoch moved): our place is gone.
    Recovered,
}

impl AlockClient {
    /// A handle with a postbox of its own (enough when the endpoint serves
    /// no other ALock).
    pub fn new(lock: RemoteAddr, config: AlockConfig) -> Self {
        Self::with_postbox(lock, config, Arc::new(AlockPostbox::new()))
    }

    pub fn with_postbox(lock: RemoteAddr, config: AlockConfig, postbox: Arc<AlockPostbox>) -> Self {
        Self {
            lock,
            config,
            postbox,
            held: None,
            poisoned: None,
            stats: AlockClientStats::default(),
            riders: Vec::new(),
            rider_replies: None,
        }
    }

    pub fn lock_addr(&self) -> RemoteAddr {
        self.lock
    }

    pub fn stats(&self) -> AlockClientStats {
        self.stats
    }

    /// Why the handle is unusable, if it is (see "Bounded waits" in [`super`]).
    pub fn poisoned(&self) -> Option<&'static str> {
        self.poisoned
    }

    fn poison(&mut self, why: &'static str) {
        log::error!("ALock client handle of {} poisoned: {why}", self.lock);
        self.poisoned = Some(why);
    }

    /// A failed round trip in the middle of the protocol leaves our place in
    /// the queue unknown: the handle cannot go on.
    fn fatal<T>(&mut self, r: Result<T, impl Into<LockError>>, why: &'static str) -> Result<T, LockError> {
        r.map_err(|e| {
            self.poison(why);
            e.into()
        })
    }

    fn word(&self, offset: u64) -> RemoteAddr {
        self.lock + offset
    }

    /// Sends a handoff. A peer that cannot be reached (its process died,
    /// its node is gone) is left to the recovery: the queue then makes no
    /// progress and is reset (see "Recovery" in [`super`]); the sender's own
    /// part is done either way.
    fn send(&mut self, ep: &Endpoint, to: ClientAddr, epoch: u8, handoff: Handoff) -> Result<(), LockError> {
        if let Err(e) = ep.send(to, &Letter { lock: self.lock, epoch, handoff }.encode()) {
            log::warn!("ALock {}: {handoff:?} to {to} not delivered ({e}); left to recovery", self.lock);
        }
        Ok(())
    }

    /// Takes the lock (exclusively). Blocks at most [`AlockConfig::give_up`].
    #[inline]
    pub fn lock(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        if let Some(why) = self.poisoned {
            return Err(LockError::Misuse(why));
        }
        if self.held.is_some() {
            return Err(LockError::Misuse("ALock acquired twice"));
        }
        if !self.lock.is_aligned(8) {
            return Err(LockError::Misuse("an ALock must be 8-aligned"));
        }
        if !self.postbox.bind(ep) {
            return Err(LockError::Misuse("the ALock postbox belongs to another endpoint"));
        }
        let me = RemoteTail::of(ep.addr())?;
        let deadline = Instant::now() + self.config.give_up;
        loop {
            if self.enqueue(ep, me, deadline)? {
                return Ok(());
            }
            // The queue was recovered under us: enqueue again.
            self.stats.requeues += 1;
        }
    }

    /// [`AlockClient::lock`], with `riders` (reads behind the same
    /// endpoint) last in the enqueue's batch: their replies if that batch
    /// took the lock on the fast path (both queues empty), when they ran
    /// after our swap into the remote tail and after the read that found
    /// the local flag down: from then on a local thread sees our tail and
    /// waits in Alg. 4, and a remote one queues behind us, so the reads saw
    /// what reads posted after `lock` returned would see. `None` otherwise.
    pub fn lock_with_reads(&mut self, ep: &Endpoint, riders: &[Verb]) -> Result<Riders, LockError> {
        self.riders = riders.to_vec();
        self.rider_replies = None;
        let locked = self.lock(ep);
        self.riders.clear();
        let replies = self.rider_replies.take();
        locked.map(|()| replies)
    }

    /// One pass through the queue; `false` if it was recovered meanwhile.
    fn enqueue(&mut self, ep: &Endpoint, me: RemoteTail, deadline: Instant) -> Result<bool, LockError> {
        // Alg. 3 line 3 (a swap of the client fields: masked CAS with an
        // empty compare mask), batched with the fast path's read of the
        // local flag and `victim`. The old word also says the epoch.
        let mut batch = ep.batch();
        let swap = batch.push(Verb::MaskedCas {
            addr: self.word(TAIL_REMOTE),
            cmp: 0,
            cmp_mask: 0,
            swap: me.0,
            swap_mask: RemoteTail::CLIENT,
        });
        let read = batch.push(Verb::Read { addr: self.word(TAIL_REMOTE), len: 24 });
        let first_rider = batch.len();
        for r in &self.riders {
            batch.push(r.clone());
        }
        let replies = match batch.submit() {
            Ok(r) => r,
            // The swap may or may not have been applied.
            Err(e) => return self.fatal(Err(e), "the enqueue's round trip failed"),
        };
        // A refused swap changed nothing (bad address): a plain error.
        let prev = RemoteTail(replies.old(swap)?);
        let view = self.fatal(
            replies.data(read).map_err(LockError::from).and_then(PetersonView::parse),
            "the enqueue's read failed after the swap",
        )?;
        // Lines 4–6 and Alg. 2 line 6: we lead the cohort; with the local
        // flag down we enter without Alg. 4 (fast path, see [`super`]).
        if !prev.has_client() && view.tail_l == 0 {
            if !self.riders.is_empty() {
                self.rider_replies = Some(replies.as_slice()[first_rider..].to_vec());
            }
            self.stats.uncontended += 1;
            self.granted(ep.addr(), prev.epoch(), self.config.budget(Cohort::Remote));
            return Ok(true);
        }
        self.lock_slow(ep, prev, deadline)
    }

    #[cold]
    fn lock_slow(&mut self, ep: &Endpoint, prev: RemoteTail, deadline: Instant) -> Result<bool, LockError> {
        let k = self.config.budget(Cohort::Remote);
        let epoch = prev.epoch();
        let me = ep.addr();
        let Some(predecessor) = prev.client() else {
            // A leader that found the local flag up: Alg. 4.
            if !self.peterson(ep, epoch, deadline)? {
                return Ok(false);
            }
            self.granted(me, epoch, k);
            return Ok(true);
        };
        // Line 8: link ourselves behind the predecessor (a message instead
        // of the rWrite into its descriptor).
        self.send(ep, predecessor, epoch, Handoff::Successor)?;
        // Line 9: wait in our own mailbox (no verbs) for the lock, looking
        // at the queue now and then (recovery).
        let handoff = match self.await_letter(ep, epoch, HandoffKind::Handover, deadline) {
            Ok(Waited::Got((_, handoff))) => handoff,
            Ok(Waited::Recovered) => return Ok(false),
            Err(e) => {
                self.poison("gave up while queued behind a remote predecessor");
                return Err(e);
            }
        };
        let Handoff::Handover { budget } = handoff else {
            return Err(LockError::Misuse("the ALock postbox returned the wrong kind of message"));
        };
        if budget == 0 {
            // Lines 10–12: the budget is spent; yield to the local cohort if
            // it waits (pReacquire), then hold with a fresh budget.
            self.stats.reacquires += 1;
            if !self.peterson(ep, epoch, deadline)? {
                return Ok(false);
            }
            self.granted(me, epoch, k);
        } else {
            if !self.enter(ep, epoch)? {
                return Ok(false);
            }
            self.stats.passed += 1;
            self.granted(me, epoch, budget);
        }
        Ok(true)
    }

    /// Records an entry after a wait (the remote cohort's visible progress,
    /// see "Recovery" in [`super`]) and checks in the same verb that the
    /// queue is still of `epoch`; `false` if it was recovered first.
    fn enter(&mut self, ep: &Endpoint, epoch: u8) -> Result<bool, LockError> {
        let r = ep.masked_faa(self.word(TAIL_REMOTE), RemoteTail::ENTER, RemoteTail::BOUNDARIES);
        let old = RemoteTail(self.fatal(r, "the entry's round trip failed")?);
        Ok(old.epoch() == epoch)
    }

    /// Waits for a `kind` letter of `epoch` until `deadline`, looking at the
    /// remote tail every [`AlockConfig::look`]: a moved epoch ends the wait
    /// ([`Waited::Recovered`]); a remote cohort that makes no progress for
    /// [`AlockConfig::stall`] is recovered here.
    fn await_letter(
        &mut self,
        ep: &Endpoint,
        epoch: u8,
        kind: HandoffKind,
        deadline: Instant,
    ) -> Result<Waited<(ClientAddr, Handoff)>, LockError> {
        let mut stall = Stall::new(&self.config);
        loop {
            let now = Instant::now();
            let until = deadline.min(now + self.config.look());
            if let Some(found) = self.postbox.receive(ep, self.lock, epoch, kind, until) {
                return Ok(Waited::Got(found));
            }
            if Instant::now() >= deadline {
                self.stats.timeouts += 1;
                return Err(LockError::Timeout(self.config.give_up));
            }
            let r = ep.read_u64(self.word(TAIL_REMOTE));
            let tail = RemoteTail(self.fatal(r, "a look at the queue failed")?);
            if tail.epoch() != epoch {
                return Ok(Waited::Recovered);
            }
            if stall.stalled(tail.0 & RemoteTail::PROGRESS) {
                self.recover(ep, tail)?;
            }
        }
    }

    /// Resets a remote queue that made no progress for the stall time (see
    /// "Recovery" in [`super`]): one masked-CAS that compares the epoch and
    /// entry count seen.
    fn recover(&mut self, ep: &Endpoint, seen: RemoteTail) -> Result<(), LockError> {
        let r = ep.masked_cas(
            self.word(TAIL_REMOTE),
            seen.0,
            RemoteTail::PROGRESS,
            seen.reset().0,
            RemoteTail::CLIENT | RemoteTail::EPOCH,
        );
        let old = RemoteTail(self.fatal(r, "the recovery's round trip failed")?);
        if old.0 & RemoteTail::PROGRESS == seen.0 & RemoteTail::PROGRESS {
            log::warn!("ALock {}: remote queue of epoch {} stalled; recovered", self.lock, seen.epoch());
            self.stats.recoveries += 1;
        }
        Ok(())
    }

    /// Alg. 4 for the remote leader: line 4, `victim ← REMOTE` (batched with
    /// the first read); line 5, poll `tail_l` and `victim` until the local
    /// flag is down or the local cohort has made itself the victim; then the
    /// entry is recorded. `false` if the queue was recovered meanwhile. On
    /// timeout, leaves the queue passing budget 0 and fails.
    fn peterson(&mut self, ep: &Endpoint, epoch: u8, deadline: Instant) -> Result<bool, LockError> {
        self.stats.peterson += 1;
        let mut batch = ep.batch();
        batch.push(Verb::Write {
            addr: self.word(VICTIM),
            data: Cohort::Remote.word().to_le_bytes().to_vec(),
        });
        let read = batch.push(Verb::Read { addr: self.word(TAIL_REMOTE), len: 24 });
        let first = batch.submit().map_err(LockError::from).and_then(|r| {
            if let Some(e) = r.first_error() {
                return Err(LockError::from(e.clone()));
            }
            PetersonView::parse(r.data(read)?)
        });
        let mut view = self.fatal(first, "Peterson's first round trip failed")?;
        let mut interval = self.config.poll;
        loop {
            if view.tail_r.epoch() != epoch {
                return Ok(false);
            }
            if view.remote_may_enter() {
                return self.enter(ep, epoch);
            }
            let now = Instant::now();
            if now >= deadline {
                self.stats.timeouts += 1;
                // We never entered: hand our place on with budget 0.
                self.leave_queue(ep, epoch, 0)?;
                return Err(LockError::Timeout(self.config.give_up));
            }
            pause(interval.min(deadline - now));
            interval = (interval * 2).min(self.config.max_poll);
            self.stats.polls += 1;
            let mut b = [0u8; 24];
            let r = ep.read(self.word(TAIL_REMOTE), &mut b).map_err(LockError::from);
            self.fatal(r, "a Peterson poll failed")?;
            view = PetersonView::parse(&b)?;
        }
    }

    #[inline]
    fn granted(&mut self, me: ClientAddr, epoch: u8, budget: u32) {
        self.held = Some(Held { me, epoch, budget });
        self.stats.acquisitions += 1;
    }

    /// Releases the lock; `ep` must be the endpoint it was acquired with.
    /// [`LockError::Fenced`] if the queue was recovered while we held (we
    /// held past the lease): nothing is handed over then.
    #[inline]
    pub fn unlock(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let held = self.held.ok_or(LockError::Misuse("ALock release without acquire"))?;
        if held.me != ep.addr() {
            return Err(LockError::Misuse("an ALock must be released through the endpoint that acquired it"));
        }
        self.held = None;
        self.leave_queue(ep, held.epoch, passed_budget(held.budget))
    }

    /// [`AlockClient::unlock`] after `before` (writes made under the lock,
    /// behind the same endpoint), posted first in the batch of the release
    /// CAS (Alg. 3 line 15): they execute before it, so the next holder,
    /// local or remote, sees them. A refused one fails the call; the lock
    /// is released all the same.
    pub fn unlock_after(&mut self, ep: &Endpoint, before: &[Verb]) -> Result<(), LockError> {
        let held = self.held.ok_or(LockError::Misuse("ALock release without acquire"))?;
        if held.me != ep.addr() {
            return Err(LockError::Misuse("an ALock must be released through the endpoint that acquired it"));
        }
        self.held = None;
        self.leave_queue_after(ep, held.epoch, passed_budget(held.budget), before)
    }

    /// Alg. 3 lines 15–18 with `pass` as the successor's budget, in `epoch`.
    fn leave_queue(&mut self, ep: &Endpoint, epoch: u8, pass: u32) -> Result<(), LockError> {
        self.leave_queue_after(ep, epoch, pass, &[])
    }

    /// [`AlockClient::leave_queue`] with `before` first in the batch of its
    /// CAS.
    fn leave_queue_after(
        &mut self,
        ep: &Endpoint,
        epoch: u8,
        pass: u32,
        before: &[Verb],
    ) -> Result<(), LockError> {
        let me = RemoteTail::of(ep.addr())?.0 | u64::from(epoch) << RemoteTail::EPOCH_SHIFT;
        let ours = RemoteTail::CLIENT | RemoteTail::EPOCH;
        // Line 15: no successor, so the remote queue (and flag) is empty.
        let (r, posted): (Result<u64, RdmaError>, Result<(), LockError>) = if before.is_empty() {
            (ep.masked_cas(self.word(TAIL_REMOTE), me, ours, 0, RemoteTail::CLIENT), Ok(()))
        } else {
            let mut batch = ep.batch();
            for v in before {
                batch.push(v.clone());
            }
            let cas = batch.push(Verb::MaskedCas {
                addr: self.word(TAIL_REMOTE),
                cmp: me,
                cmp_mask: ours,
                swap: 0,
                swap_mask: RemoteTail::CLIENT,
            });
            match batch.submit() {
                Ok(replies) => {
                    let posted =
                        match replies.as_slice()[..before.len()].iter().find_map(|r| r.as_ref().err()) {
                            Some(e) => Err(e.clone().into()),
                            None => Ok(()),
                        };
                    (replies.old(cas), posted)
                }
                Err(e) => (Err(e.into()), Ok(())),
            }
        };
        let released = self.leave_queue_on(ep, epoch, pass, me, ours, r);
        posted.and(released)
    }

    /// The rest of [`AlockClient::leave_queue`] once its CAS answered `r`.
    fn leave_queue_on(
        &mut self,
        ep: &Endpoint,
        epoch: u8,
        pass: u32,
        me: u64,
        ours: u64,
        r: Result<u64, RdmaError>,
    ) -> Result<(), LockError> {
        let old = RemoteTail(self.fatal(r, "the release CAS failed")?);
        if old.0 & ours == me {
            return Ok(());
        }
        if old.epoch() != epoch {
            log::warn!("ALock {}: released after its queue was recovered (held past the lease)", self.lock);
            return Err(LockError::Fenced);
        }
        self.hand_over(ep, epoch, pass)
    }

    #[cold]
    fn hand_over(&mut self, ep: &Endpoint, epoch: u8, pass: u32) -> Result<(), LockError> {
        let deadline = Instant::now() + self.config.give_up;
        // Line 17: a successor swapped itself in; wait for it to say so.
        let successor = match self.await_letter(ep, epoch, HandoffKind::Successor, deadline) {
            Ok(Waited::Got((successor, _))) => successor,
            // The successor died before it linked itself in, and the queue
            // was recovered: nobody to hand over to.
            Ok(Waited::Recovered) => return Ok(()),
            Err(e) => {
                self.poison("a remote successor never linked itself in");
                return Err(e);
            }
        };
        // Line 18: pass the lock with one less budget.
        self.send(ep, successor, epoch, Handoff::Handover { budget: pass })?;
        self.stats.handovers += 1;
        Ok(())
    }
}

impl RwLockClient for AlockClient {
    /// ALock is a mutex: `Shared` is taken as `Exclusive`.
    #[inline]
    fn acquire(&mut self, ep: &Endpoint, _mode: Mode) -> Result<(), LockError> {
        self.lock(ep)
    }

    #[inline]
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        self.unlock(ep)
    }

    fn acquire_with_reads(
        &mut self,
        ep: &Endpoint,
        _mode: Mode,
        riders: &[Verb],
    ) -> Result<Riders, LockError> {
        self.lock_with_reads(ep, riders)
    }

    fn release_after(&mut self, ep: &Endpoint, verbs: &[Verb]) -> Result<(), LockError> {
        self.unlock_after(ep, verbs)
    }

    fn shares_readers(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peterson_view_decodes_and_decides() {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&9u64.to_le_bytes());
        b[8..16].copy_from_slice(&5u64.to_le_bytes());
        b[16..].copy_from_slice(&Cohort::Remote.word().to_le_bytes());
        let v = PetersonView::parse(&b).unwrap();
        assert_eq!(v, PetersonView { tail_r: RemoteTail(9), tail_l: 5, victim: 2 });
        assert!(!v.remote_may_enter(), "we are the victim and the local flag is up");
        assert!(PetersonView { tail_l: 0, ..v }.remote_may_enter(), "local flag down");
        assert!(PetersonView { victim: 1, ..v }.remote_may_enter(), "the local cohort yielded");
        assert!(PetersonView::parse(&b[..20]).is_err());
    }
}
