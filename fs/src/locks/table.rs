//! Reading and writing a file's lock-record table with one-sided verbs
//! (formats in [`super::record`]).
//!
//! * Reading the table is one read per block (usually one block).
//! * A slot is claimed with a CAS on its header, from `FREE` at the
//!   generation the reader saw to `CLAIMED` at the next one, so two writers
//!   never claim one slot and a stale view cannot claim a reused slot.
//! * A record is written as words 1–7 then the header, in one ordered batch:
//!   readers that see the header see a complete record or a checksum
//!   mismatch, never a half-written record taken for whole.
//! * A slot is freed with one write of its header (generation kept, so the
//!   next claim moves it on).
//! * The table grows by blocks the meta-server allocates and links
//!   ([`TableGrowth`]); clients never move records.

use citron_lock::rdma::{Endpoint, RemoteAddr, Verb};

use super::plan::{Located, SlotIndex};
use super::record::{
    self, block_capacity, claimed_header, decode, encode, free_header, unpack_addr, Generation, LockRecord,
    SlotView, BLOCK_HEADER_BYTES, SLOT_BYTES, SLOT_WORDS,
};
use crate::error::FsError;
use crate::types::ClientId;

/// The meta-server's side of a table: allocate its first block or append one
/// (and of the waits-for chain, which a request may grow as it waits).
pub trait TableGrowth: super::waits_for::WaitsForGrowth {
    /// Appends a zeroed block after `last` (or the first block when `None`)
    /// and returns the chain's first block. Idempotent if someone else grew
    /// it meanwhile.
    fn grow(&self, last: Option<RemoteAddr>) -> Result<RemoteAddr, FsError>;
}

/// One block as read.
#[derive(Clone, Debug)]
struct Block {
    addr: RemoteAddr,
    capacity: u32,
}

/// A table as one reader saw it.
#[derive(Clone, Debug)]
pub struct Snapshot {
    blocks: Vec<Block>,
    /// Every slot in chain order.
    pub slots: Vec<SlotView>,
}

impl Snapshot {
    /// Every valid record (held or waiting) with its slot.
    pub fn records(&self) -> Vec<Located> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, v)| match v {
                SlotView::Record(record, gen) => {
                    Some(Located { slot: SlotIndex(i as u32), gen: *gen, record: *record })
                }
                _ => None,
            })
            .collect()
    }

    /// Slots that were free when read, with their generation.
    pub fn free_slots(&self) -> impl Iterator<Item = (SlotIndex, Generation)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, v)| match v {
            SlotView::Free(g) => Some((SlotIndex(i as u32), *g)),
            _ => None,
        })
    }

    /// Whether some slot was torn or mid-write when read.
    pub fn has_busy(&self) -> bool {
        self.slots.iter().any(|v| matches!(v, SlotView::Busy))
    }

    pub fn last_block(&self) -> Option<RemoteAddr> {
        self.blocks.last().map(|b| b.addr)
    }

    /// The address of a slot's header word.
    pub fn slot_addr(&self, slot: SlotIndex) -> Result<RemoteAddr, FsError> {
        let mut i = slot.0;
        for b in &self.blocks {
            if i < b.capacity {
                return Ok(b.addr + BLOCK_HEADER_BYTES + u64::from(i) * SLOT_BYTES);
            }
            i -= b.capacity;
        }
        Err(FsError::Io(format!("lock-record slot {} is beyond the table", slot.0)))
    }
}

/// Most blocks a table may chain: a bound against a corrupt loop.
const MAX_BLOCKS: usize = 1024;

/// Reads the whole table whose first block is at `first`.
pub fn read(ep: &Endpoint, first: RemoteAddr) -> Result<Snapshot, FsError> {
    read_from(ep, first, None)
}

/// The read of a table's first block at `first`, for a batch that carries
/// it (a range lock's acquisition: [`super::guard::RangeHold::acquire_with_reads`]).
pub fn first_block_read(first: RemoteAddr) -> Verb {
    Verb::Read { addr: first, len: record::BLOCK_BYTES as u32 }
}

/// The bytes of a table's first block at `first` (with its token word,
/// [`super::token`]).
pub fn read_first_block(ep: &Endpoint, first: RemoteAddr) -> Result<Vec<u8>, FsError> {
    let mut buf = vec![0u8; record::BLOCK_BYTES as usize];
    ep.read(first, &mut buf)?;
    Ok(buf)
}

