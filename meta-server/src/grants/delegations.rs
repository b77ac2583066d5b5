//! Directory delegations: the table behind [`super::Grants`]' delegations
//! ("Delegations" in its module header has the protocol).
//!
//! A delegation of directory `dir` to one caching client says: the
//! client's mount knows every entry of `dir` (it made the directory, so it
//! saw it empty, and has seen every change since, its own from their
//! answers), and the attributes of the children it made in it while
//! holding the delegation. Both stay true until another client changes
//! the directory or one of those children, which revokes the delegation as
//! a whole, or until it expires (its holder stopped polling).
//!
//! Every change of a directory's entries names the directory's attributes
//! among what it changed, and every change of an inode's attributes names
//! the inode's (meta-server `dispatch`), so the attribute keys of a change
//! are all that revocation needs: a key that is a delegated directory, or
//! a child held with one, revokes that delegation.
//!
//! A child may be held with several delegations at once: a file with
//! names in two delegated directories (a hard link), or one that two
//! clients each hold with a delegation of their own. Each delegation that
//! holds it is revoked by its change, not only the last one that took it:
//! a holder's mount keeps a child's attributes with whichever of its
//! delegations its answers brought last, and the order in which it
//! processes two answers need not be the order in which they were made,
//! so the meta-server cannot tell which one that is.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use citronfs_core::types::{ClientId, Ino};

use super::GRANT_MARGIN;

/// Most children whose attributes one delegation holds; later children of
/// the directory are still in the holder's listing, without attributes.
pub const MAX_CHILDREN: usize = 1 << 18;

/// One directory's delegation.
#[derive(Debug)]
struct Delegation {
    holder: ClientId,
    /// The holder's grant TTL: every renewal extends the delegation by it.
    ttl: Duration,
    expires: Instant,
    /// The invalidation that revokes it, queued and not yet acknowledged:
    /// it is renewed no more, and holds no new children.
    revoking: Option<u64>,
    /// Whether another client looked into it (see [`Sharing`]).
    sharing: Sharing,
    /// Children whose attributes the holder keeps with the delegation.
    children: HashSet<Ino>,
}

/// Whether a client other than the holder looked into a delegated
/// directory: from then on the holder answers no create or unlink there
/// before it sends it (meta-server `grants`, "Late changes").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sharing {
    /// Nobody else did.
    Exclusive,
    /// Told to the holder as invalidation `number`, not yet acknowledged.
    Telling(u64),
    /// Acknowledged: the holder answers unlinks there only once sent.
    Shared,
}

impl Delegation {
    fn usable_by(&self, client: ClientId, now: Instant) -> bool {
        self.holder == client && self.revoking.is_none() && self.expires > now
    }
}

/// A delegation another client's change must revoke, or is revoking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revocation {
    /// Queue `Invalidation::Listing(dir)` for `holder`, then call
    /// [`Delegations::revoking`] with its number.
    Queue { dir: Ino, holder: ClientId, expires: Instant },
    /// Already queued as invalidation `number`: wait for it too.
    Await { holder: ClientId, number: u64, expires: Instant },
    /// Queue `Invalidation::Shared(dir)` for `holder`, then call
    /// [`Delegations::sharing`] with its number.
    Share { dir: Ino, holder: ClientId, expires: Instant },
}

/// Every delegation of the cluster.
#[derive(Debug, Default)]
pub struct Delegations {
    by_dir: HashMap<Ino, Delegation>,
    /// The delegated directories each child is held with (see the module
    /// header: a child may be held with several).
    held_with: HashMap<Ino, Vec<Ino>>,
    /// How many delegations each holder has (expired ones until pruned).
    holders: HashMap<ClientId, usize>,
}

