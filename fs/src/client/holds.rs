//! Which owners may hold byte-range locks on which files here, so that a
//! close by anyone else costs no verbs (DESIGN.md §7), and so that a close
//! never forgets an owner whose lock is still being granted (no orphaned
//! locks across a fence).
//!
//! A key is added before an acquisition of the owner starts (a superset of
//! the owners that hold locks), and taken out by the close that releases
//! them. A close that comes while one of the owner's acquisitions is in
//! flight (a thread of the process waits in `F_SETLKW` while another closes
//! a descriptor of the file) must not take the key out: the grant may land
//! after the close has read the table, and then no later close would
//! release it. So each key counts its acquisitions in flight ([`Acquiring`])
//! and a close keeps a key whose count is not zero.
//!
//! Why this loses nothing: an acquisition writes its record before it ends
//! (its [`Acquiring`] drops after the grant is written), and both the end
//! and the close's look at the count are made under the set's mutex. A close
//! that sees no acquisition in flight therefore reads the table after every
//! earlier grant was written, and releases it; a close that sees one in
//! flight leaves the key for the process's next close (at the latest its
//! exit), as the kernel does: a lock granted after a close is held until
//! the next one.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::locks::LockOwner;
use crate::types::Ino;

/// Who may hold locks on a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum HoldKey {
    /// POSIX locks of an owner (released at any close by it).
    Owner(Ino, LockOwner),
    /// OFD and flock locks taken through an open file (released at its
    /// last close).
    Handle(Ino, u64),
}

/// Acquisitions of one key that have started and not ended.
type InFlight = u32;

/// The keys that may hold locks here.
#[derive(Default)]
pub(super) struct Holds {
    keys: Mutex<HashMap<HoldKey, InFlight>>,
}

impl Holds {
    /// An acquisition of `key` starts: the key may hold locks from now on,
    /// and closes keep it until the returned guard drops (after the
    /// acquisition has written its grant, or failed).
    pub fn acquiring(self: &Arc<Self>, key: HoldKey) -> Acquiring {
        *self.keys.lock().entry(key).or_insert(0) += 1;
        Acquiring { holds: self.clone(), key }
    }

    /// A close of `key`: `false` if it cannot hold anything (no verbs
    /// needed); else the caller releases its locks, and the key is
    /// forgotten unless an acquisition is in flight.
    pub fn closing(&self, key: HoldKey) -> bool {
        let mut keys = self.keys.lock();
        match keys.get(&key) {
            None => false,
            Some(0) => {
                keys.remove(&key);
                true
            }
            Some(_) => true,
        }
    }
}

/// One acquisition in flight (see [`Holds::acquiring`]).
pub(super) struct Acquiring {
    holds: Arc<Holds>,
    key: HoldKey,
}

impl Drop for Acquiring {
    fn drop(&mut self) {
        if let Some(n) = self.holds.keys.lock().get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: HoldKey = HoldKey::Owner(Ino(5), LockOwner(7));

    #[test]
    fn a_close_keeps_an_owner_whose_acquisition_is_in_flight() {
        let holds = Arc::new(Holds::default());
        assert!(!holds.closing(KEY), "never acquired: nothing to release");
        let a = holds.acquiring(KEY);
        assert!(holds.closing(KEY), "the close releases what is held");
        assert!(holds.closing(KEY), "kept while the acquisition is in flight");
        drop(a);
        assert!(holds.closing(KEY), "the next close releases the late grant");
        assert!(!holds.closing(KEY), "then the owner is forgotten");
    }
}
