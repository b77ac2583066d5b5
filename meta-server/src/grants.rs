//! Coherent kernel caching of entries and attributes: cache grants and the
//! invalidations that revoke them (callbacks as CephFS
//! capabilities and NFSv4 delegations do; DESIGN.md §2, the meta-server is
//! the one place metadata changes).
//!
//! # Grants
//!
//! A caching mount sends its `Lookup`, `GetAttr` and `ReadDirPlus` (its
//! kernel's READDIRPLUS) wrapped as `MetaRequest::Caching { client, ttl }`.
//! While the namespace mutex is still held for the answer, the service
//! records here a grant per thing the kernel may cache — the entry
//! `(parent, name)` a lookup resolved or a listing named, the answered
//! inode's attributes — for `client`, expiring
//! [`GRANT_MARGIN`] after `now + ttl`. Grants are per name, not per directory: a mount that
//! looked up its own files in a shared directory is not called back when
//! another mount unlinks its.
//!
//! A regular file's attributes are granted only while no client has it
//! open for writing: its size and mtime change one-sidedly (writes through
//! verbs to its attribute slot, which the meta-server never sees), so a
//! write open is a change like a chmod (it revokes every attribute grant of
//! the file) and while it lasts every `GetAttr` goes to the meta-server,
//! which reads the slot.
//!
//! # Changes
//!
//! A request that changes an inode's attributes or a directory's entries
//! is applied under the namespace mutex, which is then released; then
//! [`Grants::revoke`] queues an invalidation for every *other* client with
//! a live grant of what changed (the changer's kernel updates its own
//! cache from the answer, as FUSE does for its own create, unlink, rename
//! and setattr; calling it back would deadlock on the directory lock its
//! own request holds) and waits, for each, until that client acknowledges
//! it or its grant expires, whichever comes first; only then is the
//! changer answered. So when a change answers, every kernel has either
//! dropped what it cached before the change or let it expire.
//!
//! A grant recorded before the change was applied (both under the
//! namespace mutex) is in the table when the changer looks, so it is
//! revoked; one recorded after describes the changed state (it may be
//! revoked needlessly; that costs a notify, never coherence). A revoked
//! grant stays in the table until it expires or its client acknowledges a
//! later invalidation, so a second change of the same thing waits too.
//!
//! # The changer's own grants
//!
//! A change of a directory's entries by a caching client (create, mkdir,
//! unlink, rmdir, symlink) answers it the directory's attributes after the
//! change and grants them to it (`MetaResponse::ParentGranted`): its kernel
//! dropped them and asks again at the next path walk, which its mount then
//! answers without a round trip. Recorded under the namespace mutex like a
//! lookup's grant, so another client's later change of the directory
//! revokes it; the changer's own later changes spare it, and its mount
//! drops or replaces what it keeps itself (mount `attr_cache`).
//!
//! # Written files
//!
//! What a written file's answer does grant is the rest of its attributes
//! (`Grant::live`): all but the size, the mtime, the ctime and the
//! allocated bytes — the ones a write changes one-sidedly (the ctime
//! follows the mtime, the allocated bytes the file's layout). The rest
//! changes only through the meta-server, under the same `Attr` key, so
//! it is revoked as any attribute grant. Granted only to a client that
//! has the file open: its mount answers a `GETATTR` from it and reads the
//! four from the slot and its layout (one verb instead of a round trip: a
//! database's `fstat` of its own file at every transaction); its kernel
//! caches nothing of it. So it ends, as a creator's, at the client's last
//! release of the file, without a message ([`Grants::closed`]): the mount
//! dropped it before it sent the release.
//!
//! # Absent names
//!
//! A lookup that finds no such name grants its absence as the entry
//! `(parent, name)` (`MetaResponse::Absent`): the mount hands its kernel a
//! negative entry for the TTL, so a name looked for again and again — a
//! database's `-journal` and `-wal` at every transaction, a path search —
//! costs no request. Every change that makes a name (create, mkdir,
//! mknod, symlink, link, the target of a rename) names its entry among
//! what it changed, so the holders are called back before it answers, as
//! for any grant.
//!
//! The changer's own grant of an entry it makes or removes ends with the
//! change, under the namespace mutex, without a message
//! ([`Grants::end`]): its kernel learns the entry anew from the answer
//! (the new dentry of a create, with the TTL the answer grants; an
//! unlink's dentry dropped). Otherwise the absence granted to the lookup
//! the kernel sends before every create would make another mount's unlink
//! of the file wait for the creator's acknowledgement until the grant
//! expired. A rename keeps the changer's grants, and its grant of the old
//! name goes with it to the new name too ([`Grants::moved`]): its kernel
//! moves the old dentry, with its time, to the new name, so another
//! client's later change of the new name must call it back.
//!
//! # Creators
//!
//! A regular file a caching client creates with `CreateOpen` is open for
//! writing by that client alone. Its attributes (not its entry) are
//! granted to the creator for as long as it keeps the file open
//! ([`Grants::grant_until_closed`], `ParentGranted::created`): the
//! creator's mount answers its kernel's `GETATTR` of the new file — the
//! permission check of the open that follows every create — from the
//! create's answer instead of a round trip. The grant ends three ways:
//!
//! * the creator's last release of the file ([`Grants::closed`], under the
//!   namespace mutex with the release): dropped without an invalidation.
//!   Its mount stopped answering from it before it sent the release (it
//!   drops the answer at *every* release of the file, mount `attr_cache`),
//!   and its kernel never cached it (the mount hands it the ungranted TTL,
//!   zero on a coherent mount: the mount is the cache, and the mount can
//!   be told "until the close", a kernel cannot). So a later change by
//!   another client — mdtest's unlink of a file made on another node —
//!   finds no grant and waits for no one;
//! * another client's change of the inode before that (chmod, setattr,
//!   open for writing, link, unlink, rename over it): revoked as any
//!   grant, and the change waits for the creator's acknowledgement, its
//!   expiry, or its release, whichever comes first. The release ends the
//!   wait for the same reason it ends the grant without a message (the
//!   creator's kernel sends `RELEASE` asynchronously after `close(2)`, so
//!   another mount's unlink can arrive before it; it then waits at most
//!   until the release is processed);
//! * the TTL, counted as any grant's: a creator that keeps a file open
//!   longer answers from the meta-server after it (the mount counts the
//!   same TTL from when it sent the request). A fenced creator's grant
//!   stays until then (its process may still answer from it, as for every
//!   grant of a fenced client).
//!
//! Changes the meta-server does not see are the creator's own — writes
//! (verbs to the attribute slot), truncates, fallocate — and its mount
//! drops the answer before each, and at its own setattr, link, unlink and
//! rename (the last three change the link count without naming the inode
//! in every case). Every other client changes the size or times only
//! through a writing open, which revokes. The entry is not granted: the
//! kernel caches entries itself, for a TTL it counts, so it could not be
//! dropped at the release without a message; the create needs none (the
//! kernel installs the new dentry from the create's answer).
//!
//! Granting entry and attributes for the whole TTL instead (tried before)
//! saved the same `GETATTR` but made every other mount's unlink of a file
//! created within the TTL wait for the creator's acknowledgement (unlink
//! 8,592 → 5,558 per s, `bench meta --coherent-ttl 1`).
//!
//! # Delegations
//!
//! A directory a caching client makes (`Create` of a directory) is
//! *delegated* to it, as NFSv4 delegates a directory and CephFS gives a
//! client the "complete" listing with its capabilities
//! ([`Grants::delegate`], `Delegated::dir`; the table is
//! [`delegations`]). Its mount then knows every entry of the directory
//! — it saw it empty, and adds and removes names from its own changes'
//! answers — so it answers every `LOOKUP` in it, a name that is not there
//! included, without a round trip. The attributes of each child it makes
//! there while it holds the delegation are held with it
//! ([`Grants::hold_child`], `Delegated::child`): its mount answers their
//! `GETATTR` too, past the creator's release, until its own write, open,
//! setattr or link of the child drops them. So a job that makes its own
//! directory and works in it — mdtest's per-rank trees, a build's output
//! directory — looks up, stats and creates with no round trip but the
//! create's own.
//!
//! Nothing of it reaches the kernel: the mount answers with TTL zero, so
//! the kernel asks again at every use and the mount is the only cache. So
//! a revocation is one message, [`Invalidation::Listing`], after which the
//! mount drops the listing and the children's attributes; no kernel
//! notify.
//!
//! Revoked, as a whole, by the first change of the directory's entries or
//! attributes, or of a held child's attributes, by any *other* client
//! (each such change names the directory's or the child's attributes among
//! what it changed, which is how [`Grants::revoke`] finds it): the change
//! waits for the holder's acknowledgement or the delegation's expiry, as
//! for a grant, and once acknowledged the delegation is gone, so the
//! changes after it wait for nothing. A revoked directory is never
//! delegated again (only a new one is), so two mounts working in one
//! directory pay for one callback, once.
//!
//! A delegation lasts its holder's TTL from its last renewal: every poll
//! of the holder's invalidation thread renews all its delegations when it
//! arrives, and the poll waits at most a quarter of that TTL, so a mount
//! that polls keeps them, and one that stops (stopped, partitioned,
//! fenced) loses them within the TTL, as a grant. The mount counts the
//! same TTL from when it *sent* the poll, and only when the answer carries
//! every invalidation queued before it (`renewed`), so a delegation
//! revoked before the poll arrived is dropped by that answer, not renewed.
//!
//! # Late changes
//!
//! A mount answers the create of a regular file in a directory delegated
//! to it, and the unlink of a file it made there, before it sends them,
//! and sends them in batches (`LateChanges`; the client's `late_changes`
//! module; a create's inode and cookie were lent to the mount ahead,
//! `namespace::lending`). That is coherent
//! only while nobody else can look: so before it serves any request that
//! names a delegated directory, a name in one or a child held with one
//! ([`MetaRequest::named`]; for a `ReadDirPlus`, the directories it lists
//! too, whose attributes it answers), from a client other than the holder,
//! the meta-server *shares* the delegation ([`Grants::recall`]): it queues
//! [`Invalidation::Shared`] for the holder and waits, as for a grant, for
//! its acknowledgement or the delegation's expiry. The holder's mount
//! answers no change there first from then on, and its poll that
//! acknowledges is a call like any other, which sends what it queued
//! first. A shared delegation is otherwise a delegation (the holder still
//! answers lookups and listings from it: only another client's *change*
//! revokes it), and is waited for no more. Each change of a batch is made
//! at the time the mount answered it (the directory's mtime and ctime, the
//! file's times), so the holder's kernel and every other mount see the
//! same times; an unlink only if its name still names the inode the mount
//! unlinked (`LateUnlink::ino`), a create only as an inode lent to the
//! client that sends it.
//!
//! A client that leaves (`ClientLeaves`, at the end of its mount, after
//! it sent its queue) is waited for no more at all ([`Grants::left`]).
//!
//! [`MetaRequest::named`]: citronfs_core::proto::MetaRequest::named
//!
//! # Contended attributes
//!
//! Two mounts creating in one directory would call each other back at
//! every create: each create changes the directory's attributes, which
//! the other mount was granted with its own create's answer (or at its
//! last permission check), and waits for the acknowledgement. So
//! attributes that two clients change by turns — a change by one within
//! [`CONTENDED_FOR`] of a change by another — are *contended*: granted to
//! no one ([`Grants::grant_attr_unless_contended`]) until that long after the last such
//! change. Each kernel then asks for them at each use (a `GETATTR` round
//! trip, which it would have sent after the callback anyway), and the
//! changes call no one back. A change by a client that only reads the
//! attributes otherwise (another mount's chmod of a file this one stats)
//! contends nothing: it calls back once, as before.
//!
//! # Delivery
//!
//! Each caching mount long-polls with `AwaitInvalidations { acked }` on a
//! connection of its own: the answer is every queued invalidation past
//! `acked`, as soon as there is one, or nothing after [`POLL_WAIT`]. The
//! mount's invalidation thread tells its kernel (`notify inval_entry`,
//! `inval_inode`) and acknowledges in its next poll. A client that does
//! not acknowledge (stopped, partitioned, fenced) delays a change by at
//! most its grant's remaining time: the waiter never answers before the
//! grant has expired or been acknowledged. A fenced client's queue goes
//! with its lease; its grants are kept until they expire (its kernel may
//! still be caching, if the process lives). A client that leaves (its
//! mount ended) is waited for no more ([`Grants::left`]).
//!
//! # The margin
//!
//! The kernel counts a TTL from when it installs the reply, a little after
//! the meta-server answered. The mount hands the kernel the granted TTL
//! less the time since it sent the request, so the kernel's expiry is at
//! most the meta-server's grant time plus the TTL plus the time between the
//! daemon writing the reply and the requesting task installing it (a
//! wake-up, microseconds; [`GRANT_MARGIN`] on a busy machine).
//!
//! Memory: a grant per (client, cached thing), pruned once expired
//! ([`Grants::prune`], called by the lease reaper), so bounded by what the
//! mounts looked up in the last TTL.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use citronfs_core::proto::Invalidation;
use citronfs_core::types::{ClientId, Ino};
use parking_lot::{Condvar, Mutex};

