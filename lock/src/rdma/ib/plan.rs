//! From an ordered batch of verbs to what the `ib` queue pair posts: doorbells
//! of work requests, emulated masked atomics, and 16-byte atomics the host
//! executes. Pure: the FFI layer only posts what the plan says.
//!
//! # Batches and ordering
//!
//! The contract of every backend (DESIGN.md §3): verbs of one endpoint take
//! effect in the order posted, and a batch is one wait. Here a batch becomes
//! a sequence of [`Step`]s executed one after another, each finished before
//! the next starts:
//!
//! * [`Step::Doorbell`]: native verbs as one `ibv_post_send` chain (one
//!   doorbell), only the last work request signalled; one round trip.
//!   Inside a doorbell RC executes requests in order at the responder, but
//!   the InfiniBand ordering rules let a request pass an earlier RDMA READ
//!   or atomic; so every request after a READ or an atomic carries
//!   `IBV_SEND_FENCE`, which holds it until those completed. The batch keeps
//!   the rule "no verb passes an earlier write/atomic", and also "nor an
//!   earlier read", which the other backends give too.
//! * [`Step::Emulate`]: a masked verb the device cannot do, by the CAS loop
//!   of [`super::emulate`]; its extra round trips are counted.
//! * [`Step::Host`]: a 16-byte atomic on a device without extended atomics,
//!   executed by the host's CPU (its 16-byte `cmpxchg`) over the control
//!   channel; one round trip, and the host CPU does the work. Every 16-byte
//!   atomic goes this way, so they stay atomic with each other and with the
//!   host's own threads; mixing some on the NIC would not be.
//!
//! Native forms found inside the masked verbs: a masked-FAA with no
//! boundaries is an FAA, a masked-CAS comparing and swapping every bit is a
//! CAS, and one that swaps nothing only returns the word, which is an 8-byte
//! READ.
//!
//! A verb refused by the local checks ([`super::remote`]) is not posted and
//! gets its error; the verbs around it go on, as on the other backends.
//!
//! # Limits of a doorbell
//!
//! A doorbell holds at most [`Limits::max_wrs`] requests (the send queue's
//! depth) and its READs, atomics and non-inline WRITEs use at most
//! [`Limits::staging`] bytes of the queue pair's registered staging buffer;
//! a longer batch takes several doorbells (and round trips), and a transfer
//! longer than the staging buffer is cut into pieces. Each piece lands at a
//! 16-aligned offset of the buffer.

use super::remote::{RemoteRegions, Target};
use crate::rdma::error::VerbError;
use crate::rdma::verb::Verb;

/// What the queue pair and device allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Work requests per doorbell (at most the send queue's depth).
    pub max_wrs: usize,
    /// Bytes of the registered staging buffer.
    pub staging: usize,
    /// Largest WRITE sent inline (no staging, no local key).
    pub max_inline: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_wrs: 64, staging: 256 << 10, max_inline: 64 }
    }
}

/// The operation of one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOp {
    /// RDMA READ of `len` bytes into the staging buffer, for bytes
    /// `data_at .. data_at + len` of the verb's result.
    Read { data_at: u32, len: u32 },
    /// RDMA WRITE of bytes `data_at .. data_at + len` of the verb's data.
    Write { data_at: u32, len: u32, inline: bool },
    /// 8-byte atomic compare-and-swap; the old value lands in staging.
    Cas { expect: u64, new: u64 },
    /// 8-byte atomic fetch-and-add; the old value lands in staging.
    Faa { add: u64 },
}

impl WrOp {
    /// Whether a later request may pass this one (a READ or an atomic).
    fn may_be_passed(self) -> bool {
        matches!(self, WrOp::Read { .. } | WrOp::Cas { .. } | WrOp::Faa { .. })
    }

    fn staging_bytes(self) -> usize {
        match self {
            WrOp::Read { len, .. } => len as usize,
            WrOp::Write { inline: true, .. } => 0,
            WrOp::Write { len, .. } => len as usize,
            WrOp::Cas { .. } | WrOp::Faa { .. } => 8,
        }
    }
}

/// One work request of a doorbell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// The verb of the batch it belongs to.
    pub verb: usize,
    pub op: WrOp,
    pub remote: Target,
    /// Offset of its local bytes in the staging buffer (unused when inline).
    pub staging_at: usize,
    /// Wait for every earlier READ and atomic of the doorbell first.
    pub fence: bool,
    /// Only the last request of a doorbell generates a completion.
    pub signaled: bool,
}

