//! What the delegations answer for creates and unlinks the mount answers
//! before it sends them (`crate::late_changes` says which, the
//! client's `late_changes` module why it is coherent).
//!
//! A late change is applied to the listing and queued in one step, under
//! the lock a revocation or a sharing takes ([`Delegations::make_late`],
//! [`Delegations::remove_late`]): one processed after it finds the change
//! queued, and the poll that acknowledges it sends the queue first. One
//! processed before it leaves no listing (or a shared one) to answer from.

use std::time::{Duration, Instant};

use citronfs_core::types::{Attr, FileKind, Ino};

use super::{Delegations, Listing, State, Ttls, MAX_NAMES};

impl Listing {
    /// The inode under `name` if this mount made it here (its entry came
    /// with a cookie, which only an own create's answer or a late create
    /// brings; a name an own rename or link put here has none) and no
    /// other mount looked into the directory since.
    pub(super) fn made_here(&self, name: &[u8]) -> Option<Ino> {
        if self.shared {
            return None;
        }
        match self.names.get(name) {
            Some(&(ino, Some(_))) => Some(ino),
            _ => None,
        }
    }
}

impl Delegations {
    /// Delegated directory `dir`'s own attributes, if kept with its
    /// listing ([`Listing::own`]), and how long the listing lasts.
    pub fn own_attr(&self, dir: Ino) -> Option<(Attr, Duration)> {
        let now = Instant::now();
        let s = self.state.lock();
        let listing = s.listing(dir, now)?;
        Some((listing.own.clone()?, listing.valid_until - now))
    }

    /// An own change of `ino`'s mode, owner or extended attributes: if it
    /// is a delegated directory, its kept attributes go.
    pub fn forget_own(&self, ino: Ino) {
        if let Some(l) = self.state.lock().listings.get_mut(&ino) {
            l.own = None;
        }
    }

    /// An own setattr of a delegated directory answered `attr`: kept as
    /// its own attributes (any other mount's change of it revokes the
    /// listing, which they go with).
    pub fn set_own(&self, attr: &Attr) {
        if let Some(l) = self.state.lock().listings.get_mut(&attr.ino) {
            l.own = Some(attr.clone());
        }
    }

    /// Whether `name` is not in `dir`, which is delegated here for at
    /// least `margin` more and no other mount looked into: a candidate
    /// for a late create.
    pub fn absent_here(&self, dir: Ino, name: &[u8], margin: Duration) -> bool {
        let s = self.state.lock();
        s.listing(dir, Instant::now() + margin).is_some_and(|l| !l.shared && l.get(name).is_none())
    }

    /// A late create of `name` → `attr` in `dir`, with its listing
    /// `cookie`: if the name is still absent and `dir` still delegated
    /// here for at least `margin`, not shared, adds it with its attributes
    /// held and calls `queue`, under the lock [`Self::revoked`] and
    /// [`Self::shared`] take. The TTLs for the kernel if it did.
    pub fn make_late(
        &self,
        dir: Ino,
        name: &[u8],
        attr: &Attr,
        cookie: u64,
        margin: Duration,
        queue: impl FnOnce(),
    ) -> Option<Ttls> {
        let now = Instant::now();
        let mut s = self.state.lock();
        if s.names >= MAX_NAMES {
            return None;
        }
        let listing = s.listings.get_mut(&dir).filter(|l| l.valid_until > now + margin && !l.shared)?;
        if listing.get(name).is_some() {
            return None;
        }
        queue();
        let ttls = Ttls::of(attr, listing.valid_until - now);
        listing.handing(now, ttls);
        listing.insert(name, attr.ino, Some((cookie, FileKind::File)));
        s.names += 1;
        s.held.insert(attr.ino, (dir, attr.clone()));
        Some(ttls)
    }

    /// The held attributes of `name` in `dir`, if this mount made it
    /// there and `dir` is delegated here for at least `margin` more: a
    /// candidate for a late unlink.
    pub fn made_here(&self, dir: Ino, name: &[u8], margin: Duration) -> Option<Attr> {
        let s = self.state.lock();
        let ino = s.listing(dir, Instant::now() + margin)?.made_here(name)?;
        s.held.get(&ino).filter(|(d, _)| *d == dir).map(|(_, attr)| attr.clone())
    }