pub mod delegations;

use delegations::{Delegations, Revocation};

/// Time added to every grant past its TTL: the kernel installs a reply a
/// little after the meta-server made it (see the module header).
pub const GRANT_MARGIN: Duration = Duration::from_millis(250);

/// How long an `AwaitInvalidations` poll waits for work before answering
/// empty (well below a client's RPC timeout).
pub const POLL_WAIT: Duration = Duration::from_millis(500);

/// A client holding delegations polls at least this many times per TTL
/// (see "Delegations").
const POLLS_PER_TTL: u32 = 4;

/// Most invalidations one poll answers.
const POLL_BATCH: usize = 1024;

/// How long an inode's attributes stay ungranted once they were
/// contended (see "Contended attributes"), renewed by every change of another
/// client than the last one: long enough to span the gaps between the
/// changes of two mounts working in one directory (tens of microseconds
/// apart), short enough that the attributes are cached again soon after
/// the mounts stop.
pub const CONTENDED_FOR: Duration = Duration::from_millis(20);

/// What a grant lets a kernel cache.
pub type Key = Invalidation;

/// One client's grant of one thing.
#[derive(Clone, Copy, Debug)]
struct Grant {
    expires: Instant,
    /// The newest invalidation queued for it and not yet acknowledged.
    revoking: Option<u64>,
    /// A creator's grant of a new file's attributes: it ends at the
    /// client's last release of the file (see the module header).
    until_closed: bool,
}