/// A masked verb the device has no instruction for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmulatedOp {
    MaskedCas { cmp: u64, cmp_mask: u64, swap: u64, swap_mask: u64 },
    MaskedFaa { add: u64, boundary_mask: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Doorbell(Vec<WorkRequest>),
    Emulate { verb: usize, remote: Target, op: EmulatedOp },
    Host { verb: usize },
}

/// A batch, planned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Verbs refused by the local checks (never posted).
    pub refused: Vec<(usize, VerbError)>,
}

impl Plan {
    /// Round trips the plan takes at least (a doorbell or a host call is
    /// one; an emulated verb one or more).
    pub fn min_round_trips(&self) -> usize {
        self.steps.len()
    }
}

/// How one native verb is carried: which op, and for transfers the pieces.
enum Native {
    One(WrOp),
    Transfer { read: bool, len: usize },
}

fn classify(verb: &Verb) -> Result<Native, Option<EmulatedOp>> {
    Ok(match *verb {
        Verb::Read { len, .. } => Native::Transfer { read: true, len: len as usize },
        Verb::Write { ref data, .. } => Native::Transfer { read: false, len: data.len() },
        Verb::Cas { expect, new, .. } => Native::One(WrOp::Cas { expect, new }),
        Verb::Faa { add, .. } => Native::One(WrOp::Faa { add }),
        Verb::MaskedFaa { add, boundary_mask: 0, .. } => Native::One(WrOp::Faa { add }),
        Verb::MaskedCas { swap_mask: 0, .. } => Native::One(WrOp::Read { data_at: 0, len: 8 }),
        Verb::MaskedCas { cmp, cmp_mask: u64::MAX, swap, swap_mask: u64::MAX, .. } => {
            Native::One(WrOp::Cas { expect: cmp, new: swap })
        }
        Verb::MaskedCas { cmp, cmp_mask, swap, swap_mask, .. } => {
            return Err(Some(EmulatedOp::MaskedCas { cmp, cmp_mask, swap, swap_mask }))
        }
        Verb::MaskedFaa { add, boundary_mask, .. } => {
            return Err(Some(EmulatedOp::MaskedFaa { add, boundary_mask }))
        }
        Verb::ExtCas { .. } | Verb::ExtFaa { .. } | Verb::Flush { .. } => return Err(None),
    })
}

struct Builder {
    limits: Limits,
    steps: Vec<Step>,
    open: Vec<WorkRequest>,
    staged: usize,
    passable_before: bool,
}

impl Builder {
    fn close(&mut self) {
        if let Some(last) = self.open.last_mut() {
            last.signaled = true;
            self.steps.push(Step::Doorbell(std::mem::take(&mut self.open)));
        }
        self.staged = 0;
        self.passable_before = false;
    }

    fn push(&mut self, verb: usize, op: WrOp, remote: Target) {
        let bytes = op.staging_bytes();
        let slot = bytes.next_multiple_of(16);
        if self.open.len() == self.limits.max_wrs || self.staged + slot > self.limits.staging {
            self.close();
        }
        self.open.push(WorkRequest {
            verb,
            op,
            remote,
            staging_at: self.staged,
            fence: self.passable_before,
            signaled: false,
        });
        self.staged += slot;
        self.passable_before |= op.may_be_passed();
    }
}

/// Plans `verbs` for a queue pair with `limits` on a host with `regions`.
pub fn plan(verbs: &[Verb], regions: &RemoteRegions, limits: Limits) -> Plan {
    assert!(limits.max_wrs >= 1 && limits.staging >= 16, "a doorbell must hold something");
    // Transfers are cut to pieces that fit the staging buffer.
    let piece_max = (limits.staging / 16 * 16).min(u32::MAX as usize);
    let mut b = Builder { limits, steps: Vec::new(), open: Vec::new(), staged: 0, passable_before: false };
    let mut refused = Vec::new();
    for (i, verb) in verbs.iter().enumerate() {
        let remote = match regions.check_verb(verb) {
            Ok(t) => t,
            Err(e) => {
                refused.push((i, e));
                continue;
            }
        };
        match classify(verb) {
            Ok(Native::One(op)) => b.push(i, op, remote),
            Ok(Native::Transfer { read, len }) => {
                // A zero-length transfer is still a verb (and a completion).
                let mut at = 0;
                loop {
                    let n = (len - at).min(piece_max);
                    let op = if read {
                        WrOp::Read { data_at: at as u32, len: n as u32 }
                    } else {
                        WrOp::Write { data_at: at as u32, len: n as u32, inline: n <= limits.max_inline }
                    };
                    b.push(i, op, remote.offset_by(at as u64));
                    at += n;
                    if at >= len {
                        break;
                    }
                }
            }
            Err(Some(op)) => {
                b.close();
                b.steps.push(Step::Emulate { verb: i, remote, op });
            }
            Err(None) => {
                b.close();
                b.steps.push(Step::Host { verb: i });
            }
        }
    }
    b.close();
    Plan { steps: b.steps, refused }
}

