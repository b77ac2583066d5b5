//! The grace period after a restart: the clients of the meta-server's
//! previous process come back and reclaim their opens and locks before
//! anything that could conflict with them is handed out (as NFSv4 servers
//! do after a reboot, RFC 8881 §8.4.2.1).
//!
//! What survives the process: the namespace (the journal), the attribute
//! slots and the lock region (files of the state directory), so every lock
//! word, record table and waits-for entry is where the clients left it. What
//! does not: which file owns which lock area, the opens, the leases, the
//! Citron tree host's instances. The journal keeps the registered clients'
//! ids; each comes back with one [`MetaRequest::ReclaimClient`] naming its
//! opens and their lock areas, and the areas are taken back with their
//! words ([`crate::lock_areas::LockAreas::reclaim`]).
//!
//! The rules, and why each is needed:
//! * **Nothing is allocated in the lock region during the grace period**
//!   ([`crate::lock_areas::LockAreas::set_frozen`]): its free memory may
//!   hold an area a client has not reclaimed yet. Opens of files nobody
//!   reclaimed, table and waits-for growth, and creates answer
//!   [`FsError::Grace`], and the client asks again.
//! * **A quiet start** (`quiet`, one lease): reclaims are served only once
//!   every live client has noticed the restart (each renews its lease four
//!   times a lease, and a renewal is how it notices) and so stopped
//!   starting I/O under the range locks of the old process, whose tree
//!   host's memory is handed out again to the reclaimed files' new trees.
//! * **A client that has not reclaimed yet is not served** under its id
//!   ([`Grace::awaits`]): its renewals are refused (that is how it notices)
//!   and its other requests answer [`FsError::Grace`].
//! * **The end**: when every remembered client has reclaimed (after the
//!   quiet start), or at `until`. Clients that did not come back are then
//!   fenced as if their lease had run out (their records and waits go,
//!   waking whoever waits for them), and lock memory is handed out again,
//!   each dirty block zeroed first.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use citronfs_core::proto::MetaRequest;
use citronfs_core::types::ClientId;
use citronfs_core::FsError;
use parking_lot::Mutex;

/// The grace period of one meta-server process.
pub(super) struct Grace {
    state: Mutex<GraceState>,
}

struct GraceState {
    /// Clients of the previous process that have not reclaimed.
    awaiting: BTreeSet<ClientId>,
    /// Reclaims are served from here on.
    quiet_until: Instant,
    /// The period ends here at the latest.
    until: Instant,
    over: bool,
}

/// What [`Grace::tick`] found: the period just ended.
pub(super) struct GraceEnded {
    /// Remembered clients that did not come back, to be fenced.
    pub missing: Vec<ClientId>,
}

impl Grace {
    /// No grace period: a new file system, or a restart that kept no lock
    /// memory (nothing to reclaim).
    pub fn none() -> Self {
        let now = Instant::now();
        Self {
            state: Mutex::new(GraceState {
                awaiting: BTreeSet::new(),
                quiet_until: now,
                until: now,
                over: true,
            }),
        }
    }

    /// A grace period of `length` for `clients`, the first `quiet` of it
    /// without reclaims.
    pub fn start(clients: impl IntoIterator<Item = ClientId>, quiet: Duration, length: Duration) -> Self {
        let now = Instant::now();
        let awaiting: BTreeSet<ClientId> = clients.into_iter().collect();
        let over = awaiting.is_empty();
        Self {
            state: Mutex::new(GraceState {
                awaiting,
                quiet_until: now + quiet,
                until: now + length.max(quiet),
                over,
            }),
        }
    }

    /// When it ends at the latest, if it is on (status).
    pub fn ends(&self) -> Option<Instant> {
        let s = self.state.lock();
        (!s.over).then_some(s.until)
    }

    /// Clients still awaited (status).
    pub fn awaited(&self) -> usize {
        self.state.lock().awaiting.len()
    }