impl Grant {
    /// A grant made now for `ttl` (and the margin a kernel's clock needs).
    fn new(ttl: Duration, until_closed: bool) -> Self {
        Self { expires: Instant::now() + ttl + GRANT_MARGIN, revoking: None, until_closed }
    }
}

/// A caching client's invalidation queue.
#[derive(Default)]
struct Queue {
    /// Invalidations not yet acknowledged, by number.
    pending: Vec<(u64, Invalidation)>,
    /// The last number given.
    last: u64,
    /// The last number acknowledged.
    acked: u64,
    /// The grants revoked by each invalidation not yet acknowledged: gone
    /// from the table once it is.
    revoked: Vec<(u64, Key)>,
    /// Invalidations not yet acknowledged whose grant ended with the
    /// client's release of the file ([`Grants::closed`]): nobody waits
    /// for them any more.
    released: Vec<u64>,
}

impl Queue {
    /// Queues `item`; answers its number.
    fn push(&mut self, item: Invalidation) -> u64 {
        self.last += 1;
        self.pending.push((self.last, item));
        self.last
    }
}

/// An answer to a poll ([`Grants::poll`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Polled {
    /// The number of the last invalidation answered (the next `acked`).
    pub through: u64,
    pub items: Vec<Invalidation>,
    /// The client's delegations were renewed when the poll arrived, and
    /// `items` holds every invalidation queued since.
    pub renewed: bool,
}

#[derive(Default)]
struct State {
    grants: HashMap<Key, HashMap<ClientId, Grant>>,
    delegations: Delegations,
    queues: HashMap<ClientId, Queue>,
    /// Regular files some client has open for writing, and who: from the
    /// writing open to that client's last close (or its fence).
    writers: HashMap<Ino, HashSet<ClientId>>,
    /// Inodes whose attributes are not granted for now, until when
    /// (see "Contended attributes").
    contended: HashMap<Ino, Contention>,
    /// Who changed each inode's attributes last, and when (kept for the
    /// contention window, [`Grants::prune`]).
    last_changes: HashMap<Ino, LastChange>,
}

impl State {
    fn is_contended(&self, ino: Ino) -> bool {
        self.contended.get(&ino).is_some_and(|c| c.until > Instant::now())
    }
}

/// An inode whose attributes several clients change by turns.
#[derive(Clone, Copy, Debug)]
struct Contention {
    until: Instant,
}

/// The last change of an inode's attributes.
#[derive(Clone, Copy, Debug)]
struct LastChange {
    /// `None`: a client that does not cache.
    changer: Option<ClientId>,
    at: Instant,
}

/// An invalidation a change waits for.
struct Awaited {
    client: ClientId,
    number: u64,
    /// When the client's grant runs out: the wait ends then regardless.
    expires: Instant,
}

/// Cache grants of the whole cluster and the invalidation queues.
pub struct Grants {
    state: Mutex<State>,
    /// Signalled when an invalidation is queued (pollers) or acknowledged
    /// (changers).
    changed: Condvar,
    /// How long contended attributes stay ungranted ([`CONTENDED_FOR`]).
    contended_for: Duration,
}

impl Default for Grants {
    fn default() -> Self {
        Self::with_contention(CONTENDED_FOR)
    }
}

impl Grants {
    /// Grants whose contended attributes stay ungranted for
    /// `contended_for` (see "Contended attributes").
    pub fn with_contention(contended_for: Duration) -> Self {
        Self { state: Mutex::default(), changed: Condvar::new(), contended_for }
    }

    /// Records that `client`'s kernel may cache `key` for `ttl`. Called
    /// with the namespace mutex held, before the answer leaves.
    pub fn grant(&self, client: ClientId, key: Key, ttl: Duration) {
        self.insert(client, [key], ttl, false);
    }

