//! The mount's side of directory delegations (the protocol is in
//! the meta-server's `grants` module, "Delegations"): the listings of the
//! directories this mount made, and the attributes of the children it made
//! in them, from which it answers `LOOKUP` and `GETATTR` without a round
//! trip.
//!
//! # What is kept
//!
//! * a **listing** per delegated directory: every name in it and its inode.
//!   It starts empty (the answer to the mount's own mkdir says the new
//!   directory is delegated) and follows the mount's own changes of the
//!   directory from their answers. A name that is not in it is not in
//!   the directory: `LOOKUP` answers ENOENT at once — the lookup before
//!   every create, and every stat of a name that is not there.
//! * **held attributes** of children made here while the directory was
//!   delegated (`Delegated::child`), or looked up since (`Grant::held`):
//!   `LOOKUP` and `GETATTR` answer them. A held child that is itself a
//!   directory follows the mount's changes in it from their answers (its
//!   new attributes, [`Delegations::refresh`]).
//!
//! # What the kernel gets
//!
//! What is left of the delegation's time for held attributes (a stat is
//! then at most one `LOOKUP`, answered here, and an `fstat` none) and for
//! the entries of subdirectories (path walks through them cost nothing);
//! at most [`FILE_ENTRY_TTL`] for a file's entry (enough for the
//! permission check after a create and for the calls right after it);
//! TTL zero for a name that is not there. A revocation tells the kernel to
//! drop the held attributes (`inval_inode` each) and, only if an entry it
//! handed out may still be cached (`Listing::handed_until`), the names
//! (`FUSE_NOTIFY_INC_EPOCH`, which makes every dentry of the mount
//! revalidate, or one `inval_entry` each on kernels without it) before it
//! is acknowledged. Files' entries for the whole time would save a local
//! `LOOKUP` per path walk, but nearly every revocation would then drop all
//! the mount's dentries, its other directories' too (measured: half the
//! unlinks of `bench meta`'s four-process private row paid a lookup round
//! trip again).
//!
//! # Why it stays true
//!
//! * **another mount's change** of the directory or a held child revokes
//!   the delegation before that change answers; the invalidation thread
//!   drops the listing and its children's attributes
//!   ([`Delegations::revoked`]) before it acknowledges, so once the change
//!   has answered nothing here shows what was before it.
//! * **an own change's answer overtaken by the revocation** would add to a
//!   listing that is gone, and so adds nothing (updates only touch what
//!   is still kept). A directory, once dropped, is never delegated again,
//!   so a listing cannot come back under an old answer — except the new
//!   one a mkdir's answer installs: it is installed only if no
//!   revocation came since the request was sent ([`Ticket`]).
//! * **a mkdir's answer overtaken by the sharing of its directory**:
//!   another mount may look into the new directory between the
//!   meta-server's answer and this mount's processing of it, and the
//!   sharing then finds no listing to mark. So a listing a mkdir's answer
//!   installs starts shared if any sharing was processed since the
//!   request was sent ([`Ticket`]): no change is answered there before it
//!   is sent, as the meta-server counts on from the acknowledgement.
//! * **an answer that holds attributes overtaken by an own change** of
//!   them: a lookup's (`Grant::held`) or a release's (`HeldAgain`) answer
//!   read the attributes before an own link, chmod or rename on another
//!   thread changed them, and reaches the delegation after that change
//!   dropped what it held. Such answers are held only if no own change
//!   dropped the inode's held attributes since their request was sent
//!   ([`Delegations::held`], [`Delegations::held_again`]); else they are a
//!   miss. The last [`MAX_DROPS`] inodes dropped are remembered one by
//!   one; past them, and after an own change that may have changed any
//!   held file, every answer in flight is a miss.
//! * **own changes** the meta-server does not call this mount back for are
//!   applied here before the kernel hears the answer: names added and
//!   removed, the changed directory's new attributes, and every change of
//!   a child's attributes the answer does not carry (a write, an open, a
//!   setattr, a link) drops them ([`Delegations::forget`]); an own change
//!   that removes a link of a file it cannot name (a rename over a name in
//!   a directory not kept here) drops every held file's
//!   ([`Delegations::forget_files`]). An own change that fails may have
//!   been applied in part: the directory's listing goes.
//! * **the TTL**: a listing is good until the TTL after the request that
//!   brought it, or after the last poll of the invalidation thread that
//!   renewed it, counted from when that request was *sent*
//!   ([`Delegations::renew`]); the meta-server counts it from when it
//!   answered, later.
//!
//! # Memory
//!
//! At most [`MAX_NAMES`] names in all listings; a listing that would pass
//! it is dropped (it is no longer complete) and its directory is answered
//! by the meta-server from then on.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use citronfs_core::proto::{Delegated, Grant};
use citronfs_core::types::{Attr, FileKind, Ino, NAME_MAX};
use citronfs_core::FsError;
use fuser::{Errno, Generation, ReplyAttr, ReplyEntry};
use parking_lot::Mutex;

use crate::invalidation::Sample;
use crate::{fuse_attr, CitronFuse};

mod late;
mod page;
pub use page::Page;

