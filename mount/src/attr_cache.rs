//! Attributes a caching mount answers `GETATTR` with itself, without a
//! round trip to the meta-server (coherent caching): directories' after its own
//! changes of them, and those of regular files it created and still has
//! open ("New files" below).
//!
//! # Why
//!
//! After its own create, unlink or mkdir in a directory the kernel
//! drops the directory's attributes (`fuse_dir_changed`), and with
//! `default_permissions` its next path walk through the directory asks
//! `GETATTR` for them again: one round trip per create. The meta-server
//! already answers such a change of a caching mount with the directory's
//! attributes after it, granted to this mount like a getattr's
//! (`MetaResponse::ParentGranted`; it keeps the changer's grant and calls
//! every *other* mount back before the change answers, meta-server
//! `grants`). They are kept here until the grant runs out, and `GETATTR`
//! answers from here while they are.
//!
//! # What is kept, and the races
//!
//! Only directories, and only attributes a change's answer brought: a
//! directory's attributes change only through the meta-server (never
//! one-sidedly, as a regular file's size does), so every change of one is
//! either another mount's — called back, which drops it here — or this
//! mount's own — which drops or replaces it here. Each case:
//!
//! * **another mount's change**: the meta-server revokes this mount's grant
//!   before the change answers; the invalidation thread calls
//!   [`AttrCache::invalidate`] *before* it tells the kernel and
//!   acknowledges, so once the change has answered no `GETATTR` finds the
//!   old attributes here. The meta-server waits for the acknowledgement or
//!   the grant's expiry, and an entry here expires no later than the grant
//!   (it is counted from when the request was *sent*).
//! * **a reply overtaken by an invalidation**: every request whose answer
//!   may be installed takes a [`Ticket`] before it is sent — a generation
//!   of the inode's stripe, bumped by every invalidation and every own
//!   change started since — and [`AttrCache::install`] compares it and
//!   inserts under one lock, the lock [`AttrCache::invalidate`] bumps and
//!   removes under, so there is no window between the check and the
//!   insertion.
//! * **two own changes of one directory at once** (two processes creating
//!   in it): each takes its ticket with [`AttrCache::changing`], which bumps
//!   the generation first, so only the change started last can install; an
//!   older answer arriving after a newer change started is dropped (a miss,
//!   never a stale answer).
//! * **own changes whose answer carries no new attributes** (setattr,
//!   link, extended attributes): the mount calls [`AttrCache::invalidate`]
//!   for what they change, after the answer and before it replies to the
//!   kernel; an own rename or rmdir drops everything
//!   ([`AttrCache::invalidate_all`]: the moved directory's times change
//!   too, a removed one's link count, and their numbers are not in the
//!   request).
//!
//! # New files
//!
//! The attributes of a regular file this mount created are kept too, from
//! the create's answer, while the meta-server grants them to it as their
//! creator (meta-server `grants`, "Creators"): the kernel asks `GETATTR`
//! of every new file (its permission check in the open that follows the
//! create, the attributes' TTL being zero), and is answered from here,
//! with TTL zero still — the kernel never caches them, so dropping them
//! here is all it takes to stop answering them. Each case:
//!
//! * **the creator's release**: the grant ends at this client's last
//!   release of the file, without a callback; the mount drops the
//!   attributes at *every* release of the file here
//!   ([`AttrCache::forget_file`]), before the release reaches the
//!   meta-server;
//! * **another mount's change**: called back, as a directory's;
//! * **a change the meta-server does not see or does not call this mount
//!   back for** — its own write, fallocate, setattr, open, link (the size,
//!   times or link count change) — drops them before or after it, before
//!   its reply; its own unlink drops the removed inode's (its answer
//!   names it, `MetaResponse::Removed`), its own rename or rmdir every
//!   file's (the inodes they change are not in the request);
//! * **a create's answer overtaken by an invalidation**: the new inode's
//!   number is not known before the answer, so a create's ticket
//!   ([`AttrCache::creating`]) is the count of drops so far, and the
//!   answer is installed only if none of the drops since named the new
//!   inode — the last [`RECENT`] are remembered, and more than that since
//!   the ticket install nothing — checked and inserted under the lock
//!   drops take;
//! * **the TTL**: counted from when the request was sent, as a
//!   directory's.
//!
//! # Written files
//!
//! A regular file open for writing anywhere has no attributes granted (its
//! size and mtime change one-sidedly), but all the rest of them is
//! (`Grant::live`, meta-server `grants`, "Written files"). For a file
//! open on this mount they are kept here as a *base*: a `GETATTR` reads
//! the size and mtime from the file's attribute slot and the allocated
//! bytes from its layout (one verb, `FsClient::live_attr`) and answers
//! them over the base with TTL zero: a database's `fstat` and `stat` of
//! its own file at every transaction cost no round trip.
//! Each case:
//!
//! * **another mount's change** of the base (chmod, chown, utimes, link,
//!   unlink, extended attributes, a truncate): called back, as a
//!   directory's;
//! * **its writes, anyone's**: nothing here changes; what they change is
//!   read live;
//! * **own changes of the base** — setattr, fallocate, link, extended
//!   attributes, unlink, rename — drop it, as above; so does this mount's
//!   release of the file (it may no longer have the slot's address);
//! * **an answer overtaken by an invalidation**: installed only if the
//!   inode's generation did not move since the request was sent
//!   ([`AttrCache::ticket`]);
//! * **an answer overtaken by this mount's release**: the grant ends,
//!   without a callback, when the meta-server processes this client's
//!   last release of the file, which the client sends up to a linger
//!   after the close (`releases` of the client): a getattr that reaches
//!   the meta-server in between is still granted the base, and the grant
//!   ends right after. So a release drops the base and moves the
//!   generation both before and after the client queues it
//!   ([`AttrCache::released`], twice), and a getattr keeps its answer only
//!   if the file was open here *after* it took its ticket: then no last
//!   release was queued between the ticket and the install (it would have
//!   moved the generation), so the meta-server's count of this client's
//!   opens stayed above zero from the answer to the install, and the
//!   release that ends the grant is queued after the install, by a release
//!   that drops the base first.
//!
//! Strict mounts (TTL zero) never install anything here: they ask the
//! meta-server every time.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use citronfs_core::client::ChangeGrant;
use citronfs_core::types::{Attr, FileKind, Ino, Timestamp};
use citronfs_core::FsError;
use fuser::ReplyAttr;
use parking_lot::Mutex;

