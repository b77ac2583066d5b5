//! ALock: the asymmetric lock for a lock word in host memory that the host's
//! own threads and remote clients both take (alock-spaa24.md §5; Algorithms
//! 1–4). The meta-server guards each file's attribute words (size, mtime)
//! with one: its threads lock with CPU atomics, clients with verbs.
//!
//! Why a special lock: an RNIC's atomics are atomic among themselves but not
//! with the host CPU's atomics (§1, Table 1), so a word that host threads CAS
//! locally and clients CAS remotely is no lock at all. ALock splits the
//! contenders into two *cohorts* by the kind of access they make (§5): the
//! **local** cohort (host threads: [`AlockHost`], [`AlockLocal`]) uses only
//! CPU atomics on the host's mapped region; the **remote** cohort (clients:
//! [`AlockClient`], an [`RwLockClient`](crate::rwlock::RwLockClient)) uses
//! only verbs. Each cohort is a budgeted MCS queue (§5.1, Alg. 3); the two
//! queue leaders meet in a modified Peterson lock (§5.2, Alg. 4) whose flags
//! are the two queue tails. No word is read-modify-written by both cohorts,
//! which is what makes the lock correct under the verbs layer's test mode
//! [`RemoteAtomicity::NicOnly`](crate::rdma::RemoteAtomicity::NicOnly) (the
//! tests show a naive mixed CAS lock breaking under it while ALock holds).
//!
//! Our copy of the paper lacks the listings of Algorithms 2 and 4; they are
//! rebuilt from §5's prose, and their line numbers are cited where the prose
//! gives them (Alg. 2 line 6: `qLock` returned false, go to Peterson; Alg. 4
//! line 4: `victim ← own cohort`; line 5: the wait condition).
//!
//! # The lock (Alg. 1 lines 1–4; Fig. 3)
//!
//! [`AlockLayout::LOCK_BYTES`] = 24 bytes, 8-aligned; all zero is idle.
//!
//! | offset | word | constant | RMW'd by | read by | meaning |
//! |---|---|---|---|---|---|
//! | 0  | `tail_r` | [`TAIL_REMOTE`] | remote verbs only | both | the [`RemoteTail`]: the client (mailbox) at the end of the remote queue, or none; the queue's epoch and its entry count |
//! | 8  | `tail_l` | [`TAIL_LOCAL`]  | local atomics only | both | 0, or the [`LocalTail`] (a descriptor slot) at the end of the local queue |
//! | 16 | `victim` | [`VICTIM`]      | nobody (plain writes by both) | both | 0 (never written), [`Cohort::Local`] = 1 or [`Cohort::Remote`] = 2 |
//!
//! A tail that names a client is its cohort's Peterson flag (§5: "the tails
//! are also interpreted as the status flags"). `tail_l` and `victim` are
//! adjacent so a remote leader reads both with one 16-byte read (and all
//! three words with one 24-byte read).
//!
//! `tail_r`, field by field ([`RemoteTail`]):
//!
//! | bits | field | meaning |
//! |---|---|---|
//! | 0..24 | mailbox | the tail client's mailbox |
//! | 24..40 | node | its node; 0: no remote client (the remote flag is down) |
//! | 40..48 | epoch | bumped by every recovery; a queue position is valid only in its epoch |
//! | 48..64 | entries | raised by every remote client that enters after waiting: the remote cohort's visible progress |
//!
//! # Local descriptors (Alg. 1 lines 5–7)
//!
//! One pool per host ([`AlockLayout::pool_bytes`], 64-aligned, zero is
//! idle), in the host's region, used by every ALock in that region: slot `i`
//! is 64 bytes at `pool + 64 i` (padded, as §6 pads all metadata to a cache
//! line, so waiters spinning on their own slot do not share a line):
//!
//! | offset | word | constant | meaning |
//! |---|---|---|---|
//! | 0  | claim  | [`DESC_CLAIM`]  | 0 free, else the pid of the process whose [`AlockLocal`] owns the slot |
//! | 8  | budget | [`DESC_BUDGET`] | [`WAITING`] while queued; then the budget passed by the predecessor |
//! | 16 | next   | [`DESC_NEXT`]   | 0, or the [`LocalTail`] of the successor |
//!
//! # Choices where the paper leaves room, and why
//!
//! * **Remote descriptors are handover messages, not memory.** The paper puts
//!   a remote thread's MCS descriptor in RDMA-accessible memory on the
//!   thread's own node (Alg. 1 lines 8–10) so that it spins locally and its
//!   predecessor passes the lock with one rWrite. Our clients have no
//!   registered memory, but every endpoint has a mailbox that a peer can
//!   write into with one message, and waiting on it costs no verbs: a
//!   mailbox *is* the client-local memory the paper wants. So `tail_r` holds
//!   the enqueuer's [`ClientAddr`](crate::rdma::ClientAddr), the rWrite of
//!   `&desc` into `prev->next` (Alg. 3 line 8) is a [`Handoff::Successor`]
//!   message to the predecessor, and the rWrite of the budget into the
//!   successor's descriptor (line 18) is a [`Handoff::Handover`] message.
//!   Descriptors in host memory, one per remote client, were the
//!   alternative; they would turn the local spin of line 9 (and the wait of
//!   line 17) into remote polling, one verb per poll on the very NIC the
//!   paper tries to spare (§2, §5.1), and need a per-client allocator. The
//!   price of messages: a client must release through the endpoint it
//!   acquired with, one endpoint must not hold two handles of the same lock
//!   at once (they would share a tail value), and all ALock handles used
//!   with one endpoint must share one [`AlockPostbox`].
//! * **Local descriptors live in the host's region** (a pool, see above),
//!   not on the thread's stack: `tail_l` must hold something remote clients
//!   can read, and a slot index is checked before use (a raw pointer would
//!   have to be trusted). One [`AlockLocal`] owns one slot for its lifetime
//!   and uses it for one lock at a time.
//! * **Enqueue with a swap.** Alg. 3 line 3 is an rCAS retried with the
//!   learned value until it succeeds; we swap in one atomic: locally
//!   `AtomicU64::swap`, remotely a masked CAS with an empty compare mask
//!   (fetch-and-store, one verb that never fails).
//! * **Peterson fast path.** A leader whose queue was empty (Alg. 2 line 6)
//!   first reads the other cohort's tail; if it is zero it enters without
//!   writing `victim`. Safe: its own tail was set before that read, so a
//!   leader of the other cohort that enqueues later sees our flag, writes
//!   `victim` = itself and waits, and nobody of our cohort writes `victim`
//!   while we hold except a budget-0 successor, which is exactly the yield
//!   of §5.1. The remote leader batches this read behind its swap, so an
//!   uncontended remote acquire + release is 3 verbs in 2 round trips
//!   (swap + read, then the CAS of Alg. 3 line 15), the "single rCAS ...
//!   followed by a single rRead" of §5.1 plus the release. When the other
//!   tail is set the leader runs Alg. 4 as written: write `victim`, then
//!   wait until `victim` is not its cohort or the other tail is zero (a
//!   remote leader batches the write with the first read).
//! * **Budgets** (§5.1 "Adding Fairness", §6.1): a leader that won Peterson
//!   holds with budget K (its cohort's initial budget: [`AlockConfig`],
//!   paper values 5 local, 20 remote); each pass hands `budget − 1` to the
//!   successor, and a successor handed 0 runs Alg. 4 again
//!   (`pReacquire`, line 11: `victim ← own cohort`, wait), then holds with K.
//!   While a leader of the other cohort waits with its `victim` written, at
//!   most K entries of a cohort happen; counted from the moment the other
//!   cohort's tail became non-zero, at most 2K (the tests assert the latter,
//!   which the oracle can observe).
//! * **Memory order.** Every word of the lock is accessed `SeqCst`: Peterson
//!   needs the store of `victim` (and the enqueue that raises the flag) to
//!   be ordered before the load of the other flag, which acquire/release
//!   does not give (§5.2 asks for fences for the same reason), and remote
//!   verbs are `SeqCst` on both backends. Descriptor fields are handed
//!   between local threads with release/acquire (see `local.rs`).
//! * **Bounded waits.** Every wait ends after [`AlockConfig::give_up`] with
//!   [`LockError::Timeout`](crate::rwlock::LockError::Timeout). A leader that
//!   gives up in Peterson leaves cleanly: it releases its queue position
//!   passing budget 0 (its successor, if any, competes in Peterson
//!   instead). A waiter that gives up while queued cannot leave an MCS
//!   queue: the handle is then *poisoned* (every later call fails with
//!   `Misuse`, a local handle's descriptor slot is never reused) and the
//!   lock stays blocked, as ALock has no failure recovery (§4 assumes
//!   failure-free accesses). The one wait without a deadline is a local
//!   holder's wait for its local successor to link itself in (Alg. 3 line
//!   17): that successor is a live thread of this process a few
//!   instructions from the link, however long it is descheduled, and giving
//!   up on it lost the lock for good (see `hand_over` in `local.rs`). A
//!   lock whose words were reset under its holder (its memory freed while
//!   held) is detected there exactly and fails at once.
//!
//!
//! # Recovery by leases (not in the paper: §4 assumes no failures)
//!
//! A remote client that dies holding the lock, or queued on it, blocks it
//! for good: its successor waits for a handover that never comes, and the
//! local leader waits in Peterson for a remote flag that never goes down.
//! (Host threads need no recovery: they die only with the host, and the lock
//! with them.) The recovery follows the other locks' leases:
//!
//! * **Contract.** A remote client holds the lock for at most
//!   [`AlockConfig::lease`]; the file system holds it for one batch of verbs.
//! * **Progress is visible.** Handovers inside the remote cohort are
//!   messages, invisible in memory, so a remote client that *enters after
//!   waiting* (handed the lock, or let in by Peterson) raises the entry
//!   count in `tail_r` with a masked-FAA, batched with a read that checks
//!   its epoch (one round trip on the contended path only; an uncontended
//!   entry is already visible as the swap that found the queue empty, and no
//!   one watches an empty queue). Consecutive entries are then at most a
//!   lease plus a message apart while the remote cohort lives.
//! * **Detection.** A waiter that depends on the remote cohort — a queued
//!   remote client waiting for its handover, a releasing holder waiting for
//!   its successor to link itself in, the local leader in Peterson — watches
//!   the epoch and entry count. If they stand still for 3/2 of the lease
//!   (counted over reads at most a quarter lease apart), every remote client
//!   that entered has left, and the one the queue waits for is dead.
//! * **Reset.** The waiter clears the tail's client and bumps the epoch with
//!   one masked-CAS that compares the stalled epoch and entry count (a
//!   remote verb: the local leader uses the host's recovery endpoint,
//!   [`AlockHost::with_recovery`], so the reset is atomic with the remote
//!   cohort's verbs even under [`RemoteAtomicity::NicOnly`]). The remote
//!   flag is down: the local cohort may enter. Every remote client still
//!   waiting in the old epoch sees the epoch move at its next look (it looks
//!   every quarter lease while it waits for a message) and enqueues again;
//!   handoff messages carry their epoch, and a postbox drops those of an
//!   older one, so no stale handover grants anything. A remote client that
//!   was handed the lock checks the epoch in the batch that records its
//!   entry, so a reset that came first sends it back to the queue, and a
//!   reset that comes later fails on the entry count it raised.
//! * **The fence delay** ([`AlockConfig::fence_delay`], zero below a file
//!   system): the reset waits 3/2 of the lease plus it, so a remote holder
//!   whose whole process stopped after its last check of the lease is
//!   fenced at the servers (its verbs refused) before the lock passes on.
//!   The watch's looks stay a quarter lease apart and the holder's bound
//!   (the lease) is unchanged; a reset only comes later.
//! * **A release after a reset** (a holder past its lease): its release CAS
//!   compares its epoch too, fails, and the release hands nothing over and
//!   says [`LockError::Fenced`](crate::rwlock::LockError::Fenced).
//!
//! Not done: loopback baselines.
//!
//! [`RemoteAtomicity::NicOnly`]: crate::rdma::RemoteAtomicity::NicOnly