    /// Records that the mount of `client`, which has regular file `ino`
    /// open (it just created it, or it is written), may answer its
    /// attributes (those of a written file but what changes one-sidedly)
    /// for `ttl` or until the client's last release of it, whichever comes
    /// first (see "Creators" and "Written files" in the module header).
    /// Called with the namespace mutex held, before the answer leaves.
    pub fn grant_until_closed(&self, client: ClientId, ino: Ino, ttl: Duration) {
        self.insert(client, [Invalidation::Attr(ino)], ttl, true);
    }

    /// Records that `client`'s kernel may cache `ino`'s attributes for
    /// `ttl`, unless they are contended (see "Contended attributes");
    /// returns whether it may. One look under the lock, as each create's
    /// answer asks it for its directory. Called with the namespace mutex
    /// held, before the answer leaves.
    pub fn grant_attr_unless_contended(&self, client: ClientId, ino: Ino, ttl: Duration) -> bool {
        let grant = Grant::new(ttl, false);
        let mut s = self.state.lock();
        if s.is_contended(ino) {
            return false;
        }
        s.grants.entry(Invalidation::Attr(ino)).or_default().insert(client, grant);
        true
    }

    /// Delegates directory `dir`, which `client` just made, to it for
    /// `ttl` and as long as renewed (see "Delegations"). Called with the
    /// namespace mutex held, before the answer leaves.
    pub fn delegate(&self, client: ClientId, dir: Ino, ttl: Duration) {
        self.state.lock().delegations.delegate(client, dir, ttl, Instant::now());
    }

    /// Holds the attributes of `child`, which `client` just made in `dir`,
    /// with its delegation of `dir`, if it holds one; whether it does.
    /// Called with the namespace mutex held, before the answer leaves.
    pub fn hold_child(&self, client: ClientId, dir: Ino, child: Ino) -> bool {
        self.state.lock().delegations.hold_child(client, dir, child, Instant::now())
    }

    /// `client`'s grant of `key` ends, without an invalidation: its
    /// kernel learns the thing anew from the answer to its own change
    /// (see "Absent names"). Called with the namespace mutex held, with
    /// the change.
    pub fn end(&self, client: ClientId, key: &Key) {
        let mut s = self.state.lock();
        let Some(holders) = s.grants.get_mut(key) else { return };
        holders.remove(&client);
        if holders.is_empty() {
            s.grants.remove(key);
        }
    }

    /// `client` renamed entry `from` to `to` (swapped them if
    /// `exchange`): its kernel moved its dentry of `from`, with its time,
    /// to `to` (and the other way for an exchange), so its grant of the
    /// one now covers the other too — the later of the two, if it held
    /// both. Called with the namespace mutex held, with the rename.
    pub fn moved(&self, client: ClientId, from: &Key, to: &Key, exchange: bool) {
        let mut s = self.state.lock();
        let held = |s: &State, key: &Key| s.grants.get(key).and_then(|h| h.get(&client)).copied();
        let (of_from, of_to) = (held(&s, from), held(&s, to));
        let later = match (of_from, of_to) {
            (Some(a), Some(b)) => Some(if a.expires >= b.expires { a } else { b }),
            (a, b) => a.or(b),
        };
        let Some(later) = later else { return };
        // A live grant of the new name; its revocation, if one was queued
        // for the old name, still ends the old one only.
        let grant = Grant { revoking: None, ..later };
        let mut keys = vec![to];
        if exchange {
            keys.push(from);
        } else if of_from.is_none() {
            // Nothing moved to `to`: what the kernel holds there is its own.
            return;
        }
        for key in keys {
            s.grants.entry(key.clone()).or_default().insert(client, grant);
        }
    }

    /// Grants `client` each listed entry of `dir` and its attributes
    /// together, as a lookup's answer, where the attributes may be granted
    /// ([`Grants::attr_grantable`]); whether each was. A page of a listing
    /// is one look under the lock and one reading of the clock, not one
    /// per entry. Each item is a name, its inode and whether it is a
    /// regular file. Called with the namespace mutex held, before the
    /// answer leaves.
    pub fn grant_listing<'a>(
        &self,
        client: ClientId,
        dir: Ino,
        ttl: Duration,
        entries: impl IntoIterator<Item = (&'a [u8], Ino, bool)>,
    ) -> Vec<bool> {
        let grant = Grant::new(ttl, false);
        let now = Instant::now();
        let mut s = self.state.lock();
        let State { grants, contended, writers, .. } = &mut *s;
        entries
            .into_iter()
            .map(|(name, ino, regular)| {
                let contended = contended.get(&ino).is_some_and(|c| c.until > now);
                if contended || regular && writers.contains_key(&ino) {
                    return false;
                }
                let entry = Invalidation::Entry { parent: dir, name: name.to_vec() };
                grants.entry(entry).or_default().insert(client, grant);
                grants.entry(Invalidation::Attr(ino)).or_default().insert(client, grant);
                true
            })
            .collect()
    }

    fn insert(
        &self,
        client: ClientId,
        keys: impl IntoIterator<Item = Key>,
        ttl: Duration,
        until_closed: bool,
    ) {
        let grant = Grant::new(ttl, until_closed);
        let mut s = self.state.lock();
        for key in keys {
            s.grants.entry(key).or_default().insert(client, grant);
        }
    }

    /// Revokes every live grant of `keys` held by clients other than
    /// `changer`, and waits until each is acknowledged or expired. Called
    /// after the change, without the namespace mutex. Returns how many
    /// invalidations were sent.
    pub fn revoke(&self, changer: Option<ClientId>, keys: &[Key]) -> usize {
        let now = Instant::now();
        let mut awaited = Vec::new();
        let mut s = self.state.lock();
        let State { grants, delegations, queues, contended, last_changes, .. } = &mut *s;
        for key in keys {
            if let Invalidation::Attr(ino) = key {
                Self::revoke_delegations(delegations, queues, *ino, changer, now, &mut awaited);
            }
            let Some(holders) = grants.get_mut(key) else { continue };
            holders.retain(|_, g| g.expires > now);
            for (client, grant) in holders.iter_mut() {
                if Some(*client) == changer {
                    continue;
                }
                let queue = queues.entry(*client).or_default();
                let number = queue.push(key.clone());
                queue.revoked.push((number, key.clone()));
                grant.revoking = Some(number);
                awaited.push(Awaited { client: *client, number, expires: grant.expires });
            }
            if holders.is_empty() {
                grants.remove(key);
            }
        }
        // Attributes that two clients change by turns: granted to no one
        // for a while (see "Contended attributes").
        for key in keys {
            let Invalidation::Attr(ino) = key else { continue };
            let by_turns = last_changes.get(ino).is_some_and(|last| {
                now.saturating_duration_since(last.at) < self.contended_for
                    && last.changer != changer
                    && (last.changer.is_some() || changer.is_some())
            });
            // Contended from now, or for longer.
            if by_turns {
                contended.insert(*ino, Contention { until: now + self.contended_for });
            }
            last_changes.insert(*ino, LastChange { changer, at: now });
        }
        self.await_all(s, awaited)
    }