use crate::{errno, fuse_attr, CitronFuse};

/// Generations per stripe of inodes: a collision only drops an answer.
const STRIPES: usize = 1024;

/// Drops remembered for the creates in flight (see "New files" above): a
/// create that more drops overtook installs nothing.
const RECENT: usize = 256;

/// A directory's attributes, valid until `expires`.
#[derive(Clone, Debug)]
struct Cached {
    attr: Attr,
    expires: Instant,
}

struct State {
    attrs: HashMap<Ino, Cached>,
    /// New regular files' attributes (see "New files" above).
    files: HashMap<Ino, Cached>,
    /// Written files' bases (see "Written files" above).
    live: HashMap<Ino, Cached>,
    generations: Box<[u64; STRIPES]>,
    /// Drops ([`AttrCache::invalidate`]) so far, and the inodes of the last
    /// [`RECENT`] of them.
    dropped: u64,
    recent: VecDeque<Ino>,
}

impl State {
    fn generation(&mut self, ino: Ino) -> &mut u64 {
        &mut self.generations[(ino.0 as usize) % STRIPES]
    }
}

/// What a request took before it was sent: its answer is installed only if
/// nothing invalidated or changed the inode since.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    ino: Ino,
    generation: u64,
    sent: Instant,
}

/// What a create took before it was sent: the drops so far (the new
/// inode's number is not known yet).
#[derive(Clone, Copy, Debug)]
pub struct CreateTicket {
    dropped: u64,
    sent: Instant,
}

