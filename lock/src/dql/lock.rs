//! One client's handle to one DQL lock: acquisition (§4.2, §4.4), release
//! (§4.3, with the transient state of §4.3.1), and the failure handling the
//! paper leaves out (see the module comment of [`super`]).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::message::Wire;
use super::word::{DqlId, DqlVariant, Era, Stamp, TailWord, Turn, COUNTER_OFFSET, DQL_ALIGN, TAIL_OFFSET};
use crate::dslr::pause;
use crate::postbox::{Letter, Postbox, Verdict};
use crate::rdma::{ClientAddr, Endpoint, RemoteAddr};
use crate::rwlock::{LockError, Mode, RwLockClient};

/// The postbox every DQL handle used with one endpoint shares.
pub type DqlPostbox = Postbox<Wire>;

/// Timing of one DQL client, derived from the transport's RTT. Every
/// client of one lock must use the same lease.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DqlConfig {
    pub variant: DqlVariant,
    /// The longest a client holds the lock, from acquisition to release.
    /// Every failure timeout below is a fraction or multiple of it.
    pub lease: Duration,
    /// Bound of relative clock drift δ; a wait that others rely on lasts
    /// (1 + δ) times its nominal length.
    pub drift: f64,
    /// First interval between two reads of the tail by a starvation-free
    /// ticket waiting for its turn.
    pub poll: Duration,
    /// Those reads back off exponentially up to this interval.
    pub max_poll: Duration,
    /// Longest an acquisition waits in all before it fails with
    /// [`LockError::Timeout`] instead of hanging (a broken host, say).
    pub give_up: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent holder at the servers: the silence S after which
    /// a waiter resets the lock grows by it (see [`super`], "Failures").
    /// Zero (the default) below a file system.
    pub fence_delay: Duration,
}

impl DqlConfig {
    /// The floor of [`DqlConfig::from_rtt`]'s lease.
    pub const MIN_LEASE: Duration = Duration::from_secs(1);

    /// The starvation-free variant (§4.4) with a lease of 5000 RTTs (the
    /// ratio of the other locks of this crate: 10 ms on a 2 µs fabric), at
    /// least 1 s because holders are ordinary threads that a busy scheduler
    /// can stall. Turn polls start one RTT apart and back off to 64 RTTs.
    pub fn from_rtt(rtt: Duration) -> Self {
        let lease = (rtt * 5000).max(Self::MIN_LEASE);
        Self {
            variant: DqlVariant::StarvationFree,
            lease,
            drift: 1e-4,
            poll: rtt.max(Duration::from_nanos(100)),
            max_poll: (rtt * 64).max(Duration::from_micros(10)),
            give_up: crate::rwlock::give_up_after(lease, Duration::ZERO),
            fence_delay: Duration::ZERO,
        }
    }

    /// The same with lease `lease` (and a give-up time scaled with it).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    /// The same with a fence delay ([`DqlConfig::fence_delay`]); the
    /// give-up time grows by [`GIVE_UP_FENCES`](crate::rwlock::GIVE_UP_FENCES)
    /// of them.
    pub fn with_fence_delay(mut self, fence_delay: Duration) -> Self {
        self.fence_delay = fence_delay;
        self.give_up = crate::rwlock::give_up_after(self.lease, self.fence_delay);
        self
    }

    pub fn with_variant(mut self, variant: DqlVariant) -> Self {
        self.variant = variant;
        self
    }

    fn stretched(&self, d: Duration) -> Duration {
        d.mul_f64(1.0 + self.drift)
    }

    /// How often a waiting client tells its successor it is alive, and
    /// reads the tail to see whether a reset began.
    pub fn beat(&self) -> Duration {
        self.lease / 4
    }

    /// X: a client handed the lock enters only if a read of the tail posted
    /// within X before showed its era open (else it reads again first).
    pub fn fresh_window(&self) -> Duration {
        self.lease / 2
    }

    /// S: how long a waiter hears nothing from its predecessor before it
    /// takes it for dead. A waiting predecessor beats every `beat`; a
    /// holding one releases within its lease; plus a quarter lease for
    /// delivery and scheduling; plus the fence delay, so a holder whose
    /// process stopped is fenced before the reset lets anyone in.
    pub fn silence(&self) -> Duration {
        self.stretched(self.lease + self.beat()) + self.lease / 4 + self.fence_delay
    }

