//! The waits-for entries of blocked POSIX owners (deadlock detection), below the
//! lock protocol: an entry that was withdrawn is never followed again, even
//! while a publisher of the same client is half-way through reusing its
//! slot; and the deadlock check follows only edges that exist together.

use citron_lock::rdma::{Endpoint, Node, RemoteAddr};
use citronfs_core::locks::record::pack_addr;
use citronfs_core::locks::record::{
    block_header, encode, Generation, LockRecord, RecordState, BLOCK_BYTES, BLOCK_HEADER_BYTES,
    SLOTS_PER_BLOCK, SLOT_BYTES,
};
use citronfs_core::locks::waits_for::{Checker, Published, Waiting, WaitsForGrowth};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, LockOwner, OwnerKey, WaitsFor};
use citronfs_core::types::ClientId;
use citronfs_tests::{Backend, TestFabric, TEST_REGION};

const CLIENT: ClientId = ClientId(7);

fn owner(n: u64) -> OwnerKey {
    OwnerKey { client: CLIENT, owner: LockOwner(n) }
}

/// A one-block record table at `at` in which `holder` holds `range` for
/// writing (in slot 0).
fn table_with(ep: &Endpoint, at: RemoteAddr, holder: OwnerKey, range: ByteRange) {
    ep.write(at, &vec![0u8; BLOCK_BYTES as usize]).unwrap();
    write_record(ep, at, 0, RecordState::Held, holder, range);
    ep.write_u64(at, block_header(SLOTS_PER_BLOCK)).unwrap();
}

/// A POSIX write record of `owner` over `range` in `slot` of the
/// one-block table at `at`.
fn write_record(
    ep: &Endpoint,
    at: RemoteAddr,
    slot: u64,
    state: RecordState,
    owner: OwnerKey,
    range: ByteRange,
) {
    let record = LockRecord {
        state,
        mode: LockMode::Write,
        flavor: LockFlavor::Posix,
        owner,
        range,
        pid: 1,
        fh: 1,
        mailbox: None,
        listed: Default::default(),
    };
    let words = encode(&record, Generation(1));
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    ep.write(at + BLOCK_HEADER_BYTES + slot * SLOT_BYTES, &bytes).unwrap();
}

/// Blocks of the waits-for chain from a bump allocator in the test region
/// (the meta-server's part, as `GrowWaitsFor` does it: idempotent, the
/// block zeroed before the link that makes it reachable).
struct Bump<'a> {
    ep: &'a Endpoint,
    waits: WaitsFor,
    next: std::cell::Cell<u64>,
    grown: std::cell::Cell<usize>,
}

impl<'a> Bump<'a> {
    fn new(ep: &'a Endpoint, waits: WaitsFor) -> Self {
        Self { ep, waits, next: std::cell::Cell::new(64 << 10), grown: std::cell::Cell::new(0) }
    }
}

impl WaitsForGrowth for Bump<'_> {
    fn grow_waits_for(&self, last: RemoteAddr) -> Result<RemoteAddr, citronfs_core::FsError> {
        let link = self.waits.link(last);
        if let Some(next) = citronfs_core::locks::record::unpack_addr(self.ep.read_u64(link)?) {
            return Ok(next);
        }
        let block = RemoteAddr::new(TEST_REGION, self.next.get());
        let bytes = WaitsFor::bytes(self.waits.capacity);
        self.next.set(self.next.get() + bytes);
        self.ep.write(block, &vec![0u8; bytes as usize])?;
        self.ep.write_u64(link, pack_addr(block).unwrap())?;
        self.grown.set(self.grown.get() + 1);
        Ok(block)
    }
}

fn setup() -> (TestFabric, Endpoint, WaitsFor, RemoteAddr) {
    let fabric = TestFabric::new(Backend::Shm, 1 << 20);
    let node = Node::join(&fabric.addr).unwrap();
    let ep = node.endpoint().unwrap();
    let waits = WaitsFor::new(RemoteAddr::new(TEST_REGION, 0), 4);
    let table = RemoteAddr::new(TEST_REGION, 512 << 10);
    (fabric, ep, waits, table)
}

/// Owner A waited for a range that M holds, then stopped waiting (its
/// entry withdrawn). M now waits for A. Another owner of A's client
/// starts publishing into A's old slot and stalls between its claim and
/// its body: M's check must not see A's old wait (there is no cycle).
#[test]
fn a_withdrawn_entry_is_not_followed_while_its_slot_is_reused() {
    let (_fabric, ep, waits, table) = setup();
    let grow = Bump::new(&ep, waits);
    let (a, m, other) = (owner(1), owner(2), owner(3));
    let range = ByteRange::new(0, 9).unwrap();
    table_with(&ep, table, m, range);
    let mine = waits.publish(&ep, &Waiting { owner: m, table, range, mode: LockMode::Write }, &grow).unwrap();
    let a_waited =
        waits.publish(&ep, &Waiting { owner: a, table, range, mode: LockMode::Write }, &grow).unwrap();
    waits.withdraw(&ep, a_waited).unwrap();
    let stalled =
        Waiting { owner: other, table, range: ByteRange::new(100, 109).unwrap(), mode: LockMode::Read };
    let mut seen_cycle = None;
    let p = waits
        .publish_with(&ep, &stalled, &grow, || {
            seen_cycle = Some(waits.closes_cycle(&ep, m, &[a], Checker::Requesting).unwrap());
        })
        .unwrap();
    assert_eq!(seen_cycle, Some(false), "M followed A's withdrawn wait: a spurious EDEADLK");
    waits.withdraw(&ep, p).unwrap();
    waits.withdraw(&ep, mine).unwrap();
    assert_eq!(waits.list(&ep).unwrap(), vec![]);
}

