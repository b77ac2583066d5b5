//! Listing a delegated directory here: its `READDIRPLUS` pages without a
//! round trip (`find` and `ls -l` of what a mount made).
//!
//! A delegation's listing is the directory's every name (see the parent
//! module); with each name's cookie, which the answers of the mount's own
//! creates carry (`Delegated::cookie`), it is the meta-server's listing
//! too, in the meta-server's order. So the mount pages it itself, with
//! the meta-server's cookies as the kernel's offsets: a listing begun
//! here goes on at the meta-server, from the same cookie, if the
//! delegation is revoked between two pages, and a listing begun at the
//! meta-server goes on here. A name made without a cookie in its answer
//! (a link, a rename's target) ends the order (`Listing::order`), and the
//! meta-server lists the directory from then on.
//!
//! Each entry goes with its held attributes and the TTLs a lookup here
//! would give ([`Ttls::of`]); the page stops before the first name whose
//! attributes are not held (a file open for writing, or one an own
//! setattr changed), and the meta-server answers from there. Entries
//! handed to the kernel are recorded as a lookup's are
//! (`Listing::handing`), so a revocation drops them.

use std::time::{Duration, Instant};

use citronfs_core::proto::{DOTDOT_COOKIE, DOT_COOKIE};
use citronfs_core::types::{Attr, FileKind, Ino};

use super::{Delegations, Ttls};

/// One entry of a page listed here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub cookie: u64,
    pub name: Vec<u8>,
    pub ino: Ino,
    pub kind: FileKind,
    /// The held attributes, in a page with them; never for `.` and `..`,
    /// whose attributes the kernel does not read from a listing.
    pub attr: Option<Attr>,
    pub ttls: Ttls,
}

/// A page listed here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Page {
    pub entries: Vec<Listed>,
    /// The directory has no entry after these.
    pub end: bool,
}

impl Delegations {
    /// Up to `max` entries of `dir` after cookie `after`, in the
    /// meta-server's order, each with its held attributes if `plus`:
    /// `None` if `dir` is not delegated here or its order is not known. A
    /// page that stops before the directory's end (`!end`) was full or,
    /// with `plus`, met a name whose attributes are not held.
    pub fn page(&self, dir: Ino, after: u64, max: usize, plus: bool) -> Option<Page> {
        let now = Instant::now();
        let mut s = self.state.lock();
        let listing = s.listing(dir, now)?;
        let order = listing.order.as_ref()?;
        let left = listing.valid_until - now;
        let mut page = Page { entries: Vec::new(), end: true };
        let no_ttl = Ttls::both(Duration::ZERO);
        for (cookie, ino, name) in [(DOT_COOKIE, dir, "."), (DOTDOT_COOKIE, listing.parent, "..")] {
            if after < cookie && page.entries.len() < max {
                let (name, kind) = (name.as_bytes().to_vec(), FileKind::Dir);
                page.entries.push(Listed { cookie, name, ino, kind, attr: None, ttls: no_ttl });
            }
        }
        let mut handed = Duration::ZERO;
        for (&cookie, placed) in order.range(after.max(DOTDOT_COOKIE) + 1..) {
            if page.entries.len() == max {
                page.end = false;
                break;
            }
            let (ino, kind, name) = (placed.ino, placed.kind, placed.name.clone());
            if !plus {
                page.entries.push(Listed { cookie, name, ino, kind, attr: None, ttls: no_ttl });
                continue;
            }
            let Some((_, attr)) = s.held.get(&ino) else {
                page.end = false;
                break;
            };
            let ttls = Ttls::of(attr, left);
            handed = handed.max(ttls.entry);
            page.entries.push(Listed { cookie, name, ino, kind, attr: Some(attr.clone()), ttls });
        }
        // A plain page hands the kernel no entry to cache (`handed` stays
        // zero): nothing to record.
        if handed > Duration::ZERO {
            if let Some(listing) = s.listings.get_mut(&dir) {
                listing.handing(now, Ttls::both(handed));
            }
        }
        Some(page)
    }
}

#[cfg(test)]
mod tests {
    use citronfs_core::proto::Delegated;
    use citronfs_core::types::FileKind;

    use super::super::tests::{attr, with_dir, CHILD, TTL};
    use super::*;

    fn child(cookie: u64) -> Delegated {
        Delegated { cookie: Some(cookie), ..CHILD }
    }

    fn names(page: &Page) -> Vec<&[u8]> {
        page.entries.iter().map(|e| &e.name[..]).collect()
    }

