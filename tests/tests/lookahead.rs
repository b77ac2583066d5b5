//! Lookups answered ahead (issue 13, mount `lookahead`): a caching mount
//! that stats, in their listing's order, names another mount made asks the
//! meta-server for a page of them at a time instead of one call per name,
//! and whatever it keeps of such a page is never stale: a change made on
//! the other mount, or on this one, before the name is looked up here is
//! seen by that lookup.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use citronfs_core::rpc_counts::MetaKind;
use citronfs_mount::MountOptions;
use citronfs_tests::coherence::{eventually, missing};
use citronfs_tests::{TestCluster, TestMount};

/// Long enough that nothing kept expires during a test: whatever B sees
/// after a change, it sees because what it kept was dropped.
const LONG_TTL: Duration = Duration::from_secs(60);

const FILES: usize = 300;

fn cluster() -> (TestCluster, TestMount, TestMount) {
    let c = TestCluster::start(1, 64 << 20, 1 << 20);
    let options = MountOptions { cache_ttl: LONG_TTL, ..MountOptions::default() };
    let a = c.mount_with(options.clone());
    let b = c.mount_with(options);
    (c, a, b)
}

/// `FILES` files made on `a` in `d`, each closed everywhere (a file open
/// for writing has no attributes to grant).
fn make_files(c: &TestCluster, a: &TestMount) {
    fs::create_dir(a.path("d")).unwrap();
    for i in 0..FILES {
        fs::write(a.path(&format!("d/f{i:04}")), format!("file {i}")).unwrap();
    }
    a.client.flush_releases();
    eventually("every file is closed", || c.meta.status().files.opens == 0);
}

#[test]
fn stats_in_listing_order_cost_a_call_per_page_not_per_name() {
    let (c, a, b) = cluster();
    make_files(&c, &a);
    let before = b.client.rpc_counts();
    for i in 0..FILES {
        let meta = fs::metadata(b.path(&format!("d/f{i:04}"))).unwrap();
        assert_eq!(meta.len(), format!("file {i}").len() as u64, "f{i:04}");
    }
    let calls = b.client.rpc_counts() - before;
    let lookups = calls.get(MetaKind::Lookup) + calls.get(MetaKind::LookupAhead);
    // The path walk's lookup of `d`, the first name on its own, then one
    // call per page of `lookahead::AHEAD` names.
    assert!(lookups <= 6, "{FILES} stats sent {}", calls.describe());
    assert!(calls.get(MetaKind::LookupAhead) >= 2, "{}", calls.describe());
}

