//! The checker's changing threads: a random change of a zone, predicted
//! by the model, made on a mount under the zone's mutex and logged with
//! its start and end (or, if the mount answered otherwise than the model,
//! reported).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::model::{Body, Change, Ino, Tree, DIR_NAMES, DIR_PERM, FILE_NAMES, UTIME_BASE};
use super::{c_path, errno, zone_dir, Progress, Run, Version, Violation, ZoneLog};
use crate::TestMount;

/// A random path of a directory: the zone's root, or one or two levels
/// down.
pub(super) fn dir_path(rng: &mut StdRng) -> String {
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
pub(super) fn file_path(rng: &mut StdRng) -> String {
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
pub(super) fn change_until(
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
