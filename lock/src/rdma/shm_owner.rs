//! Who owns the shm fabrics of this host, and removal of the ones nobody
//! owns any more.
//!
//! A shm fabric (`/dev/shm/citronfs-NAME/`, see [`super::shm`]) is RAM until
//! reboot: a host that dies without removing it (SIGKILL, a panic that
//! aborts, a power cut of the process) would leak its regions for good. So
//! the fabric's liveness is a lock, never a guess from a pid:
//!
//! * the host ([`super::ShmHost`]) holds an exclusive `flock(2)` on the
//!   fabric's `owner` file for its whole life, through a descriptor it
//!   never closes before it removes the directory. The kernel drops the
//!   lock when that open file goes away, which a crash does too;
//! * a fabric whose owner lock can be taken has no live owner: it is an
//!   orphan, and [`remove_orphans`] deletes it. Every citronfs start and every
//!   new host does that first, so a crash leaves nothing the next start does
//!   not clean up;
//! * a fabric directory without an `owner` file was made by a citronfs
//!   from before this scheme ([`Owner::Unknown`]): nothing tells whether its
//!   host lives, so it is listed and never removed automatically;
//! * a client joining a fabric checks the same lock ([`owner_is_alive`]), so
//!   it never maps the memory of a dead host.
//!
//! Creation and sweeping are ordered by one host-wide lock file,
//! `/dev/shm/citronfs.lock` (empty, never removed): a creator holds it shared
//! from `mkdir` until its owner lock is taken, and a sweeper holds it
//! exclusive while it tests and removes, so a sweeper never takes a fabric
//! being created for an orphan. Creators do not exclude each other.
//!
//! A lock's owner pid comes from `/proc/locks` (the process that took it),
//! for display only.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where shm fabrics live.
pub const SHM_ROOT: &str = "/dev/shm";
/// Prefix of a fabric directory's name (`citronfs-NAME`).
pub const FABRIC_PREFIX: &str = "citronfs-";
/// The host-wide lock that orders creation against sweeping.
const SWEEP_LOCK: &str = "citronfs.lock";
/// The file of a fabric directory that its host keeps locked.
pub const OWNER_FILE: &str = "owner";

/// Who owns a fabric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// A live process holds the fabric's lock (its pid, when `/proc/locks`
    /// shows it to us).
    Live { pid: Option<u32> },
    /// Nobody holds it: the host died without removing it.
    Orphaned,
    /// No owner lock: made by an older citronfs; never removed here.
    Unknown,
}

/// One file of a fabric directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricFile {
    pub name: String,
    /// The file's length.
    pub bytes: u64,
    /// Memory the file really holds (tmpfs pages are allocated on first
    /// touch, so this can be far below `bytes`).
    pub resident: u64,
}

/// A fabric on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricInfo {
    /// The fabric's name (`shm:NAME`).
    pub name: String,
    pub dir: PathBuf,
    pub owner: Owner,
    /// Its files: `control`, `region-<id>`, node sockets.
    pub files: Vec<FabricFile>,
}

impl FabricInfo {
    /// Bytes of every file in the fabric.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }

    /// Memory the fabric holds.
    pub fn resident(&self) -> u64 {
        self.files.iter().map(|f| f.resident).sum()
    }

    /// The registered regions' files (`region-<id>`).
    pub fn regions(&self) -> impl Iterator<Item = &FabricFile> {
        self.files.iter().filter(|f| f.name.starts_with("region-") && !f.name.ends_with(".nic"))
    }
}

/// The exclusive lock a fabric's host holds on its owner file; the fabric
/// is alive while this exists.
#[derive(Debug)]
pub struct OwnerLock {
    _owner: File,
}

