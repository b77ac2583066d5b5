//! Requests to the meta-server and its answers (serde + bincode over the
//! framed RPC of `citron_lock::rdma::tcp::rpc`).
//!
//! Metadata goes through the meta-server; file data never does. A client
//! learns where each chunk of a file lives ([`FileLayout`]) and then reads and
//! writes chunk memory with one-sided verbs. The size and mtime of a regular
//! file live in an attribute slot in the meta-server's memory
//! ([`AttrSlot`]), which clients read and update one-sidedly, so a read or
//! write needs no RPC at all once the layout is cached.

use std::net::SocketAddr;

use citron_lock::rdma::RemoteAddr;
use serde::{Deserialize, Serialize};

use crate::error::FsError;
use crate::locks::{ClusterLockParams, LockArea, WaitsFor};
use crate::types::{
    Attr, Caller, ChangeSeq, ChunkIndex, ChunkLoc, ClientId, DataServerId, DirEntry, FileKind, FsStats, Ino,
    SetAttr, Timestamp,
};

mod named;
pub use named::Named;

/// Layout of a regular file's attribute slot in meta-server memory. Clients
/// read it with one verb and update it with atomics.
///
/// | offset | word | updated by |
/// |---|---|---|
/// | 0 | size in bytes | clients: CAS up to a write's end; meta-server: truncate |
/// | 8 | mtime, ns since the epoch | clients: fetch-and-store after a write |
/// | 16 | layout epoch | meta-server: +1 whenever extents are freed (truncate, a chunk that moves) |
/// | 24 | allocation generation | meta-server: +1 whenever chunks are allocated |
/// | 32 | permission bits (mode & 0o7777) in bits 0..16, group id in bits 32..64 | meta-server: a copy of the inode's, at every change |
///
/// The permission word lets a write see set-user/group-ID bits it must
/// clear (a writer without `CAP_FSETID`) in the slot read it makes anyway,
/// so an ordinary write pays nothing for the check; the group decides
/// whether a set-group-ID bit without group-execute goes
/// ([`crate::types::perm_without_setid`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttrSlot(pub RemoteAddr);

impl AttrSlot {
    pub const BYTES: u64 = 40;
    pub const SIZE: u64 = 0;
    pub const MTIME: u64 = 8;
    pub const EPOCH: u64 = 16;
    pub const ALLOCS: u64 = 24;
    pub const PERM: u64 = 32;

    pub fn size(self) -> RemoteAddr {
        self.0 + Self::SIZE
    }
    pub fn mtime(self) -> RemoteAddr {
        self.0 + Self::MTIME
    }
    pub fn epoch(self) -> RemoteAddr {
        self.0 + Self::EPOCH
    }
    pub fn allocs(self) -> RemoteAddr {
        self.0 + Self::ALLOCS
    }
    pub fn perm(self) -> RemoteAddr {
        self.0 + Self::PERM
    }
}

/// Where a data server's memory can be reached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataServerInfo {
    pub id: DataServerId,
    /// Its software NIC (tcp backend).
    pub nic: SocketAddr,
    /// Its shm fabric name, for clients on the same host.
    pub shm: Option<String>,
    /// Its `ib` control channel, when it serves RDMA clients (`--ib`).
    pub ib: Option<SocketAddr>,
    /// Whether its memory is a file on a persistent path (a data directory
    /// not on tmpfs): then `fsync` flushes the file's extents there
    /// ([`citron_lock::rdma::Verb::Flush`]); elsewhere nothing can make
    /// bytes more durable than writing them did.
    pub durable: bool,
}