/// Tracks the completions of one doorbell: work requests carry their index
/// in the doorbell (plus `base`) as `wr_id`; only the last is signalled, but
/// a failed request reports itself (and the ones after it are flushed).
#[derive(Debug)]
pub struct DoorbellCompletion {
    base: u64,
    len: u64,
}

/// What one polled completion means for the doorbell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The signalled last request completed: every request did, in order.
    Done,
    /// Request `index` failed with `status`; those after it did not run.
    Failed { index: usize, status: u32 },
    /// A completion of another doorbell (stale, e.g. flushed after an
    /// earlier failure): ignore it.
    Foreign,
}

impl DoorbellCompletion {
    pub fn new(base: u64, len: usize) -> Self {
        assert!(len > 0);
        Self { base, len: len as u64 }
    }

    pub fn wr_id(&self, index: usize) -> u64 {
        self.base + index as u64
    }

    /// Accounts for one work completion (`status` 0 is success).
    pub fn on_completion(&self, wr_id: u64, status: u32) -> Progress {
        let Some(index) = wr_id.checked_sub(self.base).filter(|i| *i < self.len) else {
            return Progress::Foreign;
        };
        if status != 0 {
            Progress::Failed { index: index as usize, status }
        } else if index == self.len - 1 {
            Progress::Done
        } else {
            // An unsignalled request completes silently; a success report of
            // one can only be foreign.
            Progress::Foreign
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::ib::handshake::RegionGrant;
    use crate::rdma::{RegionId, RemoteAddr};

    const BASE: u64 = 0x1000_0000;

    fn regions() -> RemoteRegions {
        RemoteRegions::new([RegionGrant { id: RegionId(1), base: BASE, len: 1 << 24, rkey: 5 }])
    }

    fn at(off: u64) -> RemoteAddr {
        RemoteAddr::new(RegionId(1), off)
    }

    fn doorbells(p: &Plan) -> Vec<&Vec<WorkRequest>> {
        p.steps.iter().filter_map(|s| if let Step::Doorbell(d) = s { Some(d) } else { None }).collect()
    }

    #[test]
    fn native_verbs_are_one_doorbell_with_the_last_signalled() {
        let verbs = vec![
            Verb::Write { addr: at(0), data: vec![1; 16] },
            Verb::Write { addr: at(64), data: vec![2; 100] },
            Verb::Cas { addr: at(128), expect: 0, new: 1 },
            Verb::Faa { addr: at(136), add: 2 },
            Verb::Read { addr: at(0), len: 32 },
        ];
        let p = plan(&verbs, &regions(), Limits::default());
        assert!(p.refused.is_empty());
        assert_eq!(p.steps.len(), 1, "one doorbell, one round trip");
        let d = doorbells(&p)[0];
        assert_eq!(d.iter().map(|w| w.verb).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(d.iter().map(|w| w.signaled).collect::<Vec<_>>(), vec![false, false, false, false, true]);
        // Writes may be pipelined; whatever follows a READ or an atomic is fenced.
        assert_eq!(d.iter().map(|w| w.fence).collect::<Vec<_>>(), vec![false, false, false, true, true]);
        assert_eq!(d[0].op, WrOp::Write { data_at: 0, len: 16, inline: true });
        assert_eq!(d[1].op, WrOp::Write { data_at: 0, len: 100, inline: false });
        assert_eq!(d[2].remote, Target { addr: BASE + 128, rkey: 5 });
        // Staging slots are distinct and 16-aligned.
        let slots: Vec<_> = d.iter().filter(|w| w.op.staging_bytes() > 0).map(|w| w.staging_at).collect();
        assert_eq!(slots, vec![0, 112, 128, 144]);
    }

    #[test]
    fn masked_verbs_split_the_batch_in_order() {
        let verbs = vec![
            Verb::Write { addr: at(0), data: vec![1; 8] },
            Verb::MaskedCas { addr: at(8), cmp: 0, cmp_mask: 1, swap: 1, swap_mask: 1 },
            Verb::MaskedFaa { addr: at(16), add: 1, boundary_mask: 1 << 31 },
            Verb::ExtCas { addr: at(32), cmp: 0, cmp_mask: 0, swap: 1, swap_mask: 1 },
            Verb::Read { addr: at(0), len: 8 },
        ];
        let p = plan(&verbs, &regions(), Limits::default());
        let kinds: Vec<String> = p
            .steps
            .iter()
            .map(|s| match s {
                Step::Doorbell(d) => format!("doorbell{:?}", d.iter().map(|w| w.verb).collect::<Vec<_>>()),
                Step::Emulate { verb, .. } => format!("emulate{verb}"),
                Step::Host { verb } => format!("host{verb}"),
            })
            .collect();
        assert_eq!(kinds, ["doorbell[0]", "emulate1", "emulate2", "host3", "doorbell[4]"]);
    }

    #[test]
    fn native_forms_of_masked_verbs() {
        let verbs = vec![
            Verb::MaskedFaa { addr: at(0), add: 3, boundary_mask: 0 },
            Verb::MaskedCas { addr: at(8), cmp: 4, cmp_mask: u64::MAX, swap: 5, swap_mask: u64::MAX },
            Verb::MaskedCas { addr: at(16), cmp: 9, cmp_mask: 0xFF, swap: 0, swap_mask: 0 },
        ];
        let p = plan(&verbs, &regions(), Limits::default());
        let d = doorbells(&p);
        assert_eq!(p.steps.len(), 1);
        let ops: Vec<_> = d[0].iter().map(|w| w.op).collect();
        assert_eq!(
            ops,
            vec![WrOp::Faa { add: 3 }, WrOp::Cas { expect: 4, new: 5 }, WrOp::Read { data_at: 0, len: 8 }]
        );
    }

    #[test]
    fn refused_verbs_are_skipped_and_the_rest_still_run() {
        let verbs = vec![
            Verb::Faa { addr: at(0), add: 1 },
            Verb::Faa { addr: at(3), add: 1 },
            Verb::Read { addr: RemoteAddr::new(RegionId(2), 0), len: 8 },
            Verb::Faa { addr: at(8), add: 1 },
        ];
        let p = plan(&verbs, &regions(), Limits::default());
        assert_eq!(p.refused.len(), 2);
        assert!(matches!(p.refused[0], (1, VerbError::Misaligned { .. })));
        assert!(matches!(p.refused[1], (2, VerbError::UnknownRegion(RegionId(2)))));
        assert_eq!(doorbells(&p)[0].iter().map(|w| w.verb).collect::<Vec<_>>(), vec![0, 3]);
    }

    #[test]
    fn limits_cut_doorbells_and_transfers() {
        let limits = Limits { max_wrs: 3, staging: 4096, max_inline: 0 };
        let verbs: Vec<Verb> = (0..7).map(|i| Verb::Faa { addr: at(8 * i), add: 1 }).collect();
        let p = plan(&verbs, &regions(), limits);
        let sizes: Vec<_> = doorbells(&p).iter().map(|d| d.len()).collect();
        assert_eq!(sizes, vec![3, 3, 1]);
        for d in doorbells(&p) {
            assert!(d.last().unwrap().signaled && d.iter().filter(|w| w.signaled).count() == 1);
            assert!(!d[0].fence, "a new doorbell starts after the previous one completed");
        }
        // A 10000-byte read with a 4096-byte staging buffer: three pieces, three doorbells.
        let p = plan(&[Verb::Read { addr: at(100), len: 10_000 }], &regions(), limits);
        let pieces: Vec<_> =
            doorbells(&p).iter().flat_map(|d| d.iter()).map(|w| (w.op, w.remote.addr)).collect();
        assert_eq!(
            pieces,
            vec![
                (WrOp::Read { data_at: 0, len: 4096 }, BASE + 100),
                (WrOp::Read { data_at: 4096, len: 4096 }, BASE + 4196),
                (WrOp::Read { data_at: 8192, len: 1808 }, BASE + 8292),
            ]
        );
        let p = plan(&[Verb::Write { addr: at(0), data: vec![] }], &regions(), limits);
        assert_eq!(doorbells(&p)[0][0].op, WrOp::Write { data_at: 0, len: 0, inline: true });
    }

    #[test]
    fn completions_of_a_doorbell() {
        let d = DoorbellCompletion::new(1000, 4);
        assert_eq!(d.wr_id(3), 1003);
        assert_eq!(d.on_completion(1003, 0), Progress::Done);
        assert_eq!(d.on_completion(1001, 12), Progress::Failed { index: 1, status: 12 });
        assert_eq!(d.on_completion(999, 0), Progress::Foreign);
        assert_eq!(d.on_completion(1004, 5), Progress::Foreign);
        assert_eq!(d.on_completion(1001, 0), Progress::Foreign);
    }
}
