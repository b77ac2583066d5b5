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

pub mod model;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::TestMount;
use model::{split, Body, Change, Ino, Obj, Resolved, Tree, DIR_NAMES, DIR_PERM, FILE_NAMES, UTIME_BASE};

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

/// A random path of a directory: the zone's root, or one or two levels
/// down.
fn dir_path(rng: &mut StdRng) -> String {
    match rng.gen_range(0..10) {
        0..=2 => String::new(),
        3..=7 => DIR_NAMES[rng.gen_range(0..DIR_NAMES.len())].to_string(),
        _ => format!("{}/{}", DIR_NAMES[rng.gen_range(0..3)], DIR_NAMES[rng.gen_range(0..3)]),
    }
}

/// A random path of a directory below the root (one that may be made,
/// removed or renamed).
fn movable_dir(rng: &mut StdRng) -> String {
    loop {
        let p = dir_path(rng);
        if !p.is_empty() {
            return p;
        }
    }
}

/// A random path of a file, hard link or symlink.
fn file_path(rng: &mut StdRng) -> String {
    let dir = dir_path(rng);
    let name = FILE_NAMES[rng.gen_range(0..FILE_NAMES.len())];
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn some_bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let b = rng.gen_range(b'a'..=b'z');
    vec![b; rng.gen_range(1..=max)]
}

/// A random change of `tree`'s zone (most on names that are there).
fn pick_change(tree: &Tree, rng: &mut StdRng, utimes: &mut i64, dir_renames: bool) -> Change {
    // A file the tree has, if one is found quickly.
    let existing_file = |rng: &mut StdRng| {
        (0..8).map(|_| file_path(rng)).find(|p| tree.file(p).is_some()).unwrap_or_else(|| file_path(rng))
    };
    match rng.gen_range(0..100) {
        0..=11 => Change::Create(file_path(rng)),
        12..=23 => {
            let path = existing_file(rng);
            let size = tree.file(&path).map_or(0, |o| match &o.body {
                Body::File { content, .. } => content.len() as u64,
                _ => 0,
            });
            Change::Write { offset: rng.gen_range(0..=size), bytes: some_bytes(rng, 24), path }
        }
        24..=29 => Change::Append { path: existing_file(rng), bytes: some_bytes(rng, 16) },
        30..=37 => Change::Truncate { path: existing_file(rng), len: rng.gen_range(0..=48) },
        48..=52 if dir_renames => Change::Rename { from: movable_dir(rng), to: movable_dir(rng) },
        38..=52 => Change::Rename { from: existing_file(rng), to: file_path(rng) },
        53..=57 => {
            // A hard link of a symlink is one too, which the model does
            // not follow: only files.
            let from = existing_file(rng);
            match tree.resolve(&from, false).map(|i| &tree.objects[&i].body) {
                Ok(Body::Symlink { .. }) => Change::Unlink(from),
                _ => Change::Link { from, to: file_path(rng) },
            }
        }
        58..=62 => {
            let target = FILE_NAMES[rng.gen_range(0..FILE_NAMES.len())].to_string();
            Change::Symlink { target, path: file_path(rng) }
        }
        63..=68 => {
            let perm = [0o600, 0o644, 0o700, 0o755, 0o640][rng.gen_range(0..5)];
            Change::Chmod { path: existing_file(rng), perm }
        }
        69..=74 => {
            *utimes += 1;
            Change::Utime {
                path: existing_file(rng),
                mtime: (UTIME_BASE + *utimes, rng.gen_range(0..1000) * 1000),
            }
        }
        75..=83 => Change::Mkdir(movable_dir(rng)),
        84..=89 => Change::Rmdir(movable_dir(rng)),
        _ => Change::Unlink(existing_file(rng)),
    }
}

