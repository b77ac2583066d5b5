//! Lookups answered ahead (issue 13): a caching mount that looks up, one
//! after another, names of a directory it did not make — the `stat` of
//! every file another mount wrote, in the order they were made, as
//! mdtest's stat phase or `ls -f | xargs stat` do — asks the meta-server
//! for the entries after the name with the lookup (`LookupAhead`), and
//! answers the `LOOKUP`s of those names itself while their grants last:
//! one round trip per page of names instead of one per name. Lustre's
//! statahead does this for `ls -l`. (A listing does not need it: the
//! mount lists with READDIRPLUS, and a directory it made is delegated to
//! it, `delegation`.)
//!
//! # When
//!
//! A directory's first lookup that this cache cannot answer asks for its
//! name only; each later one asks for [`AHEAD`] entries after it as well,
//! unless fewer than a quarter of the entries the page of the miss before
//! brought were asked for since (the names are looked up in some other
//! order than the listing's, or the page could not be kept): then that
//! miss and the directory's next [`PAUSE`] ask for their name only.
//!
//! # Why it stays true
//!
//! The meta-server grants each entry to this mount with its attributes,
//! as a lookup's answer (both or neither; neither for a file open for
//! writing anywhere), and only granted entries are kept. So:
//!
//! * **another mount's change** of a kept name or inode calls this mount
//!   back before it answers; the invalidation thread drops the entry here
//!   ([`Lookahead::invalidated`]) before it tells the kernel and
//!   acknowledges;
//! * **an answer overtaken by an invalidation** (processed while the
//!   request was out) is not kept: a page is kept only if the counter of
//!   all invalidations has not moved since the request was sent, compared
//!   under this cache's lock, which the invalidation thread takes after it
//!   moves the counter to drop entries (a miss later, never a stale
//!   answer);
//! * **this mount's own changes**, for which the meta-server calls nobody
//!   back on this mount: the client calls [`Lookahead::own_change`] before
//!   it sends any request that may change something
//!   (`MetaRequest::changes_nothing`), which drops what the request may
//!   change (every entry, for a request that names nothing) and makes a
//!   page whose request was sent before it not kept at all;
//! * **the kernel**: an entry leaves the cache when a `LOOKUP` is answered
//!   from it; from then on the kernel's copy follows the rules of every
//!   looked-up entry (its TTL, the callbacks);
//! * **the TTL**: an entry is good until the grant's TTL after its request
//!   was *sent* (the meta-server counts from when it answered, later).
//!
//! # Memory
//!
//! At most [`MAX_ENTRIES`] entries; a page that would pass it first drops
//! the expired ones, and is not kept if that is not enough.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use citronfs_core::client::Looked;
use citronfs_core::proto::{EntryPlus, MetaRequest};
use citronfs_core::types::{Attr, Caller, FileKind, Ino};
use citronfs_core::FsError;
use fuser::{Generation, ReplyEntry};
use parking_lot::Mutex;

use crate::invalidation::{Epochs, Sample};
use crate::{fuse_attr, CitronFuse};

/// Entries asked for after the looked-up name.
pub const AHEAD: u32 = 128;

/// Misses of a directory that ask for their name only after its pages went
/// mostly unused.
pub const PAUSE: u32 = 64;

/// The most entries kept, in all directories.
pub const MAX_ENTRIES: usize = 1 << 16;

/// The most directories whose misses are counted.
const MAX_DIRS: usize = 4096;

/// A kept entry: the inode's attributes and how long the grant lasts.
struct Kept {
    attr: Attr,
    until: Instant,
}

/// How a directory's lookups have gone.
#[derive(Default)]
struct DirPattern {
    /// Lookups not answered here.
    misses: u64,
    /// Entries its pages brought since its last miss, and those of them
    /// looked up.
    brought: u64,
    used: u64,
    /// Misses left that ask for their name only.
    paused: u32,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<(Ino, Vec<u8>), Kept>,
    /// Names kept per inode (one, but for a directory's `..`, which is
    /// never kept).
    names: HashMap<Ino, (Ino, Vec<u8>)>,
    dirs: HashMap<Ino, DirPattern>,
    /// Own changes begun ([`Lookahead::own_change`]).
    own_changes: u64,
}

