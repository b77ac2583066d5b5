//! The waits-for entries of blocked POSIX owners (issue #12 f), below the
//! lock protocol: an entry that was withdrawn is never followed again, even
//! while a publisher of the same client is half-way through reusing its
//! slot; and the deadlock check follows only edges that exist together.

use citron_lock::rdma::{Endpoint, Node, RemoteAddr};
use citronfs_core::locks::record::{block_header, encode, Generation, LockRecord, RecordState, BLOCK_BYTES};
use citronfs_core::locks::waits_for::Waiting;
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
    let record = LockRecord {
        state: RecordState::Held,
        mode: LockMode::Write,
        flavor: LockFlavor::Posix,
        owner: holder,
        range,
        pid: 1,
        fh: 1,
        mailbox: None,
        listed: Default::default(),
    };
    let words = encode(&record, Generation(1));
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    ep.write(at + 64, &bytes).unwrap();
    ep.write_u64(at, block_header(31)).unwrap();
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
    let (a, m, other) = (owner(1), owner(2), owner(3));
    let range = ByteRange::new(0, 9).unwrap();
    table_with(&ep, table, m, range);
    let mine = waits.publish(&ep, &Waiting { owner: m, table, range, mode: LockMode::Write }).unwrap();
    let a_waited = waits.publish(&ep, &Waiting { owner: a, table, range, mode: LockMode::Write }).unwrap();
    waits.withdraw(&ep, a_waited).unwrap();
    let stalled =
        Waiting { owner: other, table, range: ByteRange::new(100, 109).unwrap(), mode: LockMode::Read };
    let mut seen_cycle = None;
    let p = waits
        .publish_with(&ep, &stalled, || {
            seen_cycle = Some(waits.closes_cycle(&ep, m, &[a]).unwrap());
        })
        .unwrap();
    assert_eq!(seen_cycle, Some(false), "M followed A's withdrawn wait: a spurious EDEADLK");
    waits.withdraw(&ep, p).unwrap();
    waits.withdraw(&ep, mine).unwrap();
    assert_eq!(waits.list(&ep).unwrap(), vec![]);
}

/// A real cycle is still found: A waits for what M holds, M for what A
/// holds.
#[test]
fn a_real_cycle_is_found() {
    let (_fabric, ep, waits, table) = setup();
    let (a, m) = (owner(1), owner(2));
    let range = ByteRange::new(0, 9).unwrap();
    table_with(&ep, table, m, range);
    let pa = waits.publish(&ep, &Waiting { owner: a, table, range, mode: LockMode::Write }).unwrap();
    let pm = waits.publish(&ep, &Waiting { owner: m, table, range, mode: LockMode::Write }).unwrap();
    assert!(waits.closes_cycle(&ep, m, &[a]).unwrap());
    waits.withdraw(&ep, pa).unwrap();
    assert!(!waits.closes_cycle(&ep, m, &[a]).unwrap(), "A's wait is gone");
    waits.withdraw(&ep, pm).unwrap();
}