    /// Whether `client` is a client of the previous process that has not
    /// reclaimed yet.
    pub fn awaits(&self, client: ClientId) -> bool {
        let s = self.state.lock();
        !s.over && s.awaiting.contains(&client)
    }

    /// `client` comes back ([`MetaRequest::ReclaimClient`]): `Ok` takes it
    /// off the awaited list, and the caller registers it under its id.
    /// [`FsError::Grace`] during the quiet start (ask again);
    /// [`FsError::MetaRestarted`] for a client this process does not wait
    /// for (the period is over, or it was never registered).
    pub fn reclaim(&self, client: ClientId) -> Result<(), FsError> {
        let mut s = self.state.lock();
        if s.over || !s.awaiting.contains(&client) {
            return Err(FsError::MetaRestarted);
        }
        if Instant::now() < s.quiet_until {
            return Err(FsError::Grace);
        }
        s.awaiting.remove(&client);
        Ok(())
    }

    /// Ends the period if its time has come; the caller then fences the
    /// missing clients and lets lock memory be handed out.
    pub fn tick(&self) -> Option<GraceEnded> {
        let mut s = self.state.lock();
        let now = Instant::now();
        let done = now >= s.until || (s.awaiting.is_empty() && now >= s.quiet_until);
        if s.over || !done {
            return None;
        }
        s.over = true;
        Some(GraceEnded { missing: std::mem::take(&mut s.awaiting).into_iter().collect() })
    }
}

/// The client a request is made for, if it names one.
pub(super) fn client_of(request: &MetaRequest) -> Option<ClientId> {
    use MetaRequest as R;
    match request {
        R::Heartbeat { client }
        | R::ClientLeaves { client }
        | R::ReportLockTiming { client, .. }
        | R::CreateOpen { client, .. }
        | R::LateChanges { client, .. }
        | R::LendInodes { client, .. }
        | R::Open { client, .. }
        | R::Release { client, .. }
        | R::ReleaseMany { client, .. }
        | R::Caching { client, .. }
        | R::Once { client, .. }
        | R::AwaitInvalidations { client, .. } => Some(*client),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reclaims_wait_for_the_quiet_start_and_end_the_period() {
        let grace =
            Grace::start([ClientId(3), ClientId(4)], Duration::from_millis(50), Duration::from_secs(60));
        assert!(grace.awaits(ClientId(3)));
        assert_eq!(grace.reclaim(ClientId(3)), Err(FsError::Grace), "quiet start");
        assert_eq!(grace.reclaim(ClientId(9)), Err(FsError::MetaRestarted), "never registered");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(grace.reclaim(ClientId(3)), Ok(()));
        assert!(!grace.awaits(ClientId(3)));
        assert_eq!(grace.reclaim(ClientId(3)), Err(FsError::MetaRestarted), "reclaimed twice");
        assert!(grace.tick().is_none(), "client 4 is still awaited");
        assert_eq!(grace.reclaim(ClientId(4)), Ok(()));
        let ended = grace.tick().expect("every client came back");
        assert!(ended.missing.is_empty());
        assert!(grace.ends().is_none());
        assert!(grace.tick().is_none(), "ends once");
    }

    #[test]
    fn clients_that_do_not_come_back_are_fenced_at_the_end() {
        let grace = Grace::start([ClientId(5)], Duration::ZERO, Duration::from_millis(20));
        assert!(grace.tick().is_none());
        std::thread::sleep(Duration::from_millis(30));
        let ended = grace.tick().expect("its time has come");
        assert_eq!(ended.missing, vec![ClientId(5)]);
        assert_eq!(grace.reclaim(ClientId(5)), Err(FsError::MetaRestarted), "too late");
    }

    #[test]
    fn no_period_without_clients_to_wait_for() {
        assert!(Grace::none().ends().is_none());
        assert!(Grace::start([], Duration::from_secs(1), Duration::from_secs(9)).ends().is_none());
    }
}