    /// R: how long a reset keeps the tail closed. Every client that entered
    /// before the close leaves within X + lease of it (see [`super`]).
    pub fn reset_wait(&self) -> Duration {
        self.stretched(self.fresh_window() + self.lease) + self.lease / 16
    }

    /// How often a client reads a closed tail.
    pub fn closed_poll(&self) -> Duration {
        self.lease / 16
    }

    /// A tail seen closed for this long has lost its resetter: reopen it.
    pub fn abandoned_close(&self) -> Duration {
        self.reset_wait() + self.silence()
    }

    /// A starvation-free ticket that has not swapped into the tail this long
    /// after its turn came is taken for dead and skipped (per ticket).
    pub fn gap(&self) -> Duration {
        self.stretched(self.lease)
    }

    /// The bound the module comment documents: a waiter whose predecessor
    /// died is back in a fresh queue within this time of hearing from it
    /// last (or of joining behind it).
    pub fn recovery_bound(&self) -> Duration {
        self.silence() + self.reset_wait() + self.closed_poll()
    }
}

/// Counters of one handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DqlStats {
    pub acquisitions: u64,
    /// Acquisitions that found the lock free (the first CAS of §4.2 won).
    pub immediate: u64,
    /// Acquisitions that queued behind a predecessor.
    pub queued: u64,
    /// Tail CASes that failed (§4.2's retries; §4.4's contention).
    pub cas_failures: u64,
    /// Reads of the tail by a ticket waiting for its turn (§4.4).
    pub turn_polls: u64,
    /// Our ticket was passed over (a reset or a skip); we took another.
    pub passed: u64,
    /// Silent tickets we skipped over.
    pub skips: u64,
    pub alerts_sent: u64,
    pub grants_sent: u64,
    pub grants_received: u64,
    /// Releases whose CAS found a successor that had not alerted yet (§4.3.1).
    pub transient: u64,
    /// Of those, releases that gave up waiting for the alert.
    pub dropped: u64,
    pub alive_sent: u64,
    /// Reads of the tail while queued (every beat, and before suspecting).
    pub tail_polls: u64,
    /// Reads of the tail before entering on a grant older than X.
    pub freshness_reads: u64,
    /// Resets this handle made after its predecessor fell silent.
    pub resets: u64,
    /// Closed tails this handle reopened because their resetter vanished.
    pub takeovers: u64,
    /// Acquisitions started over because a reset wiped the queue.
    pub restarts: u64,
    /// Releases after the lease.
    pub late_releases: u64,
    /// Late releases during or after a reset: the critical section may
    /// have overlapped another's.
    pub fenced: u64,
    /// Messages discarded as for another acquisition.
    pub stale_messages: u64,
}

impl std::ops::AddAssign for DqlStats {
    fn add_assign(&mut self, o: Self) {
        self.acquisitions += o.acquisitions;
        self.immediate += o.immediate;
        self.queued += o.queued;
        self.cas_failures += o.cas_failures;
        self.turn_polls += o.turn_polls;
        self.passed += o.passed;
        self.skips += o.skips;
        self.alerts_sent += o.alerts_sent;
        self.grants_sent += o.grants_sent;
        self.grants_received += o.grants_received;
        self.transient += o.transient;
        self.dropped += o.dropped;
        self.alive_sent += o.alive_sent;
        self.tail_polls += o.tail_polls;
        self.freshness_reads += o.freshness_reads;
        self.resets += o.resets;
        self.takeovers += o.takeovers;
        self.restarts += o.restarts;
        self.late_releases += o.late_releases;
        self.fenced += o.fenced;
        self.stale_messages += o.stale_messages;
    }
}

/// A successor that alerted us (§4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Successor {
    token: TailWord,
    addr: ClientAddr,
}

/// What the tail CAS of an acquisition got us.
#[derive(Clone, Copy, Debug)]
enum Joined {
    /// The tail was free: the lock is ours since the CAS was posted.
    Holding { me: TailWord, posted: Instant, position: Option<u64> },
    /// We are behind `pred`. The CAS (posted at `posted`) showed the era open.
    Queued { me: TailWord, pred: TailWord, posted: Instant, position: Option<u64> },
}