/// Most names all listings of a mount hold (about 150 bytes each).
pub const MAX_NAMES: usize = 1 << 20;

/// A name in a listing's order.
struct Placed {
    name: Vec<u8>,
    ino: Ino,
    kind: FileKind,
}

/// A delegated directory's entries.
struct Listing {
    /// Each name's inode and, if its answer said, its cookie.
    names: HashMap<Vec<u8>, (Ino, Option<u64>)>,
    /// The names by cookie while every one is known (the meta-server's
    /// order, [`page`]); `None` once a name came without one.
    order: Option<BTreeMap<u64, Placed>>,
    /// The directory's parent (its `..`).
    parent: Ino,
    valid_until: Instant,
    /// When the last entry handed to the kernel from it expires there (see
    /// "What the kernel gets"): a revocation before then must drop the
    /// kernel's entries.
    handed_until: Option<Instant>,
    /// Another mount looked into it (`Invalidation::Shared`): no unlink
    /// there is answered before it is sent (`crate::late_changes`).
    shared: bool,
    /// The directory's own attributes from its mkdir's answer, following
    /// this mount's changes of it and its setattrs' answers (any other
    /// mount's change of it revokes the listing). What a late change
    /// checks its permission against when the mount keeps no newer ones
    /// (`crate::late_changes`).
    own: Option<Attr>,
}

#[derive(Default)]
struct State {
    listings: HashMap<Ino, Listing>,
    /// Held attributes, and the delegated directory they are held with.
    held: HashMap<Ino, (Ino, Attr)>,
    /// Names in all listings.
    names: usize,
    /// Revocations so far.
    revocations: u64,
    /// Sharings processed so far (see "Why it stays true").
    sharings: u64,
    /// When each inode's held attributes were last dropped by an own
    /// change (see "Why it stays true"), at most [`MAX_DROPS`] of them.
    drops: HashMap<Ino, Instant>,
    /// When the held attributes of any inode were last dropped at once (an
    /// own change that may have changed any, or [`MAX_DROPS`] passed).
    all_dropped: Option<Instant>,
}

/// Most drops remembered one by one; past them, answers in flight hold
/// nothing (a miss).
const MAX_DROPS: usize = 4096;

impl State {
    /// `ino`'s held attributes were dropped by an own change: answers
    /// sent before now hold nothing of it.
    fn dropped(&mut self, ino: Ino) {
        let now = Instant::now();
        if self.drops.len() >= MAX_DROPS && !self.drops.contains_key(&ino) {
            self.dropped_all();
        }
        self.drops.insert(ino, now);
    }

    /// Any inode's held attributes may have been dropped by an own change:
    /// answers sent before now hold nothing.
    fn dropped_all(&mut self) {
        self.drops.clear();
        self.all_dropped = Some(Instant::now());
    }

    /// Whether `ino`'s held attributes were dropped since `sent` (a clock
    /// reading equal to `sent` counts: which came first is not known).
    fn dropped_since(&self, ino: Ino, sent: Instant) -> bool {
        let since = |t: &Instant| *t >= sent;
        self.all_dropped.as_ref().is_some_and(since) || self.drops.get(&ino).is_some_and(since)
    }

    fn drop_listing(&mut self, dir: Ino) -> Dropped {
        let Some(listing) = self.listings.remove(&dir) else { return Dropped::default() };
        self.names -= listing.names.len();
        let mut dropped = Dropped::default();
        if listing.handed_until.is_some_and(|t| t > Instant::now()) {
            dropped.names = listing.names.into_keys().collect();
        }
        // Every attribute held with it, under a name it lists or not (a
        // release may hold a file again that an own rename moved away).
        self.held.retain(|ino, (d, _)| {
            let kept = *d != dir;
            if !kept {
                dropped.held.push(*ino);
            }
            kept
        });
        dropped
    }

    /// An own rename moved the inode under a name in `from` (`moved`, if
    /// known here) to `to`: if it is a directory listed here, its `..`
    /// follows. Not known, any listing whose `..` is `from` may be it, and
    /// stops listing itself ([`page`]).
    fn reparent(&mut self, moved: Option<Ino>, from: Ino, to: Ino) {
        match moved {
            Some(ino) => {
                if let Some(l) = self.listings.get_mut(&ino) {
                    l.parent = to;
                }
            }
            None => {
                for l in self.listings.values_mut().filter(|l| l.parent == from) {
                    l.order = None;
                }
            }
        }
    }

    fn listing(&self, dir: Ino, now: Instant) -> Option<&Listing> {
        self.listings.get(&dir).filter(|l| l.valid_until > now)
    }
}

/// What a lookup of a name in a delegated directory finds here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Not in the directory.
    Absent,
    /// There, with its attributes, and what the kernel may cache of it.
    Present(Attr, Ttls),
}

impl Listing {
    fn new(parent: Ino, valid_until: Instant) -> Self {
        Self {
            names: HashMap::new(),
            order: Some(BTreeMap::new()),
            parent,
            valid_until,
            handed_until: None,
            shared: false,
            own: None,
        }
    }