/// What a client needs to do I/O on a regular file without the meta-server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileLayout {
    pub ino: Ino,
    pub slot: AttrSlot,
    /// Bumped by the meta-server whenever chunks of the file are freed; a
    /// client whose cached layout has an older epoch refetches it.
    pub epoch: u64,
    /// The slot's allocation generation when the chunk list was taken: a
    /// client whose cached list is older refetches it before it reads a
    /// hole (another client may have written there since).
    pub allocs: u64,
    /// The allocated chunks, sorted by index (holes are absent), each an
    /// extent that may hold only the chunk's first bytes.
    pub chunks: Vec<(ChunkIndex, ChunkLoc)>,
    /// The file's lock memory (range locks, inode mutex, lock records):
    /// only in the answer of an open, and valid until the client's last
    /// release of the file (the meta-server reuses it once the file is
    /// closed everywhere).
    pub locks: Option<LockArea>,
}

/// The most chunks one `AllocChunks` may ask to have allocated ahead of a
/// sequential writer (16 MiB at the default chunk size).
pub const MAX_AHEAD_CHUNKS: usize = 16;

/// The extents an allocation answered (`AllocChunks`, `GrowExtents`), and
/// where its commit took the file's layout: a client whose cached layout
/// was exactly the one of `epoch_before` at generation `allocs_before`
/// holds the one of `epoch` at `allocs_after` once it puts in `chunks`
/// (a moved chunk's new extent replaces its old one, and nothing else
/// moved in that commit), so a writer that allocates or grows alone never
/// refetches the whole layout after its own allocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocated {
    /// Every chunk asked for, as it now is, sorted by index.
    pub chunks: Vec<(ChunkIndex, ChunkLoc)>,
    /// The layout epoch before the commit ...
    pub epoch_before: u64,
    /// ... and after it (one more when it moved a chunk).
    pub epoch: u64,
    /// The slot's allocation generation just before the commit ...
    pub allocs_before: u64,
    /// ... and just after it (equal when nothing new was allocated).
    pub allocs_after: u64,
}

/// What a client learns when it registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterInfo {
    pub client: ClientId,
    pub chunk_size: u64,
    /// The meta-server's own software NIC (attribute slots, lock memory).
    pub meta_nic: SocketAddr,
    pub meta_shm: Option<String>,
    /// The meta-server's `ib` control channel, when it serves RDMA clients.
    pub meta_ib: Option<SocketAddr>,
    pub data_servers: Vec<DataServerInfo>,
    /// How often the client must renew its lease, in milliseconds.
    pub lease_ms: u64,
    /// The cluster's table of blocked POSIX lock owners (deadlock checks).
    pub waits_for: WaitsFor,
    /// Lock parameters every client must share.
    pub lock_params: ClusterLockParams,
    /// The lock host's services (ShiftLock recovery, RPC lock server).
    pub lock_host: citron_lock::lock_host::LockHostInfo,
    /// In a keyed cluster: the client's session and member secrets,
    /// wrapped under the key it registered with.
    pub session: Option<crate::session::SessionKeys>,
    /// The meta-server's incarnation: with `client`, the session a client
    /// of a cluster without keys names to the NICs, so that a fence
    /// applies to its connections there.
    pub incarnation: u64,
    /// The file system this meta-server serves: the same across its
    /// restarts, another one after its state was lost.
    pub fs: crate::types::FsId,
}

/// A registered client, as `citronfs locks` and `status` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientInfo {
    pub id: ClientId,
    pub hostname: String,
    pub pid: u32,
}