    #[test]
    fn a_delegated_directory_lists_in_cookie_order_with_its_dots() {
        let d = with_dir();
        d.made(d.ticket(), Ino(2), b"b", &attr(4, FileKind::File), child(11), TTL);
        d.made(d.ticket(), Ino(2), b"a", &attr(3, FileKind::File), child(10), TTL);
        d.made(d.ticket(), Ino(2), b"c", &attr(5, FileKind::Dir), child(12), TTL);
        let all = d.page(Ino(2), 0, 100, true).expect("listed here");
        assert_eq!(names(&all), [&b"."[..], b"..", b"a", b"b", b"c"]);
        assert!(all.end);
        assert_eq!(all.entries[1].ino, Ino(1), ".. is not the parent");
        assert_eq!(all.entries[2].attr, Some(attr(3, FileKind::File)));
        assert_eq!(all.entries[2].ttls.entry, crate::delegation::FILE_ENTRY_TTL);
        assert!(all.entries[4].ttls.entry > TTL / 2, "a subdirectory's entry is for the delegation's time");
        // Paged: from a cookie on, a full page is not the end.
        let first = d.page(Ino(2), 0, 3, true).unwrap();
        assert_eq!((names(&first), first.end), (vec![&b"."[..], b"..", b"a"], false));
        let rest = d.page(Ino(2), 10, 3, true).unwrap();
        assert_eq!((names(&rest), rest.end), (vec![&b"b"[..], b"c"], true));
        d.removed(Ino(2), b"b");
        assert_eq!(names(&d.page(Ino(2), 2, 10, true).unwrap()), [&b"a"[..], b"c"]);
        // Handed to the kernel: a revocation names them.
        std::thread::sleep(Duration::from_millis(1));
        assert!(!d.revoked(Ino(2)).names.is_empty(), "listed entries are not dropped at a revocation");
        assert_eq!(d.page(Ino(2), 0, 10, true), None, "listed past a revocation");
    }

    #[test]
    fn a_page_stops_before_attributes_not_held_and_order_ends_without_a_cookie() {
        let d = with_dir();
        d.made(d.ticket(), Ino(2), b"a", &attr(3, FileKind::File), child(10), TTL);
        d.made(d.ticket(), Ino(2), b"b", &attr(4, FileKind::File), child(11), TTL);
        d.made(d.ticket(), Ino(2), b"c", &attr(5, FileKind::File), child(12), TTL);
        d.forget(Ino(4)); // an own write: b's attributes are no longer held
        let page = d.page(Ino(2), DOTDOT_COOKIE, 10, true).unwrap();
        assert_eq!((names(&page), page.end), (vec![&b"a"[..]], false));
        // Without attributes (READDIR), every name, with its kind.
        let plain = d.page(Ino(2), DOTDOT_COOKIE, 10, false).unwrap();
        assert_eq!((names(&plain), plain.end), (vec![&b"a"[..], b"b", b"c"], true));
        assert!(plain.entries.iter().all(|e| e.attr.is_none() && e.kind == FileKind::File));
        assert_eq!(d.page(Ino(1), 0, 10, true), None, "the root was never delegated");
        // A link's answer carries no cookie: the meta-server lists from now on.
        d.made(d.ticket(), Ino(2), b"l", &attr(3, FileKind::File), Delegated::default(), TTL);
        assert_eq!(d.page(Ino(2), 0, 10, true), None, "listed here without every cookie");
        assert!(d.lookup(Ino(2), b"zz").is_some(), "lookups stopped with the order");
        // So does a rename into a listing.
        let d = with_dir();
        d.made(d.ticket(), Ino(2), b"a", &attr(3, FileKind::File), child(10), TTL);
        d.renamed((Ino(2), b"a"), (Ino(2), b"b"), false);
        assert_eq!(d.page(Ino(2), 0, 10, true), None);
    }

    #[test]
    fn a_moved_directory_lists_its_new_parent_as_dot_dot() {
        let d = with_dir(); // 2, made in the root (1)
        let mkdir = |name: &[u8], ino: u64, cookie: u64| {
            let delegated = Delegated { dir: true, ..child(cookie) };
            d.made(d.ticket(), Ino(2), name, &attr(ino, FileKind::Dir), delegated, TTL);
        };
        mkdir(b"sub", 5, 10);
        mkdir(b"other", 6, 11);
        let dot_dot = |d: &Delegations, dir: u64| d.page(Ino(dir), 1, 1, false).map(|p| p.entries[0].ino);
        assert_eq!(dot_dot(&d, 5), Some(Ino(2)));
        // Moved by name from a listing: its `..` follows.
        d.renamed((Ino(2), b"sub"), (Ino(6), b"sub"), false);
        assert_eq!(dot_dot(&d, 5), Some(Ino(6)));
        assert_eq!(d.page(Ino(6), 0, 10, false), None, "6 got a name without its cookie");
        // Moved from a directory not listed here (the root): which one
        // moved is not known, so the root's listed children stop listing.
        d.renamed((Ino(1), b"d"), (Ino(6), b"d"), false);
        assert_eq!(d.page(Ino(2), 0, 10, false), None, "2 may have moved: its `..` is not known");
        assert_eq!(dot_dot(&d, 5), Some(Ino(6)), "5's parent was not the root");
    }
}