    fn get(&self, name: &[u8]) -> Option<Ino> {
        self.names.get(name).map(|&(ino, _)| ino)
    }

    /// Adds or replaces `name`, with its cookie and kind if the answer
    /// said; answers whether it is new. A name without a cookie ends the
    /// listing's order.
    fn insert(&mut self, name: &[u8], ino: Ino, placed: Option<(u64, FileKind)>) -> bool {
        let old = self.names.insert(name.to_vec(), (ino, placed.map(|(cookie, _)| cookie)));
        if let (Some(order), Some((_, Some(c)))) = (self.order.as_mut(), old) {
            order.remove(&c);
        }
        match (self.order.as_mut(), placed) {
            (Some(order), Some((cookie, kind))) => {
                order.insert(cookie, Placed { name: name.to_vec(), ino, kind });
            }
            _ => self.order = None,
        }
        old.is_none()
    }

    fn remove(&mut self, name: &[u8]) -> Option<Ino> {
        let (ino, cookie) = self.names.remove(name)?;
        if let (Some(order), Some(c)) = (self.order.as_mut(), cookie) {
            order.remove(&c);
        }
        Some(ino)
    }

    /// An entry goes to the kernel with `ttls`.
    fn handing(&mut self, now: Instant, ttls: Ttls) {
        let until = now + ttls.entry;
        if !ttls.entry.is_zero() && self.handed_until.is_none_or(|t| t < until) {
            self.handed_until = Some(until);
        }
    }
}

/// What a revocation dropped: what the kernel may have cached of it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// The names the listing held, if the kernel may cache some of them.
    pub names: Vec<Vec<u8>>,
    /// The inodes whose attributes were held with it.
    pub held: Vec<Ino>,
}

/// Taken before an own change is sent: a new directory's delegation is
/// installed only if no revocation came since, and shared if a sharing
/// did.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    revocations: u64,
    sharings: u64,
    sent: Instant,
}

/// The mount's delegations (see the module header).
#[derive(Default)]
pub struct Delegations {
    state: Mutex<State>,
}

impl Delegations {
    /// What is known of `name` in `dir`: `None` if `dir` is not delegated
    /// here (or its delegation ran out), or `name` is there but its
    /// attributes are not held.
    pub fn lookup(&self, dir: Ino, name: &[u8]) -> Option<Found> {
        let now = Instant::now();
        let mut s = self.state.lock();
        let listing = s.listing(dir, now)?;
        let left = listing.valid_until - now;
        let Some(ino) = listing.get(name) else { return Some(Found::Absent) };
        let attr = s.held.get(&ino)?.1.clone();
        let ttls = Ttls::of(&attr, left);
        s.listings.get_mut(&dir)?.handing(now, ttls);
        Some(Found::Present(attr, ttls))
    }

    /// `ino`'s held attributes, if its directory's delegation is good, and
    /// for how long.
    pub fn attr(&self, ino: Ino) -> Option<(Attr, Duration)> {
        let now = Instant::now();
        let s = self.state.lock();
        let (dir, attr) = s.held.get(&ino)?;
        let listing = s.listing(*dir, now)?;
        Some((attr.clone(), listing.valid_until - now))
    }

    pub fn ticket(&self) -> Ticket {
        let s = self.state.lock();
        Ticket { revocations: s.revocations, sharings: s.sharings, sent: Instant::now() }
    }

    /// An own change made `name` → `attr` in `dir`, and the meta-server
    /// answered it `delegated`; `ttl`: the mount's grant TTL. Answers how
    /// long the new inode's attributes are held.
    pub fn made(
        &self,
        ticket: Ticket,
        dir: Ino,
        name: &[u8],
        attr: &Attr,
        delegated: Delegated,
        ttl: Duration,
    ) -> Option<Ttls> {
        let now = Instant::now();
        let mut s = self.state.lock();
        if delegated.dir && s.revocations == ticket.revocations && s.names < MAX_NAMES {
            // A sharing processed since the request was sent may have been
            // this directory's, which found no listing to mark.
            let shared = s.sharings != ticket.sharings;
            let listing = Listing { own: Some(attr.clone()), shared, ..Listing::new(dir, ticket.sent + ttl) };
            if s.listings.insert(attr.ino, listing).is_some() {
                log::warn!("directory {} delegated twice", attr.ino.0);
            }
        }
        let listing = s.listings.get_mut(&dir)?;
        let valid_until = listing.valid_until;
        let ttls = (delegated.child && valid_until > now).then(|| Ttls::of(attr, valid_until - now));
        if let Some(ttls) = ttls {
            listing.handing(now, ttls);
        }
        if listing.insert(name, attr.ino, delegated.cookie.map(|c| (c, attr.kind))) {
            s.names += 1;
        }
        if s.names > MAX_NAMES {
            // Never answered with a TTL for a name it lacks: dropping it
            // needs no notify.
            let _ = s.drop_listing(dir);
            return None;
        }
        if ttls.is_some() {
            s.held.insert(attr.ino, (dir, attr.clone()));
        }
        ttls
    }