/// Opens of one file that a client had before the meta-server restarted,
/// with the lock memory it was lent then: taken back as they were, every
/// lock record in them kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimedOpen {
    pub ino: Ino,
    pub opens: u32,
    /// Some open was for writing.
    pub write: bool,
    pub area: crate::locks::LockArea,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum MetaRequest {
    /// A mount joins the cluster.
    RegisterClient {
        hostname: String,
        pid: u32,
    },
    /// A client of the meta-server's previous process comes back after a
    /// restart, under the id it had, with every open it had then: answered
    /// [`MetaResponse::Reclaimed`] within the grace period;
    /// [`FsError::Grace`] during its quiet start (ask again);
    /// [`FsError::MetaRestarted`] after it, or for a client the file system
    /// does not remember.
    ReclaimClient {
        client: ClientId,
        hostname: String,
        pid: u32,
        opens: Vec<ReclaimedOpen>,
    },
    /// The data servers registered so far (they may join after a client).
    DataServers,
    /// Renews the client's lease.
    Heartbeat {
        client: ClientId,
    },
    /// The client goes away (its mount ends): fence it now rather than
    /// when its lease runs out.
    ClientLeaves {
        client: ClientId,
    },
    /// A data server offers `capacity` bytes of region `region` on its NIC.
    RegisterDataServer {
        nic: SocketAddr,
        shm: Option<String>,
        ib: Option<SocketAddr>,
        region: u32,
        capacity: u64,
        /// The identity this server had, when it re-adopted its memory
        /// from its data directory: the meta-server re-links that server
        /// (its extents stay valid) instead of assigning a new id, and
        /// refuses an id it does not know.
        rejoin: Option<DataServerId>,
        /// The file system that memory belongs to (from its data
        /// directory): a rejoin to a meta-server of another file system is
        /// refused, so that no server holding one file system's data joins
        /// another under an id that is not its own.
        fs: Option<crate::types::FsId>,
        /// Whether the server keeps its memory across its own restart (a
        /// data directory): then a server that stops answering is down,
        /// not lost (see the meta-server's `service::data_servers`).
        kept: bool,
        /// Whether that memory is on a persistent path
        /// ([`DataServerInfo::durable`]).
        durable: bool,
    },
    /// A data server goes away for good (SIGTERM of a server whose memory
    /// is not kept): its memory and the file data in it are gone.
    DataServerLeaves {
        id: DataServerId,
    },
    Lookup {
        caller: Caller,
        parent: Ino,
        name: Vec<u8>,
    },
    GetAttr {
        ino: Ino,
    },
    SetAttr {
        caller: Caller,
        ino: Ino,
        set: SetAttr,
    },
    /// mknod / create / mkdir.
    Create {
        caller: Caller,
        parent: Ino,
        name: Vec<u8>,
        kind: FileKind,
        perm: u16,
        rdev: u32,
    },
    /// Creates a regular file and opens it, in one round trip (`creat`).
    /// With `exclusive` (O_EXCL) an existing name is [`FsError::Exists`];
    /// without, an existing regular file is opened instead and the answer
    /// is [`MetaResponse::OpenedExisting`] (O_CREAT is idempotent: two
    /// mounts that both found the name missing open one file).
    CreateOpen {
        caller: Caller,
        client: ClientId,
        parent: Ino,
        name: Vec<u8>,
        perm: u16,
        exclusive: bool,
    },
    Symlink {
        caller: Caller,
        parent: Ino,
        name: Vec<u8>,
        target: Vec<u8>,
    },
    ReadLink {
        ino: Ino,
    },
    Link {
        caller: Caller,
        ino: Ino,
        new_parent: Ino,
        new_name: Vec<u8>,
    },
    Unlink {
        caller: Caller,
        parent: Ino,
        name: Vec<u8>,
    },
    /// Creates and unlinks a caching mount answered before it sent them
    /// (in directories delegated to it, meta-server `grants`, "Late
    /// changes"), applied in order: each unlink as an `Unlink`, each create
    /// as an exclusive `CreateOpen` with the inode and cookie lent to
    /// `client` ([`MetaRequest::LendInodes`]), made at its time `at`.
    /// Answered [`MetaResponse::LateApplied`].
    LateChanges {
        client: ClientId,
        changes: Vec<LateChange>,
    },
    /// Lends `client` up to `count` inode numbers, each with a listing
    /// cookie and an attribute slot kept for it, for creates it answers
    /// before it sends them. Answered [`MetaResponse::Lent`].
    LendInodes {
        client: ClientId,
        count: u32,
    },
    Rmdir {
        caller: Caller,
        parent: Ino,
        name: Vec<u8>,
    },
    Rename {
        caller: Caller,
        parent: Ino,
        name: Vec<u8>,
        new_parent: Ino,
        new_name: Vec<u8>,
        flags: RenameMode,
    },
    /// Entries of `ino` after cookie `after`, in cookie order: `.` is
    /// [`DOT_COOKIE`], `..` [`DOTDOT_COOKIE`], then every name by the
    /// cookie it got when it was linked (rising, never reused).
    ReadDir {
        caller: Caller,
        ino: Ino,
        after: u64,
        max: u32,
    },
    /// `ReadDir` with each entry's attributes ([`MetaResponse::EntriesPlus`]):
    /// a caching mount's READDIRPLUS. Sent as [`MetaRequest::Caching`], each
    /// entry and its attributes are granted as a lookup's would be.
    ReadDirPlus {
        caller: Caller,
        ino: Ino,
        after: u64,
        max: u32,
    },
    /// Checks `caller` may open `ino` with `access` (R_OK/W_OK/X_OK bits).
    Access {
        caller: Caller,
        ino: Ino,
        access: u32,
    },
    /// Opens a regular file for I/O and returns its layout. The meta-server
    /// counts opens, so an unlinked file's data lives until its last release.
    Open {
        caller: Caller,
        client: ClientId,
        ino: Ino,
        /// open(2) flags (the access mode and `O_TRUNC` are checked).
        flags: i32,
    },
    /// The layout again (after an epoch change), without counting an open.
    Layout {
        ino: Ino,
    },
    /// Gives back `opens` of the client's opens of `ino` (a client tells
    /// the meta-server only at its last close of a file, handing back every
    /// open it made since; see `fs::client::opens`).
    Release {
        client: ClientId,
        ino: Ino,
        opens: u32,
    },
    /// [`MetaRequest::Release`] of several files at once: a mount's
    /// releases, sent after the closes in batches (`fs::client::releases`).
    /// Answered [`MetaResponse::HeldAgain`].
    ReleaseMany {
        client: ClientId,
        files: Vec<FileRelease>,
    },
    /// Creates the file's lock-record table (`last: None`) or appends a
    /// block after `last`; answers the table's first block. Idempotent: a
    /// request that lost a race gets the table as it is.
    GrowLockTable {
        ino: Ino,
        last: Option<RemoteAddr>,
    },
    /// The waits-for block after `last` (a block of the chain): the one
    /// already linked, else a new one, granted to every client and then
    /// linked. Answers [`MetaResponse::WaitsForBlock`]. Idempotent.
    GrowWaitsFor {
        last: RemoteAddr,
    },
    /// Clears set-user/group-ID bits as a write or truncate by a process
    /// without `CAP_FSETID` does ([`crate::types::perm_without_setid`]);
    /// `groups` are the writer's (filesystem gid and supplementary
    /// groups). Answers the attributes.
    KillSuidGid {
        ino: Ino,
        groups: Vec<u32>,
    },
    /// The registered clients.
    Clients,
    /// Gives each chunk of `chunks` that has none an extent holding bytes
    /// `[0, end)` of it (`(chunk, end)`: a write into holes), and answers
    /// every one of them as it is (an existing extent may be smaller).
    /// `ahead`: whole chunks the writer expects to fill next (a file
    /// extended sequentially), given extents while the data servers have
    /// room to spare and answered among `chunks`; those still past the end
    /// of the file at its last close anywhere are freed then (see
    /// `meta-server/src/extents.rs`, "Allocation ahead"). At most
    /// [`MAX_AHEAD_CHUNKS`].
    AllocChunks {
        ino: Ino,
        chunks: Vec<(ChunkIndex, u64)>,
        ahead: Vec<ChunkIndex>,
    },
    /// As `AllocChunks`, and moves a chunk whose extent is smaller than
    /// `end` to a bigger one. The caller holds the file's inode mutex
    /// exclusive: no I/O may use the old extent.
    GrowExtents {
        ino: Ino,
        chunks: Vec<(ChunkIndex, u64)>,
    },
    /// Allocates the chunks backing `[offset, offset + len)` and grows the
    /// size to cover it unless `keep_size`.
    Fallocate {
        ino: Ino,
        offset: u64,
        len: u64,
        keep_size: bool,
    },
    StatFs,
    /// What `citronfs status` shows.
    Status,
    SetXattr {
        caller: Caller,
        ino: Ino,
        name: Vec<u8>,
        value: Vec<u8>,
        mode: XattrMode,
    },
    GetXattr {
        caller: Caller,
        ino: Ino,
        name: Vec<u8>,
    },
    ListXattr {
        caller: Caller,
        ino: Ino,
    },
    RemoveXattr {
        caller: Caller,
        ino: Ino,
        name: Vec<u8>,
    },
    /// `request`, sent by a mount whose kernel caches what it is granted
    /// (coherent caching, `crate::grants`): the meta-server records a
    /// grant of `ttl_ms` for what a `Lookup` or `GetAttr` answers (the
    /// answer is then [`MetaResponse::Granted`], or
    /// [`MetaResponse::Absent`] for a name that is not there) and for the
    /// entries a
    /// `ReadDirPlus` lists, and a change does not
    /// invalidate `client`'s own cache (its kernel updates it from the
    /// change's answer). Never nested.
    Caching {
        client: ClientId,
        ttl_ms: u64,
        request: Box<MetaRequest>,
    },
    /// `request` (a change; itself plain or [`MetaRequest::Caching`]), applied
    /// at most once: the meta-server keeps the answer of a change it
    /// applied, journaled with it, under (`client`, `seq`), and answers a
    /// second sending of it with that answer (a client sends a change again
    /// when its connection broke as the meta-server stopped, not knowing
    /// whether it was applied). Answers of numbers below `answered_below`
    /// (every change the client still waits for is at or above it) are no
    /// longer kept. `resent`: the client sent it before (only then can an
    /// answer be kept). After NFSv4.1's sessions (RFC 8881 §2.10.6, the
    /// reply cache). Never nested.
    Once {
        client: ClientId,
        seq: ChangeSeq,
        answered_below: ChangeSeq,
        resent: bool,
        request: Box<MetaRequest>,
    },
    /// The long poll of a caching mount's invalidation thread: acknowledges
    /// every invalidation up to `acked` (its kernel has dropped what they
    /// name) and answers [`MetaResponse::Invalidations`] as soon as there
    /// are newer ones, or empty after a while.
    AwaitInvalidations {
        client: ClientId,
        acked: u64,
    },
    /// The Citron `T_wait` this client needs, in µs (its round trip to lock
    /// memory, measured again while it runs): the cluster manager publishes
    /// the largest need (`citron_lock::citron::tuning`).
    ReportLockTiming {
        client: ClientId,
        t_wait_us: u64,
    },
}