/// Makes `change` on mount `m` (`zone` the zone's directory): `Ok` or the
/// errno.
fn make(m: &TestMount, zone: &str, change: &Change) -> Result<(), i32> {
    let p = |rel: &str| m.path(&format!("{zone}/{rel}"));
    let io = |r: std::io::Result<()>| r.map_err(|e| errno(&e));
    match change {
        Change::Create(path) => {
            io(fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(p(path)).map(drop))
        }
        Change::Write { path, offset, bytes } => {
            io(fs::OpenOptions::new().write(true).open(p(path)).and_then(|f| f.write_all_at(bytes, *offset)))
        }
        Change::Append { path, bytes } => {
            io(fs::OpenOptions::new().append(true).open(p(path)).and_then(|mut f| f.write_all(bytes)))
        }
        Change::Truncate { path, len } => {
            // SAFETY: a NUL-terminated path.
            let r = unsafe { libc::truncate(c_path(&p(path)).as_ptr(), *len as libc::off_t) };
            io(if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) })
        }
        Change::Rename { from, to } => io(fs::rename(p(from), p(to))),
        Change::Link { from, to } => io(fs::hard_link(p(from), p(to))),
        Change::Symlink { target, path } => io(std::os::unix::fs::symlink(target, p(path))),
        Change::Chmod { path, perm } => io(fs::set_permissions(p(path), fs::Permissions::from_mode(*perm))),
        Change::Utime { path, mtime: (secs, nsec) } => {
            let t = libc::timespec { tv_sec: *secs, tv_nsec: *nsec as i64 };
            let times = [t, t];
            // SAFETY: a NUL-terminated path and two timespecs.
            let r = unsafe { libc::utimensat(libc::AT_FDCWD, c_path(&p(path)).as_ptr(), times.as_ptr(), 0) };
            io(if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) })
        }
        Change::Mkdir(path) => io(fs::DirBuilder::new().mode(DIR_PERM).create(p(path))),
        Change::Rmdir(path) => io(fs::remove_dir(p(path))),
        Change::Unlink(path) => io(fs::remove_file(p(path))),
    }
}

/// A changing thread: changes of `zone` on mount `mount` while the run
/// goes on.
/// Answers the refusals the model predicted.
fn change_until(
    setup: &Run,
    mount: usize,
    zone: usize,
    log: &Mutex<ZoneLog>,
    progress: &Progress,
    seed: u64,
    violations: &Mutex<Vec<Violation>>,
) -> u64 {
    let (m, dir_renames) = (setup.mounts[mount], setup.dir_renames);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut utimes = (seed % 1000) as i64 * 100_000;
    let mut refusals = 0;
    let dir = zone_dir(zone);
    while progress.going() {
        let mut log = log.lock().unwrap();
        if log.lost_at.is_some() {
            return refusals;
        }
        let tree = log.versions.last().expect("a first state").tree.clone();
        let change = pick_change(&tree, &mut rng, &mut utimes, dir_renames);
        let predicted = tree.apply(&change, Ino::MAX);
        let start = Instant::now();
        let made = make(m, &dir, &change);
        let end = Instant::now();
        let after = match (&predicted, made) {
            (None, Err(_)) => {
                refusals += 1;
                continue;
            }
            (Some(_), Ok(())) => match change.makes() {
                // Its inode number, from the mount that made it.
                Some(path) => fs::symlink_metadata(m.path(&format!("{dir}/{path}")))
                    .ok()
                    .and_then(|meta| tree.apply(&change, meta.ino())),
                None => predicted.clone(),
            },
            _ => None,
        };
        match after {
            Some(tree) => {
                let (by, tree) = (format!("{change:?} on mount {mount}"), Arc::new(tree));
                *progress.newest[zone].lock().unwrap() = tree.clone();
                log.versions.push(Version { start, end, tree, by });
                progress.changes.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                let recent: Vec<&str> = log.versions.iter().rev().take(8).map(|v| v.by.as_str()).collect();
                let detail = format!(
                    "zone {zone}: {change:?} answered {made:?}, the model predicted {}; the changes before it, \
                     newest first: {recent:?}",
                    if predicted.is_some() { "success" } else { "a refusal" },
                );
                violations.lock().unwrap().push(Violation { mount, detail });
                log.lost_at = Some(start);
                progress.zones_lost.fetch_add(1, Ordering::Relaxed);
                return refusals;
            }
        }
    }
    refusals
}

