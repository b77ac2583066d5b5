//! Fencing a client whose lease expired (DESIGN.md §6): the cluster manager
//! removes its POSIX lock records and its waits, which wakes the waiters it
//! blocked, and clears the lock tokens it held (the records it kept under
//! them go with it), before its opens are dropped.
//!
//! The meta-server does this as a lock client of its own memory — under the
//! same range locks and with the same verbs as any client — so the table
//! rules hold. If the dead client also died holding range-lock nodes,
//! Citron's lazy lease recovery (§3.10) lets the cleanup through after
//! T_lease. The fence itself begins at the reclamation point
//! ([`crate::reclaim::Reclamation::fence`]), and the files visited are pinned
//! (an open of [`META_CLIENT`]) so that their lock memory, which follows use
//! ([`crate::lock_areas`]), stays while the cleanup works on it.

use citron_lock::rdma::Endpoint;
use citronfs_core::locks::table::{self, TableGrowth};
use citronfs_core::locks::token;
use citronfs_core::locks::{FileLocks, LockTiming, WaitsFor};
use citronfs_core::types::{ClientId, Ino};
use citronfs_core::FsError;

use crate::namespace::LockTableRef;

/// The client id the meta-server claims lock slots as (clients start at 1).
pub const META_CLIENT: ClientId = ClientId(0);

/// Releases every lock record and wait of `dead` in `tables` and withdraws
/// its waits-for entries. Returns how many records went.
pub fn release_client<G: TableGrowth>(
    ep: &Endpoint,
    timing: &LockTiming,
    tables: &[LockTableRef],
    waits_for: WaitsFor,
    dead: ClientId,
    growth: &dyn Fn(Ino) -> G,
) -> Result<usize, FsError> {
    let mut released = 0;
    for t in tables {
        let g = growth(t.ino);
        let locks = FileLocks {
            ep,
            client: META_CLIENT,
            ino: t.ino,
            area: t.area,
            table: t.first_block,
            timing,
            waits_for,
            growth: &g,
        };
        released += locks.release_matching(|r| r.owner.client == dead)?;
        table::free_claimed_by(ep, t.first_block, dead)?;
        // The records it kept under a lock token go with it; whoever waits
        // for the token sees it free.
        if token::clear_token_of(ep, t.first_block, dead)? {
            log::info!("inode {}: the lock token of fenced client {} cleared", t.ino.0, dead.0);
        }
    }
    waits_for.withdraw_client(ep, dead)?;
    Ok(released)
}
