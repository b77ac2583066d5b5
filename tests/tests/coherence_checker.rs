//! The cross-mount coherence checker (`citronfs_tests::coherence_checker`)
//! run against two mounts of one cluster, in both mount modes — strict
//! (nothing cached) and coherent caching (`--cache-ttl`, with callbacks,
//! invalidations and delegations) — over both transports (shm and tcp):
//! threads on both mounts change a small tree and look at it, and no look
//! that began after a change had returned may show the tree older than
//! that change. What CI runs: strict mounts over both transports, without
//! directory renames. The other runs still find real violations, rarely,
//! and are ignored until those are fixed (each group says what fails):
//! caching mounts, and directory renames in either mode.
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

/// Fewer looks checked on a mount than this and a run proves nothing (a
/// run goes on past `DURATION` until it has them).
const MIN_LOOKS_PER_MOUNT: u64 = 300;
/// Fewer changes than this and a run proves nothing (likewise).
const MIN_CHANGES: u64 = 300;

fn mounts(c: &TestCluster, cache_ttl: Duration, transport: Transport) -> (TestMount, TestMount) {
    let options = MountOptions { cache_ttl, ..MountOptions::default() };
    let mount = || TestMount::with_config_and_options(c.client_config(None, transport), options.clone());
    (mount(), mount())
}