mod local;
mod message;
mod remote;

use std::time::Duration;

use crate::rdma::arith::{field_boundaries, field_delta};
use crate::rwlock::LockError;

pub use local::{AlockGuard, AlockHost, AlockLocal, AlockLocalStats};
pub use message::{AlockPostbox, Handoff};
pub use remote::{AlockClient, AlockClientStats};

use crate::rdma::{ClientAddr, MailboxId, NodeId};

/// Offset of `tail_r` in the lock.
pub const TAIL_REMOTE: u64 = 0;
/// Offset of `tail_l` in the lock.
pub const TAIL_LOCAL: u64 = 8;
/// Offset of `victim` in the lock.
pub const VICTIM: u64 = 16;

/// Offset of a descriptor's claim word.
pub const DESC_CLAIM: u64 = 0;
/// Offset of a descriptor's budget word.
pub const DESC_BUDGET: u64 = 8;
/// Offset of a descriptor's next word.
pub const DESC_NEXT: u64 = 16;
/// A descriptor's budget while its thread waits for the lock (Alg. 3 line 7's −1).
pub const WAITING: u64 = u64::MAX;

/// What ALock needs in host memory. Zeroed memory is an idle lock and an
/// empty pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlockLayout;

impl AlockLayout {
    /// Bytes of one lock (three words, see the module comment).
    pub const LOCK_BYTES: u64 = 24;
    /// Alignment of a lock.
    pub const LOCK_ALIGN: u64 = 8;
    /// Bytes of one local descriptor slot.
    pub const DESCRIPTOR_BYTES: u64 = 64;
    /// Alignment of the descriptor pool.
    pub const POOL_ALIGN: u64 = 64;