fn seen_attr(meta: std::io::Result<fs::Metadata>) -> Seen {
    match meta {
        Err(e) => Seen::Err(errno(&e)),
        Ok(meta) => {
            let ft = meta.file_type();
            let kind = if ft.is_dir() {
                'd'
            } else if ft.is_symlink() {
                'l'
            } else {
                'f'
            };
            Seen::Attr(SeenAttr {
                kind,
                ino: meta.ino(),
                perm: meta.mode() & 0o7777,
                size: meta.size(),
                nlink: meta.nlink(),
                mtime: (meta.mtime(), meta.mtime_nsec() as u32),
            })
        }
    }
}

/// Does `look` of `path` on mount `m` (whose zone directory is `zone`).
fn observe(m: &TestMount, zone: &str, look: Look, path: &str) -> Seen {
    let p = m.path(&format!("{zone}/{path}"));
    let access = |mode| {
        // SAFETY: a NUL-terminated path.
        match unsafe { libc::access(c_path(&p).as_ptr(), mode) } {
            0 => Seen::Done,
            _ => Seen::Err(errno(&std::io::Error::last_os_error())),
        }
    };
    match look {
        Look::Stat => seen_attr(fs::metadata(&p)),
        Look::Lstat => seen_attr(fs::symlink_metadata(&p)),
        Look::Exists => access(libc::F_OK),
        Look::Exec => access(libc::X_OK),
        Look::Read => {
            // One read(2) of more than the checker ever writes: one FUSE
            // read, made under the file's locks, sees one state. (Reading
            // on until EOF would be several, each free to see a later one.)
            let mut bytes = vec![0; READ_BUFFER];
            match fs::File::open(&p) {
                Err(e) => Seen::Err(errno(&e)),
                Ok(mut f) => match f.read(&mut bytes) {
                    Ok(n) => {
                        bytes.truncate(n);
                        Seen::Bytes(bytes)
                    }
                    Err(e) => Seen::Err(errno(&e)),
                },
            }
        }
        Look::Readlink => match fs::read_link(&p) {
            Ok(t) => Seen::Target(t.to_string_lossy().into_owned()),
            Err(e) => Seen::Err(errno(&e)),
        },
        Look::Readdir => {
            let names: std::io::Result<Vec<String>> = fs::read_dir(&p).and_then(|entries| {
                entries.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect()
            });
            match names {
                Ok(mut names) => {
                    names.sort();
                    Seen::Names(names)
                }
                Err(e) => Seen::Err(errno(&e)),
            }
        }
    }
}

/// A looking thread on mount `m` while the run goes on: its observations.
fn look_until(m: &TestMount, mount: usize, progress: &Progress, seed: u64) -> Vec<Observation> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    while progress.going() {
        let zone = rng.gen_range(0..ZONES);
        let look = LOOKS[rng.gen_range(0..LOOKS.len())];
        // Mostly names that are there now (a peek only chooses; the check
        // is against the log).
        let path = if rng.gen_bool(0.6) {
            let tree = progress.newest[zone].lock().unwrap().clone();
            let paths = tree.paths();
            paths[rng.gen_range(0..paths.len())].clone()
        } else if look == Look::Readdir {
            dir_path(&mut rng)
        } else {
            file_path(&mut rng)
        };
        let start = Instant::now();
        let seen = observe(m, &zone_dir(zone), look, &path);
        let end = Instant::now();
        out.push(Observation { zone, mount, look, path, start, end, seen });
        progress.looks[mount].fetch_add(1, Ordering::Relaxed);
    }
    out
}

