//! A data server's memory kept in a directory, so that a server that
//! restarts (a crash, SIGKILL, SIGTERM, an upgrade) re-adopts the bytes of
//! its files instead of starting empty, and registers again under the
//! identity the meta-server gave it.
//!
//! A data directory holds:
//!
//! | file | what |
//! |---|---|
//! | `region` | the memory: a sparse file of the server's capacity (rounded up to a MiB), mapped shared; the host gives it pages only as they are written |
//! | `identity` | JSON ([`DataIdentity`]): a format version, the id the meta-server assigned, the capacity, the region id, and room for the file system's identity |
//! | `lock` | held with an exclusive `flock(2)` for the server's life: one server per directory |
//!
//! Where it lives decides what it survives. Under `/dev/shm` (the default,
//! [`DEFAULT_ROOT`]) it survives any process crash or restart and is lost
//! at reboot, like tmpfs; on a persistent path (a disk, DAX/pmem) it
//! survives a reboot too. The default directory is not a shm fabric
//! (`/dev/shm/citronfs-NAME/`), so the start-up sweep of orphaned fabrics
//! never touches it: a fabric publishes the region as a link to this file,
//! and removing the fabric removes only the link.
//!
//! The identity is written once the meta-server answered the first
//! registration (to a temporary file, synced, renamed, and the directory
//! synced), so a directory with an identity always names a registration the
//! meta-server made. A region without an identity (the first start died
//! before its registration was answered) holds nothing any file refers to
//! and is started afresh.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use citronfs_core::types::DataServerId;
use citronfs_core::FsError;
use serde::{Deserialize, Serialize};

/// Where default data directories live: `/dev/shm/citronfs.data/NAME`.
pub const DEFAULT_ROOT: &str = "/dev/shm/citronfs.data";
/// The version of [`DataIdentity`] this code writes and reads.
pub const IDENTITY_VERSION: u32 = 1;

const REGION_FILE: &str = "region";
const IDENTITY_FILE: &str = "identity";
const LOCK_FILE: &str = "lock";

/// Why a data directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{} is in use by another data server", .0.display())]
    InUse(PathBuf),
    #[error("{}: {why}", path.display())]
    Identity { path: PathBuf, why: String },
    #[error(
        "{} holds {had} bytes of a data server's memory, not the {asked} asked for: keep its \
         capacity, or remove the directory to start afresh (its data is then lost)",
        path.display()
    )]
    Capacity { path: PathBuf, had: u64, asked: u64 },
    #[error("{}: the region file is gone or has the wrong size ({why}); its data is lost", path.display())]
    Region { path: PathBuf, why: String },
}

impl From<DataDirError> for FsError {
    fn from(e: DataDirError) -> Self {
        FsError::Invalid(e.to_string())
    }
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> DataDirError + '_ {
    move |source| DataDirError::Io { path: path.to_path_buf(), source }
}

/// Who a data directory's memory belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataIdentity {
    /// [`IDENTITY_VERSION`] when written.
    pub version: u32,
    /// The id the meta-server assigned at the first registration.
    pub server: DataServerId,
    /// Bytes offered (the region is this, rounded up to a MiB).
    pub capacity: u64,
    /// The region id the memory is registered as.
    pub region: u32,
    /// The identity of the file system this memory belongs to, once the
    /// meta-server has one.
    #[serde(default)]
    pub file_system: Option<String>,
}

/// A data directory, locked for this process.
#[derive(Debug)]
pub struct DataDir {
    path: PathBuf,
    identity: Option<DataIdentity>,
    /// Held for the life of the server.
    _lock: File,
}

impl DataDir {
    /// The default data directory of a server called `name`.
    pub fn default_path(name: &str) -> PathBuf {
        Path::new(DEFAULT_ROOT).join(name)
    }