    /// Bytes of a host's descriptor pool with `slots` slots: one per host
    /// thread that may hold or wait for an ALock at the same time.
    pub const fn pool_bytes(slots: u32) -> u64 {
        slots as u64 * Self::DESCRIPTOR_BYTES
    }
}

/// The two cohorts (§5), as written into `victim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cohort {
    /// Host threads, CPU atomics.
    Local = 1,
    /// Clients, verbs.
    Remote = 2,
}

impl Cohort {
    /// The value this cohort writes into `victim`.
    pub const fn word(self) -> u64 {
        self as u64
    }

    /// Decodes a `victim` word (0 means nobody has written it yet).
    pub const fn from_word(w: u64) -> Option<Cohort> {
        match w {
            1 => Some(Cohort::Local),
            2 => Some(Cohort::Remote),
            _ => None,
        }
    }

    pub const fn other(self) -> Cohort {
        match self {
            Cohort::Local => Cohort::Remote,
            Cohort::Remote => Cohort::Local,
        }
    }
}

/// A `tail_r` word (its fields are in the module comment): the client at
/// the end of the remote queue, the queue's epoch and its entry count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteTail(pub u64);

impl RemoteTail {
    pub const NONE: RemoteTail = RemoteTail(0);
    pub const MAILBOX_BITS: u32 = 24;
    pub const NODE_SHIFT: u32 = 24;
    pub const NODE_BITS: u32 = 16;
    pub const EPOCH_SHIFT: u32 = 40;
    pub const EPOCH_BITS: u32 = 8;
    pub const ENTRIES_SHIFT: u32 = 48;
    pub const ENTRIES_BITS: u32 = 16;
    /// The client fields (mailbox and node).
    pub const CLIENT: u64 = (1 << (Self::NODE_SHIFT + Self::NODE_BITS)) - 1;
    pub const EPOCH: u64 = ((1 << Self::EPOCH_BITS) - 1) << Self::EPOCH_SHIFT;
    pub const ENTRIES: u64 = ((1 << Self::ENTRIES_BITS) - 1) << Self::ENTRIES_SHIFT;
    /// What moves when the remote cohort makes progress or is recovered.
    pub const PROGRESS: u64 = Self::EPOCH | Self::ENTRIES;
    /// Masked-FAA operand: one more entry.
    pub const ENTER: u64 = field_delta(Self::ENTRIES_SHIFT, Self::ENTRIES_BITS, 1);
    /// Masked-FAA boundaries of the word's fields.
    pub const BOUNDARIES: u64 = field_boundaries(&[
        (0, Self::MAILBOX_BITS),
        (Self::NODE_SHIFT, Self::NODE_BITS),
        (Self::EPOCH_SHIFT, Self::EPOCH_BITS),
        (Self::ENTRIES_SHIFT, Self::ENTRIES_BITS),
    ]);