#[derive(Clone, Copy, Debug)]
struct Queued {
    me: TailWord,
    pred: TailWord,
    /// The starvation-free ticket's FA result (tickets before ours).
    position: Option<u64>,
    /// When we last heard from the predecessor (or alerted it).
    last_sign: Instant,
    /// Post time of the last read of the tail that showed our era open.
    fresh: Instant,
    successor: Option<Successor>,
    next_beat: Instant,
    next_poll: Instant,
    give_up_at: Instant,
}

#[derive(Clone, Copy, Debug)]
struct Holding {
    me: TailWord,
    pred: Option<TailWord>,
    position: Option<u64>,
    lease_start: Instant,
    successor: Option<Successor>,
}

#[derive(Clone, Copy, Debug)]
enum State {
    Idle,
    Queued(Queued),
    Holding(Holding),
}

/// One client's handle to one DQL lock (a mutex: `Shared` is `Exclusive`).
pub struct DqlLock {
    addr: RemoteAddr,
    config: DqlConfig,
    postbox: Arc<DqlPostbox>,
    state: State,
    /// The era this handle saw last: the first CAS's guess of the tail.
    era_hint: Era,
    /// The distributed variant's stamp: a per-handle counter from a random
    /// start, so tokens differ between acquisitions and between handles.
    nonce: Stamp,
    stats: DqlStats,
}

impl std::fmt::Debug for DqlLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DqlLock").field("addr", &self.addr).field("state", &self.state).finish()
    }
}

impl DqlLock {
    /// A handle on the lock at `addr` ([`super::DQL_BYTES`] of zeroed host
    /// memory, 8-aligned) with a postbox of its own: use it only if no
    /// other DQL handle shares its endpoint ([`DqlLock::with_postbox`]).
    pub fn new(addr: RemoteAddr, config: DqlConfig) -> Result<Self, LockError> {
        Self::with_postbox(addr, config, Arc::new(DqlPostbox::new()))
    }

    /// A handle that shares `postbox` with the other DQL handles used with
    /// the same endpoint.
    pub fn with_postbox(
        addr: RemoteAddr,
        config: DqlConfig,
        postbox: Arc<DqlPostbox>,
    ) -> Result<Self, LockError> {
        if !addr.is_aligned(DQL_ALIGN) {
            return Err(LockError::Misuse("a DQL lock must be 8-aligned"));
        }
        let mut h = RandomState::new().build_hasher();
        h.write_u64(addr.offset);
        Ok(Self {
            addr,
            config,
            postbox,
            state: State::Idle,
            era_hint: Era::default(),
            nonce: Stamp::new(h.finish() as u32),
            stats: DqlStats::default(),
        })
    }

    pub fn addr(&self) -> RemoteAddr {
        self.addr
    }

    pub fn config(&self) -> &DqlConfig {
        &self.config
    }

    pub fn stats(&self) -> DqlStats {
        self.stats
    }

    pub fn is_held(&self) -> bool {
        matches!(self.state, State::Holding(_))
    }

    /// Our token while we hold the lock.
    pub fn token(&self) -> Option<TailWord> {
        match self.state {
            State::Holding(h) => Some(h.me),
            _ => None,
        }
    }

    /// While we hold the lock: the token of the predecessor that handed it
    /// to us, `None` if we found the lock free.
    pub fn predecessor(&self) -> Option<TailWord> {
        match self.state {
            State::Holding(h) => h.pred,
            _ => None,
        }
    }

    /// While we hold a starvation-free lock: how many tickets were taken
    /// before ours (the FA's result), i.e. our place in the FIFO order.
    pub fn position(&self) -> Option<u64> {
        match self.state {
            State::Holding(h) => h.position,
            _ => None,
        }
    }

    fn tail(&self) -> RemoteAddr {
        self.addr + TAIL_OFFSET
    }

    fn counter(&self) -> RemoteAddr {
        self.addr + COUNTER_OFFSET
    }

    fn read_tail(&self, ep: &Endpoint) -> Result<TailWord, LockError> {
        Ok(TailWord(ep.read_u64(self.tail())?))
    }