/// What a caching mount must drop from its kernel's cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Invalidation {
    /// The inode's attributes.
    Attr(Ino),
    /// The entry `name` of directory `parent`.
    Entry { parent: Ino, name: Vec<u8> },
    /// The delegation of directory `dir` (meta-server `grants`,
    /// "Delegations"): its whole listing, and the attributes of the children
    /// held with it. Only the mount kept them; the kernel never did.
    Listing(Ino),
    /// Another client looked into directory `dir`, delegated to this one
    /// (meta-server `grants`, "Late changes"): the holder keeps the
    /// delegation, but from now on sends every create and unlink there
    /// before it answers it, and sends those it answered first before it
    /// acknowledges.
    Shared(Ino),
}

/// What a caching changer holds with its change of a directory's entries
/// beyond the directory's attributes (meta-server `grants`,
/// "Delegations").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delegated {
    /// A `Create` of a directory: the new, empty directory is delegated to
    /// the changer, which from now on knows its every entry.
    pub dir: bool,
    /// The new inode's attributes (in the answer) are held with the
    /// delegation of its directory, which the changer holds: they stay
    /// valid as long as the delegation, past the creator's release.
    pub child: bool,
    /// With `child`: the new entry's cookie in its directory's listing, so
    /// that the delegation's holder can list the directory itself in the
    /// meta-server's order (a listing it began can go on at the
    /// meta-server after a revocation).
    pub cookie: Option<u64>,
}