/// What a request sent to look ahead must find unchanged for its page to
/// be kept ([`Lookahead::sent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sent {
    at: Instant,
    invalidations: Sample,
    own_changes: u64,
}

/// The mount's entries looked up ahead (see the module comment).
#[derive(Default)]
pub struct Lookahead {
    inner: Mutex<Inner>,
}

impl Lookahead {
    /// The entry `(parent, name)` if it is kept and its grant lasts, with
    /// what is left of it; it is no longer kept.
    pub fn take(&self, parent: Ino, name: &[u8]) -> Option<(Attr, Duration)> {
        let mut s = self.inner.lock();
        let kept = s.entries.remove(&(parent, name.to_vec()))?;
        s.names.remove(&kept.attr.ino);
        let left = kept.until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        if let Some(d) = s.dirs.get_mut(&parent) {
            d.used += 1;
        }
        Some((kept.attr, left))
    }

    /// Counts a lookup in `parent` this cache could not answer, and says
    /// how many entries after it to ask for (zero: the name only).
    pub fn missed(&self, parent: Ino) -> u32 {
        let mut s = self.inner.lock();
        if !s.dirs.contains_key(&parent) && s.dirs.len() >= MAX_DIRS {
            s.dirs.clear();
        }
        let d = s.dirs.entry(parent).or_default();
        d.misses += 1;
        if d.paused > 0 {
            d.paused -= 1;
            return 0;
        }
        // The pages kept since the last miss, judged by how much of them
        // was asked for before this one.
        let unused = d.brought > 0 && d.used * 4 < d.brought;
        d.brought = 0;
        d.used = 0;
        if unused {
            d.paused = PAUSE;
            return 0;
        }
        if d.misses < 2 {
            return 0;
        }
        AHEAD
    }

    /// Taken just before a request that looks ahead is sent.
    pub fn sent(&self, epochs: &Epochs) -> Sent {
        let own_changes = self.inner.lock().own_changes;
        Sent { at: Instant::now(), invalidations: epochs.all(), own_changes }
    }

    /// Keeps the granted entries of a page of `parent` brought by a request
    /// taken as `sent`, for `ttl` from when it was sent, unless an
    /// invalidation or an own change came since (see the module comment);
    /// how many it kept.
    pub fn keep(
        &self,
        parent: Ino,
        page: Vec<EntryPlus>,
        sent: Sent,
        ttl: Duration,
        epochs: &Epochs,
    ) -> usize {
        let until = sent.at + ttl;
        let mut s = self.inner.lock();
        // Judged by what it brought, kept or not: a directory whose pages
        // cannot be kept (its files open for writing, its names changed
        // while each page was out) stops asking for them too.
        if !s.dirs.contains_key(&parent) && s.dirs.len() >= MAX_DIRS {
            s.dirs.clear();
        }
        s.dirs.entry(parent).or_default().brought += page.len() as u64;
        // Under the lock the invalidation thread takes after it moves the
        // counter: an invalidation either moved it before this check (the
        // page is dropped) or drops what is kept now after it.
        if epochs.all() != sent.invalidations || s.own_changes != sent.own_changes {
            return 0;
        }
        let granted: Vec<EntryPlus> = page.into_iter().filter(|e| e.grant.entry && e.grant.attr).collect();
        if s.entries.len() + granted.len() > MAX_ENTRIES {
            let now = Instant::now();
            let Inner { entries, names, .. } = &mut *s;
            entries.retain(|_, k| {
                let live = k.until > now;
                if !live {
                    names.remove(&k.attr.ino);
                }
                live
            });
            if entries.len() + granted.len() > MAX_ENTRIES {
                return 0;
            }
        }
        let mut kept = 0;
        for e in granted {
            // A second name of an inode (a hard link) is not kept: an own
            // change through one name must drop what is kept of the other,
            // and only the first is indexed.
            let linked = e.attr.kind != FileKind::Dir && e.attr.nlink > 1;
            if linked || s.names.contains_key(&e.attr.ino) {
                continue;
            }
            s.names.insert(e.attr.ino, (parent, e.entry.name.clone()));
            s.entries.insert((parent, e.entry.name), Kept { attr: e.attr, until });
            kept += 1;
        }
        kept
    }

