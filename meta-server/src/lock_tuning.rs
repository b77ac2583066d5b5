//! The cluster manager's half of Citron's cluster-wide `T_wait`
//! (citron-fast23.md §3.5.5, "Tuning the parameters"; the word, the two
//! phases and why they are safe are in [`citron_lock::citron::tuning`]).
//!
//! Every client reports the `T_wait` it needs ([`MetaRequest::ReportLockTiming`]:
//! [`needed_t_wait`] of its measured round trip to lock memory, which it
//! measures again while it runs, so a client that the machine's load slows
//! down reports more). A thread of the meta-server publishes the largest
//! need of the clients that hold a lease, never below the cluster's
//! configured floor (`--lock-t-wait-us`) nor above [`MAX_PUBLISHED_T_WAIT`]:
//! at once when it must rise, and only after it has been at most 3/4 of the
//! published value for [`LOWER_AFTER`] when it may fall, so a client whose
//! round trip wobbles does not make the cluster change it back and forth.
//! A client beyond the cap still gets every lock, through Citron's bounded
//! aborts (it locks the root), only without concurrency.
//!
//! [`MetaRequest::ReportLockTiming`]: citronfs_core::proto::MetaRequest::ReportLockTiming
//! [`needed_t_wait`]: citronfs_core::locks::guard::needed_t_wait

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use citron_lock::citron::tuning::TWaitPublisher;
use citron_lock::rdma::{Endpoint, RemoteAddr};
use citronfs_core::types::ClientId;
use parking_lot::Mutex;

/// The largest `T_wait` the cluster manager publishes: it is what every
/// holder of an internal node may wait, so it must stay far below the lock
/// lease; 100 ms covers clients up to 20 ms away.
pub const MAX_PUBLISHED_T_WAIT: Duration = Duration::from_millis(100);
/// How long the needs must stay well below the published value before it
/// is lowered.
pub const LOWER_AFTER: Duration = Duration::from_secs(5);
/// How often the publisher looks at the needs.
const TICK: Duration = Duration::from_millis(10);

/// The clients' needs and the published word.
pub struct LockTuning {
    word: RemoteAddr,
    floor: Duration,
    needs: Mutex<HashMap<ClientId, Duration>>,
}

impl LockTuning {
    /// `word`: 8 zeroed bytes of lock memory; `floor`: the cluster's
    /// configured `T_wait`.
    pub fn new(word: RemoteAddr, floor: Duration) -> Self {
        Self { word, floor: floor.min(MAX_PUBLISHED_T_WAIT), needs: Mutex::new(HashMap::new()) }
    }

    pub fn word(&self) -> RemoteAddr {
        self.word
    }

    /// `client` needs `need` (its latest report replaces the earlier one).
    pub fn report(&self, client: ClientId, need: Duration) {
        self.needs.lock().insert(client, need);
    }

    /// A client that lost its lease no longer counts.
    pub fn forget(&self, client: ClientId) {
        self.needs.lock().remove(&client);
    }

    /// What should be published now.
    pub fn target(&self) -> Duration {
        let most = self.needs.lock().values().copied().max().unwrap_or(Duration::ZERO);
        most.clamp(self.floor, MAX_PUBLISHED_T_WAIT)
    }

    /// Publishes the floor, then follows the needs until `stop`, on a
    /// thread of its own (a change blocks it for a few `T_wait`).
    pub fn spawn(self: Arc<Self>, ep: Endpoint, stop: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new().name("meta-t-wait".into()).spawn(move || {
            let mut publisher = match TWaitPublisher::start(&ep, self.word, self.floor) {
                Ok(p) => p,
                Err(e) => {
                    log::error!("cannot publish Citron's T_wait: {e}; clients use the floor");
                    return;
                }
            };
            let mut high_since: Option<Instant> = None;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(TICK);
                let (target, current) = (self.target(), publisher.current());
                let change = if target > current {
                    high_since = None;
                    true
                } else if target < current * 3 / 4 {
                    high_since.get_or_insert_with(Instant::now).elapsed() >= LOWER_AFTER
                } else {
                    high_since = None;
                    false
                };
                if change {
                    match publisher.set(&ep, target) {
                        Ok(()) => log::info!("Citron T_wait of the cluster: {current:?} -> {target:?}"),
                        Err(e) => log::error!("cannot change Citron's T_wait: {e}"),
                    }
                    high_since = None;
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use citron_lock::rdma::RegionId;

    #[test]
    fn the_target_is_the_largest_need_within_floor_and_cap() {
        let t = LockTuning::new(RemoteAddr::new(RegionId(2), 0), Duration::from_micros(200));
        assert_eq!(t.target(), Duration::from_micros(200), "no client: the floor");
        t.report(ClientId(1), Duration::from_micros(50));
        assert_eq!(t.target(), Duration::from_micros(200));
        t.report(ClientId(2), Duration::from_millis(25));
        assert_eq!(t.target(), Duration::from_millis(25), "the slowest client");
        t.report(ClientId(3), Duration::from_secs(3));
        assert_eq!(t.target(), MAX_PUBLISHED_T_WAIT, "capped");
        t.forget(ClientId(3));
        t.report(ClientId(2), Duration::from_millis(1));
        assert_eq!(t.target(), Duration::from_millis(1), "reports replace and fenced clients go");
    }
}