/// What of an answer to a [`MetaRequest::Caching`] request the kernel may
/// cache for the grant's TTL.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The entry a lookup answered.
    pub entry: bool,
    /// The attributes (never those of a regular file open for writing
    /// anywhere: its size and mtime change one-sidedly).
    pub attr: bool,
    /// A lookup by the holder of the directory's delegation: the attributes
    /// are held with it, for as long as it lasts (meta-server `grants`,
    /// "Delegations").
    pub held: bool,
    /// A regular file open for writing somewhere, whose attributes are not
    /// granted: all of them but the size, the mtime, the ctime and the
    /// allocated bytes are (meta-server `grants`, "Written files"), to a
    /// client that has the file open, until its last release of it. It
    /// reads those four from the file's attribute slot and its layout each
    /// time (one verb); its kernel caches nothing.
    pub live: bool,
}

/// One file of a [`MetaRequest::ReleaseMany`]: `opens` of the client's
/// opens of `ino` handed back, as a [`MetaRequest::Release`] would.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRelease {
    pub ino: Ino,
    pub opens: u32,
}

/// One change of a [`MetaRequest::LateChanges`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LateChange {
    Create(LateCreate),
    Unlink(LateUnlink),
}

impl LateChange {
    /// The directory it changes.
    pub fn parent(&self) -> Ino {
        match self {
            LateChange::Create(c) => c.parent,
            LateChange::Unlink(u) => u.parent,
        }
    }

