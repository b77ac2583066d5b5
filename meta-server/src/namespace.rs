//! The namespace: inodes, directories, links, symlinks, xattrs, and the
//! chunk maps of regular files. Pure metadata logic under one lock held by the
//! service; the only memory it touches is the attribute slots it owns (sizes
//! and mtimes that clients update one-sidedly) through local atomics.
//!
//! Permissions are enforced by the kernel (`default_permissions` on every
//! mount): the namespace checks what only it can know — names, types,
//! emptiness, loops, limits.
//!
//! Its two other parts: [`opens`], the opens of regular files and the lock
//! memory that follows them ([`crate::lock_areas`]), and [`data`], the
//! extents that hold a file's bytes ([`crate::extents`]).

mod data;
mod opens;

pub use data::{ExtentPlan, ExtentStep, ZeroRange};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use citron_lock::alock::{AlockHost, AlockLocal};
use citron_lock::citron::host::LockMemoryHost;
use citron_lock::rdma::{RegionMemory, RemoteAddr};
use citronfs_core::layout::ChunkGeometry;
use citronfs_core::locks::LockArea;
use citronfs_core::proto::{AttrSlot, RenameMode, XattrMode, DOTDOT_COOKIE, DOT_COOKIE};
use citronfs_core::types::{
    perm_without_setid, Attr, Caller, ChunkIndex, ChunkLoc, ClientId, DataServerId, DirEntry, FileKind, Ino,
    SetAttr, Timestamp, NAME_MAX, SYMLINK_MAX, XATTR_SIZE_MAX,
};
use citronfs_core::FsError;

use crate::extents::ExtentAllocator;
use crate::journal::image::Change;
use crate::lock_areas::{FileLockMemory, LockAreas};
use crate::reclaim::{Cause, Reclamation};

mod lending;
mod memory;
mod restore;
pub use restore::DataServerSpace;
mod slots;
mod table;
pub use lending::{Lent, MAX_LOAN};
pub use memory::extent_memory;
use slots::Slots;

/// Names' cookies start after those of "." and "..".
const FIRST_COOKIE: u64 = DOTDOT_COOKIE + 1;

struct Dir {
    parent: Ino,
    by_name: HashMap<Vec<u8>, (u64, Ino)>,
    /// The same entries in listing order, each with its inode, so a
    /// listing looks nothing up by name.
    by_cookie: BTreeMap<u64, (Vec<u8>, Ino)>,
}

struct RegularFile {
    slot: AttrSlot,
    chunks: BTreeMap<ChunkIndex, ChunkLoc>,
    /// Bytes of the extents in `chunks`.
    allocated: u64,
    epoch: u64,
    /// Opens by client; the data lives while any remains, even at nlink 0.
    opens: HashMap<ClientId, u32>,
    /// Lock memory, while the file is open somewhere or holds lock records.
    locks: Option<FileLockMemory>,
    /// Chunks of `chunks` allocated ahead of a sequential writer and not
    /// asked for since: freed at the last close if still past the end
    /// ([`Namespace::trim_ahead`]).
    ahead: BTreeSet<ChunkIndex>,
}

enum Content {
    Dir(Dir),
    File(RegularFile),
    Symlink(Vec<u8>),
    Special,
}

struct Inode {
    attr: Attr,
    content: Content,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The fingerprint of the image the journal last recorded of this
    /// inode (`None`: not recorded since it was made or restored).
    journaled: Option<u64>,
}

/// What `create` makes.
pub struct NewInode {
    pub kind: FileKind,
    pub perm: u16,
    pub rdev: u32,
    /// The target, for a symlink.
    pub symlink_target: Option<Vec<u8>>,
}