/// Runs the checker with both mounts changing and looking.
fn check_both_mounts(cache_ttl: Duration, transport: Transport, dir_renames: bool, seed: u64) -> Report {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let (a, b) = mounts(&c, cache_ttl, transport);
    let _hang = (a.watchdog(Duration::from_secs(300)), b.watchdog(Duration::from_secs(300)));
    let setup = Run {
        mounts: [&a, &b],
        changing: vec![0, 1],
        dir_renames,
        duration: DURATION,
        min_changes: MIN_CHANGES,
        min_looks_per_mount: MIN_LOOKS_PER_MOUNT,
        seed,
    };
    let report = run(&setup);
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

fn no_violations(cache_ttl: Duration, transport: Transport, dir_renames: bool, seed: u64) {
    let report = check_both_mounts(cache_ttl, transport, dir_renames, seed);
    assert!(report.violations.is_empty(), "the promise broke: {}", report.describe());
}

// Every change but directory renames.

#[test]
fn strict_mounts_over_shm_show_no_stale_state() {
    no_violations(Duration::ZERO, Transport::Auto, false, 1);
}

#[test]
fn strict_mounts_over_tcp_show_no_stale_state() {
    no_violations(Duration::ZERO, Transport::Tcp, false, 2);
}

// Caching mounts: five holes in the protocol's bookkeeping that these
// runs point at are fixed at their cause — held attributes re-held from an
// answer an own link, chmod or rename had overtaken (a link count one too
// low: `link(2)` refused with ENOENT after an unlink of the file's other
// name; `mount::delegation`, "Why it stays true"); the sharing of a
// directory overtaking its mkdir's answer (a create seen late there: the
// same); a written file's base answered before its release reached the
// meta-server (an old mode: `mount::attr_cache`, "Written files"); a child
// held with several delegations revoked with only one (meta-server
// `grants::delegations`); a renamer's grant of the old name not following
// its kernel's dentry to the new one (a name another mount had renamed
// away still found: meta-server `grants`, "Absent names"). Before them, 5
// of 32 caching runs (8 of each) showed a violation; after all but the
// last, 6 of 74 still did, mostly with the machine loaded (one of them
// the last one's), and these remain:
// - `link(2)` refused with ENOENT, once (over tcp, loaded): mount 1's
//   `Link { from: "c/f2", to: "a/f3" }` after its `Link` of `c/f2` to
//   `a/f2`, `Unlink("a/f2")` and a write of `c/f2`. The kernel refuses a
//   link of an inode whose link count it believes is zero: some answer
//   still hands it a count one too low. Not found yet;
// - an old mode (over shm: mount 1's stat 0.8 ms after mount 0's chmod
//   of another name of the file; again in 1 of 4 runs after the fifth fix,
//   a file with two names) and an old size (once, over shm, loaded: on
//   the mount that had truncated the file, after the other mount wrote
//   it). Not found yet;
// - a read answering EINVAL (3 of 35 caching runs over tcp, 1 of 24
//   before the fixes, and in strict runs over tcp too: not a caching
//   matter). One cause is fixed (a release that took a concurrent open's
//   entry with it, `citronfs_core` client `opens`); whether it was the
//   only one is not shown yet.
// Run with `--ignored`.

#[test]
#[ignore = "caching mounts: a link refused with ENOENT, an old mode or size, rarely (see above)"]
fn caching_mounts_over_shm_show_no_stale_state() {
    no_violations(LONG_TTL, Transport::Auto, false, 3);
}

#[test]
#[ignore = "caching mounts: a link refused with ENOENT, an old mode or size, rarely (see above)"]
fn caching_mounts_over_tcp_show_no_stale_state() {
    no_violations(LONG_TTL, Transport::Tcp, false, 4);
}

// With directory renames. What still fails (rarely since the fix below:
// in 4 of 36 caching runs and none of 8 strict ones, lately): a directory that one mount moved is still in
// the other mount's kernel under its old name (an entry that a zero TTL
// or an epoch bump makes revalidate only where a walk passes it). A
// lookup that finds it under its new name while a rename holds the
// superblock's rename mutex makes the kernel answer ESTALE, on the retry
// too (`d_splice_alias` only tries that mutex). The mount has the kernel
// drop such entries before a lookup answers a directory
// (`mount/src/moved_dirs.rs`), but not one in use — here, pinned by
// entries the kernel keeps below it. Seen as
// `Rename { from: "b/c", to: "a" } answered Err(116)` (ESTALE) where the
// model predicts success, and `readlink` of a moved directory answering
// ESTALE instead of EINVAL. Seen once too, in a run beside eight others:
// every call on one mount answering ENOTCONN from some moment on (its
// FUSE connection gone; why is not known); and once, in a caching run over
// tcp, a read of a file with two names answering EINVAL where its bytes
// were expected (as in the caching runs without directory renames). The
// caching runs with directory renames showed besides, once each in 10 runs
// over tcp: an old size on the mount that had not truncated the file
// (`Truncate { path: "b/f1", len: 48 }` on mount 0, mount 1's stat 0.14 ms
// later showed size 2), and both mounts reading bytes the model did not
// predict (a moved file's). Run with `--ignored`.

#[test]
#[ignore = "ESTALE from a directory another mount moved, in use here (see above)"]
fn strict_mounts_over_shm_show_no_stale_state_with_directory_renames() {
    no_violations(Duration::ZERO, Transport::Auto, true, 11);
}

#[test]
#[ignore = "ESTALE from a directory another mount moved, in use here (see above)"]
fn strict_mounts_over_tcp_show_no_stale_state_with_directory_renames() {
    no_violations(Duration::ZERO, Transport::Tcp, true, 12);
}

#[test]
#[ignore = "ESTALE, and what the caching runs without directory renames show (see above)"]
fn caching_mounts_over_shm_show_no_stale_state_with_directory_renames() {
    no_violations(LONG_TTL, Transport::Auto, true, 13);
}

#[test]
#[ignore = "ESTALE, and what the caching runs without directory renames show (see above)"]
fn caching_mounts_over_tcp_show_no_stale_state_with_directory_renames() {
    no_violations(LONG_TTL, Transport::Tcp, true, 14);
}

/// Mount A (strict) changes the tree; mount B caches for a long TTL and
/// ignores every invalidation. The checker must find B stale, and A never.
#[test]
fn a_mount_that_ignores_invalidations_is_caught() {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let config = || c.client_config(None, Transport::Auto);
    let a = TestMount::with_config_and_options(config(), MountOptions::default());
    let caching = MountOptions { cache_ttl: LONG_TTL, ..MountOptions::default() };
    let b = TestMount::with_config_and_options(config(), caching);
    b.invalidations.test_only_ignore_invalidations(true);
    let _hang = (a.watchdog(Duration::from_secs(300)), b.watchdog(Duration::from_secs(300)));
    let setup = Run {
        mounts: [&a, &b],
        changing: vec![0],
        dir_renames: true,
        duration: DURATION,
        min_changes: MIN_CHANGES,
        min_looks_per_mount: MIN_LOOKS_PER_MOUNT,
        seed: 5,
    };
    let report = run(&setup);
    eprintln!("{}", report.describe());
    assert!(report.changes >= MIN_CHANGES, "too few changes to prove anything: {}", report.describe());
    assert!(report.on(1) > 0, "the checker missed a mount that ignores invalidations: {}", report.describe());
    assert_eq!(report.on(0), 0, "the healthy mount broke the promise: {}", report.describe());
}