    /// A release sent at `sent` that the meta-server answered with
    /// `attr`, held again with this mount's delegation of `dir`
    /// (`MetaResponse::Held`): held unless an own change dropped its held
    /// attributes since (see "Why it stays true").
    pub fn held_again(&self, dir: Ino, attr: &Attr, sent: Instant) {
        let mut s = self.state.lock();
        if s.listings.contains_key(&dir) && !s.dropped_since(attr.ino, sent) {
            s.held.insert(attr.ino, (dir, attr.clone()));
        }
    }

    /// A lookup sent at `sent` that the meta-server answered held `attr`
    /// with this mount's delegation of `dir` (`Grant::held`): held unless
    /// an own change dropped its held attributes since.
    pub fn held(&self, dir: Ino, name: &[u8], attr: &Attr, sent: Instant) {
        let mut s = self.state.lock();
        if s.dropped_since(attr.ino, sent) {
            return;
        }
        let Some(listing) = s.listings.get(&dir) else { return };
        if listing.get(name) == Some(attr.ino) {
            s.held.insert(attr.ino, (dir, attr.clone()));
        }
    }

    /// An own change removed `name` from `dir`.
    pub fn removed(&self, dir: Ino, name: &[u8]) {
        let mut s = self.state.lock();
        let Some(listing) = s.listings.get_mut(&dir) else { return };
        if let Some(ino) = listing.remove(name) {
            s.names -= 1;
            s.held.remove(&ino);
            s.dropped(ino);
            // A removed directory's own listing goes with it (the kernel
            // dropped what it cached of it with the rmdir).
            let _ = s.drop_listing(ino);
        }
    }

    /// An own rename moved `from` to `to` (swapped them if `exchange`).
    /// Both listings follow if both are kept; otherwise the one that is
    /// can no longer tell what it holds under the new name and goes.
    pub fn renamed(&self, from: (Ino, &[u8]), to: (Ino, &[u8]), exchange: bool) {
        let mut s = self.state.lock();
        let moved = s.listings.get(&from.0).and_then(|l| l.get(from.1));
        let replaced = s.listings.get(&to.0).and_then(|l| l.get(to.1));
        // The moved and replaced inodes' change times moved.
        for ino in moved.iter().chain(replaced.iter()) {
            s.held.remove(ino);
            s.dropped(*ino);
        }
        // Whatever it replaced lost a link; if that is not known here, it
        // may be any held file.
        if !exchange && !s.listings.contains_key(&to.0) {
            s.held.retain(|_, (_, attr)| attr.kind == FileKind::Dir);
            s.dropped_all();
        }
        // A moved directory's `..` is now the other one.
        s.reparent(moved, from.0, to.0);
        if exchange {
            s.reparent(replaced, to.0, from.0);
        }
        let both = s.listings.contains_key(&from.0) && s.listings.contains_key(&to.0);
        // Own changes: the kernel updates its cache from their answers.
        if !both || (exchange && (moved.is_none() || replaced.is_none())) {
            let _ = s.drop_listing(from.0);
            let _ = s.drop_listing(to.0);
            return;
        }
        let Some(moved) = moved else { return }; // nothing was there: the rename failed

        // The answer carries no cookie for the names it made: neither
        // listing can be listed here any more (`Listing::insert`).
        if let Some(l) = s.listings.get_mut(&from.0) {
            l.remove(from.1);
        }
        s.names -= 1;
        if let Some(l) = s.listings.get_mut(&to.0) {
            if l.insert(to.1, moved, None) {
                s.names += 1;
            }
        }
        if let (true, Some(replaced)) = (exchange, replaced) {
            if let Some(l) = s.listings.get_mut(&from.0) {
                l.insert(from.1, replaced, None);
                s.names += 1;
            }
        } else if let Some(replaced) = replaced {
            // Replaced: gone from the directory (and its listing, if a
            // directory).
            let _ = s.drop_listing(replaced);
        }
    }

    /// Directory `dir` changed through this mount and the answer brought
    /// its new attributes: they replace the held ones, if held.
    pub fn refresh(&self, attr: &Attr) {
        let mut s = self.state.lock();
        if let Some((_, held)) = s.held.get_mut(&attr.ino) {
            *held = attr.clone();
        }
        if let Some(own) = s.listings.get_mut(&attr.ino).and_then(|l| l.own.as_mut()) {
            *own = attr.clone();
        }
    }

    /// An own change of `ino`'s attributes whose answer does not carry
    /// them.
    pub fn forget(&self, ino: Ino) {
        let mut s = self.state.lock();
        s.held.remove(&ino);
        s.dropped(ino);
    }

    /// An own change removed a name of some file not known here (a
    /// rename over a name in a directory not kept here, an unlink whose
    /// answer did not say): any held file may have lost a link, and
    /// their attributes go.
    pub fn forget_files(&self) {
        let mut s = self.state.lock();
        s.held.retain(|_, (_, attr)| attr.kind == FileKind::Dir);
        s.dropped_all();
    }

    /// An own change of `dir`'s entries failed, perhaps in part: its
    /// listing, and its own attributes, go.
    pub fn unsure(&self, dir: Ino) {
        let mut s = self.state.lock();
        let _ = s.drop_listing(dir);
        s.held.remove(&dir);
        s.dropped(dir);
    }