pub struct Namespace {
    /// Every inode; every change of one passes through the table, which
    /// hands it to the journal ([`table`]).
    inodes: table::InodeTable,
    /// Data servers joined, lost or found since the last batch.
    server_changes: Vec<Change>,
    /// The next client id ([`Namespace::new_client_id`]).
    next_client: u64,
    /// Clients registered and not gone: journaled, so that a restarted
    /// meta-server knows whom to wait for ([`Namespace::client_joined`]).
    clients: std::collections::BTreeSet<ClientId>,
    /// The answers of changes kept for a client that asks again
    /// ([`crate::journal::kept_answers`]).
    kept: crate::journal::kept_answers::KeptAnswers,
    /// The counters (inodes, cookies, clients) as the journal last
    /// recorded them.
    journaled_counters: (u64, u64, u64),
    /// Inodes with no link and no open, kept for `orphan_grace` before they
    /// are freed: the kernel may open an inode it looked up just before a
    /// rename replaced it, and that open must find it (POSIX gives it the old
    /// file). See [`Namespace::sweep_orphans`].
    orphans: std::collections::VecDeque<(Ino, std::time::Instant)>,
    orphan_grace: std::time::Duration,
    next_ino: u64,
    next_cookie: u64,
    slots: Slots,
    /// Inodes lent to clients for their late creates, each with its
    /// cookie and a slot kept for it ([`lending`]).
    lent: HashMap<ClientId, HashMap<Ino, u64>>,
    pub extents: ExtentAllocator,
    geometry: ChunkGeometry,
    /// Files' lock memory (areas, trees, record tables).
    locks: LockAreas,
    /// Where extents and lock memory are given back ([`crate::reclaim`]).
    reclaim: Arc<Reclamation>,
    /// The meta-server's side of every file's attribute ALock.
    attr_host: AlockHost,
    /// This namespace's handle on it (taken out while in use).
    attr_lock: Option<AlockLocal>,
    /// Data servers that ever joined, with the space they had.
    data_servers: BTreeMap<DataServerId, crate::journal::image::DataServerImage>,
    /// Data servers that went away with the file data in their memory.
    lost_servers: std::collections::HashSet<DataServerId>,
    /// Files whose attribute ALock the service holds for the request at
    /// hand (taken before the namespace mutex: `MetaService::with_attr_locked`).
    pub attr_held: std::collections::HashSet<Ino>,
    /// Files whose attribute ALock address a request of the service took
    /// and still uses (waits on, holds or releases), with how many do: their
    /// lock memory is not freed meanwhile ([`Namespace::pin_attr_lock`]).
    attr_pins: std::collections::HashMap<Ino, u32>,
}

/// The Citron tree host of the meta-server (DESIGN.md §4 "Tree growth"):
/// every file's tree is an instance of it, created when the file is opened
/// and has no lock memory, destroyed when the file is idle again; it runs
/// the instances' scale-ups.
#[derive(Clone)]
pub struct TreeHosting {
    pub host: Arc<LockMemoryHost>,
    /// Where clients reach it (its [`citron_lock::citron::host::TreeHostServer`]).
    pub addr: std::net::SocketAddr,
    /// The deepest tree a file's scale-ups may make.
    pub max_depth: u32,
}

/// How the namespace gives files their lock memory.
pub struct FileLocking {
    pub areas: LockAreas,
    /// The meta-server's cohort of the attribute ALocks (in the lock region).
    pub attr_host: AlockHost,
}

/// A file whose lock-record table exists: what cleanup after a dead client
/// needs to visit.
#[derive(Clone, Copy, Debug)]
pub struct LockTableRef {
    pub ino: Ino,
    pub area: LockArea,
    pub first_block: RemoteAddr,
}

fn check_name(name: &[u8]) -> Result<(), FsError> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(FsError::Invalid(format!("bad name {:?}", String::from_utf8_lossy(name))));
    }
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

impl Namespace {
    /// A namespace with an empty root directory owned by `root_owner`.
    pub fn new(
        slot_memory: Arc<RegionMemory>,
        extents: ExtentAllocator,
        locking: FileLocking,
        reclaim: Arc<Reclamation>,
        root_owner: Caller,
        orphan_grace: std::time::Duration,
    ) -> Self {
        let geometry = ChunkGeometry::new(extents.chunk_size()).expect("chunk size validated by the server");
        let mut ns = Self {
            inodes: table::InodeTable::default(),
            server_changes: Vec::new(),
            next_client: 1,
            clients: std::collections::BTreeSet::new(),
            kept: Default::default(),
            journaled_counters: (0, 0, 0),
            orphans: std::collections::VecDeque::new(),
            orphan_grace,
            next_ino: Ino::ROOT.0 + 1,
            next_cookie: FIRST_COOKIE,
            slots: Slots::new(slot_memory),
            lent: HashMap::new(),
            extents,
            geometry,
            locks: locking.areas,
            reclaim,
            attr_lock: locking.attr_host.local().ok(),
            attr_host: locking.attr_host,
            data_servers: BTreeMap::new(),
            lost_servers: std::collections::HashSet::new(),
            attr_held: std::collections::HashSet::new(),
            attr_pins: std::collections::HashMap::new(),
        };
        let now = Timestamp::now();
        let root = Inode {
            attr: Attr::fresh(Ino::ROOT, FileKind::Dir, 0o755, root_owner, now),
            content: Content::Dir(Dir {
                parent: Ino::ROOT,
                by_name: HashMap::new(),
                by_cookie: BTreeMap::new(),
            }),
            xattrs: BTreeMap::new(),
            journaled: None,
        };
        ns.inodes.insert(Ino::ROOT, root);
        ns
    }