impl Delegations {
    /// Delegates new directory `dir` to `client`, its creator, for `ttl`.
    pub fn delegate(&mut self, client: ClientId, dir: Ino, ttl: Duration, now: Instant) {
        let delegation = Delegation {
            holder: client,
            ttl,
            expires: now + ttl + GRANT_MARGIN,
            revoking: None,
            sharing: Sharing::Exclusive,
            children: HashSet::new(),
        };
        *self.holders.entry(client).or_default() += 1;
        if let Some(old) = self.by_dir.insert(dir, delegation) {
            // An inode number used again: what the old one held is void.
            self.forgo(old.holder);
            self.forget_children(dir, old.children);
        }
    }

    /// Whether a client other than `asker` holds a delegation (expired
    /// ones count until pruned or met).
    pub fn held_by_another_than(&self, asker: Option<ClientId>) -> bool {
        self.holders.keys().any(|holder| Some(*holder) != asker)
    }

    fn forgo(&mut self, holder: ClientId) {
        if let Entry::Occupied(mut e) = self.holders.entry(holder) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }

    /// Holds the attributes of `child`, just made in `dir` by `client`,
    /// with `client`'s delegation of `dir`, if it has a usable one; whether
    /// it does.
    pub fn hold_child(&mut self, client: ClientId, dir: Ino, child: Ino, now: Instant) -> bool {
        let Some(d) = self.by_dir.get_mut(&dir) else { return false };
        if !d.usable_by(client, now) || d.children.len() >= MAX_CHILDREN {
            return false;
        }
        // Held with every delegation that took it until each ends (an
        // inode number used again is still held with the old one's, which
        // costs a needless revocation at most).
        if d.children.insert(child) {
            self.held_with.entry(child).or_default().push(dir);
        }
        true
    }

    /// The delegated directories `ino` is one of, or is held with.
    fn covering(&self, ino: Ino) -> Vec<Ino> {
        let own = self.by_dir.contains_key(&ino).then_some(ino);
        let holding = self.held_with.get(&ino).into_iter().flatten().copied();
        own.into_iter().chain(holding).collect()
    }

    /// The directory whose delegation `client` holds `ino`'s attributes
    /// with, if that delegation is usable.
    pub fn held_dir(&self, client: ClientId, ino: Ino, now: Instant) -> Option<Ino> {
        let dirs = self.held_with.get(&ino)?;
        dirs.iter().copied().find(|dir| self.by_dir.get(dir).is_some_and(|d| d.usable_by(client, now)))
    }

    /// What a change of `ino`'s attributes by `changer` (`None`: a client
    /// that does not cache, or the meta-server) does to the delegations
    /// covering `ino`: `ino`'s own if it is a delegated directory (its
    /// entries may have changed), and each one it is held with if it is a
    /// held child (its attributes did) — a directory made in a delegated
    /// directory is both. Nothing for one that is expired or held by the
    /// changer.
    pub fn revocations(&mut self, ino: Ino, changer: Option<ClientId>, now: Instant) -> Vec<Revocation> {
        self.covering(ino).into_iter().filter_map(|dir| self.revocation(dir, changer, now)).collect()
    }

    fn revocation(&mut self, dir: Ino, changer: Option<ClientId>, now: Instant) -> Option<Revocation> {
        let d = self.by_dir.get(&dir)?;
        if d.expires <= now {
            self.remove(dir);
            return None;
        }
        if Some(d.holder) == changer {
            return None;
        }
        Some(match d.revoking {
            Some(number) => Revocation::Await { holder: d.holder, number, expires: d.expires },
            None => Revocation::Queue { dir, holder: d.holder, expires: d.expires },
        })
    }

