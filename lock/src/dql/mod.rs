//! DQL: the distributed FIFO queue lock of dql-icpp05.md (Devulapalli and
//! Wyckoff, ICPP'05), §3–4 — a mutex whose queue lives in its clients. The
//! lock host keeps only the queue's tail; a client swaps itself into the
//! tail with a CAS, learns its predecessor from the value it replaced, and
//! alerts it; a releasing client hands the lock to the successor that
//! alerted it, and touches the host only when nobody did. A selectable
//! mutex (`--inode-lock dql`) and a baseline for the others.
//!
//! * [`word`]: the tail word (bit table there), the ticket counter, the
//!   client identity, stamps and eras.
//! * [`message`]: the alerts of §4.2–4.3 and our liveness beat.
//! * [`lock`]: [`DqlLock`], the [`crate::rwlock::RwLockClient`] (a mutex:
//!   [`shares_readers`](crate::rwlock::RwLockClient::shares_readers) is false).
//!
//! Lock memory: [`DQL_BYTES`] = 16 bytes, [`DQL_ALIGN`] = 8, zeroed = free.
//! No host-side service: the host only provides the memory; recovery from
//! failed clients is done by the waiters with verbs (below).
//!
//! # Protocol (the paper's, with where it lives)
//!
//! * **Distributed** (§4.2, [`DqlVariant::Distributed`]): CAS the tail from
//!   "free" to our token; if that fails the CAS returned the current tail,
//!   our most likely predecessor: CAS it to our token, repeating until a CAS
//!   succeeds. Uncontended: one CAS.
//! * **Starvation-free** (§4.4, [`DqlVariant::StarvationFree`], the default):
//!   first an FA on the counter; its low bits are our ticket, and only the
//!   ticket right after the tail's may CAS itself in, so clients join in FA
//!   order. Uncontended: FA + CAS (Table 3).
//! * **Alert** (§4.2): the joiner tells its predecessor "I am your
//!   successor" ([`Wire::Alert`]).
//! * **Unlock** (§4.3): a successor's alert there → grant it
//!   ([`Wire::Grant`]), no verb; none → CAS the tail from our token back to
//!   free (one CAS). **Transient state** (§4.3.1): that CAS fails because a
//!   successor swapped in but has not alerted yet; we wait for its alert
//!   and then grant ([`DqlLock::unlock`], `release_transient`).
//!
//! Cost per uncontended acquire + release (Table 3): distributed 2 verbs
//! (CAS, CAS), starvation-free 3 (FA, CAS, CAS), one round trip each; a
//! handover costs two messages (alert, grant) and no verb.
//!
//! # Choices where the paper leaves room, and why
//!
//! * **Alerts are two-sided messages, not writes into slots of host
//!   memory.** The paper writes into the peer's memory with RDMA Write with
//!   Immediate; here clients have no registered memory. A slot per client in
//!   lock-host memory would turn §4.3's "looks for its successor message",
//!   a local check, into a remote READ on every release (a verb on the
//!   uncontended path), and waiting for a grant into polling remote memory.
//!   A message is what RWI is to the receiver (a completion it waits on),
//!   costs no host verb, and its receiver blocks in `recv` instead of
//!   polling. The sender names the receiver by the identity in the tail.
//! * **Identity** ([`DqlId`]): the paper registers clients with the lock
//!   server (§4.1) to look up the peer's keys. Here the identity is the
//!   endpoint's mailbox address itself, (16-bit node, 16-bit mailbox), so no
//!   registration is needed; an endpoint whose ids do not fit is refused.
//! * **Tokens.** The tail holds a token: identity, a 24-bit stamp and the
//!   era. The starvation-free stamp is the ticket (the paper's 32-bit counter
//!   cut to 24 bits to make room for the era); the distributed stamp is a
//!   per-handle nonce, and "free" is then a constant per era, so the first
//!   CAS of §4.2 needs no read. Every message names the token it is for, so a
//!   stale alert (from an abandoned acquisition) is never taken for a new
//!   one, which a bare identity would allow.
//! * **Waiting for the turn** (§4.4 says only "have to wait"): a ticket
//!   whose turn has not come READs the tail, backing off from one RTT to 64.
//! * **One postbox per endpoint** ([`DqlPostbox`]): messages name their
//!   lock; handles that share an endpoint share the postbox that sorts them.
//!
//! # Failures (not in the paper: §7 lists fault tolerance as future work)
//!
//! A lease T_lease bounds how long a client holds the lock, as for the
//! other locks of this crate ([`DqlConfig::from_rtt`]: 5000 RTT, at least
//! 1 s). Recovery is done by the waiters, lazily, with verbs, like DSLR's.
//!
//! * **Detection: silence of the predecessor.** A waiting client that has
//!   its successor's alert sends it a [`Wire::Alive`] every beat
//!   (T_lease/4); a holder releases within T_lease. So a waiter
//!   that hears nothing from its predecessor for S = (T_lease + beat)(1+δ) +
//!   T_lease/4 ([`DqlConfig::silence`]) takes it for dead: killed while
//!   holding, or while queued (its grant is then lost), or a holder overran
//!   its lease. Detection costs messages only while waiting, no verbs.
//! * **The fence delay** ([`DqlConfig::fence_delay`], zero below a file
//!   system) is added to S: a holder whose whole process stopped after its
//!   last check of its lease is fenced at the servers (its verbs refused)
//!   before a waiter resets the lock. R, X and the beats are unchanged: the
//!   argument below is about clients that entered before the close, which
//!   a later reset leaves as they were.
//! * **The reset (an era change).** The waiter CASes the tail closed (the
//!   [`CLOSED_BIT`](word::CLOSED_BIT)): nobody can join any more. It keeps it
//!   closed for R = (X + T_lease)(1+δ) + T_lease/16 ([`DqlConfig::reset_wait`])
//!   and then CASes it open, free, in the next era. Every client of the old
//!   era starts its acquisition over when it sees the closed tail or the new
//!   era; waiters READ the tail every beat for that, so messages of a wiped
//!   queue are stale by their token's era.
//! * **Why no two clients hold at once across a reset.** A client enters
//!   either by the CAS that finds the tail free (before the close: after it
//!   every such CAS fails), or on a grant — and then only if a READ of the
//!   tail posted no longer than X = T_lease/2 before ([`DqlConfig::fresh_window`])
//!   showed its era open (waiters READ every beat, so usually no extra verb;
//!   else one READ first). Both enter no later than X after the close, and
//!   leave within T_lease of entering: before the reopen at close + R. A
//!   client that overran its lease learns it at release: a READ showing a
//!   closed tail or another era returns [`LockError::Fenced`](crate::rwlock::LockError::Fenced).
//! * **A dead resetter.** A tail seen closed for R + S is reopened by the
//!   waiter that sees it ([`DqlConfig::abandoned_close`]); the CAS makes one
//!   of them win.
//! * **A dead ticket** (starvation-free: the client took a ticket and died
//!   before it swapped in): the ticket n places ahead of the tail's swaps
//!   in over the dead ones after n × T_lease(1+δ) of an unchanged tail
//!   ([`DqlConfig::gap`]), so the earliest live ticket goes first; a live
//!   ticket passed over this way sees the tail past it and takes another.
//! * **The transient state with a dead successor** (§4.3.1): the releaser
//!   waits S for the alert, then returns; the dead successor's own
//!   successor (or the next client to join behind it) resets.
//!
//! **The bound.** A waiter whose predecessor died is back in a new era's
//! queue within S + R + T_lease/16 ≈ 3.1 × T_lease
//! ([`DqlConfig::recovery_bound`]) of hearing from it last (or of joining
//! behind it, if it joined after the death); the other waiters of the era
//! restart within T_lease/16 of the reopen. A dead starvation-free ticket
//! costs the tickets behind it T_lease each. FIFO order holds within an
//! era; a reset restarts the waiters in the order their CASes land.
//!
//! Limits: the era has 7 bits, so a waiter that does not look at the tail
//! for 128 resets (each at least R long) could miss them (waiters look every
//! beat); at most 2^23 tickets may be outstanding at once; node and mailbox
//! ids above 65535 are refused. An acquisition that exceeds
//! [`DqlConfig::give_up`] fails with [`LockError::Timeout`](crate::rwlock::LockError::Timeout);
//! its token may stay in the queue, and its successor then resets the lock
//! (or, if it had not swapped in yet, its ticket is skipped after a gap).
//! Every client of one lock must use the same variant and lease.

pub mod lock;
pub mod message;
pub mod word;

pub use lock::{DqlConfig, DqlLock, DqlPostbox, DqlStats};
pub use message::Wire;
pub use word::{DqlId, DqlIdError, DqlVariant, Era, Stamp, TailWord, Turn, DQL_ALIGN, DQL_BYTES};