    /// Shares every delegation that covers one of `inos` (a delegated
    /// directory, or a child held with one) and that a client other than
    /// `asker` holds, and waits until each holder has acknowledged (sent
    /// what it answered first there) or the delegation expired: before a
    /// request that names them is served (see "Late changes"). A
    /// delegation shared once is waited for no more. Called without the
    /// namespace mutex. Returns how many invalidations were waited for.
    pub fn recall(&self, asker: Option<ClientId>, inos: &[Ino]) -> usize {
        let now = Instant::now();
        let mut s = self.state.lock();
        if !s.delegations.held_by_another_than(asker) {
            return 0;
        }
        let mut awaited = Vec::new();
        let State { delegations, queues, .. } = &mut *s;
        for ino in inos {
            for recall in delegations.recalls(*ino, asker, now) {
                Self::queue(delegations, queues, recall, &mut awaited);
            }
        }
        self.await_all(s, awaited)
    }

    /// Whether a client other than `asker` holds a delegation: whether
    /// any request of `asker` may have to recall one (a cheap test before
    /// the names of a request are resolved).
    pub fn delegated_to_another_than(&self, asker: Option<ClientId>) -> bool {
        self.state.lock().delegations.held_by_another_than(asker)
    }

    /// Queues the revocation of every delegation covering `ino` that
    /// `changer` does not hold (or joins the one queued), into `awaited`.
    fn revoke_delegations(
        delegations: &mut Delegations,
        queues: &mut HashMap<ClientId, Queue>,
        ino: Ino,
        changer: Option<ClientId>,
        now: Instant,
        awaited: &mut Vec<Awaited>,
    ) {
        for revocation in delegations.revocations(ino, changer, now) {
            Self::queue(delegations, queues, revocation, awaited);
        }
    }

    /// Queues what `revocation` says for its holder (or joins what is
    /// queued), into `awaited`.
    fn queue(
        delegations: &mut Delegations,
        queues: &mut HashMap<ClientId, Queue>,
        revocation: Revocation,
        awaited: &mut Vec<Awaited>,
    ) {
        let (holder, number, expires) = match revocation {
            Revocation::Queue { dir, holder, expires } => {
                let number = queues.entry(holder).or_default().push(Invalidation::Listing(dir));
                delegations.revoking(dir, number);
                (holder, number, expires)
            }
            Revocation::Share { dir, holder, expires } => {
                let number = queues.entry(holder).or_default().push(Invalidation::Shared(dir));
                delegations.sharing(dir, number);
                (holder, number, expires)
            }
            Revocation::Await { holder, number, expires } => (holder, number, expires),
        };
        awaited.push(Awaited { client: holder, number, expires });
    }

    /// Wakes the pollers, then waits until every invalidation of
    /// `awaited` is acknowledged (or released, for a creator's grant) or
    /// its grant expired. Returns how many there were.
    fn await_all(&self, mut s: parking_lot::MutexGuard<'_, State>, mut awaited: Vec<Awaited>) -> usize {
        if awaited.is_empty() {
            return 0;
        }
        self.changed.notify_all();
        let sent = awaited.len();
        loop {
            let now = Instant::now();
            // A client without a queue was fenced: only its grant's
            // expiry ends the wait. A creator's grant ends at its release.
            awaited.retain(|a| {
                a.expires > now
                    && s.queues
                        .get(&a.client)
                        .is_none_or(|q| q.acked < a.number && !q.released.contains(&a.number))
            });
            let Some(until) = awaited.iter().map(|a| a.expires).max() else { break };
            self.changed.wait_until(&mut s, until);
        }
        sent
    }

    /// A poll of `client`'s invalidation thread: records its
    /// acknowledgement of everything up to `acked` and renews its
    /// delegations, then answers the invalidations past it (waiting up to
    /// `wait`, or a quarter of its delegations' TTL, for one).
    pub fn poll(&self, client: ClientId, acked: u64, wait: Duration) -> Polled {
        let now = Instant::now();
        let mut s = self.state.lock();
        let State { grants, delegations, queues, .. } = &mut *s;
        let queue = queues.entry(client).or_default();
        let acked = acked.min(queue.last);
        if acked > queue.acked {
            queue.acked = acked;
            queue.pending.retain(|(n, _)| *n > acked);
            queue.released.retain(|n| *n > acked);
            // Grants whose revocation the client has acted on are gone from
            // its kernel (unless it was granted the thing again since).
            let (done, kept): (Vec<_>, Vec<_>) = queue.revoked.drain(..).partition(|(n, _)| *n <= acked);
            queue.revoked = kept;
            for (_, key) in done {
                let Some(holders) = grants.get_mut(&key) else { continue };
                if holders.get(&client).is_some_and(|g| g.revoking.is_some_and(|n| n <= acked)) {
                    holders.remove(&client);
                }
                if holders.is_empty() {
                    grants.remove(&key);
                }
            }
            delegations.acknowledged(client, acked);
            self.changed.notify_all();
        }
        let wait = match delegations.renew(client, now) {
            Some(ttl) => wait.min(ttl / POLLS_PER_TTL),
            None => wait,
        };
        let deadline = now + wait;
        loop {
            // Fenced while we waited: nothing more for it.
            let Some(queue) = s.queues.get(&client) else { return Polled::default() };
            if !queue.pending.is_empty() {
                let items: Vec<_> = queue.pending.iter().take(POLL_BATCH).cloned().collect();
                let through = items.last().map_or(queue.acked, |(n, _)| *n);
                let renewed = items.len() == queue.pending.len();
                return Polled { through, items: items.into_iter().map(|(_, i)| i).collect(), renewed };
            }
            if self.changed.wait_until(&mut s, deadline).timed_out() {
                let Some(queue) = s.queues.get(&client) else { return Polled::default() };
                return Polled { through: queue.acked, items: Vec::new(), renewed: queue.pending.is_empty() };
            }
        }
    }

