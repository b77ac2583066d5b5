//! Where a meta-server keeps its state when it is not told
//! (`--state-dir`): a scratch directory under `/dev/shm` (or
//! `$CITRONFS_SCRATCH_STATE_ROOT`), for a meta-server
//! that is started from code (tests, benchmarks) and whose file system
//! ends with it. A scratch directory is removed when its meta-server
//! stops; one left by a process that died is removed by the next start
//! of any meta-server on the host (no live meta-server holds its lock).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::files;

/// Where scratch state directories are made.
pub const SCRATCH_ROOT: &str = "/dev/shm";
/// Names another directory for them: a benchmark measures the journal on a
/// disk by pointing it there.
pub const SCRATCH_ROOT_ENV: &str = "CITRONFS_SCRATCH_STATE_ROOT";

fn scratch_root() -> std::path::PathBuf {
    std::env::var_os(SCRATCH_ROOT_ENV).map_or_else(|| SCRATCH_ROOT.into(), Into::into)
}
const SCRATCH_PREFIX: &str = "citronfs-scratch-";
/// How long a new scratch directory is left alone by sweeps: ample for a
/// start to take its lock.
const SETTLING: std::time::Duration = std::time::Duration::from_secs(10);

/// A scratch state directory, removed on drop.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// A new, empty scratch directory; first removes the ones whose
    /// meta-server is gone.
    pub fn new() -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let root = scratch_root();
        remove_orphaned_scratch(&root);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = root.join(format!("{SCRATCH_PREFIX}{}-{n}", std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path)?;
        }
        std::fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            log::warn!("cannot remove the scratch state {}: {e}", self.path.display());
        }
    }
}

/// Removes the scratch directories under `root` whose lock no process
/// holds (their meta-server died), and those that never got a lock file.
fn remove_orphaned_scratch(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(|n| n.starts_with(SCRATCH_PREFIX)) {
            continue;
        }
        let dir = entry.path();
        // A directory being made is not yet locked: one younger than
        // `SETTLING` is left alone, whatever its lock says (a meta-server
        // starting in this or another process, between the two steps).
        let settled = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > SETTLING));
        let orphaned = settled
            && match std::fs::OpenOptions::new().write(true).open(dir.join(files::LOCK)) {
                // Held: the lock is released by the kernel when its holder dies.
                Ok(f) => f.try_lock().is_ok(),
                // Never locked: left by a process that died while starting.
                Err(_) => true,
            };
        if orphaned {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    log::info!("removed the scratch state {} of a meta-server that is gone", dir.display())
                }
                Err(e) => log::warn!("cannot remove the scratch state {}: {e}", dir.display()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_of_a_dead_holder_is_swept_and_a_held_one_kept() {
        let root = tempfile::tempdir().unwrap();
        let held = root.path().join(format!("{SCRATCH_PREFIX}held"));
        let dead = root.path().join(format!("{SCRATCH_PREFIX}dead"));
        let other = root.path().join("something-else");
        for d in [&held, &dead, &other] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join(files::LOCK), b"").unwrap();
        }
        let young = root.path().join(format!("{SCRATCH_PREFIX}young"));
        std::fs::create_dir(&young).unwrap();
        let lock = std::fs::OpenOptions::new().write(true).open(held.join(files::LOCK)).unwrap();
        lock.try_lock().unwrap();
        let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for d in [&held, &dead, &other] {
            std::fs::File::open(d).unwrap().set_modified(an_hour_ago).unwrap();
        }
        remove_orphaned_scratch(root.path());
        assert!(held.exists(), "a directory whose lock is held stays");
        assert!(!dead.exists(), "one whose lock nobody holds goes");
        assert!(young.exists(), "one being made is left alone");
        assert!(other.exists(), "only scratch directories are swept");
    }
}
