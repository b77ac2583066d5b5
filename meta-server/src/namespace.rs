//! The namespace: inodes, directories, links, symlinks, xattrs, and the
//! chunk maps of regular files. Pure metadata logic under one lock held by the
//! service; the only memory it touches is the attribute slots it owns (sizes
//! and mtimes that clients update one-sidedly) through local atomics.
//!
//! Permissions are enforced by the kernel (`default_permissions` on every
//! mount): the namespace checks what only it can know — names, types,
//! emptiness, loops, limits.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use citron_lock::alock::{AlockHost, AlockLocal};
use citron_lock::citron::host::{InstanceId, LockMemoryHost, TreeHost, TreeHostError};
use citron_lock::citron::tree::TreeShape;
use citron_lock::dslr::DSLR_BYTES;
use citron_lock::range_lock::{RangeAlgorithm, RangeLockSite};
use citron_lock::rdma::{RegionMemory, RemoteAddr};
use citronfs_core::layout::ChunkGeometry;
use citronfs_core::locks::area::LockChoice;
use citronfs_core::locks::record::{block_header, pack_addr, BLOCK_BYTES, SLOTS_PER_BLOCK};
use citronfs_core::locks::LockArea;
use citronfs_core::proto::{AttrSlot, FileLayout, RenameMode, XattrMode};
use citronfs_core::types::{
    Attr, Caller, ChunkIndex, ChunkLoc, ClientId, DirEntry, FileKind, FsStats, Ino, SetAttr, Timestamp,
    MAX_FILE_SIZE, NAME_MAX, SYMLINK_MAX, XATTR_SIZE_MAX,
};
use citronfs_core::FsError;

use crate::chunks::ChunkAllocator;
use crate::lock_memory::LockMemory;

/// Cookies 1 and 2 are "." and ".." in listings; entries start after them.
const FIRST_COOKIE: u64 = 3;

struct Dir {
    parent: Ino,
    by_name: HashMap<Vec<u8>, (u64, Ino)>,
    by_cookie: BTreeMap<u64, Vec<u8>>,
}

struct RegularFile {
    slot: AttrSlot,
    chunks: BTreeMap<ChunkIndex, ChunkLoc>,
    epoch: u64,
    /// Opens by client; the data lives while any remains, even at nlink 0.
    opens: HashMap<ClientId, u32>,
    /// Lock memory, from the first open on.
    locks: Option<FileLockMemory>,
}

/// A file's lock area and the blocks of its lock-record table.
struct FileLockMemory {
    area: LockArea,
    blocks: Vec<RemoteAddr>,
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
}

/// What `create` makes.
pub struct NewInode {
    pub kind: FileKind,
    pub perm: u16,
    pub rdev: u32,
    /// The target, for a symlink.
    pub symlink_target: Option<Vec<u8>>,
}

/// Chunks handed out by `alloc_chunks`, and recycled memory to zero before
/// the client may use them.
pub struct Allocation {
    pub chunks: Vec<(ChunkIndex, ChunkLoc)>,
    pub zero: Vec<ZeroRange>,
}

/// Memory a chunk must have zeroed before the operation's answer is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroRange {
    pub loc: ChunkLoc,
    pub offset_in_chunk: u64,
    pub len: u64,
}

/// Attribute slots in the meta-server's region.
struct Slots {
    memory: Arc<RegionMemory>,
    next: u64,
    free: Vec<u64>,
}

impl Slots {
    fn allocate(&mut self) -> Result<AttrSlot, FsError> {
        let off = match self.free.pop() {
            Some(off) => off,
            None if self.next + AttrSlot::BYTES <= self.memory.len() => {
                self.next += AttrSlot::BYTES;
                self.next - AttrSlot::BYTES
            }
            None => return Err(FsError::NoSpace),
        };
        let slot = AttrSlot(RemoteAddr::new(self.memory.id(), off));
        for w in 0..AttrSlot::BYTES / 8 {
            self.word(slot.0 + 8 * w).store(0, SeqCst);
        }
        Ok(slot)
    }

    fn word(&self, addr: RemoteAddr) -> &std::sync::atomic::AtomicU64 {
        self.memory.word(addr).expect("attribute slots are inside the slot region by construction")
    }
}