    /// `client` opened regular file `ino` for writing: its attributes
    /// may change one-sidedly until the client's last close. Called under
    /// the namespace mutex, with the open.
    pub fn writing(&self, client: ClientId, ino: Ino) {
        self.state.lock().writers.entry(ino).or_default().insert(client);
    }

    /// `client` closed `ino` for the last time: a creator's grant of its
    /// attributes ends, without an invalidation, and a change waiting for
    /// the client's acknowledgement of its revocation waits no more (see
    /// "Creators" in the module header). Called under the namespace mutex,
    /// with the release.
    pub fn closed(&self, client: ClientId, ino: Ino) {
        let mut s = self.state.lock();
        let State { grants, queues, writers, .. } = &mut *s;
        if let Some(w) = writers.get_mut(&ino) {
            w.remove(&client);
            if w.is_empty() {
                writers.remove(&ino);
            }
        }
        let key = Invalidation::Attr(ino);
        let Some(holders) = grants.get_mut(&key) else { return };
        let Some(grant) = holders.get(&client).filter(|g| g.until_closed).copied() else { return };
        holders.remove(&client);
        if holders.is_empty() {
            grants.remove(&key);
        }
        if let (Some(n), Some(queue)) = (grant.revoking, queues.get_mut(&client)) {
            if n > queue.acked {
                queue.released.push(n);
                drop(s);
                self.changed.notify_all();
            }
        }
    }

    /// After `client`'s last release of regular file `ino`: the directory
    /// whose delegation holds `ino`'s attributes for it, if the delegation
    /// is usable and nobody has the file open for writing any more (its
    /// attributes then change only through the meta-server, which revokes).
    /// Called under the namespace mutex, with the release.
    pub fn held_again(&self, client: ClientId, ino: Ino) -> Option<Ino> {
        let s = self.state.lock();
        if s.writers.contains_key(&ino) {
            return None;
        }
        s.delegations.held_dir(client, ino, Instant::now())
    }

    /// `client` left the cluster (`ClientLeaves`: its mount ended, after
    /// sending the unlinks it answered first): its kernel caches nothing
    /// any more, so its grants and delegations go and everything queued for
    /// it counts as acknowledged — no change or recall waits for it. (A
    /// client fenced for a lost lease is waited for until its grants and
    /// delegations expire: its kernel may still cache what they answered.)
    pub fn left(&self, client: ClientId) {
        let mut s = self.state.lock();
        s.delegations.drop_holder(client);
        s.grants.retain(|_, holders| {
            holders.remove(&client);
            !holders.is_empty()
        });
        s.queues.entry(client).or_default().acked = u64::MAX;
        drop(s);
        self.changed.notify_all();
    }

    /// A fenced or departed client: its queue and its writing opens go
    /// (changers waiting for it wait for its grants to expire, which stay
    /// until then), and no recall waits for it
    /// ([`delegations::Delegations::holder_fenced`]).
    pub fn drop_client(&self, client: ClientId) {
        let mut s = self.state.lock();
        s.delegations.holder_fenced(client);
        s.queues.remove(&client);
        s.writers.retain(|_, w| {
            w.remove(&client);
            !w.is_empty()
        });
        drop(s);
        self.changed.notify_all();
    }

    /// Whether `ino`'s attributes may be granted: not contended, and, for
    /// a regular file (`regular`), not open for writing anywhere. One look
    /// under the lock, as a lookup or getattr asks it.
    pub fn attr_grantable(&self, ino: Ino, regular: bool) -> bool {
        let s = self.state.lock();
        !(s.is_contended(ino) || regular && s.writers.contains_key(&ino))
    }

    /// Forgets expired grants and delegations.
    pub fn prune(&self) {
        let now = Instant::now();
        let mut s = self.state.lock();
        s.contended.retain(|_, c| c.until > now);
        let window = self.contended_for;
        s.last_changes.retain(|_, c| now.saturating_duration_since(c.at) < window);
        s.grants.retain(|_, holders| {
            holders.retain(|_, g| g.expires > now);
            !holders.is_empty()
        });
        s.delegations.prune(now);
    }

    /// Delegations held now, expired ones included (tests, diagnostics).
    pub fn delegations(&self) -> usize {
        self.state.lock().delegations.len()
    }

