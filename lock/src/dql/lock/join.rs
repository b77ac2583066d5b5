//! Joining a DQL queue: the first half of an acquisition. Swap our token
//! into the tail, in the distributed way (§4.2) or after a ticket (§4.4),
//! wait out a closed tail, and alert the predecessor.

use std::time::Instant;

use super::{DqlLock, Holding, Joined, Queued, State};
use crate::dql::message::Wire;
use crate::dql::word::{DqlId, DqlVariant, Stamp, TailWord, Turn};
use crate::dslr::pause;
use crate::rdma::Endpoint;
use crate::rwlock::LockError;

impl DqlLock {
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
    pub(super) fn join(
        &mut self,
        ep: &Endpoint,
        me: DqlId,
        give_up_at: Instant,
    ) -> Result<Joined, LockError> {
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
    /// A tail closed for longer than
    /// [`DqlConfig::abandoned_close`](super::DqlConfig::abandoned_close) lost
    /// its resetter: we reopen it ourselves (the wait already covers the
    /// reset's).
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
    pub(super) fn settle(&mut self, ep: &Endpoint, joined: Joined, give_up_at: Instant) -> Option<Queued> {
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
}