    /// A late unlink of `name` in `dir`: if it is still `ino`, made and
    /// held here with one link, and `dir` is still delegated here for at
    /// least `margin`, removes it and calls `queue`, under the lock
    /// [`Self::revoked`] takes. Whether it did.
    pub fn remove_late(
        &self,
        dir: Ino,
        name: &[u8],
        ino: Ino,
        margin: Duration,
        queue: impl FnOnce(),
    ) -> bool {
        let mut s = self.state.lock();
        let Some(listing) = s.listing(dir, Instant::now() + margin) else { return false };
        let one_link = |s: &State| s.held.get(&ino).is_some_and(|(d, a)| *d == dir && a.nlink == 1);
        if listing.made_here(name) != Some(ino) || !one_link(&s) {
            return false;
        }
        queue();
        if let Some(listing) = s.listings.get_mut(&dir) {
            listing.remove(name);
        }
        s.names -= 1;
        s.held.remove(&ino);
        s.dropped(ino);
        true
    }

    /// Another mount looked into `dir` (`Invalidation::Shared`): its
    /// delegation stays, without changes answered first. Counted, for a
    /// listing a mkdir's answer installs after it (see "Why it stays
    /// true" in the parent module).
    pub fn shared(&self, dir: Ino) {
        let mut s = self.state.lock();
        s.sharings += 1;
        if let Some(listing) = s.listings.get_mut(&dir) {
            listing.shared = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delegation::tests::{attr, with_dir, TTL};
    use crate::delegation::{Found, FILE_ENTRY_TTL};

    const MARGIN: Duration = Duration::from_millis(100);
    const DIR: Ino = Ino(2);

    /// A late create adds an absent name, held, with its cookie (so it is
    /// one made here and listed here in the meta-server's order), and the
    /// queueing runs then; never a name that is there, in a delegation
    /// shorter than the margin, or once another mount looked.
    #[test]
    fn a_late_create_adds_an_absent_name_with_its_cookie_until_shared() {
        let d = with_dir();
        let mut queued = 0;
        assert!(d.absent_here(DIR, b"f", MARGIN));
        let ttls = d.make_late(DIR, b"f", &attr(3, FileKind::File), 40, MARGIN, || queued += 1);
        assert!(ttls.is_some_and(|t| t.entry <= FILE_ENTRY_TTL), "{ttls:?}");
        assert_eq!(queued, 1);
        assert!(!d.absent_here(DIR, b"f", MARGIN));
        assert!(matches!(d.lookup(DIR, b"f"), Some(Found::Present(..))));
        let again = d.make_late(DIR, b"f", &attr(4, FileKind::File), 41, MARGIN, || queued += 1);
        assert_eq!(again, None, "a name made twice");
        assert_eq!(d.made_here(DIR, b"f", MARGIN).map(|a| a.ino), Some(Ino(3)), "not one made here");
        let page = d.page(DIR, 0, 10, true).expect("listed here");
        let listed: Vec<(u64, Ino)> = page.entries.iter().map(|e| (e.cookie, e.ino)).collect();
        assert!(listed.contains(&(40, Ino(3))), "{listed:?}");
        let short = d.make_late(DIR, b"g", &attr(5, FileKind::File), 42, TTL * 2, || queued += 1);
        assert_eq!(short, None, "a delegation shorter than the margin");
        d.shared(DIR);
        assert!(!d.absent_here(DIR, b"g", MARGIN));
        let shared = d.make_late(DIR, b"g", &attr(5, FileKind::File), 42, MARGIN, || queued += 1);
        assert_eq!(shared, None, "answered first after another mount looked");
        assert_eq!(queued, 1);
    }

    /// A directory made here keeps its own attributes with its listing,
    /// following the mount's changes of it and its own setattrs' answers,
    /// until it is revoked.
    #[test]
    fn a_made_directory_keeps_its_attributes_while_delegated() {
        let d = with_dir();
        assert_eq!(d.own_attr(DIR).map(|(a, _)| a.ino), Some(DIR));
        let newer = Attr { size: 7, ..attr(2, FileKind::Dir) };
        d.refresh(&newer);
        assert_eq!(d.own_attr(DIR).map(|(a, _)| a.size), Some(7));
        d.forget_own(DIR);
        assert_eq!(d.own_attr(DIR), None);
        let chmodded = Attr { perm: 0o2777, ..attr(2, FileKind::Dir) };
        d.set_own(&chmodded);
        assert_eq!(d.own_attr(DIR).map(|(a, _)| a.perm), Some(0o2777));
        d.revoked(DIR);
        assert_eq!(d.own_attr(DIR), None, "kept past a revocation");
    }
}