    /// Live and expired grants held now (tests, diagnostics).
    pub fn len(&self) -> usize {
        self.state.lock().grants.values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const A: ClientId = ClientId(1);
    const B: ClientId = ClientId(2);

    #[test]
    fn a_change_waits_for_the_holders_acknowledgement_but_not_the_changers() {
        let g = Arc::new(Grants::default());
        let key = Invalidation::Attr(Ino(5));
        g.grant(A, key.clone(), Duration::from_secs(60));
        g.grant(B, key.clone(), Duration::from_secs(60));
        let changer = {
            let (g, key) = (g.clone(), key.clone());
            std::thread::spawn(move || g.revoke(Some(A), &[key]))
        };
        let Polled { through, items, .. } = g.poll(B, 0, Duration::from_secs(60));
        assert_eq!(items, vec![key.clone()]);
        assert!(!changer.is_finished(), "answered before B acknowledged");
        let none = g.poll(B, through, Duration::from_millis(1));
        assert!(none.items.is_empty());
        assert_eq!(changer.join().unwrap(), 1, "only B is called back");
        // B's revoked grant is gone (it acknowledged); A's stays.
        assert_eq!(g.len(), 1);
    }

    /// Attributes changed by two clients by turns are contended: granted
    /// to no one until [`CONTENDED_FOR`] after the last change by turns. A
    /// change by one client alone, or after a change of a reader's, is
    /// not.
    #[test]
    fn attributes_changed_by_turns_are_contended() {
        let g = Arc::new(Grants::default());
        let (dir, file) = (Ino(5), Ino(6));
        // A changes twice alone: nothing contended.
        g.revoke(Some(A), &[Invalidation::Attr(dir)]);
        g.revoke(Some(A), &[Invalidation::Attr(dir)]);
        assert!(g.attr_grantable(dir, false), "one changer alone");
        // B holds the file's attributes and A changes it: B is called back
        // once, nothing is contended.
        g.grant(B, Invalidation::Attr(file), Duration::from_secs(60));
        let changer = {
            let g = g.clone();
            std::thread::spawn(move || g.revoke(Some(A), &[Invalidation::Attr(file)]))
        };
        let Polled { through, .. } = g.poll(B, 0, Duration::from_secs(60));
        g.poll(B, through, Duration::from_millis(1));
        assert_eq!(changer.join().unwrap(), 1, "B was called back");
        assert!(g.attr_grantable(file, false), "a reader's callback contends nothing");
        // B changes the directory right after A: contended, and a change by
        // turns renews it.
        g.revoke(Some(B), &[Invalidation::Attr(dir)]);
        assert!(!g.attr_grantable(dir, false));
        let until = |g: &Grants| g.state.lock().contended[&dir].until;
        let first = until(&g);
        std::thread::sleep(Duration::from_millis(2));
        g.revoke(Some(A), &[Invalidation::Attr(dir)]);
        assert!(until(&g) > first, "a change by turns renews it");
        let renewed = until(&g);
        std::thread::sleep(Duration::from_millis(2));
        g.revoke(Some(A), &[Invalidation::Attr(dir)]);
        assert_eq!(until(&g), renewed, "the same changer again does not");
        // Once it has passed, it is forgotten.
        g.state.lock().contended.get_mut(&dir).unwrap().until = Instant::now();
        assert!(g.attr_grantable(dir, false));
        std::thread::sleep(CONTENDED_FOR);
        g.prune();
        let s = g.state.lock();
        assert!(s.contended.is_empty() && s.last_changes.is_empty());
    }

    /// A page of a listing grants each entry and its attributes but those
    /// of a file open for writing or contended, and says which; what it
    /// granted is called back as any grant.
    #[test]
    fn a_listing_grants_what_a_lookup_would_and_says_what() {
        let g = Arc::new(Grants::default());
        let (dir, written, contended, plain, subdir) = (Ino(1), Ino(2), Ino(3), Ino(4), Ino(5));
        g.writing(B, written);
        g.revoke(Some(A), &[Invalidation::Attr(contended)]);
        g.revoke(Some(B), &[Invalidation::Attr(contended)]);
        let page: [(&[u8], Ino, bool); 4] =
            [(b"w", written, true), (b"c", contended, true), (b"p", plain, true), (b"s", subdir, false)];
        let ttl = Duration::from_secs(60);
        assert_eq!(g.grant_listing(A, dir, ttl, page), vec![false, false, true, true]);
        assert_eq!(g.len(), 4, "two entries and their attributes");
        // B's unlink of p calls A back, and waits for its acknowledgement.
        let entry = Invalidation::Entry { parent: dir, name: b"p".to_vec() };
        let changer = {
            let (g, entry) = (g.clone(), entry.clone());
            std::thread::spawn(move || g.revoke(Some(B), &[entry, Invalidation::Attr(plain)]))
        };
        let Polled { through, items, .. } = g.poll(A, 0, ttl);
        assert!(items.contains(&entry), "A was not called back for the listed entry: {items:?}");
        g.poll(A, through, Duration::ZERO);
        assert_eq!(changer.join().unwrap(), 2);
    }

    /// Another client's request naming a delegated directory or a child
    /// held with it waits until the holder acknowledges the sharing (it has
    /// sent what it answered first); a shared delegation is waited for no
    /// more, stays a delegation, and the holder's own requests never wait.
    #[test]
    fn a_recall_shares_a_delegation_once_and_waits_for_the_holder() {
        let g = Arc::new(Grants::default());
        let (dir, child, other) = (Ino(10), Ino(11), Ino(12));
        let ttl = Duration::from_secs(60);
        g.delegate(A, dir, ttl);
        assert!(g.hold_child(A, dir, child));
        assert_eq!(g.recall(Some(A), &[dir, child]), 0, "the holder recalled its own delegation");
        assert_eq!(g.recall(Some(B), &[other]), 0, "an inode of no delegation was recalled");
        let reader = {
            let g = g.clone();
            std::thread::spawn(move || g.recall(Some(B), &[child]))
        };
        let Polled { through, items, .. } = g.poll(A, 0, ttl);
        assert_eq!(items, vec![Invalidation::Shared(dir)]);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!reader.is_finished(), "served before the holder acknowledged");
        g.poll(A, through, Duration::ZERO);
        assert_eq!(reader.join().unwrap(), 1);
        assert_eq!(g.recall(None, &[dir, child]), 0, "a shared delegation was waited for again");
        assert_eq!(g.delegations(), 1, "sharing revoked the delegation");
        assert!(g.hold_child(A, dir, Ino(13)), "a shared delegation stopped holding new children");
    }

