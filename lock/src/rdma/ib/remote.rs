//! The client's view of a host's regions: base, length and rkey of each, and
//! the checks every verb passes *before* it is posted.
//!
//! On a reliable connection a remote access error (out of bounds, bad rkey,
//! misaligned atomic) moves the queue pair to the error state and flushes
//! everything posted after it. The other backends refuse such a verb, change
//! nothing and keep the endpoint usable; to keep that contract the `ib`
//! backend refuses it locally, with the same [`VerbError`] the host's
//! [`RegionMemory`](crate::rdma::RegionMemory) would give, in the same order
//! of checks (tested against it).

use std::collections::HashMap;

use super::handshake::RegionGrant;
use crate::rdma::addr::{RegionId, RemoteAddr};
use crate::rdma::error::VerbError;
use crate::rdma::verb::{Verb, MAX_TRANSFER};

/// Where a checked verb goes on the wire: the host virtual address and rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub addr: u64,
    pub rkey: u32,
}

impl Target {
    /// `bytes` further on (inside a checked range).
    pub fn offset_by(self, bytes: u64) -> Target {
        Target { addr: self.addr + bytes, rkey: self.rkey }
    }
}

/// The regions of one host, as its control service granted them.
#[derive(Clone, Debug, Default)]
pub struct RemoteRegions {
    grants: HashMap<RegionId, RegionGrant>,
}

impl RemoteRegions {
    pub fn new(grants: impl IntoIterator<Item = RegionGrant>) -> Self {
        let mut r = Self::default();
        r.update(grants);
        r
    }

    /// Adds (or replaces) grants, e.g. after the host registered more memory.
    pub fn update(&mut self, grants: impl IntoIterator<Item = RegionGrant>) {
        for g in grants {
            self.grants.insert(g.id, g);
        }
    }

    pub fn contains(&self, id: RegionId) -> bool {
        self.grants.contains_key(&id)
    }

    /// The regions, sorted, as `Endpoint::list_regions` reports them.
    pub fn list(&self) -> Vec<(RegionId, u64)> {
        let mut v: Vec<_> = self.grants.values().map(|g| (g.id, g.len)).collect();
        v.sort();
        v
    }

    /// `len` bytes at `addr`, aligned to `align`: the checks of
    /// `RegionMemory::check`, in its order (bounds, then alignment).
    pub fn check(&self, addr: RemoteAddr, len: u64, align: u64) -> Result<Target, VerbError> {
        let g = self.grants.get(&addr.region).ok_or(VerbError::UnknownRegion(addr.region))?;
        if addr.offset.checked_add(len).is_none_or(|end| end > g.len) {
            return Err(VerbError::OutOfBounds { addr, len, region_len: g.len });
        }
        if !addr.is_aligned(align) {
            return Err(VerbError::Misaligned { addr, align });
        }
        Ok(Target { addr: g.base + addr.offset, rkey: g.rkey })
    }

    /// Checks `verb` as the host's `RegionMemory::execute` would, and returns
    /// its target.
    pub fn check_verb(&self, verb: &Verb) -> Result<Target, VerbError> {
        match verb {
            Verb::Read { addr, len } => self.check_transfer(*addr, u64::from(*len)),
            Verb::Write { addr, data } => self.check_transfer(*addr, data.len() as u64),
            Verb::Cas { addr, .. }
            | Verb::Faa { addr, .. }
            | Verb::MaskedCas { addr, .. }
            | Verb::MaskedFaa { addr, .. } => self.check(*addr, 8, 8),
            Verb::ExtCas { addr, .. } | Verb::ExtFaa { addr, .. } => self.check(*addr, 16, 16),
            Verb::Flush { addr, len } => self.check(*addr, *len, 1),
        }
    }

    fn check_transfer(&self, addr: RemoteAddr, len: u64) -> Result<Target, VerbError> {
        // The host's order: an unknown region first (the table lookup), then
        // the size limit, then bounds.
        if !self.contains(addr.region) {
            return Err(VerbError::UnknownRegion(addr.region));
        }
        if len > MAX_TRANSFER {
            return Err(VerbError::TooLarge { len, max: MAX_TRANSFER });
        }
        self.check(addr, len, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::memory::{RegionMemory, RegionTable};
    use proptest::prelude::*;

    const LEN: u64 = 1 << 16;

    fn regions() -> (RemoteRegions, RegionTable) {
        let table = RegionTable::new();
        table.insert(RegionMemory::anonymous(RegionId(1), LEN).unwrap()).unwrap();
        table.insert(RegionMemory::anonymous(RegionId(2), 4096).unwrap()).unwrap();
        let remote = RemoteRegions::new([
            RegionGrant { id: RegionId(1), base: 0x10_0000, len: LEN, rkey: 11 },
            RegionGrant { id: RegionId(2), base: 0x90_0000, len: 4096, rkey: 22 },
        ]);
        (remote, table)
    }

    fn verb_strategy() -> impl Strategy<Value = Verb> {
        let region = prop_oneof![Just(RegionId(1)), Just(RegionId(2)), Just(RegionId(3))];
        let offset = prop_oneof![0..LEN + 64, (LEN - 64)..(LEN + 64), Just(u64::MAX - 3)];
        (region, offset, 0u8..8, 0u32..9000).prop_map(|(region, offset, kind, len)| {
            let addr = RemoteAddr::new(region, offset);
            match kind {
                0 => Verb::Read { addr, len },
                1 => Verb::Write { addr, data: vec![7; len as usize % 300] },
                2 => Verb::Cas { addr, expect: 0, new: 1 },
                3 => Verb::Faa { addr, add: 1 },
                4 => Verb::MaskedCas { addr, cmp: 0, cmp_mask: 1, swap: 1, swap_mask: 1 },
                5 => Verb::MaskedFaa { addr, add: 1, boundary_mask: 1 << 31 },
                6 => Verb::ExtCas { addr, cmp: 0, cmp_mask: 0, swap: 1, swap_mask: 1 },
                _ => Verb::ExtFaa { addr, add: 1, boundary_mask: 0 },
            }
        })
    }

    proptest! {
        /// The local checks refuse exactly what the host would refuse, with
        /// the same error, and accept the rest at base + offset.
        #[test]
        fn local_checks_agree_with_the_host(verb in verb_strategy()) {
            let (remote, table) = regions();
            let local = remote.check_verb(&verb);
            let host = table.execute(&verb);
            match (&local, &host) {
                (Err(a), Err(b)) => prop_assert_eq!(a, b),
                (Ok(t), Ok(_)) => {
                    let base = if verb.addr().region == RegionId(1) { 0x10_0000 } else { 0x90_0000 };
                    prop_assert_eq!(t.addr, base + verb.addr().offset);
                }
                _ => prop_assert!(false, "local {:?} but host {:?} for {:?}", local, host, verb),
            }
        }
    }

    #[test]
    fn too_large_and_unknown() {
        let (remote, _) = regions();
        let addr = RemoteAddr::new(RegionId(1), 0);
        let len = (MAX_TRANSFER + 1) as u32;
        assert_eq!(
            remote.check_verb(&Verb::Read { addr, len }),
            Err(VerbError::TooLarge { len: MAX_TRANSFER + 1, max: MAX_TRANSFER })
        );
        let nowhere = RemoteAddr::new(RegionId(9), 0);
        assert_eq!(
            remote.check_verb(&Verb::Read { addr: nowhere, len }),
            Err(VerbError::UnknownRegion(RegionId(9)))
        );
        assert_eq!(remote.list(), vec![(RegionId(1), LEN), (RegionId(2), 4096)]);
    }
}