    /// The name it makes or removes.
    pub fn name(&self) -> &[u8] {
        match self {
            LateChange::Create(c) => &c.name,
            LateChange::Unlink(u) => &u.name,
        }
    }

    pub fn caller_mut(&mut self) -> &mut Caller {
        match self {
            LateChange::Create(c) => &mut c.caller,
            LateChange::Unlink(u) => &mut u.caller,
        }
    }
}

/// One create of a [`MetaRequest::LateChanges`]: regular file `name` in
/// `parent`, made by `caller` with `perm` at `at` (the time the mount gave
/// its times and the directory's mtime and ctime in its answer), as inode
/// `ino`, lent to the client ([`LentInodes`]) with the cookie its listing
/// entry gets; opened for the client, as `CreateOpen` does.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateCreate {
    pub caller: Caller,
    pub parent: Ino,
    pub name: Vec<u8>,
    pub ino: Ino,
    pub perm: u16,
    pub at: Timestamp,
    /// Extents allocated with the create, as an `AllocChunks` of these
    /// chunks would (each chunk and the bytes of it to hold; at most
    /// [`MAX_AHEAD_CHUNKS`]): the chunks of a write that waits for the
    /// create, so that the write needs no call of its own. Empty when no
    /// write waited. The create stands if they cannot be allocated (the
    /// write asks again and is told why).
    pub first_write: Vec<(ChunkIndex, u64)>,
}

/// Inode numbers `first_ino ..` lent to a client, `count` of them; the
/// `i`-th has cookie `first_cookie + i` in its directory's listing
/// ([`MetaRequest::LendInodes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LentInodes {
    pub first_ino: Ino,
    pub first_cookie: u64,
    pub count: u32,
}

impl LentInodes {
    /// The `i`-th inode and its cookie.
    pub fn nth(&self, i: u32) -> Option<(Ino, u64)> {
        (i < self.count).then(|| (Ino(self.first_ino.0 + i as u64), self.first_cookie + i as u64))
    }
}

/// What a late change did ([`MetaResponse::LateApplied`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LateDone {
    Unlinked,
    /// The create's open: the layout, with the file's lock memory.
    Created(FileLayout),
}