/// What `look` shows of object `obj` (the look having found it by name).
fn shows(look: Look, obj: &Obj, nlink_now: Option<u32>) -> Seen {
    match (&obj.body, look) {
        (_, Look::Exists) => Seen::Done,
        (Body::File { perm, .. }, Look::Exec) if perm & 0o111 == 0 => Seen::Err(libc::EACCES),
        (_, Look::Exec) => Seen::Done,
        (Body::File { content, .. }, Look::Read) => Seen::Bytes(content.clone()),
        (Body::Dir { .. }, Look::Read) => Seen::Err(libc::EISDIR),
        (Body::Symlink { target }, Look::Readlink) => Seen::Target(target.clone()),
        (_, Look::Readlink) => Seen::Err(libc::EINVAL),
        (Body::Dir { children }, Look::Readdir) => Seen::Names(children.keys().cloned().collect()),
        (_, Look::Readdir) => Seen::Err(libc::ENOTDIR),
        (body, Look::Stat | Look::Lstat) => {
            let (kind, perm, size, nlink) = match body {
                Body::File { content, perm, .. } => {
                    ('f', *perm, content.len() as u64, nlink_now.unwrap_or(0))
                }
                Body::Dir { .. } => ('d', DIR_PERM, 0, 0),
                Body::Symlink { target } => ('l', 0o777, target.len() as u64, 1),
            };
            Seen::Attr(SeenAttr { kind, ino: obj.ino, perm, size, nlink: nlink as u64, mtime: (0, 0) })
        }
        (Body::Symlink { .. }, Look::Read) => unreachable!("a read follows symlinks"),
    }
}

/// Whether `seen` is what `look` shows of `obj`: the mtime by its rule,
/// and of a directory neither its size nor its link count.
fn agrees(look: Look, obj: &Obj, nlink_now: Option<u32>, seen: &Seen) -> bool {
    let expected = shows(look, obj, nlink_now);
    match (&expected, seen) {
        (Seen::Attr(e), Seen::Attr(s)) => {
            let same = e.kind == s.kind && e.ino == s.ino;
            match &obj.body {
                Body::File { mtime, .. } => {
                    same && e.perm == s.perm
                        && e.size == s.size
                        && e.nlink == s.nlink
                        && mtime.matches(s.mtime)
                }
                Body::Dir { .. } => same && e.perm == s.perm,
                Body::Symlink { .. } => same && e.size == s.size,
            }
        }
        _ => expected == *seen,
    }
}

/// The most symlinks one walk follows (Linux's `MAXSYMLINKS`).
const MAX_SYMLINKS: u32 = 40;