/// The mount's granted directory attributes (see the module header).
pub struct AttrCache {
    state: Mutex<State>,
}

impl Default for AttrCache {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                attrs: HashMap::new(),
                files: HashMap::new(),
                live: HashMap::new(),
                generations: Box::new([0; STRIPES]),
                dropped: 0,
                recent: VecDeque::with_capacity(RECENT),
            }),
        }
    }
}

impl AttrCache {
    /// Before an own change of directory `ino` whose answer brings its new
    /// attributes: answers of changes started earlier are no longer
    /// installed.
    pub fn changing(&self, ino: Ino) -> Ticket {
        let mut s = self.state.lock();
        let g = s.generation(ino);
        *g += 1;
        Ticket { ino, generation: *g, sent: Instant::now() }
    }

    /// Installs `attr` (the directory of `ticket`'s answer), granted for
    /// `ttl` from when the request was sent, unless the inode was
    /// invalidated or changed again since the ticket was taken.
    pub fn install(&self, ticket: Ticket, attr: Attr, ttl: Duration) {
        if attr.ino != ticket.ino || attr.kind != FileKind::Dir || ttl.is_zero() {
            return;
        }
        let expires = ticket.sent + ttl;
        let mut s = self.state.lock();
        if *s.generation(ticket.ino) != ticket.generation {
            return;
        }
        s.attrs.insert(ticket.ino, Cached { attr, expires });
    }

    /// Before a getattr whose answer may be kept: only an answer that no
    /// invalidation or own change of `ino` overtook is.
    pub fn ticket(&self, ino: Ino) -> Ticket {
        let mut s = self.state.lock();
        let generation = *s.generation(ino);
        Ticket { ino, generation, sent: Instant::now() }
    }

    /// Keeps `base`, a written file's attributes but what changes
    /// one-sidedly, granted for `ttl` from when the request of `ticket`
    /// was sent, unless the inode was invalidated or changed since.
    pub fn install_live(&self, ticket: Ticket, base: Attr, ttl: Duration) {
        if base.ino != ticket.ino || base.kind != FileKind::File || ttl.is_zero() {
            return;
        }
        let mut s = self.state.lock();
        if *s.generation(ticket.ino) == ticket.generation {
            s.live.insert(ticket.ino, Cached { attr: base, expires: ticket.sent + ttl });
        }
    }

    /// Written file `ino`'s base, if kept and not expired.
    pub fn live(&self, ino: Ino) -> Option<Attr> {
        let mut s = self.state.lock();
        let c = s.live.get(&ino)?;
        if c.expires > Instant::now() {
            return Some(c.attr.clone());
        }
        s.live.remove(&ino);
        None
    }

    /// This mount's release of `ino`: what is kept of it as a new file
    /// and as a written one goes, and no answer in flight installs a base
    /// (see "Written files" above: called before and after the release is
    /// queued).
    pub fn released(&self, ino: Ino) {
        let mut s = self.state.lock();
        *s.generation(ino) += 1;
        s.files.remove(&ino);
        s.live.remove(&ino);
    }

    /// Before a create whose answer may bring a new file's attributes.
    pub fn creating(&self) -> CreateTicket {
        CreateTicket { dropped: self.state.lock().dropped, sent: Instant::now() }
    }

    /// Installs `attr`, a regular file this mount created with `ticket`,
    /// granted to it for `ttl` from when the request was sent or until its
    /// release here, unless a drop since the ticket named it (or too many
    /// to tell came).
    pub fn install_created(&self, ticket: CreateTicket, attr: Attr, ttl: Duration) {
        if attr.kind != FileKind::File || ttl.is_zero() {
            return;
        }
        let mut s = self.state.lock();
        let since = (s.dropped - ticket.dropped) as usize;
        if since > s.recent.len() || s.recent.iter().rev().take(since).any(|i| *i == attr.ino) {
            return;
        }
        s.files.insert(attr.ino, Cached { attr, expires: ticket.sent + ttl });
    }