/// One unlink of a [`MetaRequest::LateChanges`]: `name` of `parent`,
/// removed by `caller` at `at` (the time the mount gave the directory's
/// mtime and ctime in its answer), if it still names `ino`, the inode the
/// mount unlinked; else it is refused ([`FsError::NotFound`]): what the
/// mount removed is no longer there, and whatever took the name since is
/// not its to remove.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateUnlink {
    pub caller: Caller,
    pub parent: Ino,
    pub name: Vec<u8>,
    pub ino: Ino,
    pub at: Timestamp,
}

/// A released file's attributes, held again with the releasing client's
/// delegation of `dir` (see [`MetaResponse::Held`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldAgain {
    pub dir: Ino,
    pub attr: Attr,
}

/// The listing cookie of `.` in every directory.
pub const DOT_COOKIE: u64 = 1;
/// The listing cookie of `..`; a directory's names come after it.
pub const DOTDOT_COOKIE: u64 = 2;

/// An entry of a `ReadDirPlus` answer: what a lookup of it would answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryPlus {
    pub entry: DirEntry,
    pub attr: Attr,
    /// Granted to a caching client: the entry and its attributes together
    /// or neither (the kernel takes one TTL for both), never for "." and
    /// "..", which the kernel does not cache from a listing.
    pub grant: Grant,
}

impl MetaRequest {
    /// The request itself, out of its [`MetaRequest::Once`] and
    /// [`MetaRequest::Caching`] wrappers.
    pub fn inner(&self) -> &MetaRequest {
        match self {
            MetaRequest::Once { request, .. } => request.inner(),
            MetaRequest::Caching { request, .. } => request,
            other => other,
        }
    }

    /// Whether the request is a change a client sends as
    /// [`MetaRequest::Once`]: one that changes the namespace, or what the
    /// meta-server hands out (opens, loans, allocations), so that asking it
    /// twice is not the same as asking it once. Registrations, renewals and
    /// the invalidation poll are the session itself, not changes in it.
    pub fn asked_once(&self) -> bool {
        use MetaRequest as R;
        matches!(
            self.inner(),
            R::SetAttr { .. }
                | R::Create { .. }
                | R::CreateOpen { .. }
                | R::Symlink { .. }
                | R::Link { .. }
                | R::Unlink { .. }
                | R::LateChanges { .. }
                | R::LendInodes { .. }
                | R::Rmdir { .. }
                | R::Rename { .. }
                | R::Open { .. }
                | R::Release { .. }
                | R::ReleaseMany { .. }
                | R::GrowLockTable { .. }
                | R::GrowWaitsFor { .. }
                | R::KillSuidGid { .. }
                | R::AllocChunks { .. }
                | R::GrowExtents { .. }
                | R::Fallocate { .. }
                | R::SetXattr { .. }
                | R::RemoveXattr { .. }
        )
    }

    /// Whether the request only reads: answered twice, it changes nothing
    /// (a cache grant it asks for is granted again), so one whose answer
    /// was lost with a connection may be sent again.
    pub fn only_reads(&self) -> bool {
        use MetaRequest as R;
        matches!(
            self.inner(),
            R::Lookup { .. }
                | R::GetAttr { .. }
                | R::ReadLink { .. }
                | R::ReadDir { .. }
                | R::ReadDirPlus { .. }
                | R::Access { .. }
                | R::Layout { .. }
                | R::GetXattr { .. }
                | R::ListXattr { .. }
                | R::StatFs
                | R::Status
                | R::Clients
                | R::DataServers
        )
    }
}

/// How `rename` treats an existing target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RenameMode {
    /// Replace it (POSIX rename).
    Replace,
    /// Fail with EEXIST (RENAME_NOREPLACE).
    NoReplace,
    /// Swap the two entries (RENAME_EXCHANGE).
    Exchange,
}