    /// The client fields of `client` (epoch and entries 0), or an error if
    /// its ids do not fit (node 1..=65535, mailbox below 2^24, as ShiftLock's).
    pub fn of(client: ClientAddr) -> Result<RemoteTail, LockError> {
        if client.node.0 == 0 || client.node.0 >= 1 << Self::NODE_BITS {
            return Err(LockError::Misuse("an ALock client's node id must be 1..=65535"));
        }
        if client.mailbox.0 >= 1 << Self::MAILBOX_BITS {
            return Err(LockError::Misuse("an ALock client's mailbox id must be below 2^24"));
        }
        Ok(RemoteTail(u64::from(client.node.0) << Self::NODE_SHIFT | u64::from(client.mailbox.0)))
    }

    /// The client at the tail, or `None` for an empty remote queue.
    pub const fn client(self) -> Option<ClientAddr> {
        let node = ((self.0 >> Self::NODE_SHIFT) & ((1 << Self::NODE_BITS) - 1)) as u32;
        if node == 0 {
            return None;
        }
        let mailbox = (self.0 & ((1 << Self::MAILBOX_BITS) - 1)) as u32;
        Some(ClientAddr { node: NodeId(node), mailbox: MailboxId(mailbox) })
    }

    /// Whether a remote client is queued or holds (the remote Peterson flag).
    pub const fn has_client(self) -> bool {
        self.0 & (((1 << Self::NODE_BITS) - 1) << Self::NODE_SHIFT) != 0
    }