    /// What a request of `asker` that names `ino` (and is served after
    /// this) must wait for, of the delegations covering `ino` that another
    /// client holds: one nobody else looked into is shared
    /// ([`Revocation::Share`]); one being shared or revoked is awaited.
    /// Nothing for one shared and acknowledged, or expired.
    pub fn recalls(&mut self, ino: Ino, asker: Option<ClientId>, now: Instant) -> Vec<Revocation> {
        let mut recalls = Vec::new();
        for dir in self.covering(ino) {
            let Some(d) = self.by_dir.get(&dir) else { continue };
            if d.expires <= now {
                self.remove(dir);
                continue;
            }
            if Some(d.holder) == asker {
                continue;
            }
            let (holder, expires) = (d.holder, d.expires);
            match (d.revoking, d.sharing) {
                (Some(number), _) | (None, Sharing::Telling(number)) => {
                    recalls.push(Revocation::Await { holder, number, expires })
                }
                (None, Sharing::Exclusive) => recalls.push(Revocation::Share { dir, holder, expires }),
                (None, Sharing::Shared) => {}
            }
        }
        recalls
    }

    /// The sharing of `dir`'s delegation was queued as invalidation
    /// `number` of its holder.
    pub fn sharing(&mut self, dir: Ino, number: u64) {
        if let Some(d) = self.by_dir.get_mut(&dir) {
            d.sharing = Sharing::Telling(number);
        }
    }

    /// The revocation of `dir`'s delegation was queued as invalidation
    /// `number` of its holder.
    pub fn revoking(&mut self, dir: Ino, number: u64) {
        if let Some(d) = self.by_dir.get_mut(&dir) {
            d.revoking = Some(number);
        }
    }

    /// `client` acknowledged its invalidations up to `acked`: the
    /// delegations they revoked are gone from its mount.
    pub fn acknowledged(&mut self, client: ClientId, acked: u64) {
        for d in self.by_dir.values_mut().filter(|d| d.holder == client) {
            if matches!(d.sharing, Sharing::Telling(n) if n <= acked) {
                d.sharing = Sharing::Shared;
            }
        }
        let done: Vec<Ino> = self
            .by_dir
            .iter()
            .filter(|(_, d)| d.holder == client && d.revoking.is_some_and(|n| n <= acked))
            .map(|(dir, _)| *dir)
            .collect();
        for dir in done {
            self.remove(dir);
        }
    }

    /// A poll of `client` arrived: its usable delegations last its TTL
    /// from now. Answers the shortest TTL among them (`None`: it holds
    /// none).
    pub fn renew(&mut self, client: ClientId, now: Instant) -> Option<Duration> {
        let mut shortest: Option<Duration> = None;
        for d in self.by_dir.values_mut().filter(|d| d.usable_by(client, now)) {
            d.expires = now + d.ttl + GRANT_MARGIN;
            shortest = Some(shortest.map_or(d.ttl, |s| s.min(d.ttl)));
        }
        shortest
    }

    /// Forgets the delegations of `client`, which left the cluster (its
    /// mount is gone, and sent what it answered first before it left).
    pub fn drop_holder(&mut self, client: ClientId) {
        let held: Vec<Ino> =
            self.by_dir.iter().filter(|(_, d)| d.holder == client).map(|(dir, _)| *dir).collect();
        for dir in held {
            self.remove(dir);
        }
    }

    /// `client` was fenced: it can send nothing any more under this
    /// registration (what it answered first it sends again once registered
    /// anew, each unlink naming its inode), so no recall waits for it: its
    /// delegations count as shared. They stay until they expire, so that a
    /// change still waits for what its kernel may cache from them.
    pub fn holder_fenced(&mut self, client: ClientId) {
        for d in self.by_dir.values_mut().filter(|d| d.holder == client) {
            d.sharing = Sharing::Shared;
        }
    }

    /// Forgets expired delegations.
    pub fn prune(&mut self, now: Instant) {
        let expired: Vec<Ino> =
            self.by_dir.iter().filter(|(_, d)| d.expires <= now).map(|(dir, _)| *dir).collect();
        for dir in expired {
            self.remove(dir);
        }
    }

    /// Delegations held now, expired ones included (tests, diagnostics).
    pub fn len(&self) -> usize {
        self.by_dir.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_dir.is_empty()
    }

