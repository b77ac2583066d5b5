//! The vocabulary of the file system: ids, attributes, where chunks live.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use citron_lock::rdma::RemoteAddr;
use serde::{Deserialize, Serialize};

/// An inode number. [`Ino::ROOT`] is the root directory, as FUSE expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Ino(pub u64);

impl Ino {
    pub const ROOT: Ino = Ino(1);
}

/// A client (a mount) registered with the meta-server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClientId(pub u64);

/// The number of one change a client asked of the meta-server
/// ([`crate::proto::MetaRequest::Once`]): its changes are numbered from 1
/// up, never twice by one client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChangeSeq(pub u64);

/// The identity of one file system: made at random when its meta-server
/// first starts on an empty state directory, kept in its state, and given
/// to every client at registration. A client that finds another identity
/// after reconnecting is talking to a different file system (state lost,
/// or the wrong cluster) and must not show it in place of the old one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FsId(pub u128);

/// As a UUID string where people read it (JSON: `citronfs status
/// --json`, a data directory's identity file, which also have no 128-bit
/// numbers), as a number on the wire.
impl Serialize for FsId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            s.serialize_u128(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for FsId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
        } else {
            u128::deserialize(d).map(FsId)
        }
    }
}

impl FsId {
    /// A new identity, from the operating system's random source.
    pub fn random() -> Self {
        Self(rand::random())
    }
}

/// As a UUID is written: 8-4-4-4-12 hexadecimal digits.
impl std::fmt::Display for FsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = format!("{:032x}", self.0);
        write!(f, "{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
    }
}

impl std::fmt::Debug for FsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FsId({self})")
    }
}

impl std::str::FromStr for FsId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let hex: String = s.trim().chars().filter(|c| *c != '-').collect();
        if hex.len() != 32 {
            return Err(format!("a file-system id has 32 hex digits: {s:?}"));
        }
        u128::from_str_radix(&hex, 16).map(Self).map_err(|e| format!("{s:?}: {e}"))
    }
}

/// A data server registered with the meta-server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DataServerId(pub u32);

/// The index of a chunk in a file: byte offset / chunk size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkIndex(pub u64);

/// Where one chunk of file data lives: an extent of a data server's memory
/// that holds the chunk's first `capacity` bytes (DESIGN.md §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkLoc {
    pub server: DataServerId,
    pub addr: RemoteAddr,
    /// Bytes of the chunk the extent holds, from the chunk's start: a power
    /// of two, at most the chunk size. The chunk's bytes past it read zero.
    pub capacity: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

/// A point in time as seconds and nanoseconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Timestamp {
    pub secs: i64,
    pub nanos: u32,
}

impl Timestamp {
    pub fn now() -> Self {
        Self::from(SystemTime::now())
    }

    /// Nanoseconds since the epoch, as kept in the one-sided attribute words.
    pub fn as_nanos(self) -> u64 {
        (self.secs.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(self.nanos.into())
    }

    pub fn from_nanos(n: u64) -> Self {
        Self { secs: (n / 1_000_000_000) as i64, nanos: (n % 1_000_000_000) as u32 }
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Self { secs: d.as_secs() as i64, nanos: d.subsec_nanos() },
            Err(e) => {
                let d = e.duration();
                let mut secs = -(d.as_secs() as i64);
                let mut nanos = d.subsec_nanos();
                if nanos > 0 {
                    secs -= 1;
                    nanos = 1_000_000_000 - nanos;
                }
                Self { secs, nanos }
            }
        }
    }
}

impl From<Timestamp> for SystemTime {
    fn from(t: Timestamp) -> Self {
        if t.secs >= 0 {
            UNIX_EPOCH + Duration::new(t.secs as u64, t.nanos)
        } else {
            UNIX_EPOCH - Duration::from_secs(t.secs.unsigned_abs()) + Duration::from_nanos(t.nanos.into())
        }
    }
}

/// An inode's attributes as the meta-server reports them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub ino: Ino,
    pub kind: FileKind,
    /// Permission bits (and set-id/sticky bits): `mode & 0o7777`.
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u32,
    pub rdev: u32,
    /// Bytes of data-server memory the file's extents take (`st_blocks` is
    /// this in 512-byte units).
    pub allocated: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub crtime: Timestamp,
}

impl Attr {
    /// A new inode's attributes: empty, every time `now`, one link (two
    /// for a directory: its own "." and its entry).
    pub fn fresh(ino: Ino, kind: FileKind, perm: u16, owner: Caller, now: Timestamp) -> Self {
        Self {
            ino,
            kind,
            perm,
            uid: owner.uid,
            gid: owner.gid,
            size: 0,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            rdev: 0,
            allocated: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
        }
    }
}

/// Which attributes a `setattr` changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetAttr {
    pub perm: Option<u16>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Timestamp>,
    pub mtime: Option<Timestamp>,
    pub ctime: Option<Timestamp>,
}

/// The permission bits after a write, truncate or chown by a process
/// without `CAP_FSETID`, as Linux's local file systems leave them
/// (`should_remove_suid`, `setattr_should_drop_sgid`): set-user-ID always
/// goes; set-group-ID goes when group-execute is set, and otherwise (the
/// old mandatory-locking mark) when the writer is not a member of the
/// file's group. `writer_in_group` is asked only in that last case.
pub fn perm_without_setid(perm: u16, writer_in_group: impl FnOnce() -> bool) -> u16 {
    let mut p = perm & !S_ISUID;
    if p & S_ISGID != 0 && (p & S_IXGRP != 0 || !writer_in_group()) {
        p &= !S_ISGID;
    }
    p
}

pub const S_ISUID: u16 = 0o4000;
pub const S_ISGID: u16 = 0o2000;
pub const S_IXGRP: u16 = 0o0010;

/// Who asks: the caller's credentials, for permission checks and ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl Caller {
    pub const ROOT: Caller = Caller { uid: 0, gid: 0, pid: 0 };
}

/// A directory entry as `readdir` returns it. `cookie` is the offset to
/// resume after this entry; cookies of live entries never change, so a
/// listing stays consistent while the directory changes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub cookie: u64,
    pub ino: Ino,
    pub kind: FileKind,
    pub name: Vec<u8>,
}

/// File-system totals for `statfs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsStats {
    pub chunk_size: u64,
    /// Bytes of data-server memory for file data, and how many are free.
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Inodes in use, and the most there can be (attribute slots).
    pub inodes: u64,
    pub max_inodes: u64,
}

/// Longest name in a directory, as ext4 and POSIX's usual NAME_MAX.
pub const NAME_MAX: usize = 255;
/// Largest file: 4 TiB.
pub const MAX_FILE_SIZE: u64 = 1 << 42;
/// Largest symlink target.
pub const SYMLINK_MAX: usize = 4095;
/// Largest xattr value.
pub const XATTR_SIZE_MAX: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::FsId;

    #[test]
    fn a_file_system_id_reads_back_as_written() {
        let id = FsId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(id.to_string(), "01234567-89ab-cdef-0011-223344556677");
        assert_eq!(id.to_string().parse::<FsId>(), Ok(id));
        assert!("0123".parse::<FsId>().is_err());
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"01234567-89ab-cdef-0011-223344556677\"");
        assert_eq!(serde_json::from_str::<FsId>(&json).unwrap(), id);
        assert_eq!(bincode::deserialize::<FsId>(&bincode::serialize(&id).unwrap()).unwrap(), id);
        assert_ne!(FsId::random(), FsId::random());
    }
}