    /// Opens (creating it if need be) the data directory at `path` and
    /// takes its lock.
    pub fn open(path: &Path) -> Result<Self, DataDirError> {
        fs::create_dir_all(path).map_err(io_at(path))?;
        // Nothing in the memory can be checked once a process maps it:
        // private to the user that runs the servers, as a shm fabric is.
        fs::set_permissions(path, fs::Permissions::from_mode(0o700)).map_err(io_at(path))?;
        let lock_path = path.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io_at(&lock_path))?;
        // SAFETY: flock(2) on a descriptor `lock` keeps open for the call.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EWOULDBLOCK) => DataDirError::InUse(path.to_path_buf()),
                _ => DataDirError::Io { path: lock_path, source: e },
            });
        }
        let identity_path = path.join(IDENTITY_FILE);
        let identity = match fs::read(&identity_path) {
            Ok(bytes) => Some(parse_identity(&identity_path, &bytes)?),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(DataDirError::Io { path: identity_path, source: e }),
        };
        Ok(Self { path: path.to_path_buf(), identity, _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the directory is on a persistent path: not on tmpfs or
    /// ramfs, whose pages no sync makes more durable than they are.
    pub fn is_durable(&self) -> bool {
        use std::os::unix::ffi::OsStrExt;
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        const RAMFS_MAGIC: i64 = 0x8584_58f6;
        let Ok(path) = std::ffi::CString::new(self.path.as_os_str().as_bytes()) else { return true };
        // SAFETY: an all-zero statfs is a valid value to be overwritten.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `st` is a valid out-pointer.
        if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
            return true;
        }
        #[allow(clippy::unnecessary_cast)] // f_type's type differs between libcs
        let kind = st.f_type as i64;
        kind != TMPFS_MAGIC && kind != RAMFS_MAGIC
    }

    /// The identity recorded at the first registration; `None` for a new
    /// directory.
    pub fn identity(&self) -> Option<&DataIdentity> {
        self.identity.as_ref()
    }

    /// The capacity to offer: the recorded one for memory that is kept
    /// (`asked` must agree if given), `asked` or `default` for a new
    /// directory.
    pub fn capacity(&self, asked: Option<u64>, default: impl FnOnce() -> u64) -> Result<u64, DataDirError> {
        match (&self.identity, asked) {
            (Some(id), Some(asked)) if asked != id.capacity => {
                Err(DataDirError::Capacity { path: self.path.clone(), had: id.capacity, asked })
            }
            (Some(id), _) => Ok(id.capacity),
            (None, Some(asked)) => Ok(asked),
            (None, None) => Ok(default()),
        }
    }

    /// The region file.
    pub fn region_path(&self) -> PathBuf {
        self.path.join(REGION_FILE)
    }

    /// The region file of `len` bytes, ready to map: the kept one, or for a
    /// new directory a fresh sparse one (any leftover of a start that never
    /// registered is dropped).
    pub fn region(&self, len: u64) -> Result<File, DataDirError> {
        let path = self.region_path();
        if self.identity.is_none() {
            match fs::remove_file(&path) {
                Ok(()) => log::info!("{}: dropping a region no registration refers to", path.display()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(DataDirError::Io { path, source: e }),
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(io_at(&path))?;
            file.set_len(len).map_err(io_at(&path))?;
            return Ok(file);
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| DataDirError::Region { path: path.clone(), why: e.to_string() })?;
        let found = file.metadata().map_err(io_at(&path))?.len();
        if found != len {
            return Err(DataDirError::Region { path, why: format!("{found} bytes, not {len}") });
        }
        Ok(file)
    }

    /// Records `identity` (durably: synced, renamed into place, the
    /// directory synced).
    pub fn record(&mut self, identity: DataIdentity) -> Result<(), DataDirError> {
        let path = self.path.join(IDENTITY_FILE);
        let tmp = self.path.join(format!(".{IDENTITY_FILE}.tmp"));
        let mut bytes = serde_json::to_vec_pretty(&identity).expect("an identity serializes");
        bytes.push(b'\n');
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io_at(&tmp))?;
            f.write_all(&bytes).map_err(io_at(&tmp))?;
            f.sync_all().map_err(io_at(&tmp))?;
        }
        fs::rename(&tmp, &path).map_err(io_at(&path))?;
        File::open(&self.path).and_then(|d| d.sync_all()).map_err(io_at(&self.path))?;
        self.identity = Some(identity);
        Ok(())
    }
}

fn parse_identity(path: &Path, bytes: &[u8]) -> Result<DataIdentity, DataDirError> {
    let bad = |why: String| DataDirError::Identity { path: path.to_path_buf(), why };
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    let version = value.get("version").and_then(serde_json::Value::as_u64);
    if version != Some(u64::from(IDENTITY_VERSION)) {
        return Err(bad(format!("identity format {version:?}; this citronfs reads {IDENTITY_VERSION}")));
    }
    serde_json::from_value(value).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_keeps_its_identity_and_region_and_admits_one_server() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        let mut d = DataDir::open(&dir).unwrap();
        assert!(d.identity().is_none());
        assert_eq!(d.capacity(None, || 1 << 20).unwrap(), 1 << 20);
        let region = d.region(2 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&region, b"kept", 4096).unwrap();
        assert!(matches!(DataDir::open(&dir), Err(DataDirError::InUse(_))));
        let identity = DataIdentity {
            version: IDENTITY_VERSION,
            server: DataServerId(7),
            capacity: 2 << 20,
            region: 1,
            file_system: None,
        };
        d.record(identity.clone()).unwrap();
        drop(d);

        let d = DataDir::open(&dir).unwrap();
        assert_eq!(d.identity(), Some(&identity));
        assert_eq!(d.capacity(None, || 1).unwrap(), 2 << 20);
        assert!(matches!(d.capacity(Some(4 << 20), || 1), Err(DataDirError::Capacity { .. })));
        let region = d.region(2 << 20).unwrap();
        let mut buf = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(&region, &mut buf, 4096).unwrap();
        assert_eq!(&buf, b"kept");
        assert!(matches!(d.region(4 << 20), Err(DataDirError::Region { .. })));
    }

    #[test]
    fn an_identity_of_another_format_is_refused() {
        let root = tempfile::tempdir().unwrap();
        fs::write(root.path().join(IDENTITY_FILE), br#"{"version": 99, "server": 1}"#).unwrap();
        let e = DataDir::open(root.path()).unwrap_err();
        assert!(e.to_string().contains("identity format"), "{e}");
    }
}
