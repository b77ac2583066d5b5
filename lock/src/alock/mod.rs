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
//! | 0  | `tail_r` | [`TAIL_REMOTE`] | remote verbs only | both | 0, or the [`RemoteTail`] (a client's mailbox) at the end of the remote queue |
//! | 8  | `tail_l` | [`TAIL_LOCAL`]  | local atomics only | both | 0, or the [`LocalTail`] (a descriptor slot) at the end of the local queue |
//! | 16 | `victim` | [`VICTIM`]      | nobody (plain writes by both) | both | 0 (never written), [`Cohort::Local`] = 1 or [`Cohort::Remote`] = 2 |
//!
//! A non-zero tail is its cohort's Peterson flag (§5: "the tails are also
//! interpreted as the status flags"). `tail_l` and `victim` are adjacent so a
//! remote leader reads both with one 16-byte read.
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
//!   instead). A waiter that gives up while queued, or a holder whose
//!   successor never links itself in, cannot leave an MCS queue: the handle
//!   is then *poisoned* (every later call fails with `Misuse`, a local
//!   handle's descriptor slot is never reused) and the lock stays blocked,
//!   as ALock has no failure recovery (§4 assumes failure-free accesses).
//!
//! Not done: recovery of a lock whose holder died (a client process killed
//! holding or queued blocks the lock until the host resets it by zeroing
//! its words while nobody uses it; see the report); loopback baselines.

mod local;
mod message;
mod remote;

use std::time::Duration;

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

/// A `tail_r` value: the mailbox of the client at the end of the remote
/// queue, `node << 32 | mailbox`. Node ids start at 1, so a client's tail is
/// never 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteTail(pub u64);

impl RemoteTail {
    pub const NONE: RemoteTail = RemoteTail(0);

    pub const fn of(client: ClientAddr) -> RemoteTail {
        RemoteTail((client.node.0 as u64) << 32 | client.mailbox.0 as u64)
    }

    /// The client, or `None` for an empty queue (or a word no client can
    /// have written: node 0).
    pub const fn client(self) -> Option<ClientAddr> {
        let node = (self.0 >> 32) as u32;
        if node == 0 {
            return None;
        }
        Some(ClientAddr { node: NodeId(node), mailbox: MailboxId(self.0 as u32) })
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
}

/// The budgets of the paper's evaluation (§6.1).
pub const PAPER_LOCAL_BUDGET: u32 = 5;
pub const PAPER_REMOTE_BUDGET: u32 = 20;

impl AlockConfig {
    /// The paper's budgets; polls start one RTT apart and back off to 64
    /// RTTs (a remote poll costs about one RTT itself); give up after 30 s.
    pub fn from_rtt(rtt: Duration) -> Self {
        let rtt = rtt.max(Duration::from_nanos(100));
        Self {
            local_budget: PAPER_LOCAL_BUDGET,
            remote_budget: PAPER_REMOTE_BUDGET,
            poll: rtt,
            max_poll: rtt * 64,
            give_up: Duration::from_secs(30),
        }
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
        for (node, mailbox) in [(1, 0), (1, 7), (u32::MAX, u32::MAX), (3, u32::MAX)] {
            let c = ClientAddr { node: NodeId(node), mailbox: MailboxId(mailbox) };
            let t = RemoteTail::of(c);
            assert_ne!(t, RemoteTail::NONE);
            assert_eq!(t.client(), Some(c));
        }
        assert_eq!(RemoteTail::NONE.client(), None);
        assert_eq!(RemoteTail(0xFFFF_FFFF).client(), None, "node 0 is no client");
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
        assert_eq!((p.poll, p.max_poll), (Duration::from_micros(3), Duration::from_micros(192)));
    }
}