    pub const fn epoch(self) -> u8 {
        (self.0 >> Self::EPOCH_SHIFT) as u8
    }

    /// The word a recovery leaves: no client, the next epoch, the same
    /// entry count.
    pub const fn reset(self) -> RemoteTail {
        RemoteTail((self.0 & Self::ENTRIES) | (self.epoch().wrapping_add(1) as u64) << Self::EPOCH_SHIFT)
    }
}

/// How long the remote cohort's progress (the epoch and entry count in
/// `tail_r`) has stood still, counted over looks at most half a lease apart
/// (a waiter that was not looking cannot tell that nothing happened).
pub(crate) struct Stall {
    key: Option<u64>,
    since: std::time::Instant,
    last_look: std::time::Instant,
    stall: Duration,
    gap: Duration,
}

impl Stall {
    pub fn new(config: &AlockConfig) -> Self {
        let now = std::time::Instant::now();
        Self { key: None, since: now, last_look: now, stall: config.stall(), gap: config.lease / 2 }
    }

    /// One look at the progress `key`; `true` once it has stood still for
    /// the stall time.
    pub fn stalled(&mut self, key: u64) -> bool {
        let now = std::time::Instant::now();
        let close = now.duration_since(self.last_look) <= self.gap;
        self.last_look = now;
        if self.key != Some(key) || !close {
            self.key = Some(key);
            self.since = now;
            return false;
        }
        now.duration_since(self.since) >= self.stall
    }
}

/// The index of a local descriptor in its host's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DescriptorSlot(pub u32);

/// A `tail_l` (or descriptor `next`) value: slot + 1, so 0 is "none".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalTail(pub u64);

impl LocalTail {
    pub const NONE: LocalTail = LocalTail(0);

    pub const fn of(slot: DescriptorSlot) -> LocalTail {
        LocalTail(slot.0 as u64 + 1)
    }

    /// The slot, or `None` for 0; `Err` for a value no slot of a pool with
    /// `slots` slots can have written.
    pub fn slot(self, slots: u32) -> Result<Option<DescriptorSlot>, u64> {
        match self.0 {
            0 => Ok(None),
            v if v <= u64::from(slots) => Ok(Some(DescriptorSlot((v - 1) as u32))),
            v => Err(v),
        }
    }
}

/// The budget a holder hands to its successor (Alg. 3 line 18:
/// `desc.budget − 1`). A holder's budget is never 0: a successor handed 0
/// reacquires through Peterson and holds with the initial budget (lines
/// 10–12).
pub const fn passed_budget(held: u32) -> u32 {
    held.saturating_sub(1)
}

/// Tunables of both cohorts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlockConfig {
    /// K_l: acquisitions the local cohort may make in a row before it must
    /// go through Peterson again (§6.1 chooses 5).
    pub local_budget: u32,
    /// K_r: the same for the remote cohort (§6.1 chooses 20, because a
    /// remote reacquire costs verbs).
    pub remote_budget: u32,
    /// First interval between two remote polls of Peterson's words.
    pub poll: Duration,
    /// Polls back off exponentially up to this interval.
    pub max_poll: Duration,
    /// Longest any single acquisition or release waits before it fails with
    /// [`LockError::Timeout`](crate::rwlock::LockError::Timeout).
    pub give_up: Duration,
    /// A remote holder releases within it; a remote cohort that shows no
    /// progress for 3/2 of it (plus the fence delay) is recovered (see the
    /// module comment).
    pub lease: Duration,
    /// How long after a holder's lease ran out the cluster may still need
    /// to fence a silent remote holder at the servers: the recovery waits
    /// this much longer, so a stopped holder's verbs are refused before
    /// anyone else enters. Zero (the default) below a file system.
    pub fence_delay: Duration,
}