    fn inode(&self, ino: Ino) -> Result<&Inode, FsError> {
        self.inodes.get(&ino).ok_or(FsError::NotFound)
    }

    fn inode_mut(&mut self, ino: Ino) -> Result<&mut Inode, FsError> {
        self.inodes.get_mut(&ino).ok_or(FsError::NotFound)
    }

    fn dir(&self, ino: Ino) -> Result<&Dir, FsError> {
        match &self.inode(ino)?.content {
            Content::Dir(d) => Ok(d),
            _ => Err(FsError::NotDir),
        }
    }

    /// Whether `ino` is a directory.
    pub fn is_dir(&self, ino: Ino) -> bool {
        self.dir(ino).is_ok()
    }

    fn dir_mut(&mut self, ino: Ino) -> Result<&mut Dir, FsError> {
        match &mut self.inode_mut(ino)?.content {
            Content::Dir(d) => Ok(d),
            _ => Err(FsError::NotDir),
        }
    }

    /// The attributes, with a regular file's size and mtime read from its slot.
    pub fn attr(&self, ino: Ino) -> Result<Attr, FsError> {
        Ok(self.attr_of(self.inode(ino)?))
    }

    fn attr_of(&self, inode: &Inode) -> Attr {
        let mut attr = inode.attr.clone();
        match &inode.content {
            Content::File(f) => {
                attr.size = self.slots.word(f.slot.size()).load(SeqCst);
                attr.allocated = f.allocated;
                // The slot holds the file's mtime once anyone wrote or set
                // it (clients store it one-sidedly after a write); a write
                // changes the ctime too.
                let mtime = self.slots.word(f.slot.mtime()).load(SeqCst);
                if mtime != 0 {
                    let m = Timestamp::from_nanos(mtime);
                    attr.mtime = m;
                    attr.ctime = attr.ctime.max(m);
                }
            }
            Content::Dir(d) => attr.size = d.by_name.len() as u64,
            Content::Symlink(t) => attr.size = t.len() as u64,
            Content::Special => {}
        }
        attr
    }