/// `flock(2)` on `file`; `Ok(false)` when `nonblocking` and someone else
/// holds a conflicting lock.
fn flock(file: &File, operation: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: flock(2) on a descriptor `file` keeps open for the call.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// The owner file of the fabric at `dir`; `None` if it has none (an older
/// citronfs made it).
fn open_owner(dir: &Path) -> io::Result<Option<File>> {
    match File::open(dir.join(OWNER_FILE)) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::NotFound && dir.is_dir() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The host-wide lock file, locked with `operation` (blocking); unlocked
/// when the returned file is dropped.
fn sweep_lock(root: &Path, operation: libc::c_int) -> io::Result<File> {
    let file =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(root.join(SWEEP_LOCK))?;
    flock(&file, operation)?;
    Ok(file)
}

/// Who owns the fabric at `dir` (without its pid).
///
/// Tested with a non-blocking shared lock that is released at once: it is
/// refused exactly while a host holds its exclusive one.
fn owner_of(dir: &Path) -> io::Result<Owner> {
    let Some(file) = open_owner(dir)? else { return Ok(Owner::Unknown) };
    Ok(if flock(&file, libc::LOCK_SH | libc::LOCK_NB)? { Owner::Orphaned } else { Owner::Live { pid: None } })
}

/// Whether the fabric at `dir` may have a live host: its owner lock is
/// held, or it has none (an older citronfs made it).
pub fn owner_is_alive(dir: &Path) -> io::Result<bool> {
    Ok(owner_of(dir)? != Owner::Orphaned)
}

/// Creates the fabric directory `dir` (under [`SHM_ROOT`]) and takes its
/// owner lock. A directory of that name left by a dead host is removed
/// first; one whose host is alive is refused.
pub(crate) fn create_owned(dir: &Path) -> io::Result<OwnerLock> {
    let root = dir.parent().unwrap_or(Path::new(SHM_ROOT));
    let _creating = sweep_lock(root, libc::LOCK_SH)?;
    if dir.exists() {
        if let Owner::Live { .. } = owner_of(dir)? {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is in use by a live process", dir.display()),
            ));
        }
        // An orphan, or an older citronfs's fabric of this name (replaced
        // as before).
        log::warn!("removing stale shm fabric {}", dir.display());
        fs::remove_dir_all(dir)?;
    }
    fs::create_dir(dir)?;
    // Private to the user that runs the servers (see `shm`): nothing in a
    // region can be checked once a process maps it.
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    }
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(dir.join(OWNER_FILE))?
    };
    if !flock(&file, libc::LOCK_EX | libc::LOCK_NB)? {
        // Only a second creator of the same name that won the race can hold it.
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{} was taken meanwhile", dir.display()),
        ));
    }
    Ok(OwnerLock { _owner: file })
}

/// The owners of flock locks by (device, inode), from `/proc/locks`.
fn flock_owners() -> Vec<((u32, u32, u64), u32)> {
    let Ok(text) = fs::read_to_string("/proc/locks") else { return Vec::new() };
    // `1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF`; waiters start with `->`.
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(1) != Some(&"FLOCK") {
                return None;
            }
            let pid: u32 = fields.get(4)?.parse().ok()?;
            let mut id = fields.get(5)?.split(':');
            let major = u32::from_str_radix(id.next()?, 16).ok()?;
            let minor = u32::from_str_radix(id.next()?, 16).ok()?;
            let inode: u64 = id.next()?.parse().ok()?;
            Some(((major, minor, inode), pid))
        })
        .collect()
}

fn describe(dir: &Path, name: &str, owner: Owner) -> FabricInfo {
    let mut files: Vec<FabricFile> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            // Through a region published as a link to a data directory's
            // file: that file's size and memory.
            let meta = fs::metadata(e.path()).ok()?;
            Some(FabricFile {
                name: e.file_name().to_string_lossy().into_owned(),
                bytes: meta.len(),
                resident: meta.blocks() * 512,
            })
        })
        .collect();
    files.sort_by(|a, b| a.name.cmp(&b.name));
    FabricInfo { name: name.to_string(), dir: dir.to_path_buf(), owner, files }
}