/// Where the walk of `path` through `states` may end: what it found (or
/// the errno) and the state its last step read. Each step of a walk (a
/// name looked up, a symlink followed) reads one state, no older than the
/// one the step before it read.
fn walks(states: &[Version], path: &str, follow: bool) -> BTreeSet<(Resolved, usize)> {
    let (dirs, name) = split(path);
    let root = states[0].tree.root;
    let mut out = BTreeSet::new();
    if name.is_empty() {
        out.insert((Ok(root), 0));
        return out;
    }
    let mut at: BTreeSet<(Ino, usize)> = BTreeSet::from([(root, 0)]);
    for component in dirs {
        let mut next = BTreeSet::new();
        for &(dir, from) in &at {
            for (i, v) in states.iter().enumerate().skip(from) {
                match v.tree.children(dir).and_then(|c| c.get(component)) {
                    None => out.insert((Err(libc::ENOENT), i)),
                    Some(sub) if v.tree.children(*sub).is_some() => next.insert((*sub, i)),
                    Some(_) => out.insert((Err(libc::ENOTDIR), i)),
                };
            }
        }
        at = next;
    }
    // The last name, and the symlinks it leads through (targets are
    // names in the same directory).
    let mut todo: Vec<(Ino, String, usize, u32)> =
        at.into_iter().map(|(dir, from)| (dir, name.to_string(), from, 0)).collect();
    let mut done = BTreeSet::new();
    while let Some(step) = todo.pop() {
        if !done.insert(step.clone()) {
            continue;
        }
        let (dir, name, from, followed) = step;
        for (i, v) in states.iter().enumerate().skip(from) {
            match v.tree.children(dir).and_then(|c| c.get(&name)) {
                None => {
                    out.insert((Err(libc::ENOENT), i));
                }
                Some(found) => {
                    // A request about the inode it found (a getattr, a
                    // readlink, an open) reads a later state, which may
                    // no longer have it.
                    if let Some(gone) = states[i..].iter().position(|v| !v.tree.objects.contains_key(found)) {
                        out.insert((Err(libc::ENOENT), i + gone));
                    }
                    match &v.tree.objects[found].body {
                        Body::Symlink { target } if follow => match followed {
                            MAX_SYMLINKS => {
                                out.insert((Err(libc::ELOOP), i));
                            }
                            _ => todo.push((dir, target.clone(), i, followed + 1)),
                        },
                        _ => {
                            out.insert((Ok(*found), i));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Whether `names`, a listing of directory `dir` opened in `states[0]`,
/// is one a listing made while `states` followed one another may be:
/// every name that kept its entry through all of them once, and nothing
/// but names the directory had in one of them (a name that changed
/// during the listing may be missed or listed twice).
fn listing_agrees(states: &[Version], dir: Ino, names: &[String]) -> bool {
    let entries: Vec<&BTreeMap<String, Ino>> = states.iter().filter_map(|v| v.tree.children(dir)).collect();
    let Some(first) = entries.first() else { return false };
    let kept = |name: &str| {
        let entry = first.get(name);
        entry.is_some() && entries.iter().all(|e| e.get(name) == entry)
    };
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in names {
        *counts.entry(n).or_default() += 1;
    }
    first.keys().all(|n| !kept(n) || counts.get(n.as_str()) == Some(&1))
        && counts
            .iter()
            .all(|(n, count)| entries.iter().any(|e| e.contains_key(*n)) && (*count == 1 || !kept(n)))
}

/// Checks observation `o` against its zone's log: `None` if it shows an
/// allowed state, else what went wrong.
fn check(versions: &[Version], o: &Observation) -> Option<String> {
    // The last state whose change had ended before the look began, and the
    // last whose change had begun before it ended.
    let first = versions.partition_point(|v| v.end <= o.start).saturating_sub(1);
    let last = versions.partition_point(|v| v.start <= o.end).saturating_sub(1).max(first);
    let candidates = &versions[first..=last];
    let follow = !matches!(o.look, Look::Lstat | Look::Readlink);
    for (found, i) in walks(candidates, &o.path, follow) {
        let ino = match found {
            Err(e) if o.seen == Seen::Err(e) => return None,
            Err(_) => continue,
            Ok(ino) => ino,
        };
        if let (Look::Readdir, Seen::Names(names)) = (o.look, &o.seen) {
            if listing_agrees(&candidates[i..], ino, names) {
                return None;
            }
            continue;
        }
        // The object as that state and every later one has it (one no
        // longer named keeps what it had, with no links).
        let mut obj = &candidates[i].tree.objects[&ino];
        for later in &candidates[i..] {
            let nlink_now = match later.tree.objects.get(&ino) {
                Some(now) => {
                    obj = now;
                    match now.body {
                        Body::File { nlink, .. } => Some(nlink),
                        _ => None,
                    }
                }
                None => None,
            };
            if agrees(o.look, obj, nlink_now, &o.seen) {
                return None;
            }
        }
    }
    let newest = &versions[first];
    let expected: Vec<String> = candidates
        .iter()
        .map(|v| match v.tree.resolve(&o.path, follow) {
            Err(e) => format!("errno {e}"),
            Ok(ino) => {
                let obj = &v.tree.objects[&ino];
                let nlink = match obj.body {
                    Body::File { nlink, .. } => Some(nlink),
                    _ => None,
                };
                format!("{:?}", shows(o.look, obj, nlink))
            }
        })
        .collect();
    let recent: Vec<&str> = versions[..=last].iter().rev().take(8).map(|v| v.by.as_str()).collect();
    Some(format!(
        "{:?} of zone{}/{} began {:?} after the last change before it had returned ({}) and took {:?}; saw {:?}, \
         expected one of {:?} ({} states could overlap it); the changes up to the last that could, newest \
         first: {recent:?}",
        o.look,
        o.zone,
        o.path,
        o.start.duration_since(newest.end),
        newest.by,
        o.end.duration_since(o.start),
        o.seen,
        expected,
        candidates.len()
    ))
}