    pub fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr, FsError> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let dir = self.dir(parent)?;
        let ino = match name {
            b"." => parent,
            b".." => dir.parent,
            _ => dir.by_name.get(name).ok_or(FsError::NotFound)?.1,
        };
        self.attr(ino)
    }

    /// The cookie of `name` in directory `dir`'s listing, if it is there.
    pub fn cookie(&self, dir: Ino, name: &[u8]) -> Option<u64> {
        self.dir(dir).ok()?.by_name.get(name).map(|&(cookie, _)| cookie)
    }

    fn link_entry(&mut self, parent: Ino, name: &[u8], ino: Ino) -> Result<(), FsError> {
        self.next_cookie += 1;
        self.link_entry_as(parent, name, ino, self.next_cookie - 1)
    }

    fn link_entry_as(&mut self, parent: Ino, name: &[u8], ino: Ino, cookie: u64) -> Result<(), FsError> {
        let dir = self.dir_mut(parent)?;
        dir.by_name.insert(name.to_vec(), (cookie, ino));
        dir.by_cookie.insert(cookie, (name.to_vec(), ino));
        self.inodes.entry_changed(parent, name, Some((cookie, ino)));
        Ok(())
    }

    fn unlink_entry(&mut self, parent: Ino, name: &[u8]) -> Result<Ino, FsError> {
        let dir = self.dir_mut(parent)?;
        let (cookie, ino) = dir.by_name.remove(name).ok_or(FsError::NotFound)?;
        dir.by_cookie.remove(&cookie);
        self.inodes.entry_changed(parent, name, None);
        Ok(ino)
    }

    fn touch_dir(&mut self, dir: Ino, nlink_delta: i32) {
        self.touch_dir_at(dir, nlink_delta, Timestamp::now())
    }

    fn touch_dir_at(&mut self, dir: Ino, nlink_delta: i32, now: Timestamp) {
        if let Some(d) = self.inodes.get_mut(&dir) {
            d.attr.mtime = now;
            d.attr.ctime = now;
            d.attr.nlink = d.attr.nlink.saturating_add_signed(nlink_delta);
        }
    }

    pub fn create(
        &mut self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        new: NewInode,
    ) -> Result<Attr, FsError> {
        self.create_as(caller, parent, name, new, None, Timestamp::now())
    }

    /// [`Self::create`] made at `now`, as `lent` (an inode lent to a client
    /// with its cookie, whose slot is kept: [`lending`]) or as the next
    /// inode.
    fn create_as(
        &mut self,
        caller: Caller,
        parent: Ino,
        name: &[u8],
        new: NewInode,
        lent: Option<(Ino, u64)>,
        now: Timestamp,
    ) -> Result<Attr, FsError> {
        let NewInode { kind, perm, rdev, symlink_target } = new;
        check_name(name)?;
        let pdir = self.dir(parent)?;
        if pdir.by_name.contains_key(name) {
            return Err(FsError::Exists);
        }
        let parent_attr = &self.inode(parent)?.attr;
        // Set-group-id directories pass their group on (BSD semantics).
        let gid = if parent_attr.perm & 0o2000 != 0 { parent_attr.gid } else { caller.gid };
        let mut perm = perm & 0o7777;
        if kind == FileKind::Dir && parent_attr.perm & 0o2000 != 0 {
            perm |= 0o2000;
        }
        let content = match kind {
            FileKind::Dir => {
                Content::Dir(Dir { parent, by_name: HashMap::new(), by_cookie: BTreeMap::new() })
            }
            FileKind::File => Content::File(RegularFile {
                slot: match lent {
                    Some(_) => self.slots.allocate_kept(),
                    None => match self.slots.allocate() {
                        // Unlinked files in their grace hold slots: they go now.
                        Err(FsError::NoSpace) if self.free_orphans_now() => self.slots.allocate()?,
                        slot => slot?,
                    },
                },
                chunks: BTreeMap::new(),
                allocated: 0,
                epoch: 0,
                opens: HashMap::new(),
                locks: None,
                ahead: BTreeSet::new(),
            }),
            FileKind::Symlink => {
                let target =
                    symlink_target.ok_or_else(|| FsError::Invalid("symlink without target".into()))?;
                if target.is_empty() || target.len() > SYMLINK_MAX {
                    return Err(if target.is_empty() { FsError::NotFound } else { FsError::NameTooLong });
                }
                Content::Symlink(target)
            }
            _ => Content::Special,
        };
        let (ino, cookie) = match lent {
            Some((ino, cookie)) => (ino, cookie),
            None => {
                self.next_ino += 1;
                self.next_cookie += 1;
                (Ino(self.next_ino - 1), self.next_cookie - 1)
            }
        };
        let attr = Attr {
            ino,
            kind,
            perm: if kind == FileKind::Symlink { 0o777 } else { perm },
            uid: caller.uid,
            gid,
            size: 0,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            rdev: if matches!(kind, FileKind::CharDevice | FileKind::BlockDevice) { rdev } else { 0 },
            allocated: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
        };
        self.inodes.insert(ino, Inode { attr, content, xattrs: BTreeMap::new(), journaled: None });
        self.mirror_perm(ino);
        self.link_entry_as(parent, name, ino, cookie)?;
        self.touch_dir_at(parent, if kind == FileKind::Dir { 1 } else { 0 }, now);
        self.attr(ino)
    }

    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        match &self.inode(ino)?.content {
            Content::Symlink(t) => Ok(t.clone()),
            _ => Err(FsError::Invalid("not a symlink".into())),
        }
    }

    pub fn link(&mut self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<Attr, FsError> {
        check_name(new_name)?;
        if self.inode(ino)?.attr.kind == FileKind::Dir {
            return Err(FsError::Perm);
        }
        if self.dir(new_parent)?.by_name.contains_key(new_name) {
            return Err(FsError::Exists);
        }
        self.link_entry(new_parent, new_name, ino)?;
        let inode = self.inode_mut(ino)?;
        inode.attr.nlink += 1;
        inode.attr.ctime = Timestamp::now();
        self.touch_dir(new_parent, 0);
        self.attr(ino)
    }

    /// Drops one link of `ino`; frees it when no link and no open remains.
    fn drop_link(&mut self, ino: Ino) {
        self.drop_link_at(ino, Timestamp::now())
    }

    fn drop_link_at(&mut self, ino: Ino, now: Timestamp) {
        let Some(inode) = self.inodes.get_mut(&ino) else { return };
        inode.attr.nlink = inode.attr.nlink.saturating_sub(1);
        inode.attr.ctime = now;
        self.maybe_free(ino);
    }

    fn maybe_free(&mut self, ino: Ino) {
        let Some(inode) = self.inodes.get(&ino) else { return };
        let dead = match &inode.content {
            Content::File(f) => inode.attr.nlink == 0 && f.opens.is_empty(),
            Content::Dir(_) => inode.attr.nlink <= 1,
            _ => inode.attr.nlink == 0,
        };
        if !dead {
            return;
        }
        if matches!(inode.content, Content::File(_)) {
            self.orphans.push_back((ino, std::time::Instant::now()));
            return;
        }
        self.inodes.remove(&ino);
    }

    /// Frees the orphans whose grace has passed and that are still unlinked
    /// and unopened.
    pub fn sweep_orphans(&mut self) {
        self.sweep_orphans_past(self.orphan_grace);
    }

    /// Bytes of extents held by orphans (each counted once).
    fn orphan_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.orphans
            .iter()
            .filter(|(ino, _)| seen.insert(*ino))
            .filter_map(|(ino, _)| match self.inodes.get(ino) {
                Some(Inode { attr, content: Content::File(f), .. })
                    if attr.nlink == 0 && f.opens.is_empty() =>
                {
                    Some(f.allocated)
                }
                _ => None,
            })
            .sum()
    }

    /// Frees every orphan that is still unlinked and unopened, grace or not:
    /// the data servers are full and their space is wanted now. (An open
    /// that raced the unlink of one of them answers ENOENT, as it would had
    /// the lookup come a moment later.) Returns whether any was freed.
    pub fn free_orphans_now(&mut self) -> bool {
        let before = self.orphans.len();
        self.sweep_orphans_past(std::time::Duration::ZERO);
        self.orphans.len() < before
    }

    fn sweep_orphans_past(&mut self, grace: std::time::Duration) {
        let mut pinned = Vec::new();
        while let Some(&(ino, since)) = self.orphans.front() {
            if since.elapsed() < grace {
                break;
            }
            self.orphans.pop_front();
            let still_dead = matches!(self.inodes.get(&ino), Some(Inode { attr, content: Content::File(f), .. })
                if attr.nlink == 0 && f.opens.is_empty());
            if still_dead && self.attr_pins.contains_key(&ino) {
                // A request uses its attribute ALock: freeing (zeroing) the
                // lock under it would break the lock; the next sweep frees it.
                pinned.push((ino, std::time::Instant::now()));
            } else if still_dead {
                self.free_file(ino);
            }
        }
        self.orphans.extend(pinned);
    }

    /// Frees a regular file that has no link and no open: nobody can reach
    /// its extents or lock memory any more (see [`crate::reclaim`]).
    fn free_file(&mut self, ino: Ino) {
        if let Some(Inode { content: Content::File(f), .. }) = self.inodes.remove(&ino) {
            for (_, loc) in f.chunks {
                self.reclaim.extent(&mut self.extents, loc, Cause::InodeFreed);
            }
            self.slots.free(f.slot);
            if let Some(locks) = f.locks {
                self.reclaim.lock_memory(&mut self.locks, ino, locks, Cause::InodeFreed);
            }
        }
    }

    pub fn unlink(&mut self, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        self.unlink_at(parent, name, Timestamp::now())
    }

    /// [`Self::unlink`] made at `at`: the directory's mtime and ctime and
    /// the file's ctime become `at` (a late unlink, answered by its mount
    /// at `at` before it was sent).
    pub fn unlink_at(&mut self, parent: Ino, name: &[u8], at: Timestamp) -> Result<(), FsError> {
        let ino = self.dir(parent)?.by_name.get(name).ok_or(FsError::NotFound)?.1;
        if self.inode(ino)?.attr.kind == FileKind::Dir {
            return Err(FsError::IsDir);
        }
        self.unlink_entry(parent, name)?;
        self.touch_dir_at(parent, 0, at);
        self.drop_link_at(ino, at);
        Ok(())
    }

    pub fn rmdir(&mut self, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        if name == b"." {
            return Err(FsError::Invalid("rmdir of \".\"".into()));
        }
        if name == b".." {
            return Err(FsError::NotEmpty);
        }
        let ino = self.dir(parent)?.by_name.get(name).ok_or(FsError::NotFound)?.1;
        if !self.dir(ino)?.by_name.is_empty() {
            return Err(FsError::NotEmpty);
        }
        self.unlink_entry(parent, name)?;
        self.touch_dir(parent, -1);
        self.inodes.remove(&ino);
        Ok(())
    }

    /// Whether `ancestor` is `ino` or one of its ancestors.
    fn is_ancestor(&self, ancestor: Ino, mut ino: Ino) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            match self.dir(ino) {
                Ok(d) if d.parent != ino => ino = d.parent,
                _ => return false,
            }
        }
    }

    pub fn rename(
        &mut self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        mode: RenameMode,
    ) -> Result<(), FsError> {
        check_name(new_name)?;
        let src = self.dir(parent)?.by_name.get(name).ok_or(FsError::NotFound)?.1;
        let dst = self.dir(new_parent)?.by_name.get(new_name).map(|e| e.1);
        let src_is_dir = self.inode(src)?.attr.kind == FileKind::Dir;
        if src_is_dir && self.is_ancestor(src, new_parent) {
            return Err(FsError::Invalid("cannot move a directory into itself".into()));
        }
        if dst == Some(src) {
            return Ok(()); // same inode: POSIX says do nothing
        }
        match (mode, dst) {
            (RenameMode::NoReplace, Some(_)) => return Err(FsError::Exists),
            (RenameMode::Exchange, None) => return Err(FsError::NotFound),
            (RenameMode::Exchange, Some(dst)) => {
                let dst_is_dir = self.inode(dst)?.attr.kind == FileKind::Dir;
                if dst_is_dir && self.is_ancestor(dst, parent) {
                    return Err(FsError::Invalid("cannot move a directory into itself".into()));
                }
                // Swap the targets of the two entries in place (cookies stay).
                self.dir_mut(parent)?.by_name.get_mut(name).expect("looked up above").1 = dst;
                self.dir_mut(new_parent)?.by_name.get_mut(new_name).expect("looked up above").1 = src;
                if src_is_dir {
                    self.dir_mut(src)?.parent = new_parent;
                }
                if dst_is_dir {
                    self.dir_mut(dst)?.parent = parent;
                }
                let delta = i32::from(src_is_dir) - i32::from(dst_is_dir);
                self.touch_dir(parent, -delta);
                self.touch_dir(new_parent, delta);
                return Ok(());
            }
            _ => {}
        }
        if let Some(dst) = dst {
            let dst_is_dir = self.inode(dst)?.attr.kind == FileKind::Dir;
            match (src_is_dir, dst_is_dir) {
                (true, false) => return Err(FsError::NotDir),
                (false, true) => return Err(FsError::IsDir),
                (true, true) if !self.dir(dst)?.by_name.is_empty() => return Err(FsError::NotEmpty),
                _ => {}
            }
            self.unlink_entry(new_parent, new_name)?;
            if dst_is_dir {
                self.touch_dir(new_parent, -1);
                self.inodes.remove(&dst);
            } else {
                self.drop_link(dst);
            }
        }
        self.unlink_entry(parent, name)?;
        self.link_entry(new_parent, new_name, src)?;
        if src_is_dir {
            self.dir_mut(src)?.parent = new_parent;
            self.touch_dir(parent, -1);
            self.touch_dir(new_parent, 1);
        } else {
            self.touch_dir(parent, 0);
            self.touch_dir(new_parent, 0);
        }
        self.inode_mut(src)?.attr.ctime = Timestamp::now();
        Ok(())
    }

    /// Entries with cookies greater than `after`, at most `max`, with "." and
    /// ".." first (cookies 1 and 2).
    pub fn readdir(&self, ino: Ino, after: u64, max: u32) -> Result<Vec<DirEntry>, FsError> {
        Ok(self.listing(ino, after, max)?.into_iter().map(|(entry, _)| entry).collect())
    }

    /// As [`Namespace::readdir`], each entry with its attributes (found
    /// with the same inode lookup).
    pub fn readdir_plus(&self, ino: Ino, after: u64, max: u32) -> Result<Vec<(DirEntry, Attr)>, FsError> {
        // An entry whose inode is gone cannot be listed with attributes
        // (never happens under the namespace mutex).
        self.listing(ino, after, max)?
            .into_iter()
            .map(|(entry, inode)| Ok((entry, self.attr_of(inode.ok_or(FsError::NotFound)?))))
            .collect()
    }

    /// Entries of `ino` after cookie `after`, at most `max`, each with its
    /// inode (`None` if it is gone).
    fn listing(&self, ino: Ino, after: u64, max: u32) -> Result<Vec<(DirEntry, Option<&Inode>)>, FsError> {
        let dir = self.dir(ino)?;
        let dots = [(DOT_COOKIE, ino, &b"."[..]), (DOTDOT_COOKIE, dir.parent, &b".."[..])]
            .into_iter()
            .filter(|(cookie, ..)| after < *cookie)
            .map(|(cookie, ino, name)| {
                (DirEntry { cookie, ino, kind: FileKind::Dir, name: name.to_vec() }, self.inode(ino).ok())
            });
        let children = dir.by_cookie.range(after.max(DOTDOT_COOKIE) + 1..).map(|(&cookie, (name, child))| {
            let inode = self.inode(*child).ok();
            let kind = inode.map_or(FileKind::File, |i| i.attr.kind);
            (DirEntry { cookie, ino: *child, kind, name: name.clone() }, inode)
        });
        Ok(dots.chain(children).take(max as usize).collect())
    }

    fn file(&self, ino: Ino) -> Result<&RegularFile, FsError> {
        match &self.inode(ino)?.content {
            Content::File(f) => Ok(f),
            Content::Dir(_) => Err(FsError::IsDir),
            _ => Err(FsError::Invalid("not a regular file".into())),
        }
    }

    fn file_mut(&mut self, ino: Ino) -> Result<&mut RegularFile, FsError> {
        match &mut self.inode_mut(ino)?.content {
            Content::File(f) => Ok(f),
            Content::Dir(_) => Err(FsError::IsDir),
            _ => Err(FsError::Invalid("not a regular file".into())),
        }
    }

    /// The attribute ALock of `ino`, if the file has lock memory (a file
    /// without any is open on no client, so none could race).
    pub fn attr_lock_of(&self, ino: Ino) -> Option<RemoteAddr> {
        self.file(ino).ok().and_then(|f| f.locks.as_ref()).map(|l| l.area.attr_lock())
    }

    /// [`Namespace::attr_lock_of`], with the file's lock memory kept until
    /// [`Namespace::unpin_attr_lock`]: the service takes the lock after it
    /// let go of the namespace mutex and holds it across several takings of
    /// it, and a last close (or a fence, or the orphan sweep) in between
    /// would free the memory, i.e. zero the lock's words under its waiter
    /// or holder. A holder whose `tail_l` was zeroed cannot release (its
    /// CAS fails and it waits for a successor that does not exist: the
    /// release stalled for the give-up time and poisoned its handle), and a
    /// zeroed lock reused by another file lets two threads in at once.
    pub fn pin_attr_lock(&mut self, ino: Ino) -> Option<RemoteAddr> {
        let lock = self.attr_lock_of(ino)?;
        *self.attr_pins.entry(ino).or_default() += 1;
        Some(lock)
    }

    /// Runs `f` holding `ino`'s attribute ALock (if the file has lock
    /// memory; a file without any is open on no client, so none could
    /// race), so the meta-server's changes to the size and mtime words and
    /// clients' one-sided ones exclude each other (DESIGN.md §4). The
    /// service takes the lock before it locks the namespace (`attr_held`),
    /// so no request waits for it under the namespace mutex; the wait below
    /// is what a caller that did not gets.
    ///
    /// ALock has no recovery of its own (the paper assumes no failures): a
    /// client that died holding or queued on the lock would block it, so the
    /// wait is bounded (`AlockConfig::give_up`, set from the lease), and on
    /// timeout the change goes ahead — only a dead client can hold the lock
    /// that long, since live ones hold it for one batch of verbs — with a
    /// fresh handle (the timed-out one is poisoned by the lock crate).
    fn with_attr_lock<R>(&mut self, ino: Ino, f: impl FnOnce(&mut Self) -> R) -> R {
        if self.attr_held.contains(&ino) {
            return f(self);
        }
        let lock = match &self.file(ino).ok().and_then(|f| f.locks.as_ref()) {
            Some(l) => l.area.attr_lock(),
            None => return f(self),
        };
        let Some(mut local) = self.attr_lock.take() else {
            log::error!("no ALock handle left for the attribute words; changing inode {} unlocked", ino.0);
            return f(self);
        };
        let granted = match local.lock(lock) {
            Ok(guard) => {
                let r = f(self);
                if let Err(e) = guard.unlock() {
                    log::error!("releasing the attribute ALock of inode {}: {e}", ino.0);
                }
                Ok(r)
            }
            Err(e) => Err((e, f)),
        };
        let result = match granted {
            Ok(r) => r,
            Err((e, f)) => {
                log::error!("attribute ALock of inode {} not granted ({e}); a dead client holds it", ino.0);
                let r = f(self);
                match self.attr_host.local() {
                    Ok(fresh) => local = fresh,
                    Err(e) => {
                        log::error!("no ALock descriptor left: {e}");
                        return r;
                    }
                }
                r
            }
        };
        self.attr_lock = Some(local);
        result
    }

    pub fn setattr(&mut self, ino: Ino, set: &SetAttr) -> Result<(Attr, Vec<ZeroRange>), FsError> {
        let mut zero = Vec::new();
        if let Some(size) = set.size {
            zero = self.set_size(ino, size)?;
        }
        let now = Timestamp::now();
        let inode = self.inode_mut(ino)?;
        if let Some(p) = set.perm {
            inode.attr.perm = p & 0o7777;
        }
        if let Some(u) = set.uid {
            inode.attr.uid = u;
        }
        if let Some(g) = set.gid {
            inode.attr.gid = g;
        }
        if let Some(a) = set.atime {
            inode.attr.atime = a;
        }
        if let Some(m) = set.mtime {
            inode.attr.mtime = m;
        }
        inode.attr.ctime = set.ctime.unwrap_or(now);
        if set.perm.is_some() || set.gid.is_some() {
            self.mirror_perm(ino);
        }
        let inode = self.inode_mut(ino)?;
        if let Content::File(f) = &inode.content {
            // A regular file's mtime lives in its slot (see `attr`): an
            // explicit one (utimens) goes there; 0 means "use the inode's".
            let slot = f.slot;
            if let Some(m) = set.mtime {
                self.with_attr_lock(ino, |ns| ns.slots.word(slot.mtime()).store(m.as_nanos(), SeqCst));
            }
        }
        Ok((self.attr(ino)?, zero))
    }

    /// A write or truncate by a process without `CAP_FSETID` and with
    /// `groups`: set-ID bits go as [`perm_without_setid`] says; the ctime
    /// moves only if a bit went.
    pub fn kill_suidgid(&mut self, ino: Ino, groups: &[u32]) -> Result<Attr, FsError> {
        let inode = self.inode_mut(ino)?;
        let gid = inode.attr.gid;
        let perm = perm_without_setid(inode.attr.perm, || groups.contains(&gid));
        if perm != inode.attr.perm {
            inode.attr.perm = perm;
            inode.attr.ctime = Timestamp::now();
            self.mirror_perm(ino);
        }
        self.attr(ino)
    }

    /// Copies a regular file's permission bits and group into its
    /// attribute slot, where writes read them (see [`AttrSlot`]).
    fn mirror_perm(&self, ino: Ino) {
        if let Some(Inode { attr, content: Content::File(f), .. }) = self.inodes.get(&ino) {
            let word = u64::from(attr.perm) | u64::from(attr.gid) << 32;
            self.slots.word(f.slot.perm()).store(word, SeqCst);
        }
    }

    pub fn set_xattr(&mut self, ino: Ino, name: &[u8], value: &[u8], mode: XattrMode) -> Result<(), FsError> {
        if name.is_empty() || name.len() > NAME_MAX {
            return Err(if name.is_empty() {
                FsError::Invalid("empty xattr name".into())
            } else {
                FsError::Range
            });
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(FsError::Range);
        }
        let inode = self.inode_mut(ino)?;
        let exists = inode.xattrs.contains_key(name);
        match (mode, exists) {
            (XattrMode::Create, true) => return Err(FsError::Exists),
            (XattrMode::Replace, false) => return Err(FsError::NoAttr),
            _ => {}
        }
        inode.xattrs.insert(name.to_vec(), value.to_vec());
        inode.attr.ctime = Timestamp::now();
        Ok(())
    }

    pub fn get_xattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>, FsError> {
        self.inode(ino)?.xattrs.get(name).cloned().ok_or(FsError::NoAttr)
    }

    pub fn list_xattr(&self, ino: Ino) -> Result<Vec<Vec<u8>>, FsError> {
        Ok(self.inode(ino)?.xattrs.keys().cloned().collect())
    }

    pub fn remove_xattr(&mut self, ino: Ino, name: &[u8]) -> Result<(), FsError> {
        let inode = self.inode_mut(ino)?;
        inode.xattrs.remove(name).ok_or(FsError::NoAttr)?;
        inode.attr.ctime = Timestamp::now();
        Ok(())
    }
}
