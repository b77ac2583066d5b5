//! Coherent kernel caching of entries and attributes: cache grants and the
//! invalidations that revoke them (issue 13; callbacks as CephFS
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
//! # Creators
//!
//! A regular file a caching client creates with `CreateOpen` is open for
//! writing by that client alone, so its entry and attributes could be
//! granted to the creator (its size and times change one-sidedly only by
//! its own writes, which its kernel sees). They are not: tried,
//! it saved the create's `GETATTR` of the new file (create 3,516 → 4,803
//! per s, one process, `bench meta --coherent-ttl 1`) but made every other
//! mount's unlink of a file created within the TTL wait for the creator's
//! acknowledgement (unlink 8,592 → 5,558 per s; 11,200 → 6,025 with four
//! processes in private directories), in the same run. mdtest's pattern
//! and most shared work (files made on one node, consumed and removed on
//! another) pay that, so creators are granted nothing.
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
//! grant has expired or been acknowledged. A fenced or departed client's
//! queue goes with its lease; its grants are kept until they expire (its
//! kernel may still be caching, if the process lives).
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

/// Time added to every grant past its TTL: the kernel installs a reply a
/// little after the meta-server made it (see the module header).
pub const GRANT_MARGIN: Duration = Duration::from_millis(250);

/// How long an `AwaitInvalidations` poll waits for work before answering
/// empty (well below a client's RPC timeout).
pub const POLL_WAIT: Duration = Duration::from_millis(500);

/// Most invalidations one poll answers.
const POLL_BATCH: usize = 1024;

/// What a grant lets a kernel cache.
pub type Key = Invalidation;

/// One client's grant of one thing.
#[derive(Clone, Copy, Debug)]
struct Grant {
    expires: Instant,
    /// The newest invalidation queued for it and not yet acknowledged.
    revoking: Option<u64>,
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
}

#[derive(Default)]
struct State {
    grants: HashMap<Key, HashMap<ClientId, Grant>>,
    queues: HashMap<ClientId, Queue>,
    /// Regular files some client has open for writing, and who: from the
    /// writing open to that client's last close (or its fence).
    writers: HashMap<Ino, HashSet<ClientId>>,
}

/// An invalidation a change waits for.
struct Awaited {
    client: ClientId,
    number: u64,
    /// When the client's grant runs out: the wait ends then regardless.
    expires: Instant,
}

/// Cache grants of the whole cluster and the invalidation queues.
#[derive(Default)]
pub struct Grants {
    state: Mutex<State>,
    /// Signalled when an invalidation is queued (pollers) or acknowledged
    /// (changers).
    changed: Condvar,
}

impl Grants {
    /// Records that `client`'s kernel may cache `key` for `ttl`. Called
    /// with the namespace mutex held, before the answer leaves.
    pub fn grant(&self, client: ClientId, key: Key, ttl: Duration) {
        let expires = Instant::now() + ttl + GRANT_MARGIN;
        let mut s = self.state.lock();
        s.grants.entry(key).or_default().insert(client, Grant { expires, revoking: None });
    }

    /// Revokes every live grant of `keys` held by clients other than
    /// `changer`, and waits until each is acknowledged or expired. Called
    /// after the change, without the namespace mutex. Returns how many
    /// invalidations were sent.
    pub fn revoke(&self, changer: Option<ClientId>, keys: &[Key]) -> usize {
        let now = Instant::now();
        let mut awaited = Vec::new();
        let mut s = self.state.lock();
        let State { grants, queues, .. } = &mut *s;
        for key in keys {
            let Some(holders) = grants.get_mut(key) else { continue };
            holders.retain(|_, g| g.expires > now);
            for (client, grant) in holders.iter_mut() {
                if Some(*client) == changer {
                    continue;
                }
                let queue = queues.entry(*client).or_default();
                queue.last += 1;
                queue.pending.push((queue.last, key.clone()));
                queue.revoked.push((queue.last, key.clone()));
                grant.revoking = Some(queue.last);
                awaited.push(Awaited { client: *client, number: queue.last, expires: grant.expires });
            }
            if holders.is_empty() {
                grants.remove(key);
            }
        }
        if awaited.is_empty() {
            return 0;
        }
        self.changed.notify_all();
        let sent = awaited.len();
        loop {
            let now = Instant::now();
            // A client without a queue was fenced: only its grant's
            // expiry ends the wait.
            awaited.retain(|a| a.expires > now && s.queues.get(&a.client).is_none_or(|q| q.acked < a.number));
            let Some(until) = awaited.iter().map(|a| a.expires).max() else { break };
            self.changed.wait_until(&mut s, until);
        }
        sent
    }