    /// The meta-server revoked `dir`'s delegation (`Invalidation::Listing`):
    /// answers what the kernel may have cached of it.
    pub fn revoked(&self, dir: Ino) -> Dropped {
        let mut s = self.state.lock();
        s.revocations += 1;
        s.drop_listing(dir)
    }

    /// A poll sent at `sent` renewed this mount's delegations, and every
    /// revocation queued before it has been processed: each listing still
    /// good at `sent` is good for `ttl` from then. Listings that ran out go.
    pub fn renew(&self, sent: Instant, ttl: Duration) {
        let mut s = self.state.lock();
        let mut expired = Vec::new();
        for (dir, listing) in s.listings.iter_mut() {
            if listing.valid_until > sent {
                listing.valid_until = listing.valid_until.max(sent + ttl);
            } else {
                expired.push(*dir);
            }
        }
        for dir in expired {
            // The kernel's TTLs ran out before it did.
            let _ = s.drop_listing(dir);
        }
    }

    /// Forgets every delegation (a new registration of the client).
    pub fn clear(&self) {
        let mut s = self.state.lock();
        s.revocations += 1;
        s.listings.clear();
        s.held.clear();
        s.names = 0;
    }

    /// Delegated directories kept now (tests, diagnostics).
    pub fn len(&self) -> usize {
        self.state.lock().listings.len()
    }
}

/// What the kernel gets for an inode a delegation answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttls {
    pub attr: Duration,
    pub entry: Duration,
}

impl Ttls {
    /// `ttl` for the entry and its attributes alike.
    pub fn both(ttl: Duration) -> Self {
        Self { attr: ttl, entry: ttl }
    }
}

/// Longest a file's entry from a delegation is cached by the kernel (see
/// "What the kernel gets").
pub const FILE_ENTRY_TTL: Duration = Duration::from_millis(100);

impl Ttls {
    /// Held attributes good for `left`: the attributes for all of it, and
    /// the entry too if a directory's (path walks go through it); a file's
    /// entry for at most [`FILE_ENTRY_TTL`].
    fn of(attr: &Attr, left: Duration) -> Self {
        let entry = if attr.kind == FileKind::Dir { left } else { left.min(FILE_ENTRY_TTL) };
        Self { attr: left, entry }
    }

    /// These, unless an invalidation was processed while they were read
    /// (`before`, `after`; see [`crate::invalidation`]): then nothing.
    pub(crate) fn unless_overtaken(self, before: Sample, after: Sample) -> Self {
        Self {
            attr: unless_overtaken(self.attr, before, after),
            entry: unless_overtaken(self.entry, before, after),
        }
    }
}

/// The TTL to hand the kernel for what a delegation answered, good for
/// `left`: zero if an invalidation was processed while it was read
/// (`before`, `after`; see [`crate::invalidation`]).
fn unless_overtaken(left: Duration, before: Sample, after: Sample) -> Duration {
    if before == after {
        left
    } else {
        Duration::ZERO
    }
}

/// The file system's use of its delegations: nothing of them unless the
/// mount caches coherently.
impl CitronFuse {
    fn delegations(&self) -> Option<&Delegations> {
        self.caching().then(|| self.invalidations.delegations())
    }

    /// Answers a `LOOKUP` of `name` in `parent` from a delegation; `reply`
    /// back if none answers it.
    pub(crate) fn lookup_delegated(&self, parent: Ino, name: &[u8], reply: ReplyEntry) -> Option<ReplyEntry> {
        let Some(d) = self.delegations() else { return Some(reply) };
        if name == b"." || name == b".." {
            return Some(reply);
        }
        let epochs = self.invalidations.epochs();
        let before = epochs.all();
        // Refused as the meta-server's lookup refuses it: a name no
        // listing can hold is not absent but too long, and the calls that
        // name it (chmod, truncate, create, rename, ...) must fail with
        // ENAMETOOLONG, not ENOENT.
        if name.len() > NAME_MAX {
            reply.error(Errno::ENAMETOOLONG);
            return None;
        }
        match d.lookup(parent, name) {
            // TTL zero: a negative entry could be dropped only by an epoch
            // (see the module header).
            Some(Found::Absent) => reply.error(Errno::ENOENT),
            Some(Found::Present(attr, ttls)) => {
                let ttls = ttls.unless_overtaken(before, epochs.all());
                reply.entry_with_ttls(&ttls.attr, &ttls.entry, &fuse_attr(&attr), Generation(0))
            }
            None => return Some(reply),
        }
        None
    }

    /// Up to `max` entries of `dir`'s listing after cookie `after` from
    /// its delegation, if this mount lists it itself ([`Page`]); each
    /// entry's TTLs are zero if an invalidation was processed while it was
    /// read (see [`crate::invalidation`]).
    pub(crate) fn page_delegated(&self, dir: Ino, after: u64, max: usize, plus: bool) -> Option<Page> {
        let d = self.delegations()?;
        let epochs = self.invalidations.epochs();
        let before = epochs.all();
        let mut page = d.page(dir, after, max, plus)?;
        let read = epochs.all();
        for e in &mut page.entries {
            e.ttls = e.ttls.unless_overtaken(before, read);
        }
        Some(page)
    }