    /// The first part of an acquisition: join the queue (§4.2 / §4.4) and
    /// alert the predecessor. `true` if the lock is held already, `false`
    /// if [`DqlLock::complete`] must wait for the grant. Call `complete`
    /// soon: until then this client does not answer its successor.
    pub fn begin(&mut self, ep: &Endpoint) -> Result<bool, LockError> {
        if !matches!(self.state, State::Idle) {
            return Err(LockError::Misuse("acquire while this DQL handle holds or waits for the lock"));
        }
        if !self.postbox.bind(ep) {
            return Err(LockError::Misuse("a DQL postbox serves one endpoint only"));
        }
        let me = self.identity(ep)?;
        let give_up_at = Instant::now() + self.config.give_up;
        let joined = self.join(ep, me, give_up_at)?;
        match self.settle(ep, joined, give_up_at) {
            None => Ok(true),
            Some(q) => {
                self.state = State::Queued(q);
                Ok(false)
            }
        }
    }

    fn identity(&self, ep: &Endpoint) -> Result<DqlId, LockError> {
        DqlId::from_client(ep.addr()).map_err(|e| {
            log::error!("DQL {}: {e}", self.addr);
            LockError::Misuse("this endpoint's address does not fit a DQL identity")
        })
    }

    /// Swaps our token into the tail, in the variant's way.
    #[inline]
    fn join(&mut self, ep: &Endpoint, me: DqlId, give_up_at: Instant) -> Result<Joined, LockError> {
        match self.config.variant {
            DqlVariant::Distributed => self.join_distributed(ep, me, give_up_at),
            DqlVariant::StarvationFree => self.join_ticket(ep, me, give_up_at),
        }
    }

    /// §4.2: CAS our identity into the tail, guessing it free; on failure
    /// the CAS returned the current tail, our most likely predecessor: swap
    /// it for ourselves, and repeat until a CAS succeeds.
    fn join_distributed(
        &mut self,
        ep: &Endpoint,
        me: DqlId,
        give_up_at: Instant,
    ) -> Result<Joined, LockError> {
        self.nonce = self.nonce.next();
        let mut expect = TailWord::free(self.era_hint);
        loop {
            let mine = TailWord::new(expect.era(), self.nonce, me);
            let posted = Instant::now();
            let got = TailWord(ep.cas(self.tail(), expect.0, mine.0)?);
            if got == expect {
                self.era_hint = mine.era();
                return Ok(if expect.id().is_nobody() {
                    Joined::Holding { me: mine, posted, position: None }
                } else {
                    Joined::Queued { me: mine, pred: expect, posted, position: None }
                });
            }
            self.stats.cas_failures += 1;
            if Instant::now() >= give_up_at {
                return Err(LockError::Timeout(self.config.give_up));
            }
            expect = if got.is_closed() { self.wait_open(ep, got, give_up_at)? } else { got };
            self.era_hint = expect.era();
        }
    }