pub struct Namespace {
    inodes: HashMap<Ino, Inode>,
    /// Inodes with no link and no open, kept for `orphan_grace` before they
    /// are freed: the kernel may open an inode it looked up just before a
    /// rename replaced it, and that open must find it (POSIX gives it the old
    /// file). See [`Namespace::sweep_orphans`].
    orphans: std::collections::VecDeque<(Ino, std::time::Instant)>,
    orphan_grace: std::time::Duration,
    next_ino: u64,
    next_cookie: u64,
    slots: Slots,
    pub chunks: ChunkAllocator,
    geometry: ChunkGeometry,
    lock_memory: LockMemory,
    /// How files are locked (range and inode-mutex algorithms, granule).
    lock_choice: LockChoice,
    /// The RPC range lock server, when files use it.
    range_server: Option<std::net::SocketAddr>,
    /// The meta-server's side of every file's attribute ALock.
    attr_host: AlockHost,
    /// This namespace's handle on it (taken out while in use).
    attr_lock: Option<AlockLocal>,
    /// Files whose attribute ALock the service holds for the request at
    /// hand (taken before the namespace mutex: `MetaService::with_attr_locked`).
    pub attr_held: HashSet<Ino>,
    /// Where files' Citron trees live when they grow.
    trees: Option<TreeHosting>,
}