    fn remove(&mut self, dir: Ino) {
        if let Some(d) = self.by_dir.remove(&dir) {
            self.forgo(d.holder);
            self.forget_children(dir, d.children);
        }
    }

    fn forget_children(&mut self, dir: Ino, children: HashSet<Ino>) {
        for child in children {
            if let Entry::Occupied(mut e) = self.held_with.entry(child) {
                e.get_mut().retain(|d| *d != dir);
                if e.get().is_empty() {
                    e.remove();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ClientId = ClientId(1);
    const B: ClientId = ClientId(2);
    const TTL: Duration = Duration::from_secs(60);
    const DIR: Ino = Ino(10);

    #[test]
    fn the_holders_own_changes_revoke_nothing_and_anothers_revoke_the_whole() {
        let now = Instant::now();
        let mut d = Delegations::default();
        d.delegate(A, DIR, TTL, now);
        assert!(d.hold_child(A, DIR, Ino(11), now));
        assert!(!d.hold_child(B, DIR, Ino(12), now), "a child held with another client's delegation");
        assert_eq!(d.held_dir(A, Ino(11), now), Some(DIR));
        assert_eq!(d.held_dir(B, Ino(11), now), None, "held for a client that does not hold the delegation");
        assert_eq!(d.revocations(DIR, Some(A), now), vec![]);
        assert_eq!(d.revocations(Ino(11), Some(A), now), vec![]);
        assert_eq!(d.revocations(Ino(12), Some(B), now), vec![], "a child not held revokes");
        let [Revocation::Queue { dir, holder, .. }] = d.revocations(Ino(11), Some(B), now)[..] else {
            panic!("a child's change by another client does not revoke");
        };
        assert_eq!((dir, holder), (DIR, A));
        d.revoking(DIR, 7);
        assert!(matches!(d.revocations(DIR, None, now)[..], [Revocation::Await { number: 7, .. }]));
        assert!(!d.hold_child(A, DIR, Ino(13), now), "a revoked delegation holds new children");
        assert_eq!(d.renew(A, now), None, "a revoked delegation renewed");
        d.acknowledged(A, 6);
        assert_eq!(d.len(), 1);
        assert!(d.held_by_another_than(Some(B)) && !d.held_by_another_than(Some(A)));
        assert!(d.held_by_another_than(None), "a client that does not cache is another");
        d.acknowledged(A, 7);
        assert_eq!(d.len(), 0);
        assert!(d.held_with.is_empty(), "a child outlived its delegation");
        assert!(!d.held_by_another_than(Some(B)), "a holder outlived its delegations");
    }

    #[test]
    fn a_delegation_is_shared_once_and_awaited_until_acknowledged() {
        let now = Instant::now();
        let mut d = Delegations::default();
        d.delegate(A, DIR, TTL, now);
        assert!(d.hold_child(A, DIR, Ino(11), now));
        assert_eq!(d.recalls(DIR, Some(A), now), vec![], "the holder's own request");
        let [Revocation::Share { dir, holder, .. }] = d.recalls(Ino(11), Some(B), now)[..] else {
            panic!("another client's look at a held child does not share");
        };
        assert_eq!((dir, holder), (DIR, A));
        d.sharing(DIR, 4);
        assert!(matches!(d.recalls(DIR, None, now)[..], [Revocation::Await { number: 4, .. }]));
        d.acknowledged(A, 4);
        assert_eq!(d.recalls(DIR, Some(B), now), vec![], "a shared delegation is shared again");
        assert_eq!(d.len(), 1, "sharing ended the delegation");
        // A change still revokes it.
        assert!(matches!(d.revocations(DIR, Some(B), now)[..], [Revocation::Queue { .. }]));
        d.drop_holder(A);
        assert_eq!(d.len(), 0);
        assert!(!d.held_by_another_than(Some(B)));
        // A fenced holder is waited for by no recall, and still revoked.
        d.delegate(A, DIR, TTL, now);
        d.holder_fenced(A);
        assert_eq!(d.recalls(DIR, Some(B), now), vec![], "a recall waits for a fenced holder");
        assert!(matches!(d.revocations(DIR, Some(B), now)[..], [Revocation::Queue { .. }]));
    }

    #[test]
    fn a_delegation_lasts_while_renewed_and_no_longer() {
        let start = Instant::now();
        let ttl = Duration::from_secs(1);
        let mut d = Delegations::default();
        d.delegate(A, DIR, ttl, start);
        d.hold_child(A, DIR, Ino(11), start);
        let later = start + ttl + GRANT_MARGIN / 2;
        assert_eq!(d.renew(A, later), Some(ttl));
        let past_first = start + ttl + GRANT_MARGIN * 2;
        assert_eq!(d.revocations(DIR, Some(B), past_first).len(), 1, "renewal did not extend it");
        let past_renewal = later + ttl + GRANT_MARGIN * 2;
        assert_eq!(d.revocations(Ino(11), Some(B), past_renewal), vec![], "an expired delegation revoked");
        assert_eq!(d.len(), 0);
        d.delegate(A, DIR, ttl, start);
        d.prune(past_renewal);
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn a_delegated_directory_held_in_a_delegated_directory_revokes_both() {
        let now = Instant::now();
        let mut d = Delegations::default();
        let sub = Ino(11);
        d.delegate(A, DIR, TTL, now);
        assert!(d.hold_child(A, DIR, sub, now));
        d.delegate(A, sub, TTL, now);
        let dirs: Vec<Ino> = d
            .revocations(sub, Some(B), now)
            .into_iter()
            .map(|r| match r {
                Revocation::Queue { dir, .. } => dir,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(dirs, vec![sub, DIR], "its listing and its attributes were not both revoked");
    }

    /// A file held with two delegations of one client (a name in each), or
    /// with delegations of two clients: a change of it revokes every one
    /// held by another client than the changer, whichever took it last.
    #[test]
    fn a_child_held_with_several_delegations_revokes_each() {
        let now = Instant::now();
        let mut d = Delegations::default();
        let (d1, d2, d3, file) = (Ino(20), Ino(21), Ino(22), Ino(30));
        d.delegate(A, d1, TTL, now);
        d.delegate(A, d2, TTL, now);
        d.delegate(B, d3, TTL, now);
        assert!(d.hold_child(A, d1, file, now));
        assert!(d.hold_child(A, d2, file, now));
        assert!(d.hold_child(B, d3, file, now));
        let revoked = |d: &mut Delegations, changer| {
            let mut dirs: Vec<Ino> = d
                .revocations(file, Some(changer), now)
                .into_iter()
                .map(|r| match r {
                    Revocation::Queue { dir, .. } => dir,
                    other => panic!("{other:?}"),
                })
                .collect();
            dirs.sort();
            dirs
        };
        assert_eq!(revoked(&mut d, B), vec![d1, d2], "a delegation that holds the file was not revoked");
        assert_eq!(revoked(&mut d, A), vec![d3], "B's delegation was not revoked");
        // Another client's look at it shares each of A's.
        assert_eq!(d.recalls(file, Some(B), now).len(), 2);
        // One ending leaves the others holding it.
        d.revoking(d1, 1);
        d.acknowledged(A, 1);
        assert_eq!(d.held_dir(A, file, now), Some(d2));
        assert_eq!(revoked(&mut d, B), vec![d2]);
    }

    #[test]
    fn children_are_bounded() {
        let now = Instant::now();
        let mut d = Delegations::default();
        d.delegate(A, DIR, TTL, now);
        for i in 0..MAX_CHILDREN as u64 {
            assert!(d.hold_child(A, DIR, Ino(100 + i), now));
        }
        assert!(!d.hold_child(A, DIR, Ino(1), now));
    }
}