/// Names B has kept, not yet looked up, changed on A: each is seen by B's
/// very next lookup of it.
#[test]
fn a_name_changed_elsewhere_after_it_was_looked_up_ahead_is_seen_at_once() {
    let (c, a, b) = cluster();
    make_files(&c, &a);
    // B looks up the first names: the page after them is kept.
    for i in 0..3 {
        fs::metadata(b.path(&format!("d/f{i:04}"))).unwrap();
    }
    assert!(b.invalidations.looked_ahead() >= 100, "kept {}", b.invalidations.looked_ahead());
    // On A: unlink, chmod, rename over, grow, and rename away.
    fs::remove_file(a.path("d/f0010")).unwrap();
    fs::set_permissions(a.path("d/f0011"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(a.path("d/new"), b"replacement").unwrap();
    fs::rename(a.path("d/new"), a.path("d/f0012")).unwrap();
    fs::write(a.path("d/f0013"), vec![7u8; 5000]).unwrap();
    fs::rename(a.path("d/f0014"), a.path("d/moved")).unwrap();
    assert!(missing(&b, "d/f0010"), "unlinked on A");
    assert_eq!(fs::metadata(b.path("d/f0011")).unwrap().permissions().mode() & 0o7777, 0o600);
    assert_eq!(fs::read(b.path("d/f0012")).unwrap(), b"replacement");
    assert_eq!(fs::metadata(b.path("d/f0012")).unwrap().len(), 11);
    assert_eq!(fs::metadata(b.path("d/f0013")).unwrap().len(), 5000);
    assert!(missing(&b, "d/f0014"), "renamed away on A");
    assert_eq!(fs::read(b.path("d/moved")).unwrap(), b"file 14");
    // The rest of the page is as it was.
    assert_eq!(fs::metadata(b.path("d/f0015")).unwrap().len(), "file 15".len() as u64);
}

/// B's own changes are not called back to B: what each may change goes
/// from what B kept before it is sent, so B's later lookups see it; the
/// rest stays.
#[test]
fn an_own_change_drops_what_it_changes_and_keeps_the_rest() {
    let (c, a, b) = cluster();
    make_files(&c, &a);
    for i in 0..3 {
        fs::metadata(b.path(&format!("d/f{i:04}"))).unwrap();
    }
    let kept = b.invalidations.looked_ahead();
    assert!(kept >= 100, "kept {kept}");
    // Through B's kernel, which looks each name up first, and through B's
    // client directly, which does not: the entries of f0030 and f0031 are
    // still kept when their changes are sent.
    let ino = |rel: &str| citronfs_core::types::Ino(fs::metadata(a.path(rel)).unwrap().ino());
    fs::hard_link(b.path("d/f0020"), b.path("d/link")).unwrap();
    let root = citronfs_core::types::Caller::ROOT;
    let set = citronfs_core::types::SetAttr { perm: Some(0o600), ..Default::default() };
    b.client.setattr(root, ino("d/f0030"), set).unwrap();
    let d = ino("d");
    b.client.unlink(root, d, b"f0031").unwrap();
    assert_eq!(fs::metadata(b.path("d/f0030")).unwrap().permissions().mode() & 0o7777, 0o600);
    assert!(missing(&b, "d/f0031"), "unlinked by B's client");
    let linked = fs::metadata(b.path("d/f0020")).unwrap();
    assert_eq!((linked.ino(), linked.nlink()), (ino("d/f0020").0, 2), "the link count B changed");
    assert!(b.invalidations.looked_ahead() >= kept - 5, "the rest stays: {}", b.invalidations.looked_ahead());
    assert_eq!(fs::metadata(b.path("d/f0032")).unwrap().nlink(), 1);
}

/// Lookups in another order than the listing's stop asking for pages.
#[test]
fn lookups_in_another_order_stop_asking_for_pages() {
    let (c, a, b) = cluster();
    make_files(&c, &a);
    let before = b.client.rpc_counts();
    // Backwards: every page brings names already looked up.
    for i in (0..FILES).rev() {
        fs::metadata(b.path(&format!("d/f{i:04}"))).unwrap();
    }
    // Asking a page at every miss would be ~300 calls; a directory whose
    // pages go unused asks for its names only, for 64 misses at a time.
    let calls = b.client.rpc_counts() - before;
    assert!(calls.get(MetaKind::LookupAhead) <= 10, "{}", calls.describe());
}

/// Mount A changes the names' modes round after round while mount B stats
/// them in listing order, its kernel's dentries dropped before each pass
/// (so B looks them up again and keeps pages ahead): a stat on B that
/// starts after a round ended on A never sees a mode older than that
/// round's.
#[test]
fn stats_racing_with_changes_on_another_mount_never_see_an_older_state() {
    use std::sync::atomic::{AtomicU32, Ordering};
    const ROUNDS: u32 = 12;
    const NAMES: usize = 80;
    let (c, a, b) = cluster();
    make_files(&c, &a);
    let mode = |round: u32| 0o400 + round;
    let ended = AtomicU32::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            for round in 1..=ROUNDS {
                for i in 0..NAMES {
                    let p = fs::Permissions::from_mode(mode(round));
                    fs::set_permissions(a.path(&format!("d/f{i:04}")), p).unwrap();
                }
                // SeqCst: a stat that reads `round` here began after every
                // chmod of the round had answered.
                ended.store(round, Ordering::SeqCst);
            }
        });
        let mut passes = 0;
        while ended.load(Ordering::SeqCst) < ROUNDS || passes == 0 {
            // Every kernel's unused dentries go (root only; the tests run as
            // root, as mounting needs).
            fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
            for i in 0..NAMES {
                let at_least = ended.load(Ordering::SeqCst);
                let seen = fs::metadata(b.path(&format!("d/f{i:04}"))).unwrap().permissions().mode() & 0o7777;
                let round = seen.saturating_sub(0o400);
                assert!(
                    seen == 0o644 && at_least == 0 || round >= at_least,
                    "f{i:04}: mode {seen:o} after round {at_least} ended on A"
                );
            }
            passes += 1;
        }
        assert!(b.client.rpc_counts().get(MetaKind::LookupAhead) > 0, "B never looked ahead");
    });
}