    /// §4.4: take a ticket with one FA on the counter; only the ticket
    /// after the tail's may swap in. The first CAS guesses the tail as the
    /// previous ticket's release left it (free, its stamp), so uncontended
    /// this is the paper's FA + CAS.
    fn join_ticket(&mut self, ep: &Endpoint, me: DqlId, give_up_at: Instant) -> Result<Joined, LockError> {
        'ticket: loop {
            let position = ep.faa(self.counter(), 1)?;
            let ticket = Stamp::ticket_of(position);
            let mut expect = TailWord::new(self.era_hint, ticket.prev(), DqlId::NOBODY);
            let mut wait = self.config.poll;
            // The tail's stamp while we wait for our turn, and since when.
            let mut watch: Option<(Stamp, Instant)> = None;
            loop {
                let mine = TailWord::new(expect.era(), ticket, me);
                let posted = Instant::now();
                let got = TailWord(ep.cas(self.tail(), expect.0, mine.0)?);
                if got == expect {
                    self.era_hint = mine.era();
                    let position = Some(position);
                    return Ok(if expect.id().is_nobody() {
                        Joined::Holding { me: mine, posted, position }
                    } else {
                        Joined::Queued { me: mine, pred: expect, posted, position }
                    });
                }
                self.stats.cas_failures += 1;
                let mut seen = got;
                // Judge the tail until there is a CAS worth trying.
                loop {
                    if Instant::now() >= give_up_at {
                        return Err(LockError::Timeout(self.config.give_up));
                    }
                    if seen.is_closed() {
                        seen = self.wait_open(ep, seen, give_up_at)?;
                        watch = None;
                        continue;
                    }
                    self.era_hint = seen.era();
                    match Turn::of(ticket, seen.stamp()) {
                        Turn::Now => break,
                        Turn::Passed => {
                            self.stats.passed += 1;
                            continue 'ticket;
                        }
                        Turn::Ahead(n) => match watch {
                            Some((stamp, since)) if stamp == seen.stamp() => {
                                if since.elapsed() > self.config.gap() * n {
                                    // The n tickets before ours were taken and
                                    // never used (their clients died between
                                    // FA and CAS): swap in over them. A live
                                    // one among them sees itself passed.
                                    self.stats.skips += 1;
                                    log::warn!(
                                        "DQL {}: tickets {}..{} silent for {:?}; skipping them",
                                        self.addr,
                                        seen.stamp().next().get(),
                                        ticket.get(),
                                        since.elapsed()
                                    );
                                    break;
                                }
                                // Back off; past max_poll, stretch with the
                                // silence (1/16 of it, as DSLR's polls), so a
                                // dead ticket costs a few dozen reads.
                                pause(wait.max(since.elapsed() / 16).min(self.config.gap() / 16));
                                wait = (wait * 2).min(self.config.max_poll);
                                seen = self.read_tail(ep)?;
                                self.stats.turn_polls += 1;
                            }
                            _ => {
                                watch = Some((seen.stamp(), Instant::now()));
                                wait = self.config.poll;
                                pause(wait);
                                seen = self.read_tail(ep)?;
                                self.stats.turn_polls += 1;
                            }
                        },
                    }
                }
                expect = seen;
            }
        }
    }

    /// Waits while the tail is closed by a reset; returns the open word.
    /// A tail closed for longer than [`DqlConfig::abandoned_close`] lost its
    /// resetter: we reopen it ourselves (the wait already covers the reset's).
    #[cold]
    fn wait_open(
        &mut self,
        ep: &Endpoint,
        mut seen: TailWord,
        give_up_at: Instant,
    ) -> Result<TailWord, LockError> {
        let mut watch = (seen, Instant::now());
        while seen.is_closed() {
            if Instant::now() >= give_up_at {
                return Err(LockError::Timeout(self.config.give_up));
            }
            if seen != watch.0 {
                watch = (seen, Instant::now());
            } else if watch.1.elapsed() > self.config.abandoned_close() {
                let open = seen.reopened(self.config.variant);
                if ep.cas(self.tail(), seen.0, open.0)? == seen.0 {
                    self.stats.takeovers += 1;
                    log::warn!("DQL {}: reset of {seen:?} abandoned; reopened it", self.addr);
                    return Ok(open);
                }
            }
            pause(self.config.closed_poll());
            seen = self.read_tail(ep)?;
        }
        Ok(seen)
    }

    /// After the tail CAS: hold, or alert the predecessor (§4.2: "it sends
    /// an alert to it, so that the predecessor is informed about it") and
    /// return the queued state.
    fn settle(&mut self, ep: &Endpoint, joined: Joined, give_up_at: Instant) -> Option<Queued> {
        match joined {
            Joined::Holding { me, posted, position } => {
                self.state = State::Holding(Holding {
                    me,
                    pred: None,
                    position,
                    lease_start: posted,
                    successor: None,
                });
                self.stats.acquisitions += 1;
                self.stats.immediate += 1;
                None
            }
            Joined::Queued { me, pred, posted, position } => {
                self.stats.queued += 1;
                let to = pred.id().client().expect("a predecessor has an identity");
                self.send(ep, to, Wire::Alert { lock: self.addr, pred, succ: me });
                self.stats.alerts_sent += 1;
                let now = Instant::now();
                Some(Queued {
                    me,
                    pred,
                    position,
                    last_sign: now,
                    fresh: posted,
                    successor: None,
                    next_beat: now + self.config.beat(),
                    next_poll: now + self.config.beat(),
                    give_up_at,
                })
            }
        }
    }

    fn send(&self, ep: &Endpoint, to: ClientAddr, wire: Wire) {
        // A failed send means the peer is gone; the silence it leaves is
        // what the failure handling acts on.
        if let Err(e) = ep.send(to, &wire.encode()) {
            log::warn!("DQL {}: cannot send {wire:?} to {to}: {e}", self.addr);
        }
    }

    /// Waits until a [`DqlLock::begin`] that returned `false` holds the
    /// lock: the grant from the predecessor (§4.3), with the beats, tail
    /// reads and resets of the failure handling, and restarts after resets.
    #[cold]
    pub fn complete(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let mut q = match std::mem::replace(&mut self.state, State::Idle) {
            State::Queued(q) => q,
            held @ State::Holding(_) => {
                self.state = held;
                return Ok(());
            }
            State::Idle => return Err(LockError::Misuse("complete without begin")),
        };
        let me_id = q.me.id();
        loop {
            let now = Instant::now();
            if now >= q.give_up_at {
                // Our token stays in the queue; our successor will find us
                // silent and reset the lock.
                return Err(LockError::Timeout(self.config.give_up));
            }
            let suspect_at = q.last_sign + self.config.silence();
            let mut deadline = q.next_poll.min(suspect_at).min(q.give_up_at);
            if q.successor.is_some() {
                deadline = deadline.min(q.next_beat);
            }
            let me = q.me;
            let stats = &mut self.stats;
            let letter = self.postbox.receive(ep, self.addr, deadline, |l| judge(l, me, stats));
            let rejoined = match letter {
                Some(Letter { wire: Wire::Grant { .. }, .. }) => {
                    // The freshness rule: enter only if a read posted within
                    // X showed our era open; else read again.
                    let stale = q.fresh.elapsed() > self.config.fresh_window();
                    if stale {
                        self.stats.freshness_reads += 1;
                        q.fresh = Instant::now();
                    }
                    if stale && !self.read_tail(ep)?.is_open_in(me.era()) {
                        // A reset began since: the grant is from a wiped queue.
                        self.restart(ep, me_id, q.give_up_at)?
                    } else {
                        self.enter(q);
                        return Ok(());
                    }
                }
                Some(Letter { wire: Wire::Alive { .. }, .. }) => {
                    q.last_sign = Instant::now();
                    continue;
                }
                Some(Letter { from, wire: Wire::Alert { succ, .. } }) => {
                    // Our successor. It counts its silence from its alert, so
                    // the first beat is due one beat from now: a handover
                    // stays the paper's two messages (alert, grant).
                    q.successor = Some(Successor { token: succ, addr: from });
                    q.next_beat = Instant::now() + self.config.beat();
                    continue;
                }
                None => {
                    let now = Instant::now();
                    if let Some(s) = q.successor {
                        if now >= q.next_beat {
                            self.beat(ep, s.token, s.addr);
                            q.next_beat = now + self.config.beat();
                        }
                    }
                    if now < q.next_poll && now < suspect_at {
                        continue;
                    }
                    let posted = Instant::now();
                    let seen = self.read_tail(ep)?;
                    self.stats.tail_polls += 1;
                    q.next_poll = Instant::now() + self.config.beat();
                    if !seen.is_open_in(me.era()) {
                        // A reset began or ended: our queue is gone.
                        self.restart(ep, me_id, q.give_up_at)?
                    } else {
                        q.fresh = posted;
                        if now < suspect_at {
                            continue;
                        }
                        log::warn!(
                            "DQL {}: predecessor {:?} silent for {:?}; resetting the lock",
                            self.addr,
                            q.pred,
                            q.last_sign.elapsed()
                        );
                        self.reset(ep, seen)?;
                        self.restart(ep, me_id, q.give_up_at)?
                    }
                }
            };
            match rejoined {
                None => return Ok(()),
                Some(next) => q = next,
            }
        }
    }

    /// Holds the lock on a grant. The lease starts no later than X after
    /// the fresh read (what the reset's wait R relies on).
    fn enter(&mut self, q: Queued) {
        self.stats.grants_received += 1;
        self.stats.acquisitions += 1;
        self.state = State::Holding(Holding {
            me: q.me,
            pred: Some(q.pred),
            position: q.position,
            lease_start: Instant::now().min(q.fresh + self.config.fresh_window()),
            successor: q.successor,
        });
    }

    fn beat(&mut self, ep: &Endpoint, to: TailWord, addr: ClientAddr) {
        self.stats.alive_sent += 1;
        self.send(ep, addr, Wire::Alive { lock: self.addr, to });
    }

    /// Joins again after a reset wiped our queue (§ "failures" of the
    /// module comment). `None` if that made us the holder.
    #[cold]
    fn restart(
        &mut self,
        ep: &Endpoint,
        me: DqlId,
        give_up_at: Instant,
    ) -> Result<Option<Queued>, LockError> {
        log::info!("DQL {}: reset while queued; joining again", self.addr);
        self.stats.restarts += 1;
        let joined = self.join(ep, me, give_up_at)?;
        Ok(self.settle(ep, joined, give_up_at))
    }

    /// The failure reset: close the tail of our era (nobody joins any
    /// more), keep it closed for R, so every holder of the era has left,
    /// then open the next era, free. A CAS that fails because someone
    /// joined is retried; one that finds the tail closed or of another era
    /// leaves the reset to whoever made it.
    #[cold]
    fn reset(&mut self, ep: &Endpoint, mut seen: TailWord) -> Result<(), LockError> {
        let era = seen.era();
        while seen.is_open_in(era) {
            let closed = seen.closed();
            let got = TailWord(ep.cas(self.tail(), seen.0, closed.0)?);
            if got == seen {
                self.stats.resets += 1;
                std::thread::sleep(self.config.reset_wait());
                let open = closed.reopened(self.config.variant);
                // Fails only if a waiter took the reset over meanwhile.
                let _ = ep.cas(self.tail(), closed.0, open.0)?;
                log::warn!("DQL {}: reset {seen:?} to {open:?}", self.addr);
                return Ok(());
            }
            seen = got;
        }
        Ok(())
    }

    /// Releases the lock (§4.3): hand it to a successor that alerted us, or
    /// swap ourselves out of the tail; if that CAS finds a successor that
    /// has not alerted yet, wait for its alert (§4.3.1).
    pub fn unlock(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        let h = match self.state {
            State::Holding(h) => h,
            _ => return Err(LockError::Misuse("release without a held DQL lock")),
        };
        if DqlId::from_client(ep.addr()) != Ok(h.me.id()) {
            return Err(LockError::Misuse("release through another endpoint than the acquisition"));
        }
        self.state = State::Idle;
        let late = h.lease_start.elapsed() >= self.config.lease;
        if late {
            self.stats.late_releases += 1;
            if !self.read_tail(ep)?.is_open_in(h.me.era()) {
                // A waiter reset the lock while we held it past our lease:
                // someone may have entered beside us.
                self.stats.fenced += 1;
                log::warn!("DQL {}: held past the lease through a reset", self.addr);
                return Err(LockError::Fenced);
            }
        }
        // §4.3: "it looks for its successor message".
        let successor = match h.successor {
            Some(s) => Some(s),
            None => self.take_alert(ep, h.me, Instant::now()),
        };
        if let Some(s) = successor {
            self.hand_over(ep, s);
            return Ok(());
        }
        // "it tries to get an update on the tail by swapping itself out with
        // some value that stands for the unlocked state".
        let free = h.me.released(self.config.variant);
        let got = TailWord(ep.cas(self.tail(), h.me.0, free.0)?);
        if got == h.me || !got.is_open_in(h.me.era()) {
            // Released; or a reset closed the tail after we left the
            // critical section: its waiters start over, nothing to hand.
            return Ok(());
        }
        self.release_transient(ep, h.me)
    }

    /// §4.3.1: "Since B is no longer at the tail of the queue, it waits for
    /// a message from its successor ... As soon as it gets an alert, it
    /// sends an alert back to it." The wait is bounded by the silence S: a
    /// successor that died between its CAS and its alert never alerts, and
    /// its own successor (or the next client to join) resets the lock.
    #[cold]
    fn release_transient(&mut self, ep: &Endpoint, me: TailWord) -> Result<(), LockError> {
        self.stats.transient += 1;
        match self.take_alert(ep, me, Instant::now() + self.config.silence()) {
            Some(s) => self.hand_over(ep, s),
            None => {
                self.stats.dropped += 1;
                log::warn!(
                    "DQL {}: our successor never alerted us; leaving the lock to its reset",
                    self.addr
                );
            }
        }
        Ok(())
    }

    /// §4.3: the grant ("sends an alert to the successor ... transferring
    /// the lock").
    fn hand_over(&mut self, ep: &Endpoint, s: Successor) {
        self.stats.grants_sent += 1;
        self.send(ep, s.addr, Wire::Grant { lock: self.addr, to: s.token });
    }

    /// The alert of our successor for token `me`, waiting until `deadline`.
    fn take_alert(&mut self, ep: &Endpoint, me: TailWord, deadline: Instant) -> Option<Successor> {
        let stats = &mut self.stats;
        let letter = self.postbox.receive(ep, self.addr, deadline, |l| match l.wire {
            Wire::Alert { pred, .. } if pred == me => Verdict::Take,
            _ => {
                stats.stale_messages += 1;
                Verdict::Discard
            }
        })?;
        match letter.wire {
            Wire::Alert { succ, .. } => Some(Successor { token: succ, addr: letter.from }),
            _ => None,
        }
    }
}

