//! The client's half of Citron's cluster-wide `T_wait`
//! (`citron_lock::citron::tuning`): a thread measures this client's round
//! trip to lock memory again and again and tells the cluster manager what
//! `T_wait` it needs ([`needed_t_wait`]), so the published value follows
//! the slowest client, also when the machine's load slows one down.
//!
//! At connection the client reports once and waits (boundedly) until the
//! published value covers it, so a far mount's first locks need not abort
//! their way to the root while the cluster manager catches up.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use citron_lock::citron::tuning::TWaitWord;
use citron_lock::rdma::{Endpoint, RemoteAddr};

use super::{answer, Shared};
use crate::error::FsError;
use crate::locks::guard::needed_t_wait;
use crate::proto::{MetaRequest, MetaResponse};
use crate::types::ClientId;

/// Reads of one measurement; their median is the round trip.
const SAMPLES: usize = 8;
/// Between two measurements.
const PERIOD: Duration = Duration::from_secs(1);
/// A need is reported again when it moved by more than a quarter, or after
/// this long anyway (the cluster manager may have restarted its count).
const REFRESH: Duration = Duration::from_secs(10);
/// Longest a new client waits for the published value to cover it (and
/// at most a quarter of its lease, which runs from its registration).
const COVER_WAIT: Duration = Duration::from_secs(1);

/// Where to measure and what is published.
#[derive(Clone, Copy, Debug)]
pub(super) struct TuningSite {
    /// A word of lock memory that clients only read.
    pub probe: RemoteAddr,
    /// The published `T_wait` (`None`: the cluster publishes none).
    pub word: Option<RemoteAddr>,
}

fn report(shared: &Shared, need: Duration) -> Result<(), FsError> {
    let client = ClientId(shared.client.load(Ordering::Relaxed));
    // Rounded up: the published value (whole µs) must not fall short.
    let t_wait_us = need.as_nanos().div_ceil(1000).min(u128::from(u64::MAX)) as u64;
    match answer(shared.call(&MetaRequest::ReportLockTiming { client, t_wait_us }))? {
        MetaResponse::Done => Ok(()),
        other => Err(super::unexpected(other)),
    }
}

/// Reports the need of a client `rtt` away and waits until the published
/// `T_wait` covers it (at most [`COVER_WAIT`]; a cluster manager that
/// caps it lower leaves this client to Citron's bounded aborts).
pub(super) fn join(shared: &Shared, ep: &Endpoint, site: TuningSite, rtt: Duration) -> Result<(), FsError> {
    let Some(word) = site.word else { return Ok(()) };
    let need = needed_t_wait(rtt);
    report(shared, need)?;
    let start = Instant::now();
    while start.elapsed() < COVER_WAIT.min(shared.lease / 4) {
        if TWaitWord(ep.read_u64(word)?).budget().is_some_and(|b| b >= need) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    log::info!("the cluster's published T_wait does not cover this client's {need:?} yet");
    Ok(())
}

/// The reporting thread's loop, until the client stops.
pub(super) fn run(shared: Arc<Shared>, ep: Endpoint, site: TuningSite, first: Duration) {
    if site.word.is_none() {
        return;
    }
    let mut reported = (needed_t_wait(first), Instant::now(), shared.registration.load(Ordering::Relaxed));
    let mut next = Instant::now() + PERIOD;
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(20));
        if Instant::now() < next {
            continue;
        }
        next = Instant::now() + PERIOD;
        let rtt = match ep.measure_rtt(site.probe, SAMPLES) {
            Ok(rtt) => rtt,
            Err(e) => {
                log::debug!("cannot measure the lock-memory round trip: {e}");
                continue;
            }
        };
        let need = needed_t_wait(rtt);
        let registration = shared.registration.load(Ordering::Relaxed);
        let (last, when, reg) = reported;
        let moved = need > last + last / 4 || need < last - last / 4;
        if moved || when.elapsed() >= REFRESH || registration != reg {
            match report(&shared, need) {
                Ok(()) => reported = (need, Instant::now(), registration),
                Err(e) => log::debug!("cannot report the T_wait this client needs: {e}"),
            }
        }
    }
}