/// The budgets of the paper's evaluation (§6.1).
pub const PAPER_LOCAL_BUDGET: u32 = 5;
pub const PAPER_REMOTE_BUDGET: u32 = 20;

impl AlockConfig {
    /// The paper's budgets; polls start one RTT apart and back off to 64
    /// RTTs (a remote poll costs about one RTT itself); give up after 30 s;
    /// a lease of 5000 RTT, at least 1 s (as DSLR's).
    pub fn from_rtt(rtt: Duration) -> Self {
        let rtt = rtt.max(Duration::from_nanos(100));
        Self {
            local_budget: PAPER_LOCAL_BUDGET,
            remote_budget: PAPER_REMOTE_BUDGET,
            poll: rtt,
            max_poll: rtt * 64,
            give_up: Duration::from_secs(30),
            lease: (rtt * 5000).max(Duration::from_secs(1)),
            fence_delay: Duration::ZERO,
        }
    }

    /// The same with a lease (a cluster's); the give-up time grows to
    /// leave room for a recovery.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self.give_up = self.give_up.max(lease * 8 + self.fence_delay * crate::rwlock::GIVE_UP_FENCES);
        self
    }

    /// The same with a fence delay ([`AlockConfig::fence_delay`]); the
    /// give-up time grows to leave room for
    /// [`GIVE_UP_FENCES`](crate::rwlock::GIVE_UP_FENCES) of them.
    pub fn with_fence_delay(mut self, fence_delay: Duration) -> Self {
        self.fence_delay = fence_delay;
        self.give_up = self.give_up.max(self.lease * 8 + fence_delay * crate::rwlock::GIVE_UP_FENCES);
        self
    }

    /// How long the remote cohort may show no progress before it is
    /// recovered: 3/2 of the lease, plus the fence delay.
    pub fn stall(&self) -> Duration {
        self.lease * 3 / 2 + self.fence_delay
    }

    /// How often a waiter that depends on the remote cohort looks at it.
    pub fn look(&self) -> Duration {
        self.lease / 4
    }

    /// The same with budgets K_l and K_r (each at least 1).
    pub fn with_budgets(mut self, local: u32, remote: u32) -> Self {
        self.local_budget = local.max(1);
        self.remote_budget = remote.max(1);
        self
    }

    pub fn with_give_up(mut self, give_up: Duration) -> Self {
        self.give_up = give_up;
        self
    }

    #[inline]
    fn budget(&self, cohort: Cohort) -> u32 {
        match cohort {
            Cohort::Local => self.local_budget.max(1),
            Cohort::Remote => self.remote_budget.max(1),
        }
    }
}