/// What a queued client takes: messages for its current token; every other
/// message about this lock is from an earlier acquisition (of ours, or of a
/// queue a reset wiped) and is dropped.
fn judge(letter: &Letter<Wire>, me: TailWord, stats: &mut DqlStats) -> Verdict {
    match letter.wire {
        Wire::Grant { to, .. } | Wire::Alive { to, .. } if to == me => Verdict::Take,
        Wire::Alert { pred, .. } if pred == me => Verdict::Take,
        _ => {
            stats.stale_messages += 1;
            Verdict::Discard
        }
    }
}

impl RwLockClient for DqlLock {
    /// Both modes take the mutex.
    #[inline]
    fn acquire(&mut self, ep: &Endpoint, _mode: Mode) -> Result<(), LockError> {
        if self.begin(ep)? {
            return Ok(());
        }
        self.complete(ep)
    }

    #[inline]
    fn release(&mut self, ep: &Endpoint) -> Result<(), LockError> {
        self.unlock(ep)
    }

    fn shares_readers(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_follows_the_lease() {
        let c = DqlConfig::from_rtt(Duration::from_micros(2));
        assert_eq!(c.lease, DqlConfig::MIN_LEASE);
        assert_eq!(c.variant, DqlVariant::StarvationFree);
        assert_eq!(DqlConfig::from_rtt(Duration::from_millis(1)).lease, Duration::from_secs(5));
        let c = c.with_lease(Duration::from_millis(400));
        assert_eq!(c.give_up, Duration::from_secs(24));
        // The waits the safety argument relies on.
        assert!(c.beat() < c.fresh_window());
        assert!(c.silence() > c.lease + c.beat());
        assert!(c.reset_wait() > c.fresh_window() + c.lease);
        assert!(c.abandoned_close() > c.reset_wait());
        // The documented bound: about 3.1 leases.
        let b = c.recovery_bound().as_secs_f64() / c.lease.as_secs_f64();
        assert!((3.0..3.3).contains(&b), "{b}");
    }

    #[test]
    fn the_reset_waits_the_fence_delay() {
        let c = DqlConfig::from_rtt(Duration::from_micros(2)).with_lease(Duration::from_millis(400));
        assert_eq!(c.fence_delay, Duration::ZERO);
        let f = c.with_fence_delay(Duration::from_secs(3));
        assert_eq!(f.silence(), c.silence() + Duration::from_secs(3));
        assert_eq!(f.recovery_bound(), c.recovery_bound() + Duration::from_secs(3));
        // What the holder and the reset rely on does not move.
        assert_eq!(
            (f.beat(), f.fresh_window(), f.reset_wait()),
            (c.beat(), c.fresh_window(), c.reset_wait())
        );
        assert!(f.give_up > f.recovery_bound() * 4, "{f:?}");
        assert_eq!(f, c.with_lease(Duration::from_millis(400)).with_fence_delay(Duration::from_secs(3)));
    }

    #[test]
    fn misaligned_lock_is_refused() {
        let c = DqlConfig::from_rtt(Duration::from_micros(1));
        assert!(DqlLock::new(RemoteAddr::new(crate::rdma::RegionId(1), 12), c).is_err());
        assert!(DqlLock::new(RemoteAddr::new(crate::rdma::RegionId(1), 16), c).is_ok());
    }
}