    /// Another mount changed what an invalidation names: `ino`'s
    /// attributes, the name `(parent, name)`, or (`listing`) every name of
    /// a directory. Called by the invalidation thread after it moved the
    /// counter of all invalidations and before it acknowledges.
    pub fn invalidated(&self, ino: Option<Ino>, entry: Option<(Ino, &[u8])>, listing: Option<Ino>) {
        let mut s = self.inner.lock();
        if s.entries.is_empty() {
            return;
        }
        if let Some(key) = ino.and_then(|i| s.names.remove(&i)) {
            s.entries.remove(&key);
        }
        if let Some((parent, name)) = entry {
            if let Some(k) = s.entries.remove(&(parent, name.to_vec())) {
                s.names.remove(&k.attr.ino);
            }
        }
        if let Some(dir) = listing {
            let Inner { entries, names, .. } = &mut *s;
            entries.retain(|(p, _), k| {
                if *p == dir {
                    names.remove(&k.attr.ino);
                }
                *p != dir
            });
        }
    }

    /// Before an own change is sent: what it may change goes — the names
    /// it makes, removes or moves, the inodes whose attributes it changes,
    /// and the entries of the directories it changes (their times and
    /// link counts); everything for a change it does not name — and pages
    /// asked for before it are not kept.
    pub fn own_change(&self, request: &MetaRequest) {
        use MetaRequest as R;
        let mut s = self.inner.lock();
        s.own_changes += 1;
        if s.entries.is_empty() {
            return;
        }
        let (names, inodes): (Vec<(Ino, &[u8])>, Vec<Ino>) = match request.inner() {
            R::Create { parent, name, .. }
            | R::CreateOpen { parent, name, .. }
            | R::Symlink { parent, name, .. }
            | R::Unlink { parent, name, .. }
            | R::Rmdir { parent, name, .. } => (vec![(*parent, name)], vec![*parent]),
            R::Rename { parent, name, new_parent, new_name, .. } => {
                (vec![(*parent, name), (*new_parent, new_name)], vec![*parent, *new_parent])
            }
            R::Link { ino, new_parent, new_name, .. } => {
                (vec![(*new_parent, new_name)], vec![*ino, *new_parent])
            }
            R::SetAttr { ino, .. }
            | R::Open { ino, .. }
            | R::KillSuidGid { ino, .. }
            | R::AllocChunks { ino, .. }
            | R::GrowExtents { ino, .. }
            | R::Fallocate { ino, .. }
            | R::SetXattr { ino, .. }
            | R::RemoveXattr { ino, .. } => (Vec::new(), vec![*ino]),
            _ => {
                // New maps: the memory of a large page goes back.
                s.entries = HashMap::new();
                s.names = HashMap::new();
                return;
            }
        };
        for (parent, name) in names {
            if let Some(k) = s.entries.remove(&(parent, name.to_vec())) {
                s.names.remove(&k.attr.ino);
            }
        }
        for ino in inodes {
            if let Some(key) = s.names.remove(&ino) {
                s.entries.remove(&key);
            }
        }
    }

    /// Everything goes (a new registration: the grants were the old one's).
    pub fn clear(&self) {
        let mut s = self.inner.lock();
        s.entries.clear();
        s.names.clear();
        s.dirs.clear();
    }

    /// Entries kept now, expired ones included (tests, diagnostics).
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }
}

/// The file system's lookups ahead (a caching mount's only).
impl CitronFuse {
    /// Answers a `LOOKUP` of `name` in `parent` from what was looked up
    /// ahead; `reply` back if nothing kept answers it. The TTL is zero if
    /// an invalidation was processed while the entry was taken (see
    /// `invalidation`, "Replies overtaken by an invalidation").
    pub(crate) fn lookup_kept(&self, parent: Ino, name: &[u8], reply: ReplyEntry) -> Option<ReplyEntry> {
        if !self.caching() {
            return Some(reply);
        }
        let epochs = self.invalidations.epochs();
        let before = epochs.all();
        let Some((attr, left)) = self.invalidations.lookahead().take(parent, name) else {
            return Some(reply);
        };
        let ttl = if epochs.all() == before { left } else { Duration::ZERO };
        reply.entry_with_ttls(&ttl, &ttl, &fuse_attr(&attr), Generation(0));
        None
    }