/// Owner A (1) holds what owner M (2) asks for, and both have published
/// that they wait for [`range`] of `table`, which M holds.
fn a_and_m_wait_for_each_other(
    ep: &Endpoint,
    waits: WaitsFor,
    table: RemoteAddr,
    grow: &Bump,
) -> [Published; 2] {
    table_with(ep, table, owner(2), range());
    [owner(1), owner(2)].map(|owner| {
        waits.publish(ep, &Waiting { owner, table, range: range(), mode: LockMode::Write }, grow).unwrap()
    })
}

/// The bytes the two owners of [`a_and_m_wait_for_each_other`] wait for.
fn range() -> ByteRange {
    ByteRange::new(0, 9).unwrap()
}

/// A real cycle is still found: A waits for what M holds, M for what A
/// holds.
#[test]
fn a_real_cycle_is_found() {
    let (_fabric, ep, waits, table) = setup();
    let grow = Bump::new(&ep, waits);
    let (a, m) = (owner(1), owner(2));
    let [pa, pm] = a_and_m_wait_for_each_other(&ep, waits, table, &grow);
    assert!(waits.closes_cycle(&ep, m, &[a], Checker::Requesting).unwrap());
    waits.withdraw(&ep, pa).unwrap();
    assert!(!waits.closes_cycle(&ep, m, &[a], Checker::Requesting).unwrap(), "A's wait is gone");
    waits.withdraw(&ep, pm).unwrap();
}

/// An owner already waiting follows only registered waiters: A has
/// published its entry but is still in its own check (no waiting record
/// yet), so A's wait closes a cycle for a requester M, not for an M that
/// already waits. Once A's waiting record is in the table, it does for both.
#[test]
fn a_requester_still_in_its_check_closes_no_cycle_for_a_waiter() {
    let (_fabric, ep, waits, table) = setup();
    let grow = Bump::new(&ep, waits);
    let (a, m) = (owner(1), owner(2));
    let [pa, pm] = a_and_m_wait_for_each_other(&ep, waits, table, &grow);
    assert!(waits.closes_cycle(&ep, m, &[a], Checker::Requesting).unwrap());
    assert!(!waits.closes_cycle(&ep, m, &[a], Checker::Waiting).unwrap(), "A is still in its check");
    write_record(&ep, table, 1, RecordState::Waiting, a, range());
    assert!(waits.closes_cycle(&ep, m, &[a], Checker::Waiting).unwrap(), "A waits now");
    waits.withdraw(&ep, pa).unwrap();
    waits.withdraw(&ep, pm).unwrap();
}

/// The table has no fixed cap: with blocks of 4 entries (3 waits and the
/// link), 40 owners wait at once through a chain of blocks, every one is
/// listed, a cycle between the last two is found, and the cleanup of their
/// client withdraws them all. (Before the chain, the 4th publish failed
/// with ENOLCK.)
#[test]
fn the_table_grows_by_blocks_past_a_full_one() {
    let (_fabric, ep, waits, table) = setup();
    let grow = Bump::new(&ep, waits);
    const OWNERS: u64 = 40;
    let range = ByteRange::new(0, 9).unwrap();
    let (x, y) = (owner(OWNERS - 1), owner(OWNERS));
    table_with(&ep, table, y, range);
    let mut published = Vec::new();
    for n in 1..=OWNERS {
        let w = Waiting { owner: owner(n), table, range, mode: LockMode::Write };
        published.push(waits.publish(&ep, &w, &grow).unwrap());
    }
    let listed = waits.list(&ep).unwrap();
    assert_eq!(listed.len(), OWNERS as usize, "every wait is listed");
    assert!(waits.blocks(&ep).unwrap() >= (OWNERS as usize).div_ceil(3));
    // y (in the last block) waits for what x holds; x waits for what y
    // holds (the table): a cycle far past the first block.
    let other_table = RemoteAddr::new(TEST_REGION, 768 << 10);
    table_with(&ep, other_table, x, range);
    waits.withdraw(&ep, published.pop().unwrap()).unwrap();
    let py = waits
        .publish(&ep, &Waiting { owner: y, table: other_table, range, mode: LockMode::Write }, &grow)
        .unwrap();
    assert!(
        waits.closes_cycle(&ep, x, &[y], Checker::Requesting).unwrap(),
        "a cycle past the first block is found"
    );
    assert!(
        !waits.closes_cycle(&ep, owner(1), &[owner(2)], Checker::Requesting).unwrap(),
        "no spurious cycle"
    );
    waits.withdraw(&ep, py).unwrap();
    assert_eq!(waits.withdraw_client(&ep, CLIENT).unwrap(), OWNERS as usize - 1);
    assert_eq!(waits.list(&ep).unwrap(), vec![]);
    let grown = grow.grown.get();
    // Freed entries are reused before the chain grows again.
    for n in 1..=OWNERS {
        let w = Waiting { owner: owner(n), table, range, mode: LockMode::Read };
        waits.publish(&ep, &w, &grow).unwrap();
    }
    assert_eq!(grow.grown.get(), grown, "the chain grew though it had room");
}