/// `setxattr` flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum XattrMode {
    Any,
    /// XATTR_CREATE: fail if it exists.
    Create,
    /// XATTR_REPLACE: fail if it does not.
    Replace,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum MetaResponse {
    Registered(ClusterInfo),
    /// A client's reclaim after a restart: its registration, and each
    /// reclaimed open's layout (whose area may name a new range lock) or
    /// why it could not be taken back.
    Reclaimed(ClusterInfo, Vec<(Ino, Result<FileLayout, FsError>)>),
    /// The data server's id, and the file system its memory now belongs to.
    DataServerRegistered(DataServerId, crate::types::FsId),
    DataServers(Vec<DataServerInfo>),
    Attr(Attr),
    /// The answer to a `Lookup` or `GetAttr` sent as
    /// [`MetaRequest::Caching`], with what of it is granted.
    Granted(Attr, Grant),
    /// The answer to a `Lookup` sent as [`MetaRequest::Caching`] that
    /// found no such name: its absence is granted as the entry (its kernel
    /// may cache a negative entry for the grant's TTL; whoever makes the
    /// name calls the client back first, meta-server `grants`, "Absent
    /// names"). A lookup sent plainly answers `FsError::NotFound`.
    Absent,
    /// The answer to an `Unlink`: the inode whose name it removed (its
    /// link count and ctime changed; a caching changer drops what it kept
    /// of it).
    Removed(Ino),
    /// The answer to [`MetaRequest::LateChanges`]: each change's outcome,
    /// in order.
    LateApplied(Vec<Result<LateDone, FsError>>),
    /// The answer to [`MetaRequest::LendInodes`].
    Lent(LentInodes),
    /// Invalidations numbered up to `through` (the next `acked`).
    /// `renewed`: the poll renewed the client's delegations when it arrived
    /// and `items` holds every invalidation queued before this answer (none
    /// left for the next poll), so a delegation `items` does not revoke is
    /// good for the client's TTL from when it sent the poll.
    Invalidations {
        through: u64,
        items: Vec<Invalidation>,
        renewed: bool,
    },
    Entries(Vec<DirEntry>),
    /// The answer to a `ReadDirPlus`.
    EntriesPlus(Vec<EntryPlus>),
    Target(Vec<u8>),
    Layout(FileLayout),
    Opened(Attr, FileLayout),
    /// A non-exclusive `CreateOpen` found a regular file and opened it.
    OpenedExisting(Attr, FileLayout),
    /// The answer to a change of a directory's entries (`Create`,
    /// `CreateOpen`, `Symlink`, `Unlink`, `Rmdir`) sent as
    /// [`MetaRequest::Caching`]: `answer` as without caching, and the
    /// directory's attributes after the change, granted to the changer
    /// (its kernel dropped them; the mount answers the next `GETATTR` from
    /// these). `created`: a `CreateOpen` made a new regular file, whose
    /// attributes in `answer` are granted to the changer until its last
    /// release of the file (meta-server `grants`, "Creators"). `delegated`:
    /// what the changer holds as delegations.
    ParentGranted {
        answer: Box<MetaResponse>,
        /// `None` while the directory's attributes are contended (several
        /// clients change it in turn): granted to no one.
        parent: Option<Attr>,
        created: bool,
        delegated: Delegated,
    },
    /// A caching client's last release of a regular file it made in a
    /// directory delegated to it, which nobody has open for writing any
    /// more: the file's attributes now, held again with the delegation of
    /// `dir` (meta-server `grants`, "Delegations").
    Held {
        dir: Ino,
        attr: Attr,
    },
    /// The answer to [`MetaRequest::ReleaseMany`]: what [`MetaResponse::Held`]
    /// would have answered each release that held a file's attributes again.
    HeldAgain(Vec<HeldAgain>),
    Chunks(Allocated),
    Stats(FsStats),
    Status(Box<crate::status::ClusterStatus>),
    LockTable(RemoteAddr),
    WaitsForBlock(RemoteAddr),
    Clients(Vec<ClientInfo>),
    Xattr(Vec<u8>),
    XattrNames(Vec<Vec<u8>>),
    Done,
    Failed(FsError),
}