    /// A lookup the meta-server answers, asking for the entries after the
    /// name too when this directory's lookups come in its listing's order
    /// ([`Lookahead::missed`]); the granted ones are kept.
    pub(crate) fn look_up(&self, caller: Caller, parent: Ino, name: &[u8]) -> Result<Looked, FsError> {
        let lookahead = self.invalidations.lookahead();
        let ahead = if self.caching() { lookahead.missed(parent) } else { 0 };
        if ahead == 0 {
            return self.client.lookup_granted(caller, parent, name);
        }
        let epochs = self.invalidations.epochs();
        let sent = lookahead.sent(epochs);
        let (looked, next) = self.client.lookup_ahead(caller, parent, name, ahead)?;
        lookahead.keep(parent, next, sent, self.options.cache_ttl, epochs);
        Ok(looked)
    }
}

#[cfg(test)]
mod tests {
    use citronfs_core::proto::Grant;
    use citronfs_core::types::{DirEntry, Timestamp};

    use super::*;

    const DIR: Ino = Ino(10);
    const TTL: Duration = Duration::from_secs(5);

    fn attr(ino: u64, kind: FileKind, nlink: u32) -> Attr {
        Attr {
            ino: Ino(ino),
            kind,
            perm: 0o644,
            uid: 0,
            gid: 0,
            size: 0,
            nlink,
            rdev: 0,
            allocated: 0,
            atime: Timestamp::default(),
            mtime: Timestamp::default(),
            ctime: Timestamp::default(),
            crtime: Timestamp::default(),
        }
    }

    fn entry(name: &str, a: Attr, granted: bool) -> EntryPlus {
        let grant = Grant { entry: granted, attr: granted, ..Grant::default() };
        EntryPlus {
            entry: DirEntry { ino: a.ino, kind: a.kind, name: name.into(), cookie: 0 },
            attr: a,
            grant,
        }
    }

    fn page(from: u64, n: u64) -> Vec<EntryPlus> {
        (from..from + n).map(|i| entry(&format!("f{i}"), attr(100 + i, FileKind::File, 1), true)).collect()
    }

