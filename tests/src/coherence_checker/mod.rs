//! A cross-mount coherence checker with an oracle (`coherence_checker`
//! test): threads change a small tree through two mounts of one cluster
//! while others look at it through both, and afterwards every look is
//! checked against the states the tree could have had while it ran.
//!
//! The promise checked: a change that returned on one mount is seen by
//! every call that begins afterwards on any mount.
//!
//! How the oracle knows: the tree is cut into zones (a directory each) and
//! every change of a zone is made under the zone's test-side mutex, so the
//! changes of a zone happen one after the other in a known order. Each
//! change is predicted by the model ([`model::Tree::apply`]) and made; the
//! tree it leaves is logged with the change's start and end on one
//! monotonic clock. A change the file system answers otherwise than the
//! model (refused where it should succeed, or the reverse) is itself a
//! violation: the changing mount did not see an earlier change. Looks
//! (stat, lstat, access, open and read, readlink, readdir) hold no mutex;
//! each logs its start, end and what it saw. A look may show any state
//! from the last one whose change had ended before the look began to the
//! last one whose change had begun before the look ended; a look made of
//! several requests (the name looked up in one state, the inode's
//! attributes or bytes read in a later one) may combine two such states in
//! that order, and nothing else.

mod changes;
mod check;
mod looks;
pub mod model;

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::TestMount;
use changes::change_until;
use check::check;
use looks::look_until;
use model::{Ino, Tree, DIR_PERM};

/// The buffer of a read look: more than any file of the checker holds.
const READ_BUFFER: usize = 4096;

/// Zones of the tree: changes in different zones run at once.
const ZONES: usize = 2;
/// Looking threads per mount.
const LOOKERS_PER_MOUNT: usize = 2;

/// One run of the checker.
pub struct Run<'a> {
    /// The two mounts of one cluster.
    pub mounts: [&'a TestMount; 2],
    /// The mounts (indices into `mounts`) that change the tree: one
    /// changing thread per zone on each. Both look.
    pub changing: Vec<usize>,
    /// Whether directories are renamed too (a file rename takes their
    /// turn otherwise).
    pub dir_renames: bool,
    /// How long the threads run at least.
    pub duration: Duration,
    /// After `duration`, the threads run on until the run has made this
    /// many changes and each mount this many looks (or the model lost
    /// every zone), so that a slow machine still checks enough.
    pub min_changes: u64,
    /// See `min_changes`.
    pub min_looks_per_mount: u64,
    pub seed: u64,
}

/// What the threads of a run share besides the logs: how far it got, and
/// each zone's newest tree (which the lookers peek at to choose names,
/// without waiting for a change in flight).
struct Progress {
    until: Instant,
    min_changes: u64,
    min_looks_per_mount: u64,
    changes: AtomicU64,
    looks: [AtomicU64; 2],
    zones_lost: AtomicU64,
    newest: Vec<Mutex<Arc<Tree>>>,
}

impl Progress {
    /// Whether the threads go on.
    fn going(&self) -> bool {
        let enough = self.changes.load(Ordering::Relaxed) >= self.min_changes
            && self.looks.iter().all(|l| l.load(Ordering::Relaxed) >= self.min_looks_per_mount);
        let hopeless = self.zones_lost.load(Ordering::Relaxed) == ZONES as u64;
        Instant::now() < self.until || !(enough || hopeless)
    }
}

/// What the run did and found.
#[derive(Debug, Default)]
pub struct Report {
    /// Changes made, that the model had predicted would succeed.
    pub changes: u64,
    /// Changes refused, as the model had predicted.
    pub refusals: u64,
    /// Looks checked against the log (those of a zone after a change the
    /// model got wrong are not: the model no longer knows that zone).
    pub looks_checked: u64,
    /// Looks checked, by mount.
    pub looks_by_mount: [u64; 2],
    pub violations: Vec<Violation>,
}

/// One break of the promise.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The mount that saw or did it.
    pub mount: usize,
    pub detail: String,
}

impl Report {
    /// The violations seen on `mount`.
    pub fn on(&self, mount: usize) -> usize {
        self.violations.iter().filter(|v| v.mount == mount).count()
    }

    /// A summary line, and the first violations in full.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} changes, {} refusals as predicted, {} looks checked (mount 0: {}, mount 1: {}), {} violations \
             (mount 0: {}, mount 1: {})",
            self.changes,
            self.refusals,
            self.looks_checked,
            self.looks_by_mount[0],
            self.looks_by_mount[1],
            self.violations.len(),
            self.on(0),
            self.on(1)
        );
        for v in self.violations.iter().take(12) {
            s.push_str(&format!("\n  mount {}: {}", v.mount, v.detail));
        }
        s
    }
}