    /// A lookup sent at `sent` the meta-server answered: `grant.held`
    /// attributes are kept with this mount's delegation of `parent`.
    pub(crate) fn lookup_answered(
        &self,
        parent: Ino,
        name: &[u8],
        attr: &Attr,
        grant: &Grant,
        sent: Instant,
    ) {
        if let (Some(d), true) = (self.delegations(), grant.held) {
            d.held(parent, name, attr, sent);
        }
    }

    /// Answers a `GETATTR` of `ino` from a delegation; `reply` back if
    /// none holds it.
    pub(crate) fn getattr_delegated(&self, ino: Ino, reply: ReplyAttr) -> Option<ReplyAttr> {
        let epochs = self.invalidations.epochs();
        let before = epochs.of(ino);
        match self.delegations().and_then(|d| d.attr(ino)) {
            Some((attr, left)) => {
                reply.attr(&unless_overtaken(left, before, epochs.of(ino)), &fuse_attr(&attr));
                None
            }
            None => Some(reply),
        }
    }

    /// Before an own change that makes an entry.
    pub(crate) fn making(&self) -> Option<Ticket> {
        self.delegations().map(Delegations::ticket)
    }

    /// An own change that makes `name` in `parent` answered: the TTLs to
    /// hand the kernel for the new inode's entry and attributes.
    pub(crate) fn made(
        &self,
        ticket: Option<Ticket>,
        parent: Ino,
        name: &[u8],
        r: Result<(&Attr, Delegated), &FsError>,
    ) -> Ttls {
        let ungranted = Ttls::both(self.options.attr_ttl);
        let (Some(d), Some(t)) = (self.delegations(), ticket) else { return ungranted };
        let epochs = self.invalidations.epochs();
        let before = epochs.all();
        match r {
            Ok((attr, delegated)) => match d.made(t, parent, name, attr, delegated, self.options.cache_ttl) {
                Some(ttls) => ttls.unless_overtaken(before, epochs.all()),
                None => ungranted,
            },
            Err(_) => {
                d.unsure(parent);
                ungranted
            }
        }
    }

    /// An own change that removes `name` from `parent` answered.
    pub(crate) fn removed<T>(&self, parent: Ino, name: &[u8], r: &Result<T, FsError>) {
        let Some(d) = self.delegations() else { return };
        match r {
            Ok(_) => d.removed(parent, name),
            Err(_) => d.unsure(parent),
        }
    }

