//! The cross-mount coherence checker (`citronfs_tests::coherence_checker`)
//! run against two mounts of one cluster, in both mount modes — strict
//! (nothing cached) and coherent caching (`--cache-ttl`, with callbacks,
//! invalidations and delegations) — over both transports (shm and tcp):
//! threads on both mounts change a small tree and look at it, and no look
//! that began after a change had returned may show the tree older than
//! that change.
//!
//! And the proof that the oracle can fail: a mount that caches with a long
//! TTL but ignores its invalidations (a test-only hook) is caught.

use std::time::Duration;

use citronfs_core::client::Transport;
use citronfs_mount::MountOptions;
use citronfs_tests::coherence_checker::{run, Report, Run};
use citronfs_tests::{TestCluster, TestMount};

/// How long each configuration runs.
const DURATION: Duration = Duration::from_secs(8);

/// The grant TTL of caching mounts: long, so that a missed invalidation is
/// a stale answer for the rest of the run, never hidden by an expiry.
const LONG_TTL: Duration = Duration::from_secs(60);

/// Fewer looks checked than this and a run proves nothing.
const MIN_LOOKS_PER_MOUNT: u64 = 300;
/// Fewer changes than this and a run proves nothing.
const MIN_CHANGES: u64 = 100;

fn mounts(c: &TestCluster, cache_ttl: Duration, transport: Transport) -> (TestMount, TestMount) {
    let options = MountOptions { cache_ttl, ..MountOptions::default() };
    let mount = || TestMount::with_config_and_options(c.client_config(None, transport), options.clone());
    (mount(), mount())
}

/// Runs the checker with both mounts changing and looking.
fn check_both_mounts(cache_ttl: Duration, transport: Transport, seed: u64) -> Report {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b) = mounts(&c, cache_ttl, transport);
    let _hang = (a.watchdog(Duration::from_secs(300)), b.watchdog(Duration::from_secs(300)));
    let report = run(&Run { mounts: [&a, &b], changing: vec![0, 1], duration: DURATION, seed });
    eprintln!("{}", report.describe());
    assert!(report.changes >= MIN_CHANGES, "too few changes to prove anything: {}", report.describe());
    for m in 0..2 {
        assert!(
            report.looks_by_mount[m] >= MIN_LOOKS_PER_MOUNT,
            "too few looks checked on mount {m}: {}",
            report.describe()
        );
    }
    report
}

fn no_violations(cache_ttl: Duration, transport: Transport, seed: u64) {
    let report = check_both_mounts(cache_ttl, transport, seed);
    assert!(report.violations.is_empty(), "the promise broke: {}", report.describe());
}

#[test]
fn strict_mounts_over_shm_show_no_stale_state() {
    no_violations(Duration::ZERO, Transport::Auto, 1);
}

#[test]
fn strict_mounts_over_tcp_show_no_stale_state() {
    no_violations(Duration::ZERO, Transport::Tcp, 2);
}

#[test]
fn caching_mounts_over_shm_show_no_stale_state() {
    no_violations(LONG_TTL, Transport::Auto, 3);
}

#[test]
fn caching_mounts_over_tcp_show_no_stale_state() {
    no_violations(LONG_TTL, Transport::Tcp, 4);
}

/// Mount A changes the tree; mount B caches for a long TTL and ignores
/// every invalidation. The checker must find B stale, and A never.
#[test]
fn a_mount_that_ignores_invalidations_is_caught() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b) = mounts(&c, LONG_TTL, Transport::Auto);
    b.invalidations.test_only_ignore_invalidations(true);
    let _hang = (a.watchdog(Duration::from_secs(300)), b.watchdog(Duration::from_secs(300)));
    let report = run(&Run { mounts: [&a, &b], changing: vec![0], duration: DURATION, seed: 5 });
    eprintln!("{}", report.describe());
    assert!(report.changes >= MIN_CHANGES, "too few changes to prove anything: {}", report.describe());
    assert!(report.on(1) > 0, "the checker missed a mount that ignores invalidations: {}", report.describe());
    assert_eq!(report.on(0), 0, "the healthy mount broke the promise: {}", report.describe());
}