    /// A poll of `client`'s invalidation thread: records its
    /// acknowledgement of everything up to `acked`, then answers the
    /// invalidations past it (waiting up to `wait` for one) and the number
    /// of the last one answered.
    pub fn poll(&self, client: ClientId, acked: u64, wait: Duration) -> (u64, Vec<Invalidation>) {
        let deadline = Instant::now() + wait;
        let mut s = self.state.lock();
        let State { grants, queues, .. } = &mut *s;
        let queue = queues.entry(client).or_default();
        let acked = acked.min(queue.last);
        if acked > queue.acked {
            queue.acked = acked;
            queue.pending.retain(|(n, _)| *n > acked);
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
            self.changed.notify_all();
        }
        loop {
            // Fenced while we waited: nothing more for it.
            let Some(queue) = s.queues.get(&client) else { return (0, Vec::new()) };
            if !queue.pending.is_empty() {
                let items: Vec<_> = queue.pending.iter().take(POLL_BATCH).cloned().collect();
                let through = items.last().map_or(queue.acked, |(n, _)| *n);
                return (through, items.into_iter().map(|(_, i)| i).collect());
            }
            if self.changed.wait_until(&mut s, deadline).timed_out() {
                let acked = s.queues.get(&client).map_or(0, |q| q.acked);
                return (acked, Vec::new());
            }
        }
    }

    /// `client` opened regular file `ino` for writing: its attributes
    /// may change one-sidedly until the client's last close. Called under
    /// the namespace mutex, with the open.
    pub fn writing(&self, client: ClientId, ino: Ino) {
        self.state.lock().writers.entry(ino).or_default().insert(client);
    }

    /// `client` closed `ino` for the last time. Called under the namespace
    /// mutex, with the release.
    pub fn closed(&self, client: ClientId, ino: Ino) {
        let mut s = self.state.lock();
        if let Some(w) = s.writers.get_mut(&ino) {
            w.remove(&client);
            if w.is_empty() {
                s.writers.remove(&ino);
            }
        }
    }

    /// Whether some client has regular file `ino` open for writing (then
    /// its attributes are not granted).
    pub fn written(&self, ino: Ino) -> bool {
        self.state.lock().writers.contains_key(&ino)
    }

    /// A fenced or departed client: its queue and its writing opens go
    /// (changers waiting for it wait for its grants to expire, which stay
    /// until then).
    pub fn drop_client(&self, client: ClientId) {
        let mut s = self.state.lock();
        s.queues.remove(&client);
        s.writers.retain(|_, w| {
            w.remove(&client);
            !w.is_empty()
        });
        drop(s);
        self.changed.notify_all();
    }

    /// Forgets expired grants.
    pub fn prune(&self) {
        let now = Instant::now();
        let mut s = self.state.lock();
        s.grants.retain(|_, holders| {
            holders.retain(|_, g| g.expires > now);
            !holders.is_empty()
        });
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
        let (through, items) = g.poll(B, 0, Duration::from_secs(60));
        assert_eq!(items, vec![key.clone()]);
        assert!(!changer.is_finished(), "answered before B acknowledged");
        let (_, none) = g.poll(B, through, Duration::from_millis(1));
        assert!(none.is_empty());
        assert_eq!(changer.join().unwrap(), 1, "only B is called back");
        // B's revoked grant is gone (it acknowledged); A's stays.
        assert_eq!(g.len(), 1);
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
}