/// Fabric directories under `root`: (name, path).
fn fabric_dirs(root: &Path) -> io::Result<Vec<(String, PathBuf)>> {
    let mut dirs = Vec::new();
    for entry in fs::read_dir(root)? {
        let entry = entry?;
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str().and_then(|n| n.strip_prefix(FABRIC_PREFIX)) else { continue };
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            dirs.push((name.to_string(), entry.path()));
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// Every shm fabric of this host and who owns it.
pub fn list_fabrics() -> io::Result<Vec<FabricInfo>> {
    list_fabrics_in(Path::new(SHM_ROOT))
}

/// [`list_fabrics`] under another root (tests).
pub fn list_fabrics_in(root: &Path) -> io::Result<Vec<FabricInfo>> {
    let owners = flock_owners();
    let mut out = Vec::new();
    for (name, dir) in fabric_dirs(root)? {
        // A fabric removed while we look is simply not listed.
        let Ok(owner) = owner_of(&dir) else { continue };
        let owner = match owner {
            Owner::Live { .. } => {
                let pid = fs::metadata(dir.join(OWNER_FILE)).ok().and_then(|m| {
                    let key = (libc::major(m.dev()), libc::minor(m.dev()), m.ino());
                    owners.iter().find(|(k, _)| *k == key).map(|(_, pid)| *pid)
                });
                Owner::Live { pid }
            }
            other => other,
        };
        out.push(describe(&dir, &name, owner));
    }
    Ok(out)
}

/// Removes every fabric of this host that no live process owns; returns
/// what it removed.
pub fn remove_orphans() -> io::Result<Vec<FabricInfo>> {
    remove_orphans_in(Path::new(SHM_ROOT))
}

/// [`remove_orphans`] under another root (tests).
pub fn remove_orphans_in(root: &Path) -> io::Result<Vec<FabricInfo>> {
    let _sweeping = sweep_lock(root, libc::LOCK_EX)?;
    let mut removed = Vec::new();
    for (name, dir) in fabric_dirs(root)? {
        let Ok(Some(file)) = open_owner(&dir) else { continue };
        // Held until the directory is gone, so no client joins meanwhile
        // (a joining client's shared test fails and it reports the host dead).
        if !flock(&file, libc::LOCK_EX | libc::LOCK_NB)? {
            continue;
        }
        let info = describe(&dir, &name, Owner::Orphaned);
        match fs::remove_dir_all(&dir) {
            Ok(()) => {
                log::warn!(
                    "removed orphaned shm fabric {} ({} bytes resident)",
                    dir.display(),
                    info.resident()
                );
                removed.push(info);
            }
            Err(e) => log::warn!("cannot remove orphaned shm fabric {}: {e}", dir.display()),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fabric_is_live_while_its_lock_is_held_and_an_orphan_after() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(format!("{FABRIC_PREFIX}a"));
        let lock = create_owned(&dir).unwrap();
        fs::write(dir.join("region-1"), vec![7u8; 8192]).unwrap();
        assert!(owner_is_alive(&dir).unwrap());
        let listed = list_fabrics_in(root.path()).unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "a");
        assert!(matches!(listed[0].owner, Owner::Live { .. }), "{listed:?}");
        assert_eq!(listed[0].regions().map(|r| r.bytes).sum::<u64>(), 8192);
        // A second host of the same name is refused while the first lives.
        assert_eq!(create_owned(&dir).unwrap_err().kind(), io::ErrorKind::AddrInUse);
        assert!(remove_orphans_in(root.path()).unwrap().is_empty());
        assert!(dir.exists());

        drop(lock); // as the kernel does when the owner dies
        assert!(!owner_is_alive(&dir).unwrap());
        assert_eq!(list_fabrics_in(root.path()).unwrap()[0].owner, Owner::Orphaned);
        let removed = remove_orphans_in(root.path()).unwrap();
        assert_eq!(removed.len(), 1);
        assert!(!dir.exists());
    }

    #[test]
    fn a_new_host_replaces_an_orphan_of_its_name() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(format!("{FABRIC_PREFIX}b"));
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("region-1"), b"stale").unwrap();
        let _lock = create_owned(&dir).unwrap();
        assert!(!dir.join("region-1").exists());
        assert!(owner_is_alive(&dir).unwrap());
    }

    #[test]
    fn other_entries_of_the_root_are_left_alone() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir(root.path().join("someone-else")).unwrap();
        // An older citronfs's fabric: no owner file, so nobody can tell.
        let legacy = root.path().join(format!("{FABRIC_PREFIX}legacy"));
        fs::create_dir(&legacy).unwrap();
        fs::write(legacy.join("region-1"), b"x").unwrap();
        assert_eq!(list_fabrics_in(root.path()).unwrap()[0].owner, Owner::Unknown);
        assert!(owner_is_alive(&legacy).unwrap());
        assert!(remove_orphans_in(root.path()).unwrap().is_empty());
        assert!(legacy.exists());
        fs::remove_dir_all(&legacy).unwrap();
        fs::write(root.path().join(format!("{FABRIC_PREFIX}file")), b"not a dir").unwrap();
        assert!(remove_orphans_in(root.path()).unwrap().is_empty());
        assert!(list_fabrics_in(root.path()).unwrap().is_empty());
        assert!(root.path().join("someone-else").exists());
    }
}