/// One state of a zone: what a change left, and when the change ran.
struct Version {
    start: Instant,
    end: Instant,
    tree: Arc<Tree>,
    /// The change and the mount that made it.
    by: String,
}

/// The log of a zone; its mutex is the one every change of the zone holds.
struct ZoneLog {
    versions: Vec<Version>,
    /// When the change the model got wrong began: the model knows nothing
    /// of the zone from then on.
    lost_at: Option<Instant>,
}

/// What a look does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Look {
    Stat,
    Lstat,
    /// `access(F_OK)`.
    Exists,
    /// `access(X_OK)` (root: any execute bit of a file).
    Exec,
    /// Open and read the whole file.
    Read,
    Readlink,
    Readdir,
}

const LOOKS: [Look; 7] =
    [Look::Stat, Look::Lstat, Look::Exists, Look::Exec, Look::Read, Look::Readlink, Look::Readdir];

/// The attributes a stat shows that the model knows.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SeenAttr {
    kind: char,
    ino: Ino,
    perm: u32,
    size: u64,
    nlink: u64,
    mtime: (i64, u32),
}

/// What a look saw.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Err(i32),
    Attr(SeenAttr),
    Done,
    Bytes(Vec<u8>),
    Target(String),
    Names(Vec<String>),
}

/// A look, logged.
struct Observation {
    zone: usize,
    mount: usize,
    look: Look,
    path: String,
    start: Instant,
    end: Instant,
    seen: Seen,
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(-1)
}

fn c_path(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in a path")
}

fn zone_dir(zone: usize) -> String {
    format!("zone{zone}")
}

/// Runs the checker and checks its log.
pub fn run(setup: &Run) -> Report {
    // The model's modes: files 0644 and directories 0755 as asked.
    // SAFETY: umask has no failure.
    unsafe { libc::umask(0o022) };
    let logs: Vec<Mutex<ZoneLog>> = (0..ZONES)
        .map(|zone| {
            let dir = setup.mounts[0].path(&zone_dir(zone));
            fs::DirBuilder::new().mode(DIR_PERM).create(&dir).expect("make a zone");
            let root = fs::metadata(&dir).expect("stat a zone").ino();
            let now = Instant::now();
            let first =
                Version { start: now, end: now, tree: Arc::new(Tree::empty(root)), by: "the start".into() };
            Mutex::new(ZoneLog { versions: vec![first], lost_at: None })
        })
        .collect();
    let progress = Progress {
        until: Instant::now() + setup.duration,
        min_changes: setup.min_changes,
        min_looks_per_mount: setup.min_looks_per_mount,
        changes: AtomicU64::new(0),
        looks: [AtomicU64::new(0), AtomicU64::new(0)],
        zones_lost: AtomicU64::new(0),
        newest: logs.iter().map(|l| Mutex::new(l.lock().unwrap().versions[0].tree.clone())).collect(),
    };
    let progress = &progress;
    let violations = Mutex::new(Vec::new());
    let mut observations = Vec::new();
    let mut refusals = 0;
    std::thread::scope(|s| {
        let mut changers = Vec::new();
        for &mount in &setup.changing {
            for (zone, log) in logs.iter().enumerate() {
                let seed = setup.seed ^ ((mount * ZONES + zone) as u64) << 32;
                let violations = &violations;
                changers
                    .push(s.spawn(move || change_until(setup, mount, zone, log, progress, seed, violations)));
            }
        }
        let mut lookers = Vec::new();
        for mount in 0..2 {
            for i in 0..LOOKERS_PER_MOUNT {
                let seed = setup.seed ^ (0x1000 + (mount * LOOKERS_PER_MOUNT + i) as u64) << 32;
                let m = setup.mounts[mount];
                lookers.push(s.spawn(move || look_until(m, mount, progress, seed)));
            }
        }
        for c in changers {
            refusals += c.join().expect("a changing thread");
        }
        for l in lookers {
            observations.extend(l.join().expect("a looking thread"));
        }
    });
    let mut report = Report { refusals, violations: violations.into_inner().unwrap(), ..Report::default() };
    let logs: Vec<ZoneLog> = logs.into_iter().map(|l| l.into_inner().unwrap()).collect();
    report.changes = logs.iter().map(|l| l.versions.len() as u64 - 1).sum();
    for o in &observations {
        let log = &logs[o.zone];
        if log.lost_at.is_some_and(|lost| o.end >= lost) {
            continue;
        }
        report.looks_checked += 1;
        report.looks_by_mount[o.mount] += 1;
        if let Some(detail) = check(&log.versions, o) {
            report.violations.push(Violation { mount: o.mount, detail });
        }
    }
    report
}