impl Default for AlockConfig {
    /// [`AlockConfig::from_rtt`] of a 2 µs fabric (the paper's RTT).
    fn default() -> Self {
        Self::from_rtt(Duration::from_micros(2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        assert_eq!(AlockLayout::LOCK_BYTES, VICTIM + 8);
        assert_eq!(TAIL_LOCAL + 8, VICTIM, "tail_l and victim are one 16-byte read");
        assert_eq!(AlockLayout::pool_bytes(16), 1024);
        const { assert!(DESC_NEXT + 8 <= AlockLayout::DESCRIPTOR_BYTES) };
        assert_eq!(AlockLayout::DESCRIPTOR_BYTES % AlockLayout::POOL_ALIGN, 0);
    }

    #[test]
    fn remote_tail_round_trips_and_is_never_zero() {
        for (node, mailbox) in [(1, 0), (1, 7), (0xFFFF, 0xFF_FFFF), (3, 0xFF_FFFF)] {
            let c = ClientAddr { node: NodeId(node), mailbox: MailboxId(mailbox) };
            let t = RemoteTail::of(c).unwrap();
            assert_ne!(t, RemoteTail::NONE);
            assert!(t.has_client());
            assert_eq!(t.client(), Some(c));
            assert_eq!(t.0 & !RemoteTail::CLIENT, 0);
        }
        for (node, mailbox) in [(0, 1), (0x1_0000, 0), (1, 0x100_0000)] {
            assert!(RemoteTail::of(ClientAddr { node: NodeId(node), mailbox: MailboxId(mailbox) }).is_err());
        }
        assert_eq!(RemoteTail::NONE.client(), None);
        assert_eq!(RemoteTail(0xFF_FFFF).client(), None, "node 0 is no client");
        assert!(!RemoteTail(RemoteTail::PROGRESS).has_client(), "epoch and entries are no client");
    }

    #[test]
    fn entries_and_resets_move_their_fields_only() {
        use crate::rdma::arith::masked_faa_u64;
        let c = RemoteTail::of(ClientAddr { node: NodeId(7), mailbox: MailboxId(9) }).unwrap();
        let t = RemoteTail(c.0 | 0xFF << RemoteTail::EPOCH_SHIFT | 0xFFFF << RemoteTail::ENTRIES_SHIFT);
        let entered = RemoteTail(masked_faa_u64(t.0, RemoteTail::ENTER, RemoteTail::BOUNDARIES));
        assert_eq!(entered.client(), c.client());
        assert_eq!(entered.epoch(), 0xFF, "the entry count wraps without touching the epoch");
        assert_eq!(entered.0 & RemoteTail::ENTRIES, 0);
        let reset = t.reset();
        assert!(!reset.has_client());
        assert_eq!(reset.epoch(), 0, "the epoch wraps");
        assert_eq!(reset.0 & RemoteTail::ENTRIES, t.0 & RemoteTail::ENTRIES);
    }

    #[test]
    fn local_tail_is_slot_plus_one_and_checked() {
        assert_eq!(LocalTail::of(DescriptorSlot(0)), LocalTail(1));
        assert_eq!(LocalTail(0).slot(4), Ok(None));
        assert_eq!(LocalTail(1).slot(4), Ok(Some(DescriptorSlot(0))));
        assert_eq!(LocalTail(4).slot(4), Ok(Some(DescriptorSlot(3))));
        assert_eq!(LocalTail(5).slot(4), Err(5));
        assert_eq!(LocalTail(u64::MAX).slot(u32::MAX), Err(u64::MAX));
    }

    #[test]
    fn cohorts_and_victim_words() {
        for c in [Cohort::Local, Cohort::Remote] {
            assert_eq!(Cohort::from_word(c.word()), Some(c));
            assert_eq!(c.other().other(), c);
            assert_ne!(c.word(), 0, "zero is the idle victim");
        }
        assert_eq!(Cohort::from_word(0), None);
        assert_eq!(Cohort::from_word(3), None);
    }

    #[test]
    fn budgets_count_down_to_a_reacquire() {
        // A leader holds with K and hands K−1, …, 1, 0: K holders in a row,
        // and the one handed 0 goes through Peterson.
        let k = 5;
        let mut held = k;
        let mut holders = 1;
        loop {
            let passed = passed_budget(held);
            if passed == 0 {
                break;
            }
            holders += 1;
            held = passed;
        }
        assert_eq!(holders, k);
        assert_eq!(passed_budget(0), 0, "never wraps");
        let c = AlockConfig::default().with_budgets(0, 0);
        assert_eq!((c.budget(Cohort::Local), c.budget(Cohort::Remote)), (1, 1));
        let p = AlockConfig::from_rtt(Duration::from_micros(3));
        assert_eq!((p.local_budget, p.remote_budget), (5, 20));
        let l = p.with_lease(Duration::from_secs(5));
        assert_eq!(
            (l.lease, l.stall(), l.look()),
            (Duration::from_secs(5), Duration::from_millis(7500), Duration::from_millis(1250))
        );
        assert!(l.give_up > l.stall(), "a waiter outlasts a recovery");
        assert_eq!((p.poll, p.max_poll), (Duration::from_micros(3), Duration::from_micros(192)));
    }

    #[test]
    fn recovery_waits_the_fence_delay() {
        let l = AlockConfig::from_rtt(Duration::from_micros(3)).with_lease(Duration::from_secs(1));
        assert_eq!(l.fence_delay, Duration::ZERO);
        assert_eq!(l.stall(), Duration::from_millis(1500));
        let f = l.with_fence_delay(Duration::from_secs(3));
        assert_eq!((f.stall(), f.look()), (Duration::from_millis(4500), Duration::from_millis(250)));
        assert!(f.give_up > f.stall() * 4, "a waiter outlasts several recoveries: {f:?}");
        let g = AlockConfig::from_rtt(Duration::from_micros(3))
            .with_fence_delay(Duration::from_secs(3))
            .with_lease(Duration::from_secs(1));
        assert_eq!((g.stall(), g.give_up), (f.stall(), f.give_up), "either order");
    }
}
