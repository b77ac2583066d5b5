//! The namespace: inodes, directories, links, symlinks, xattrs, and the
//! chunk maps of regular files. Pure metadata logic under one lock held by the
//! service; the only memory it touches is the attribute slots it owns (sizes
//! and mtimes that clients update one-sidedly) through local atomics.
//!
//! Permissions are enforced by the kernel (`default_permissions` on every
//! mount): the namespace checks what only it can know — names, types,
//! emptiness, loops, limits.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use citron_lock::rdma::{RegionMemory, RemoteAddr};
use citronfs_core::layout::ChunkGeometry;
use citronfs_core::proto::{AttrSlot, FileLayout, RenameMode, XattrMode};
use citronfs_core::types::{
    Attr, Caller, ChunkIndex, ChunkLoc, ClientId, DirEntry, FileKind, FsStats, Ino, SetAttr, Timestamp,
    MAX_FILE_SIZE, NAME_MAX, SYMLINK_MAX, XATTR_SIZE_MAX,
};
use citronfs_core::FsError;

use crate::chunks::ChunkAllocator;

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
                self.chunks.free(loc);
            }
            self.slots.free.push(f.slot.0.offset);
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
            chunks: f.chunks.iter().map(|(i, l)| (*i, *l)).collect(),
        })
    }

    pub fn open(&mut self, client: ClientId, ino: Ino) -> Result<FileLayout, FsError> {
        *self.file_mut(ino)?.opens.entry(client).or_insert(0) += 1;
        self.layout(ino)
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
        Ok(Allocation { chunks: out, zero })
    }

    /// Sets the size (truncate). Shrinking frees whole chunks past the end,
    /// returns the tail of the last chunk to zero, and bumps the epoch so
    /// clients refetch their layouts.
    fn set_size(&mut self, ino: Ino, size: u64) -> Result<Vec<ZeroRange>, FsError> {
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
                self.slots.word(slot.mtime()).store(m.as_nanos(), SeqCst);
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
            self.slots.word(slot.size()).fetch_max(end, SeqCst);
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