    /// A client that left is waited for by nobody: its delegations and
    /// grants go, and what was queued for it counts as acknowledged.
    #[test]
    fn nobody_waits_for_a_client_that_left() {
        let g = Arc::new(Grants::default());
        let (dir, file) = (Ino(10), Ino(20));
        let ttl = Duration::from_secs(60);
        g.delegate(A, dir, ttl);
        g.grant(A, Invalidation::Attr(file), ttl);
        let reader = {
            let g = g.clone();
            std::thread::spawn(move || g.recall(Some(B), &[dir]))
        };
        while g.state.lock().queues.get(&A).is_none_or(|q| q.pending.is_empty()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        g.left(A);
        assert_eq!(reader.join().unwrap(), 1, "the recall was not queued");
        assert_eq!(g.delegations(), 0);
        assert_eq!(g.revoke(Some(B), &[Invalidation::Attr(file)]), 0, "a departed client was called back");
    }

    #[test]
    fn an_ended_grant_is_called_back_for_nothing_and_others_stay() {
        let g = Grants::default();
        let key = Invalidation::Entry { parent: Ino(1), name: b"f".to_vec() };
        g.grant(A, key.clone(), Duration::from_secs(60));
        g.end(A, &key);
        assert!(g.is_empty(), "an ended grant stayed in the table");
        assert_eq!(g.revoke(Some(B), std::slice::from_ref(&key)), 0, "A was called back for an ended grant");
        g.grant(A, key.clone(), Duration::from_secs(60));
        g.grant(B, key.clone(), Duration::from_secs(60));
        g.end(B, &key);
        assert_eq!(g.len(), 1, "ending B's grant took A's too");
        g.end(B, &Invalidation::Attr(Ino(7)));
        assert_eq!(g.len(), 1);
    }

    /// A's own rename moves its kernel's dentry, with its time, to the new
    /// name: B's later change of the new name calls A back.
    #[test]
    fn a_renamers_grant_of_the_old_name_covers_the_new_one() {
        let g = Arc::new(Grants::default());
        let old = Invalidation::Entry { parent: Ino(1), name: b"f".to_vec() };
        let new = Invalidation::Entry { parent: Ino(2), name: b"g".to_vec() };
        g.grant(A, old.clone(), Duration::from_secs(60));
        g.moved(A, &old, &new, false);
        let changer = {
            let (g, new) = (g.clone(), new.clone());
            std::thread::spawn(move || g.revoke(Some(B), &[new]))
        };
        let Polled { through, items, .. } = g.poll(A, 0, Duration::from_secs(60));
        assert_eq!(items, vec![new.clone()], "the renamer was not called back for the new name");
        g.poll(A, through, Duration::ZERO);
        assert_eq!(changer.join().unwrap(), 1);
        // A rename of a name A held no grant of grants nothing.
        let other = Invalidation::Entry { parent: Ino(3), name: b"h".to_vec() };
        g.moved(A, &other, &old, false);
        assert_eq!(g.revoke(Some(B), &[other]), 0);
    }

    #[test]
    fn a_silent_holder_delays_a_change_until_its_grant_expires() {
        let g = Grants::default();
        let key = Invalidation::Entry { parent: Ino(1), name: b"f".to_vec() };
        let ttl = Duration::from_millis(50);
        let granted = Instant::now();
        g.grant(B, key.clone(), ttl);
        assert_eq!(g.revoke(None, std::slice::from_ref(&key)), 1);
        assert!(granted.elapsed() >= ttl + GRANT_MARGIN, "answered before the grant expired");
        g.prune();
        assert!(g.is_empty());
        // Fenced: nothing more is queued for it.
        g.drop_client(B);
        assert_eq!(g.revoke(None, &[key]), 0);
    }

    #[test]
    fn a_delegation_is_revoked_once_by_the_first_change_of_another_client() {
        let g = Arc::new(Grants::default());
        let (dir, child) = (Ino(20), Ino(21));
        g.delegate(A, dir, Duration::from_secs(60));
        assert!(g.hold_child(A, dir, child));
        assert_eq!(g.revoke(Some(A), &[Invalidation::Attr(dir), Invalidation::Attr(child)]), 0);
        let changer = {
            let g = g.clone();
            std::thread::spawn(move || g.revoke(Some(B), &[Invalidation::Attr(child)]))
        };
        let polled = g.poll(A, 0, Duration::from_secs(60));
        assert_eq!(polled.items, vec![Invalidation::Listing(dir)]);
        assert!(polled.renewed);
        assert!(!changer.is_finished(), "answered before A acknowledged");
        g.poll(A, polled.through, Duration::from_millis(1));
        assert_eq!(changer.join().unwrap(), 1);
        assert_eq!(g.delegations(), 0, "the acknowledged delegation stayed");
        assert_eq!(g.revoke(Some(B), &[Invalidation::Attr(dir)]), 0, "a second change called A back");
    }

    #[test]
    fn a_holders_poll_renews_and_waits_a_part_of_its_ttl() {
        let g = Grants::default();
        g.delegate(A, Ino(20), Duration::from_millis(400));
        let asked = Instant::now();
        let polled = g.poll(A, 0, Duration::from_secs(60));
        assert!(asked.elapsed() < Duration::from_secs(30), "the poll waited as long as without a delegation");
        assert!(polled.renewed && polled.items.is_empty());
        assert_eq!(g.delegations(), 1);
    }

    #[test]
    fn a_creators_grant_ends_at_its_release_without_a_message() {
        let g = Grants::default();
        g.writing(A, Ino(9));
        g.grant_until_closed(A, Ino(9), Duration::from_secs(60));
        g.grant(A, Invalidation::Attr(Ino(10)), Duration::from_secs(60));
        g.closed(A, Ino(9));
        g.closed(A, Ino(10));
        assert!(g.attr_grantable(Ino(9), true), "no longer written");
        assert_eq!(g.len(), 1, "the creator's grant outlived its release, or a lookup's did not");
        assert_eq!(
            g.revoke(Some(B), &[Invalidation::Attr(Ino(9))]),
            0,
            "the released creator is called back"
        );
    }

    #[test]
    fn a_change_waiting_for_a_creator_ends_at_its_release() {
        let g = Arc::new(Grants::default());
        g.grant_until_closed(A, Ino(9), Duration::from_secs(60));
        let changer = {
            let g = g.clone();
            std::thread::spawn(move || g.revoke(Some(B), &[Invalidation::Attr(Ino(9))]))
        };
        while g.state.lock().queues.get(&A).is_none_or(|q| q.pending.is_empty()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!changer.is_finished(), "answered before A acknowledged or released");
        // A never acknowledges; its release (the close raced the change)
        // ends the wait.
        g.closed(A, Ino(9));
        assert_eq!(changer.join().unwrap(), 1);
        assert!(g.is_empty());
        // The invalidation still reaches A, which acknowledges it.
        let Polled { through, items, .. } = g.poll(A, 0, Duration::from_millis(1));
        assert_eq!(items, vec![Invalidation::Attr(Ino(9))]);
        g.poll(A, through, Duration::from_millis(1));
        assert!(g.state.lock().queues[&A].released.is_empty());
    }
}