    /// Drops what is kept of new file `ino` (its release, or an own change
    /// of its size, times or mode).
    pub fn forget_file(&self, ino: Ino) {
        let mut s = self.state.lock();
        if !s.files.is_empty() {
            s.files.remove(&ino);
        }
    }

    /// Drops what is kept of every new file and every written file's base
    /// (an own unlink whose answer did not name the removed inode).
    pub fn forget_files(&self) {
        let mut s = self.state.lock();
        s.files.clear();
        s.live.clear();
        // Nor is a written file's base in flight kept (which inode changed
        // is not known).
        for g in s.generations.iter_mut() {
            *g += 1;
        }
    }

    /// Drops `ino`'s attributes, and every answer in flight that would
    /// install them (a callback from the meta-server, or an own change
    /// whose answer does not carry them).
    pub fn invalidate(&self, ino: Ino) {
        let mut s = self.state.lock();
        *s.generation(ino) += 1;
        s.attrs.remove(&ino);
        s.files.remove(&ino);
        s.live.remove(&ino);
        s.dropped += 1;
        if s.recent.len() == RECENT {
            s.recent.pop_front();
        }
        s.recent.push_back(ino);
    }

    /// An own late change of directory `dir`'s entries, answered at `at`
    /// without a round trip (`crate::late_changes`), that added
    /// `entries` names (a create one, an unlink minus one): its kept
    /// attributes take `at` as their mtime and ctime and count the names
    /// in their size, as the meta-server's will, and an answer in flight
    /// that would install older ones is dropped (as after
    /// [`Self::changing`]). Returns them, or `None` if none were kept
    /// (nothing is then).
    pub fn changed_here(&self, dir: Ino, at: Timestamp, entries: i64) -> Option<Attr> {
        let now = Instant::now();
        let mut s = self.state.lock();
        *s.generation(dir) += 1;
        match s.attrs.get_mut(&dir) {
            Some(c) if c.expires > now => {
                c.attr.mtime = at;
                c.attr.ctime = at;
                c.attr.size = c.attr.size.saturating_add_signed(entries);
                Some(c.attr.clone())
            }
            _ => {
                s.attrs.remove(&dir);
                None
            }
        }
    }

    /// Drops everything, and every answer in flight.
    pub fn invalidate_all(&self) {
        let mut s = self.state.lock();
        for g in s.generations.iter_mut() {
            *g += 1;
        }
        s.attrs.clear();
        s.files.clear();
        s.live.clear();
        // No create in flight installs (more drops than remembered).
        s.dropped += RECENT as u64 + 1;
        s.recent.clear();
    }

    /// `ino`'s attributes and how long they stay valid (`None`: a new
    /// file's, valid for this one answer only), if held and not expired.
    pub fn get(&self, ino: Ino) -> Option<(Attr, Option<Duration>)> {
        let now = Instant::now();
        let mut s = self.state.lock();
        if let Some(c) = s.attrs.get(&ino) {
            if c.expires > now {
                return Some((c.attr.clone(), Some(c.expires - now)));
            }
            s.attrs.remove(&ino);
        }
        if let Some(c) = s.files.get(&ino) {
            if c.expires > now {
                return Some((c.attr.clone(), None));
            }
            s.files.remove(&ino);
        }
        None
    }

    /// Directories, new files and written files' bases held now, expired
    /// ones included (tests, diagnostics).
    pub fn len(&self) -> usize {
        let s = self.state.lock();
        s.attrs.len() + s.files.len() + s.live.len()
    }
}

/// The file system's use of the cache: nothing of it unless the mount
/// caches coherently.
impl CitronFuse {
    pub(crate) fn caching(&self) -> bool {
        !self.options.cache_ttl.is_zero()
    }