/// The Citron tree host of the meta-server (DESIGN.md §4 "Tree growth"):
/// every file's tree is an instance of it, created at the file's first open
/// and destroyed with the inode; it runs the instances' scale-ups.
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
    pub memory: LockMemory,
    pub choice: LockChoice,
    /// The RPC range lock server, when `choice` uses it.
    pub range_server: Option<std::net::SocketAddr>,
    /// The meta-server's cohort of the attribute ALocks (in `memory`'s region).
    pub attr_host: AlockHost,
    /// Citron trees that grow, when `choice` is Citron (else fixed trees in
    /// the files' areas).
    pub trees: Option<TreeHosting>,
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
        chunks: ChunkAllocator,
        locking: FileLocking,
        root_owner: Caller,
        orphan_grace: std::time::Duration,
    ) -> Self {
        let geometry = ChunkGeometry::new(chunks.chunk_size()).expect("chunk size validated by the server");
        let mut ns = Self {
            inodes: HashMap::new(),
            orphans: std::collections::VecDeque::new(),
            orphan_grace,
            next_ino: Ino::ROOT.0 + 1,
            next_cookie: FIRST_COOKIE,
            slots: Slots { memory: slot_memory, next: 0, free: Vec::new() },
            chunks,
            geometry,
            lock_memory: locking.memory,
            lock_choice: locking.choice,
            range_server: locking.range_server,
            attr_lock: locking.attr_host.local().ok(),
            attr_host: locking.attr_host,
            attr_held: HashSet::new(),
            trees: locking.trees.filter(|_| locking.choice.range == RangeAlgorithm::Citron),
        };
        let now = Timestamp::now();
        let root = Inode {
            attr: Attr {
                ino: Ino::ROOT,
                kind: FileKind::Dir,
                perm: 0o755,
                uid: root_owner.uid,
                gid: root_owner.gid,
                size: 0,
                nlink: 2,
                rdev: 0,
                atime: now,
                mtime: now,
                ctime: now,
                crtime: now,
            },
            content: Content::Dir(Dir {
                parent: Ino::ROOT,
                by_name: HashMap::new(),
                by_cookie: BTreeMap::new(),
            }),
            xattrs: BTreeMap::new(),
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

    fn dir_mut(&mut self, ino: Ino) -> Result<&mut Dir, FsError> {
        match &mut self.inode_mut(ino)?.content {
            Content::Dir(d) => Ok(d),
            _ => Err(FsError::NotDir),
        }
    }

    /// The attributes, with a regular file's size and mtime read from its slot.
    pub fn attr(&self, ino: Ino) -> Result<Attr, FsError> {
        let inode = self.inode(ino)?;
        let mut attr = inode.attr.clone();
        match &inode.content {
            Content::File(f) => {
                attr.size = self.slots.word(f.slot.size()).load(SeqCst);
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
        Ok(attr)
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

    fn link_entry(&mut self, parent: Ino, name: &[u8], ino: Ino) -> Result<(), FsError> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let dir = self.dir_mut(parent)?;
        dir.by_name.insert(name.to_vec(), (cookie, ino));
        dir.by_cookie.insert(cookie, name.to_vec());
        Ok(())
    }

    fn unlink_entry(&mut self, parent: Ino, name: &[u8]) -> Result<Ino, FsError> {
        let dir = self.dir_mut(parent)?;
        let (cookie, ino) = dir.by_name.remove(name).ok_or(FsError::NotFound)?;
        dir.by_cookie.remove(&cookie);
        Ok(ino)
    }

    fn touch_dir(&mut self, dir: Ino, nlink_delta: i32) {
        if let Some(d) = self.inodes.get_mut(&dir) {
            let now = Timestamp::now();
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
                slot: self.slots.allocate()?,
                chunks: BTreeMap::new(),
                epoch: 0,
                opens: HashMap::new(),
                locks: None,
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
        let ino = Ino(self.next_ino);
        self.next_ino += 1;
        let now = Timestamp::now();
        let attr = Attr {
            ino,
            kind,
            perm: if kind == FileKind::Symlink { 0o777 } else { perm },
            uid: caller.uid,
            gid,
            size: 0,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            rdev: if matches!(kind, FileKind::CharDevice | FileKind::BlockDevice) { rdev } else { 0 },
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
        };
        self.inodes.insert(ino, Inode { attr, content, xattrs: BTreeMap::new() });
        self.link_entry(parent, name, ino)?;
        self.touch_dir(parent, if kind == FileKind::Dir { 1 } else { 0 });
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
        let Some(inode) = self.inodes.get_mut(&ino) else { return };
        inode.attr.nlink = inode.attr.nlink.saturating_sub(1);
        inode.attr.ctime = Timestamp::now();
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

    /// When space held by orphans or quarantined chunks will next come back.
    pub fn next_space_event(&self) -> Option<std::time::Duration> {
        let orphan = self.orphans.front().map(|(_, since)| self.orphan_grace.saturating_sub(since.elapsed()));
        match (orphan, self.chunks.next_release()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Frees the orphans whose grace has passed and that are still unlinked
    /// and unopened.
    pub fn sweep_orphans(&mut self) {
        while let Some(&(ino, since)) = self.orphans.front() {
            if since.elapsed() < self.orphan_grace {
                break;
            }
            self.orphans.pop_front();
            let still_dead = matches!(self.inodes.get(&ino), Some(Inode { attr, content: Content::File(f), .. })
                if attr.nlink == 0 && f.opens.is_empty());
            if still_dead {
                self.free_file(ino);
            }
        }
    }

    fn free_file(&mut self, ino: Ino) {
        if let Some(Inode { content: Content::File(f), .. }) = self.inodes.remove(&ino) {
            for (_, loc) in f.chunks {
                self.chunks.free_unreachable(loc);
            }
            self.slots.free.push(f.slot.0.offset);
            if let Some(locks) = f.locks {
                self.lock_memory.free(locks.area.base, locks.area.bytes);
                for b in locks.blocks {
                    self.lock_memory.free(b, BLOCK_BYTES);
                }
                if let (RangeLockSite::CitronHosted { instance, .. }, Some(t)) =
                    (locks.area.range, &self.trees)
                {
                    if let Err(e) = t.host.destroy(instance) {
                        log::error!("freeing the Citron tree of inode {}: {e}", ino.0);
                    }
                }
            }
        }
    }

    pub fn unlink(&mut self, parent: Ino, name: &[u8]) -> Result<(), FsError> {
        let ino = self.dir(parent)?.by_name.get(name).ok_or(FsError::NotFound)?.1;
        if self.inode(ino)?.attr.kind == FileKind::Dir {
            return Err(FsError::IsDir);
        }
        self.unlink_entry(parent, name)?;
        self.touch_dir(parent, 0);
        self.drop_link(ino);
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
        let dir = self.dir(ino)?;
        let mut out = Vec::new();
        if after < 1 {
            out.push(DirEntry { cookie: 1, ino, kind: FileKind::Dir, name: b".".to_vec() });
        }
        if after < 2 {
            out.push(DirEntry { cookie: 2, ino: dir.parent, kind: FileKind::Dir, name: b"..".to_vec() });
        }
        for (&cookie, name) in dir.by_cookie.range(after.max(2) + 1..) {
            if out.len() >= max as usize {
                break;
            }
            let child = dir.by_name[name].1;
            let kind = self.inode(child).map(|i| i.attr.kind).unwrap_or(FileKind::File);
            out.push(DirEntry { cookie, ino: child, kind, name: name.clone() });
        }
        out.truncate(max as usize);
        Ok(out)
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

    pub fn layout(&self, ino: Ino) -> Result<FileLayout, FsError> {
        let f = self.file(ino)?;
        Ok(FileLayout {
            ino,
            slot: f.slot,
            epoch: f.epoch,
            allocs: self.slots.word(f.slot.allocs()).load(SeqCst),
            chunks: f.chunks.iter().map(|(i, l)| (*i, *l)).collect(),
            locks: f.locks.as_ref().map(|l| l.area),
        })
    }

    pub fn open(&mut self, client: ClientId, ino: Ino) -> Result<FileLayout, FsError> {
        if self.file(ino)?.locks.is_none() {
            let size = self.slots.word(self.file(ino)?.slot.size()).load(SeqCst);
            let area = match self.trees.clone() {
                Some(trees) => self.hosted_area(&trees, size)?,
                None => {
                    let bad = |e: citron_lock::rwlock::LockError| FsError::Io(format!("lock area: {e}"));
                    let bytes = LockArea::bytes_for(self.lock_choice, size).map_err(bad)?;
                    let base = self.lock_memory.allocate(bytes)?;
                    LockArea::plan(base, self.lock_choice, size, ino, self.range_server).map_err(|e| {
                        self.lock_memory.free(base, bytes);
                        bad(e)
                    })?
                }
            };
            self.file_mut(ino)?.locks = Some(FileLockMemory { area, blocks: Vec::new() });
        }
        *self.file_mut(ino)?.opens.entry(client).or_insert(0) += 1;
        self.layout(ino)
    }

    /// A lock area whose range lock is a new instance of the tree host: the
    /// tree as [`LockArea::plan`] would size it, its spillover word (an
    /// allocation of the instance, freed with it), scaled by the host up to
    /// `trees.max_depth`; the area itself holds the other locks.
    fn hosted_area(&mut self, trees: &TreeHosting, size: u64) -> Result<LockArea, FsError> {
        let tree_err = |e: TreeHostError| match e {
            TreeHostError::OutOfMemory { .. } => FsError::NoLocks,
            other => FsError::Io(format!("Citron tree host: {other}")),
        };
        let shape = TreeShape::covering(LockArea::initial_units(self.lock_choice, size));
        let (instance, geometry) = trees.host.create(shape).map_err(tree_err)?;
        let made = (|| {
            let spillover = trees.host.instance(instance).allocate(DSLR_BYTES).map_err(tree_err)?;
            trees.host.enable_scaling(instance, spillover, trees.max_depth).map_err(tree_err)?;
            let site = RangeLockSite::CitronHosted {
                tree: geometry.maximizer,
                depth: shape.depth(),
                spillover,
                host: trees.addr,
                instance,
                max_depth: trees.max_depth,
            };
            let base = self.lock_memory.allocate(LockArea::bytes_for_hosted())?;
            LockArea::with_range(base, self.lock_choice, site).map_err(|e| {
                self.lock_memory.free(base, LockArea::bytes_for_hosted());
                FsError::Io(format!("lock area: {e}"))
            })
        })();
        if made.is_err() {
            let _ = trees.host.destroy(instance);
        }
        made
    }

    /// The hosted Citron tree of a file, if it has one: its instance.
    pub fn hosted_tree(&self, ino: Ino) -> Option<(InstanceId, RangeLockSite)> {
        let f = self.file(ino).ok()?;
        match f.locks.as_ref()?.area.range {
            site @ RangeLockSite::CitronHosted { instance, .. } => Some((instance, site)),
            _ => None,
        }
    }

    /// Creates the lock-record table of an open file, or appends a block
    /// after `last` if that is still the last one; returns the first block.
    pub fn grow_lock_table(&mut self, ino: Ino, last: Option<RemoteAddr>) -> Result<RemoteAddr, FsError> {
        let current = match &self.file(ino)?.locks {
            Some(l) => (l.area, l.blocks.first().copied(), l.blocks.last().copied()),
            None => return Err(FsError::Invalid("lock table of a file that was never opened".into())),
        };
        let (area, first, tail) = current;
        let wanted = match (first, last) {
            (None, _) => true,
            (Some(_), Some(l)) => Some(l) == tail,
            (Some(_), None) => false,
        };
        if !wanted {
            return first.ok_or_else(|| FsError::Io("lock table vanished".into()));
        }
        let block = self.lock_memory.allocate(BLOCK_BYTES)?;
        let memory = self.lock_memory.memory().clone();
        let word = |addr: RemoteAddr| {
            memory.word(addr).map_err(|e| FsError::Io(format!("lock memory at {addr}: {e}")))
        };
        let packed =
            pack_addr(block).ok_or_else(|| FsError::Io("lock block address does not pack".into()))?;
        // The header first, then the link that makes the block reachable
        // (SeqCst stores: a client that reads the link sees the header).
        word(block)?.store(block_header(SLOTS_PER_BLOCK), SeqCst);
        match tail {
            None => word(area.table_head())?.store(packed, SeqCst),
            Some(t) => word(t + 8)?.store(packed, SeqCst),
        }
        let locks = self.file_mut(ino)?.locks.as_mut().expect("checked above");
        locks.blocks.push(block);
        Ok(locks.blocks[0])
    }

    /// Every file with a lock-record table.
    pub fn lock_tables(&self) -> Vec<LockTableRef> {
        self.inodes
            .iter()
            .filter_map(|(ino, i)| match &i.content {
                Content::File(RegularFile { locks: Some(l), .. }) => {
                    l.blocks.first().map(|&first_block| LockTableRef { ino: *ino, area: l.area, first_block })
                }
                _ => None,
            })
            .collect()
    }

    /// A word of the lock region (diagnostics).
    pub fn lock_memory_word(&self, addr: RemoteAddr) -> Option<u64> {
        self.lock_memory.memory().word(addr).ok().map(|w| w.load(SeqCst))
    }

    /// Lock memory allocated and not freed, in bytes.
    pub fn lock_memory_in_use(&self) -> u64 {
        self.lock_memory.in_use()
    }

    /// Allocates lock memory outside any file (the waits-for table).
    pub fn allocate_lock_memory(&mut self, bytes: u64) -> Result<RemoteAddr, FsError> {
        self.lock_memory.allocate(bytes)
    }

    pub fn release(&mut self, client: ClientId, ino: Ino) -> Result<(), FsError> {
        let f = self.file_mut(ino)?;
        if let Some(n) = f.opens.get_mut(&client) {
            *n -= 1;
            if *n == 0 {
                f.opens.remove(&client);
            }
        }
        self.maybe_free(ino);
        Ok(())
    }

    /// Forgets every open of a client whose lease expired.
    pub fn drop_client(&mut self, client: ClientId) {
        let inos: Vec<Ino> = self
            .inodes
            .iter()
            .filter(|(_, i)| matches!(&i.content, Content::File(f) if f.opens.contains_key(&client)))
            .map(|(ino, _)| *ino)
            .collect();
        for ino in inos {
            if let Ok(f) = self.file_mut(ino) {
                f.opens.remove(&client);
            }
            self.maybe_free(ino);
        }
    }

    /// Allocates the missing chunks among `wanted`. Returns every requested
    /// chunk's location and the recycled memory to zero first.
    pub fn alloc_chunks(&mut self, ino: Ino, wanted: &[ChunkIndex]) -> Result<Allocation, FsError> {
        let max_chunk = MAX_FILE_SIZE / self.geometry.chunk_size();
        if wanted.iter().any(|c| c.0 >= max_chunk) {
            return Err(FsError::FileTooBig);
        }
        let mut zero = Vec::new();
        let mut out = Vec::with_capacity(wanted.len());
        let mut fresh = Vec::new();
        for &c in wanted {
            if let Some(loc) = self.file(ino)?.chunks.get(&c) {
                out.push((c, *loc));
                continue;
            }
            let Some(a) = self.chunks.allocate() else {
                // Give back what this request took: all or nothing.
                for (c, loc) in fresh {
                    self.file_mut(ino)?.chunks.remove(&c);
                    self.chunks.free(loc);
                }
                return Err(FsError::NoSpace);
            };
            if a.needs_zeroing {
                zero.push(ZeroRange { loc: a.loc, offset_in_chunk: 0, len: self.geometry.chunk_size() });
            }
            self.file_mut(ino)?.chunks.insert(c, a.loc);
            fresh.push((c, a.loc));
            out.push((c, a.loc));
        }
        if !fresh.is_empty() {
            // Clients with an older chunk list refetch it (see `AttrSlot`).
            self.slots.word(self.file(ino)?.slot.allocs()).fetch_add(1, SeqCst);
        }
        Ok(Allocation { chunks: out, zero })
    }

    /// The attribute ALock of `ino`, if the file has lock memory (a file
    /// never opened has no client that could race).
    pub fn attr_lock_of(&self, ino: Ino) -> Option<RemoteAddr> {
        self.file(ino).ok().and_then(|f| f.locks.as_ref()).map(|l| l.area.attr_lock())
    }

    /// Runs `f` holding `ino`'s attribute ALock (if the file has lock
    /// memory; a file never opened has no client that could race), so the
    /// meta-server's changes to the size and mtime words and clients'
    /// one-sided ones exclude each other (DESIGN.md §4). The service takes
    /// the lock before it locks the namespace (`attr_held`), so no request
    /// waits for it under the namespace mutex; the wait below is what a
    /// caller that did not gets.
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

    /// Sets the size (truncate). Shrinking frees whole chunks past the end,
    /// returns the tail of the last chunk to zero, and bumps the epoch so
    /// clients refetch their layouts.
    fn set_size(&mut self, ino: Ino, size: u64) -> Result<Vec<ZeroRange>, FsError> {
        self.with_attr_lock(ino, |ns| ns.set_size_locked(ino, size))
    }

    fn set_size_locked(&mut self, ino: Ino, size: u64) -> Result<Vec<ZeroRange>, FsError> {
        if size > MAX_FILE_SIZE {
            return Err(FsError::FileTooBig);
        }
        let cs = self.geometry.chunk_size();
        let f = self.file(ino)?;
        let slot = f.slot;
        let old = self.slots.word(slot.size()).load(SeqCst);
        let mut zero = Vec::new();
        if size < old {
            let keep = self.geometry.chunks_for_size(size);
            let f = self.file_mut(ino)?;
            let freed: Vec<ChunkLoc> = f.chunks.split_off(&ChunkIndex(keep)).into_values().collect();
            if !size.is_multiple_of(cs) {
                if let Some(loc) = f.chunks.get(&ChunkIndex(size / cs)) {
                    zero.push(ZeroRange { loc: *loc, offset_in_chunk: size % cs, len: cs - size % cs });
                }
            }
            f.epoch += 1;
            let epoch = f.epoch;
            for loc in freed {
                self.chunks.free(loc);
            }
            self.slots.word(slot.epoch()).store(epoch, SeqCst);
        }
        self.slots.word(slot.size()).store(size, SeqCst);
        self.slots.word(slot.mtime()).store(Timestamp::now().as_nanos(), SeqCst);
        Ok(zero)
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

    pub fn fallocate(
        &mut self,
        ino: Ino,
        offset: u64,
        len: u64,
        keep_size: bool,
    ) -> Result<Vec<ZeroRange>, FsError> {
        let end = offset.checked_add(len).filter(|e| *e <= MAX_FILE_SIZE).ok_or(FsError::FileTooBig)?;
        if len == 0 {
            return Err(FsError::Invalid("fallocate of zero bytes".into()));
        }
        let wanted: Vec<ChunkIndex> =
            (self.geometry.chunk_of(offset).0..=self.geometry.chunk_of(end - 1).0).map(ChunkIndex).collect();
        let zero = self.alloc_chunks(ino, &wanted)?.zero;
        if !keep_size {
            let slot = self.file(ino)?.slot;
            self.with_attr_lock(ino, |ns| ns.slots.word(slot.size()).fetch_max(end, SeqCst));
        }
        Ok(zero)
    }

    pub fn stats(&self) -> FsStats {
        FsStats {
            chunk_size: self.geometry.chunk_size(),
            total_chunks: self.chunks.total_chunks(),
            free_chunks: self.chunks.free_chunks(),
            inodes: self.inodes.len() as u64,
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