/// [`read`], where the first block may have been read already (by
/// [`first_block_read`], under the same lock): `first_block` is its bytes.
pub fn read_from(
    ep: &Endpoint,
    first: RemoteAddr,
    first_block: Option<Vec<u8>>,
) -> Result<Snapshot, FsError> {
    let mut blocks = Vec::new();
    let mut slots = Vec::new();
    let mut next = Some(first);
    let mut prefetched = first_block.filter(|b| b.len() == record::BLOCK_BYTES as usize);
    // The first read assumes a block of the default size; a bigger one is
    // read again whole (blocks are all the default size today).
    while let Some(addr) = next {
        if blocks.len() >= MAX_BLOCKS {
            return Err(FsError::Io("lock-record table chain is too long (corrupt?)".into()));
        }
        let buf = match prefetched.take() {
            Some(buf) => buf,
            None => {
                let mut buf = vec![0u8; record::BLOCK_BYTES as usize];
                ep.read(addr, &mut buf)?;
                buf
            }
        };
        let word = |i: usize| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let capacity =
            block_capacity(word(0)).ok_or_else(|| FsError::Io(format!("no lock-record block at {addr}")))?;
        if u64::from(capacity) * SLOT_BYTES + BLOCK_HEADER_BYTES != record::BLOCK_BYTES {
            return Err(FsError::Io(format!("lock-record block at {addr} has {capacity} slots")));
        }
        next = unpack_addr(word(1));
        for s in 0..capacity as usize {
            let base = (BLOCK_HEADER_BYTES as usize) / 8 + s * SLOT_WORDS;
            let mut w = [0u64; SLOT_WORDS];
            for (j, x) in w.iter_mut().enumerate() {
                *x = word(base + j);
            }
            slots.push(decode(&w));
        }
        blocks.push(Block { addr, capacity });
    }
    Ok(Snapshot { blocks, slots })
}

/// Claims a free slot of `snapshot` (CAS), trying each free slot once.
/// `None` if every free slot was taken meanwhile (or there were none).
pub fn claim(
    ep: &Endpoint,
    snapshot: &Snapshot,
    client: ClientId,
    skip: &[SlotIndex],
) -> Result<Option<(SlotIndex, Generation)>, FsError> {
    for (slot, gen) in snapshot.free_slots() {
        if skip.contains(&slot) {
            continue;
        }
        let addr = snapshot.slot_addr(slot)?;
        let next = gen.next();
        let old = ep.cas(addr, free_header(gen), claimed_header(next, client))?;
        if old == free_header(gen) {
            return Ok(Some((slot, next)));
        }
    }
    Ok(None)
}

/// Verbs that write `record` into `slot` at generation `gen`: words 1–7,
/// then the header (ordered, so the header lands last).
pub fn write_verbs(
    snapshot: &Snapshot,
    slot: SlotIndex,
    gen: Generation,
    record: &LockRecord,
    out: &mut Vec<Verb>,
) -> Result<(), FsError> {
    let addr = snapshot.slot_addr(slot)?;
    let words = encode(record, gen);
    let body: Vec<u8> = words[1..].iter().flat_map(|w| w.to_le_bytes()).collect();
    out.push(Verb::Write { addr: addr + 8, data: body });
    out.push(Verb::Write { addr, data: words[0].to_le_bytes().to_vec() });
    Ok(())
}

/// The verb that frees `slot` (read at generation `gen`).
pub fn free_verb(snapshot: &Snapshot, slot: SlotIndex, gen: Generation) -> Result<Verb, FsError> {
    Ok(Verb::Write { addr: snapshot.slot_addr(slot)?, data: free_header(gen).to_le_bytes().to_vec() })
}

/// Runs `verbs` as one batch and fails on the first refused verb.
pub fn execute(ep: &Endpoint, verbs: &[Verb]) -> Result<(), FsError> {
    for r in ep.execute(verbs)? {
        r.map_err(|e| FsError::Io(format!("lock-record table: {e}")))?;
    }
    Ok(())
}

/// Frees the slots `client` claimed and never finished writing (it died in
/// between). Nobody else touches a claimed slot, so a CAS from the exact
/// claimed header suffices. Returns how many.
pub fn free_claimed_by(ep: &Endpoint, first: RemoteAddr, client: ClientId) -> Result<usize, FsError> {
    let snapshot = read(ep, first)?;
    let mut freed = 0;
    for (i, view) in snapshot.slots.iter().enumerate() {
        if !matches!(view, SlotView::Busy) {
            continue;
        }
        let addr = snapshot.slot_addr(SlotIndex(i as u32))?;
        let header = ep.read_u64(addr)?;
        if record::claimed_by(header, client) {
            let gen = record::header_generation(header);
            if ep.cas(addr, header, free_header(gen))? == header {
                freed += 1;
            }
        }
    }
    Ok(freed)
}