    #[test]
    fn a_kept_entry_is_answered_once_with_what_is_left_of_its_grant() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let sent = l.sent(&epochs);
        assert_eq!(l.keep(DIR, page(0, 3), sent, TTL, &epochs), 3);
        let (a, left) = l.take(DIR, b"f1").expect("kept");
        assert_eq!(a.ino, Ino(101));
        assert!(left <= TTL && left > TTL - Duration::from_secs(1), "{left:?}");
        assert!(l.take(DIR, b"f1").is_none(), "handed to the kernel once");
        assert!(l.take(Ino(11), b"f0").is_none(), "another directory's name");
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn an_expired_entry_answers_nothing() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let sent = l.sent(&epochs);
        l.keep(DIR, page(0, 1), sent, Duration::from_millis(1), &epochs);
        std::thread::sleep(Duration::from_millis(5));
        assert!(l.take(DIR, b"f0").is_none());
    }

    #[test]
    fn ungranted_and_hard_linked_entries_are_not_kept() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let sent = l.sent(&epochs);
        let mixed = vec![
            entry("open-for-writing", attr(1, FileKind::File, 1), false),
            entry("linked", attr(2, FileKind::File, 2), true),
            entry("dir", attr(3, FileKind::Dir, 2), true),
        ];
        assert_eq!(l.keep(DIR, mixed, sent, TTL, &epochs), 1);
        assert!(l.take(DIR, b"dir").is_some());
    }

    #[test]
    fn a_page_overtaken_by_an_invalidation_or_an_own_change_is_not_kept() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let sent = l.sent(&epochs);
        epochs.bump(Ino(999));
        assert_eq!(l.keep(DIR, page(0, 3), sent, TTL, &epochs), 0, "an invalidation came meanwhile");
        let sent = l.sent(&epochs);
        l.own_change(&MetaRequest::Clients);
        assert_eq!(l.keep(DIR, page(0, 3), sent, TTL, &epochs), 0, "an own change began meanwhile");
        let sent = l.sent(&epochs);
        assert_eq!(l.keep(DIR, page(0, 3), sent, TTL, &epochs), 3);
    }

    #[test]
    fn invalidations_drop_what_they_name_and_own_changes_drop_everything() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let sent = l.sent(&epochs);
        l.keep(DIR, page(0, 4), sent, TTL, &epochs);
        l.keep(Ino(11), page(10, 2), l.sent(&epochs), TTL, &epochs);
        l.invalidated(Some(Ino(100)), None, None);
        assert!(l.take(DIR, b"f0").is_none(), "its attributes changed");
        l.invalidated(None, Some((DIR, b"f1")), None);
        assert!(l.take(DIR, b"f1").is_none(), "its name changed");
        l.invalidated(None, None, Some(Ino(11)));
        assert!(l.take(Ino(11), b"f10").is_none(), "its directory's listing");
        assert!(l.take(DIR, b"f2").is_some(), "the rest stays");
        l.own_change(&MetaRequest::Clients);
        assert!(l.take(DIR, b"f3").is_none(), "a change that names nothing drops everything");
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn an_own_change_drops_the_names_inodes_and_directories_it_changes() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let caller = citronfs_core::types::Caller::ROOT;
        let mut kept = page(0, 6);
        kept.push(entry("sub", attr(50, FileKind::Dir, 2), true));
        l.keep(DIR, kept, l.sent(&epochs), TTL, &epochs);
        l.own_change(&MetaRequest::Unlink { caller, parent: DIR, name: b"f0".to_vec() });
        assert!(l.take(DIR, b"f0").is_none(), "the name it removes");
        let set = citronfs_core::types::SetAttr::default();
        l.own_change(&MetaRequest::SetAttr { caller, ino: Ino(101), set });
        assert!(l.take(DIR, b"f1").is_none(), "the inode whose attributes it sets");
        l.own_change(&MetaRequest::Create {
            caller,
            parent: Ino(50),
            name: b"x".to_vec(),
            kind: FileKind::File,
            perm: 0o644,
            rdev: 0,
        });
        assert!(l.take(DIR, b"sub").is_none(), "the directory it changes");
        l.own_change(&MetaRequest::Link {
            caller,
            ino: Ino(102),
            new_parent: Ino(50),
            new_name: b"y".to_vec(),
        });
        assert!(l.take(DIR, b"f2").is_none(), "the inode it links");
        assert_eq!(l.len(), 3, "f3, f4 and f5 stay");
        assert!(l.take(DIR, b"f3").is_some());
    }

    #[test]
    fn a_directory_asks_ahead_from_its_second_miss_and_pauses_when_its_pages_go_unused() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        assert_eq!(l.missed(DIR), 0, "a first lookup asks for its name");
        assert_eq!(l.missed(DIR), AHEAD);
        // Looked up in listing order: the page is used, the next miss asks again.
        l.keep(DIR, page(0, 8), l.sent(&epochs), TTL, &epochs);
        for i in 0..8 {
            assert!(l.take(DIR, format!("f{i}").as_bytes()).is_some());
        }
        assert_eq!(l.missed(DIR), AHEAD);
        // In another order: a page of 100 of which one was used.
        l.keep(DIR, page(100, 100), l.sent(&epochs), TTL, &epochs);
        assert!(l.take(DIR, b"f150").is_some());
        assert_eq!(l.missed(DIR), 0, "mostly unused: paused");
        for _ in 0..PAUSE {
            assert_eq!(l.missed(DIR), 0);
        }
        assert_eq!(l.missed(DIR), AHEAD, "asks again after the pause");
        // Pages that cannot be kept count as unused.
        let sent = l.sent(&epochs);
        epochs.bump(Ino(999));
        assert_eq!(l.keep(DIR, page(300, 100), sent, TTL, &epochs), 0);
        assert_eq!(l.missed(DIR), 0, "nothing of the page was kept: paused");
    }

    #[test]
    fn a_page_past_the_bound_is_not_kept() {
        let (l, epochs) = (Lookahead::default(), Epochs::default());
        let full = MAX_ENTRIES as u64;
        assert_eq!(l.keep(DIR, page(0, full), l.sent(&epochs), TTL, &epochs), MAX_ENTRIES);
        assert_eq!(l.keep(DIR, page(full, 1), l.sent(&epochs), TTL, &epochs), 0);
        // Expired entries make room.
        let l = Lookahead::default();
        l.keep(DIR, page(0, full), l.sent(&epochs), Duration::from_millis(1), &epochs);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(l.keep(DIR, page(full, 1), l.sent(&epochs), TTL, &epochs), 1);
        assert_eq!(l.len(), 1);
    }
}