    /// Before an own change of directory `dir`'s entries that answers its
    /// new attributes.
    pub(crate) fn dir_changing(&self, dir: Ino) -> Option<Ticket> {
        self.caching().then(|| self.invalidations.attrs().changing(dir))
    }

    /// The change of `ticket` answered: keeps the directory's attributes it
    /// was granted, if any; a failed change (`None`: it may have been
    /// applied in part, as a create whose open failed) drops what was kept.
    pub(crate) fn dir_changed(&self, ticket: Option<Ticket>, grant: Option<&ChangeGrant>) {
        let Some(t) = ticket else { return };
        match grant.map(|g| g.parent.as_ref()) {
            Some(Some(parent)) => {
                self.invalidations.delegations().refresh(parent);
                self.invalidations.attrs().install(t, parent.clone(), self.options.cache_ttl)
            }
            // Applied, but the directory's attributes are contended: not
            // granted, asked for again.
            Some(None) => self.invalidations.attrs().invalidate(t.ino),
            None => {
                self.invalidations.delegations().unsure(t.ino);
                self.invalidations.attrs().invalidate(t.ino)
            }
        }
    }

    /// [`Self::dir_changed`], passing the change's own answer on.
    pub(crate) fn dir_changed_then<T>(
        &self,
        ticket: Option<Ticket>,
        r: Result<(T, ChangeGrant), FsError>,
    ) -> Result<T, FsError> {
        self.dir_changed(ticket, r.as_ref().ok().map(|(_, grant)| grant));
        r.map(|(answer, _)| answer)
    }

    /// An own change of `inos` whose answer carries no new attributes
    /// answered: what is kept of them goes.
    pub(crate) fn attrs_changed(&self, inos: &[Ino]) {
        if self.caching() {
            for ino in inos {
                self.invalidations.delegations().forget(*ino);
                self.invalidations.delegations().forget_own(*ino);
                self.invalidations.attrs().invalidate(*ino);
            }
        }
    }

    /// An own rename or rmdir answered: everything kept goes (see the
    /// module header).
    pub(crate) fn forget_all_attrs(&self) {
        if self.caching() {
            self.invalidations.attrs().invalidate_all();
        }
    }

    /// Answers a `GETATTR` of `ino` from what is kept of it; `reply` back
    /// if nothing is.
    pub(crate) fn getattr_kept(&self, ino: Ino, reply: ReplyAttr) -> Option<ReplyAttr> {
        match self.caching().then(|| self.invalidations.attrs().get(ino)).flatten() {
            Some((attr, ttl)) => {
                reply.attr(&ttl.unwrap_or(self.options.attr_ttl), &fuse_attr(&attr));
                None
            }
            None => Some(reply),
        }
    }

    /// Before a create of a regular file.
    pub(crate) fn creating(&self) -> Option<CreateTicket> {
        self.caching().then(|| self.invalidations.attrs().creating())
    }

    /// The create of `ticket` answered a new regular file, its attributes
    /// granted to this mount until its release (`grant.created`): kept,
    /// unless an invalidation of it overtook the answer.
    pub(crate) fn created(&self, ticket: Option<CreateTicket>, attr: &Attr, grant: &ChangeGrant) {
        if let Some(t) = ticket.filter(|_| grant.created) {
            self.invalidations.attrs().install_created(t, attr.clone(), self.options.cache_ttl);
        }
    }

    /// An own change of regular file `ino` the meta-server does not call
    /// this mount back for (a write, a fallocate, an open): what is kept of
    /// it goes, as a new file's or a delegated child's.
    pub(crate) fn file_changing(&self, ino: Ino) {
        if self.caching() {
            self.invalidations.delegations().forget(ino);
            self.invalidations.attrs().forget_file(ino);
        }
    }

    /// This mount's release of regular file `ino`: the creator's grant of
    /// a new file's attributes ends. A release changes no attribute, so a
    /// delegated child's stay.
    pub(crate) fn file_released(&self, ino: Ino) {
        if self.caching() {
            self.invalidations.attrs().released(ino);
        }
    }