    /// An own rename answered.
    pub(crate) fn renamed(&self, from: (Ino, &[u8]), to: (Ino, &[u8]), exchange: bool, ok: bool) {
        let Some(d) = self.delegations() else { return };
        if ok {
            d.renamed(from, to, exchange);
        } else {
            d.unsure(from.0);
            d.unsure(to.0);
        }
        // Both directories' times moved; the answer does not carry them.
        d.forget(from.0);
        d.forget(to.0);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use citronfs_core::types::FileKind;

    use super::*;

    pub(crate) fn attr(ino: u64, kind: FileKind) -> Attr {
        crate::attr_cache::tests::attr(ino, kind, 1)
    }

    pub(crate) const TTL: Duration = Duration::from_secs(60);
    const ROOT: Ino = Ino(1);
    const DIR: Delegated = Delegated { dir: true, child: false, cookie: Some(20) };
    pub(crate) const CHILD: Delegated = Delegated { dir: false, child: true, cookie: None };

    /// A mount that made directory 2 in the root.
    pub(crate) fn with_dir() -> Delegations {
        let d = Delegations::default();
        d.made(d.ticket(), ROOT, b"d", &attr(2, FileKind::Dir), DIR, TTL);
        d
    }

    /// Only a file made here (its entry has a cookie), held, with one
    /// link, in a directory nobody else looked into and that lasts the
    /// margin, is removed for a late unlink, and the queueing runs then.
    #[test]
    fn only_files_made_here_are_removed_late_and_sharing_ends_it() {
        let d = with_dir();
        let made = Delegated { dir: false, child: true, cookie: Some(30) };
        d.made(d.ticket(), Ino(2), b"f", &attr(3, FileKind::File), made, TTL);
        d.made(d.ticket(), Ino(2), b"g", &attr(4, FileKind::File), made, TTL);
        // Held, but its entry came without a cookie (as an own rename's).
        d.made(d.ticket(), Ino(2), b"moved", &attr(5, FileKind::File), CHILD, TTL);
        let margin = Duration::from_millis(100);
        assert_eq!(d.made_here(Ino(2), b"f", margin).map(|a| a.ino), Some(Ino(3)));
        assert_eq!(d.made_here(Ino(2), b"moved", margin), None, "a name it did not make");
        assert_eq!(d.made_here(Ino(2), b"f", TTL * 2), None, "a delegation shorter than the margin");
        let mut queued = 0;
        assert!(!d.remove_late(Ino(2), b"f", Ino(9), margin, || queued += 1), "another inode under the name");
        assert!(d.remove_late(Ino(2), b"f", Ino(3), margin, || queued += 1));
        assert_eq!(queued, 1);
        assert_eq!(d.lookup(Ino(2), b"f"), Some(Found::Absent), "the name stayed in the listing");
        assert!(!d.remove_late(Ino(2), b"f", Ino(3), margin, || queued += 1), "removed twice");
        d.shared(Ino(2));
        assert_eq!(d.made_here(Ino(2), b"g", margin), None, "answered first after another mount looked");
        assert!(!d.remove_late(Ino(2), b"g", Ino(4), margin, || queued += 1));
        assert_eq!(queued, 1);
        assert!(matches!(d.lookup(Ino(2), b"g"), Some(Found::Present(..))), "sharing dropped the listing");
    }

    /// Another mount looked into a new directory before this mount
    /// processed its mkdir's answer: the sharing found no listing, and the
    /// listing the answer installs is shared — no create or unlink is
    /// answered there before it is sent.
    #[test]
    fn a_sharing_that_overtakes_a_mkdirs_answer_leaves_its_listing_shared() {
        let d = Delegations::default();
        let ticket = d.ticket();
        d.shared(Ino(2));
        d.made(ticket, ROOT, b"d", &attr(2, FileKind::Dir), DIR, TTL);
        assert_eq!(d.lookup(Ino(2), b"f"), Some(Found::Absent), "a shared listing still answers lookups");
        let margin = Duration::from_millis(100);
        assert!(!d.absent_here(Ino(2), b"f", margin), "a create would be answered first");
        let made = attr(3, FileKind::File);
        assert_eq!(d.make_late(Ino(2), b"f", &made, 30, margin, || ()), None);
        // A mkdir sent after the sharing is exclusive.
        d.made(d.ticket(), ROOT, b"e", &attr(4, FileKind::Dir), DIR, TTL);
        assert!(d.absent_here(Ino(4), b"f", margin));
    }

    /// A lookup's or a release's answer that read a child's attributes
    /// before an own change dropped them (a link or chmod on another
    /// thread) holds nothing; one sent after it does.
    #[test]
    fn an_answer_sent_before_an_own_change_of_the_child_holds_nothing() {
        let d = with_dir();
        d.made(d.ticket(), Ino(2), b"f", &attr(3, FileKind::File), CHILD, TTL);
        let before = Instant::now();
        // A clock reading apart from the drop.
        std::thread::sleep(Duration::from_millis(1));
        d.forget(Ino(3));
        d.held(Ino(2), b"f", &attr(3, FileKind::File), before);
        assert_eq!(d.attr(Ino(3)), None, "a lookup's answer from before an own link held its link count");
        d.held_again(Ino(2), &attr(3, FileKind::File), before);
        assert_eq!(d.attr(Ino(3)), None, "a release's answer from before an own link held its link count");
        std::thread::sleep(Duration::from_millis(1));
        d.held_again(Ino(2), &attr(3, FileKind::File), Instant::now());
        assert!(d.attr(Ino(3)).is_some());
        // Another inode's drop refuses nothing; a drop of any does.
        d.made(d.ticket(), Ino(2), b"g", &attr(4, FileKind::File), CHILD, TTL);
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        d.forget(Ino(4));
        d.forget(Ino(3));
        d.held(Ino(2), b"g", &attr(4, FileKind::File), before);
        assert!(d.attr(Ino(4)).is_none());
        d.held_again(Ino(2), &attr(3, FileKind::File), before);
        assert!(d.attr(Ino(3)).is_none());
        let sent = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        d.forget(Ino(9));
        d.held(Ino(2), b"g", &attr(4, FileKind::File), sent);
        assert!(d.attr(Ino(4)).is_some(), "another inode's drop refused the answer");
        d.forget_files();
        d.held_again(Ino(2), &attr(3, FileKind::File), sent);
        assert!(d.attr(Ino(3)).is_none(), "held past a drop of every file's attributes");
    }

    #[test]
    fn a_made_directory_answers_every_name_until_revoked() {
        let d = with_dir();
        assert_eq!(d.lookup(Ino(2), b"f"), Some(Found::Absent));
        assert_eq!(d.lookup(ROOT, b"d"), None, "the root was never delegated");
        d.made(d.ticket(), Ino(2), b"f", &attr(3, FileKind::File), CHILD, TTL);
        let Some(Found::Present(found, ttls)) = d.lookup(Ino(2), b"f") else { panic!("d/f not found") };
        assert_eq!(found, attr(3, FileKind::File));
        assert!(ttls.attr <= TTL && ttls.attr > TTL / 2, "held for {ttls:?}");
        assert_eq!(ttls.entry, FILE_ENTRY_TTL);
        assert_eq!(d.attr(Ino(3)).map(|(a, _)| a), Some(attr(3, FileKind::File)));
        d.forget(Ino(3));
        assert_eq!(d.lookup(Ino(2), b"f"), None, "answered attributes an own write changed");
        assert_eq!(d.lookup(Ino(2), b"g"), Some(Found::Absent));
        // Sent after the forget (a clock reading apart from it).
        std::thread::sleep(Duration::from_millis(1));
        d.held(Ino(2), b"f", &attr(3, FileKind::File), Instant::now());
        assert!(d.attr(Ino(3)).is_some());
        d.removed(Ino(2), b"f");
        assert_eq!(d.lookup(Ino(2), b"f"), Some(Found::Absent));
        assert_eq!(d.attr(Ino(3)), None);
        d.made(d.ticket(), Ino(2), b"g", &attr(4, FileKind::File), CHILD, TTL);
        let dropped = d.revoked(Ino(2));
        assert_eq!(dropped.held, vec![Ino(4)], "the kernel is not told of the held attributes");
        assert_eq!(d.lookup(Ino(2), b"h"), None, "answered past a revocation");
        assert_eq!(d.attr(Ino(4)), None);
        d.made(d.ticket(), Ino(2), b"h", &attr(5, FileKind::File), CHILD, TTL);
        assert_eq!(d.attr(Ino(5)), None, "a late answer brought a revoked listing back");
        assert_eq!(d.state.lock().names, 0);
    }

    #[test]
    fn a_revocation_names_the_entries_only_while_the_kernel_may_cache_one() {
        let d = with_dir();
        d.made(d.ticket(), Ino(2), b"f", &attr(3, FileKind::File), CHILD, TTL);
        std::thread::sleep(FILE_ENTRY_TTL + Duration::from_millis(10));
        assert!(d.revoked(Ino(2)).names.is_empty(), "names notified after their entries expired");
        d.made(d.ticket(), ROOT, b"d2", &attr(5, FileKind::Dir), DIR, TTL);
        d.made(d.ticket(), Ino(5), b"f", &attr(3, FileKind::File), CHILD, TTL);
        d.made(d.ticket(), Ino(5), b"e", &attr(4, FileKind::Dir), CHILD, TTL);
        std::thread::sleep(FILE_ENTRY_TTL + Duration::from_millis(10));
        let mut names = d.revoked(Ino(5)).names;
        names.sort();
        assert_eq!(names, vec![b"e".to_vec(), b"f".to_vec()], "a subdirectory's entry was forgotten");
        assert_eq!(Ttls::of(&attr(3, FileKind::File), TTL).entry, FILE_ENTRY_TTL);
        assert_eq!(Ttls::of(&attr(4, FileKind::Dir), TTL).entry, TTL);
    }

    #[test]
    fn a_mkdir_overtaken_by_a_revocation_delegates_nothing() {
        let d = Delegations::default();
        let ticket = d.ticket();
        d.revoked(Ino(2));
        d.made(ticket, ROOT, b"d", &attr(2, FileKind::Dir), DIR, TTL);
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn a_listing_lasts_while_renewed() {
        let d = Delegations::default();
        let ttl = Duration::from_millis(50);
        let ticket = d.ticket();
        d.made(ticket, ROOT, b"d", &attr(2, FileKind::Dir), DIR, ttl);
        d.renew(ticket.sent + ttl / 2, ttl);
        std::thread::sleep(ttl);
        // Still good until sent + ttl / 2 + ttl, if the sleep was short.
        let later = Instant::now();
        if later < ticket.sent + ttl / 2 + ttl {
            assert!(d.lookup(Ino(2), b"f").is_some(), "renewal did not extend it");
        }
        std::thread::sleep(ttl * 2);
        assert_eq!(d.lookup(Ino(2), b"f"), None, "answered past its expiry");
        d.renew(Instant::now(), ttl);
        assert_eq!(d.len(), 0, "an expired listing was renewed");
    }

    #[test]
    fn renames_move_names_between_listings_or_drop_them() {
        let d = with_dir();
        d.made(d.ticket(), ROOT, b"e", &attr(3, FileKind::Dir), DIR, TTL);
        d.made(d.ticket(), Ino(2), b"f", &attr(4, FileKind::File), CHILD, TTL);
        d.renamed((Ino(2), b"f"), (Ino(3), b"g"), false);
        assert_eq!(d.lookup(Ino(2), b"f"), Some(Found::Absent));
        assert_eq!(d.lookup(Ino(3), b"g"), None, "the moved file's attributes are held still");
        assert_eq!(d.state.lock().listings[&Ino(3)].get(b"g"), Some(Ino(4)));
        // Into a directory this mount does not know: the source goes.
        d.renamed((Ino(3), b"g"), (ROOT, b"x"), false);
        assert_eq!(d.lookup(Ino(3), b"g"), None);
        assert_eq!(d.lookup(Ino(2), b"f"), Some(Found::Absent));
    }

    #[test]
    fn listings_are_bounded() {
        let d = with_dir();
        d.state.lock().names = MAX_NAMES;
        d.made(d.ticket(), Ino(2), b"f", &attr(3, FileKind::File), CHILD, TTL);
        assert_eq!(d.len(), 0, "a listing past the bound was kept");
        assert_eq!(d.state.lock().names, MAX_NAMES);
    }
}
