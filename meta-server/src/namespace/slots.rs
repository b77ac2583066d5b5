//! Attribute slots in the meta-server's region: one per regular file (its
//! size, mtime and mode words, which clients update one-sidedly), so the
//! region's size is the most regular files there can be. Some are kept for
//! the inodes lent to clients ([`super::lending`]): a create a mount has
//! already answered must not find the region full when it arrives.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::rdma::{RegionMemory, RemoteAddr};
use citronfs_core::proto::AttrSlot;
use citronfs_core::FsError;

/// How often "no slot left" is logged at most.
const WARNING_EVERY: Duration = Duration::from_secs(10);

pub(super) struct Slots {
    memory: Arc<RegionMemory>,
    /// Offset of the first slot never handed out.
    next: u64,
    /// Offsets of slots handed out and freed since.
    free: Vec<u64>,
    /// Free slots kept for lent inodes: only [`Slots::allocate_kept`]
    /// takes them.
    kept: u64,
    /// When the meta-server last said it is out of slots.
    last_warning: Option<Instant>,
}

impl Slots {
    pub(super) fn new(memory: Arc<RegionMemory>) -> Self {
        Self { memory, next: 0, free: Vec::new(), kept: 0, last_warning: None }
    }

    pub(super) fn capacity(&self) -> u64 {
        self.memory.len() / AttrSlot::BYTES
    }

    pub(super) fn in_use(&self) -> u64 {
        self.next / AttrSlot::BYTES - self.free.len() as u64
    }

    /// Slots neither in use nor kept.
    fn available(&self) -> u64 {
        self.capacity() - self.in_use() - self.kept
    }

    /// A zeroed slot for a new regular file; [`FsError::NoSpace`] when
    /// every slot is in use or kept.
    pub(super) fn allocate(&mut self) -> Result<AttrSlot, FsError> {
        if self.available() == 0 {
            if self.last_warning.is_none_or(|t| t.elapsed() >= WARNING_EVERY) {
                self.last_warning = Some(Instant::now());
                log::warn!(
                    "no attribute slot left: {} regular files exist or are lent, the most the meta-server \
                     was started for; creating files answers ENOSPC. Raise --max-files",
                    self.capacity()
                );
            }
            return Err(FsError::NoSpace);
        }
        Ok(self.take())
    }

    /// Keeps up to `n` slots for lent inodes; how many it kept.
    pub(super) fn keep(&mut self, n: u64) -> u64 {
        let n = n.min(self.available());
        self.kept += n;
        n
    }

    /// Gives back `n` kept slots (lent inodes that will not be created).
    pub(super) fn unkeep(&mut self, n: u64) {
        debug_assert!(n <= self.kept);
        self.kept -= n.min(self.kept);
    }

    /// A slot kept for a lent inode ([`Slots::keep`]): there is one.
    pub(super) fn allocate_kept(&mut self) -> AttrSlot {
        debug_assert!(self.kept > 0);
        self.kept = self.kept.saturating_sub(1);
        self.take()
    }

    /// After a restart: the slots of `used` belong to existing files (their
    /// words are kept), every other one is free; none is kept (loans end
    /// with the meta-server process).
    pub(super) fn restore(&mut self, used: Vec<AttrSlot>) {
        let used: std::collections::HashSet<u64> = used.iter().map(|s| s.0.offset).collect();
        self.next = used.iter().max().map_or(0, |&o| o + AttrSlot::BYTES);
        self.free = (0..self.next / AttrSlot::BYTES)
            .map(|i| i * AttrSlot::BYTES)
            .filter(|o| !used.contains(o))
            .rev()
            .collect();
        self.kept = 0;
    }

    /// Frees the slot of a freed file.
    pub(super) fn free(&mut self, slot: AttrSlot) {
        self.free.push(slot.0.offset);
    }

    /// Hands out a free slot, zeroed. Callers checked that one is free:
    /// `in_use + kept < capacity` (or a kept one is taken), and slots not
    /// in use are in `free` or past `next`.
    fn take(&mut self) -> AttrSlot {
        let off = self.free.pop().unwrap_or_else(|| {
            debug_assert!(self.next + AttrSlot::BYTES <= self.memory.len(), "no free slot");
            self.next += AttrSlot::BYTES;
            self.next - AttrSlot::BYTES
        });
        let slot = AttrSlot(RemoteAddr::new(self.memory.id(), off));
        for w in 0..AttrSlot::BYTES / 8 {
            self.word(slot.0 + 8 * w).store(0, SeqCst);
        }
        slot
    }

    pub(super) fn word(&self, addr: RemoteAddr) -> &AtomicU64 {
        self.memory.word(addr).expect("attribute slots are inside the slot region by construction")
    }
}

#[cfg(test)]
mod tests {
    use citron_lock::rdma::RegionId;

    use super::*;

    fn slots(n: u64) -> Slots {
        Slots::new(Arc::new(RegionMemory::anonymous(RegionId(1), n * AttrSlot::BYTES).unwrap()))
    }

    #[test]
    fn restored_slots_keep_their_words_and_free_the_rest() {
        let mut s = slots(8);
        let used: Vec<AttrSlot> = (0..4).map(|_| s.allocate().unwrap()).collect();
        s.word(used[3].size()).store(4096, SeqCst);
        let mut again = Slots::new(s.memory.clone());
        again.restore(vec![used[1], used[3]]);
        assert_eq!(again.in_use(), 2);
        assert_eq!(again.word(used[3].size()).load(SeqCst), 4096, "a restored slot keeps its size");
        let taken: Vec<u64> = (0..6).map(|_| again.allocate().unwrap().0.offset).collect();
        assert!(!taken.contains(&used[1].0.offset) && !taken.contains(&used[3].0.offset));
        assert!(again.allocate().is_err(), "8 slots: 2 restored, 6 handed out");
    }

    #[test]
    fn kept_slots_go_only_to_lent_inodes_until_given_back() {
        let mut s = slots(4);
        let first = s.allocate().unwrap();
        assert_eq!(s.keep(10), 3, "kept more than were free");
        assert_eq!(s.keep(1), 0);
        assert_eq!(s.allocate(), Err(FsError::NoSpace), "an ordinary create took a kept slot");
        let kept = s.allocate_kept();
        assert_ne!(kept, first);
        s.unkeep(2);
        let again = s.allocate().unwrap();
        s.free(first);
        s.free(again);
        assert_eq!(s.in_use(), 1);
        assert_eq!(s.keep(10), 3);
        for _ in 0..3 {
            s.allocate_kept();
        }
        assert_eq!(s.in_use(), 4);
        assert_eq!(s.allocate(), Err(FsError::NoSpace));
    }
}