    /// Answers a `GETATTR` of written file `ino` from its kept base and
    /// what its slot says now (see "Written files"); `reply` back if no
    /// base is kept or the file is not open here.
    pub(crate) fn getattr_live(&self, ino: Ino, reply: ReplyAttr) -> Option<ReplyAttr> {
        let Some(base) = self.caching().then(|| self.invalidations.attrs().live(ino)).flatten() else {
            return Some(reply);
        };
        match self.client.live_attr(&base) {
            Ok(Some(attr)) => reply.attr(&Duration::ZERO, &fuse_attr(&attr)),
            Ok(None) => return Some(reply),
            Err(e) => reply.error(errno(&e)),
        }
        None
    }

    /// An own unlink answered without naming the removed inode: what is
    /// kept of every new and written file goes (it may be one), and every
    /// file's attributes held with a delegation.
    pub(crate) fn forget_files(&self) {
        if self.caching() {
            self.invalidations.attrs().forget_files();
            self.invalidations.delegations().forget_files();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Attributes of inode `ino`, for tests.
    pub(crate) fn attr(ino: u64, kind: FileKind, nlink: u32) -> Attr {
        let t = citronfs_core::types::Timestamp::default();
        Attr {
            ino: Ino(ino),
            kind,
            perm: 0o755,
            uid: 0,
            gid: 0,
            size: 0,
            nlink,
            rdev: 0,
            allocated: 0,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
        }
    }

    fn dir(ino: u64, nlink: u32) -> Attr {
        attr(ino, FileKind::Dir, nlink)
    }

    const TTL: Duration = Duration::from_secs(60);

    #[test]
    fn an_answer_is_served_until_invalidated() {
        let c = AttrCache::default();
        let t = c.changing(Ino(7));
        c.install(t, dir(7, 3), TTL);
        assert_eq!(c.get(Ino(7)).map(|(a, _)| a.nlink), Some(3));
        c.invalidate(Ino(7));
        assert!(c.get(Ino(7)).is_none());
    }

    /// A late unlink's time becomes the kept directory's mtime and ctime,
    /// and an answer of a change sent before it installs nothing; with
    /// nothing kept, nothing is made up.
    #[test]
    fn a_late_unlink_dates_the_kept_directory_and_overtakes_answers_in_flight() {
        let c = AttrCache::default();
        let at = Timestamp { secs: 7, nanos: 8 };
        assert!(c.changed_here(Ino(7), at, -1).is_none(), "attributes made up");
        c.install(c.changing(Ino(7)), dir(7, 3), TTL);
        let in_flight = c.changing(Ino(7));
        let before = c.get(Ino(7)).map(|(a, _)| a.size).unwrap();
        let kept = c.changed_here(Ino(7), at, 1).expect("kept");
        assert_eq!((kept.mtime, kept.ctime, kept.nlink, kept.size), (at, at, 3, before + 1));
        c.install(in_flight, dir(7, 9), TTL);
        assert_eq!(
            c.get(Ino(7)).map(|(a, _)| (a.mtime, a.nlink)),
            Some((at, 3)),
            "an older answer installed"
        );
    }

    #[test]
    fn an_answer_overtaken_by_an_invalidation_or_a_later_change_is_not_installed() {
        let c = AttrCache::default();
        let t = c.changing(Ino(7));
        c.invalidate(Ino(7));
        c.install(t, dir(7, 3), TTL);
        assert!(c.get(Ino(7)).is_none(), "installed past an invalidation");

        let older = c.changing(Ino(7));
        let newer = c.changing(Ino(7));
        c.install(newer, dir(7, 5), TTL);
        c.install(older, dir(7, 4), TTL);
        assert_eq!(c.get(Ino(7)).map(|(a, _)| a.nlink), Some(5), "an older answer replaced a newer one");
    }

    #[test]
    fn only_directories_and_only_unexpired() {
        let c = AttrCache::default();
        c.install(c.changing(Ino(8)), attr(8, FileKind::File, 1), TTL);
        assert!(c.get(Ino(8)).is_none());
        c.install(c.changing(Ino(9)), dir(9, 2), Duration::ZERO);
        assert!(c.get(Ino(9)).is_none());
    }

    #[test]
    fn a_written_files_base_is_kept_until_released_invalidated_or_overtaken() {
        let c = AttrCache::default();
        let file = || attr(8, FileKind::File, 1);
        c.install_live(c.ticket(Ino(8)), file(), TTL);
        assert_eq!(c.live(Ino(8)).map(|a| a.ino), Some(Ino(8)));
        c.forget_file(Ino(8));
        assert!(c.live(Ino(8)).is_some(), "an own write dropped the base");
        c.released(Ino(8));
        assert!(c.live(Ino(8)).is_none(), "kept past the release");
        let t = c.ticket(Ino(8));
        c.released(Ino(8));
        c.install_live(t, file(), TTL);
        assert!(c.live(Ino(8)).is_none(), "installed past a release (whose grant ends without a callback)");

        let t = c.ticket(Ino(8));
        c.invalidate(Ino(8));
        c.install_live(t, file(), TTL);
        assert!(c.live(Ino(8)).is_none(), "installed past a callback");
        let t = c.ticket(Ino(8));
        c.forget_files();
        c.install_live(t, file(), TTL);
        assert!(c.live(Ino(8)).is_none(), "installed past an own unlink of an inode not known");
        c.install_live(c.ticket(Ino(8)), file(), TTL);
        c.forget_files();
        assert!(c.live(Ino(8)).is_none());
        c.install_live(c.ticket(Ino(9)), dir(9, 2), TTL);
        assert!(c.live(Ino(9)).is_none(), "a directory has no base");
    }

    #[test]
    fn a_new_file_is_served_until_forgotten_invalidated_or_overtaken() {
        let c = AttrCache::default();
        let file = || attr(8, FileKind::File, 1);
        c.install_created(c.creating(), file(), TTL);
        assert_eq!(c.get(Ino(8)).map(|(a, ttl)| (a.ino, ttl)), Some((Ino(8), None)));
        c.forget_file(Ino(8));
        assert!(c.get(Ino(8)).is_none());
        c.install_created(c.creating(), file(), TTL);
        c.invalidate(Ino(8));
        assert!(c.get(Ino(8)).is_none(), "served past a callback");

        let t = c.creating();
        c.invalidate(Ino(9));
        c.invalidate(Ino(8));
        c.invalidate(Ino(10));
        c.install_created(t, file(), TTL);
        assert!(c.get(Ino(8)).is_none(), "installed past an invalidation of it");
        let t = c.creating();
        for i in 0..RECENT as u64 {
            c.invalidate(Ino(100 + i));
        }
        c.install_created(t, file(), TTL);
        assert!(c.get(Ino(8)).is_some(), "others' invalidations refused it");
        let t = c.creating();
        for i in 0..=RECENT as u64 {
            c.invalidate(Ino(100 + i));
        }
        c.install_created(t, attr(11, FileKind::File, 1), TTL);
        assert!(c.get(Ino(11)).is_none(), "installed past more invalidations than remembered");
        let t = c.creating();
        c.invalidate_all();
        c.install_created(t, attr(12, FileKind::File, 1), TTL);
        assert!(c.get(Ino(12)).is_none(), "installed past a drop of everything");

        c.install_created(c.creating(), file(), Duration::from_nanos(1));
        std::thread::sleep(Duration::from_millis(1));
        assert!(c.get(Ino(8)).is_none(), "served expired");
        c.install_created(c.creating(), file(), TTL);
        c.install(c.changing(Ino(7)), dir(7, 2), TTL);
        c.forget_files();
        assert!(c.get(Ino(8)).is_none());
        assert!(c.get(Ino(7)).is_some(), "an own unlink dropped a directory's attributes");
    }
}
