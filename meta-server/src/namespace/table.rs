//! The namespace's inodes, and the one place that sees every change to
//! them: the journal's entrance ([`crate::journal`]).
//!
//! Every mutable access to an inode (`get_mut`, `insert`, `remove`) marks
//! it touched; every change of a directory entry is recorded as it is made
//! ([`InodeTable::entry_changed`], called by the namespace's only two
//! entry mutators). When the namespace lock is let go, [`InodeTable::take_changes`]
//! turns the touched inodes into images and keeps those whose persistent
//! part changed: an open or a lock-memory change touches an inode without
//! changing what the journal keeps, and costs no record. Which part is
//! persistent is decided in one place, [`Inode::image`], so a new field is
//! journaled or not by that function alone, never by the call sites.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use citronfs_core::types::Ino;

use super::{Content, Inode};
use crate::journal::image::{Change, ContentImage, InodeImage};

#[derive(Default)]
pub(super) struct InodeTable {
    map: HashMap<Ino, Inode>,
    /// Inodes accessed mutably since the last [`InodeTable::take_changes`].
    touched: HashSet<Ino>,
    /// Entry changes since then, in order.
    entries: Vec<Change>,
}

impl InodeTable {
    pub(super) fn get(&self, ino: &Ino) -> Option<&Inode> {
        self.map.get(ino)
    }

    pub(super) fn get_mut(&mut self, ino: &Ino) -> Option<&mut Inode> {
        let inode = self.map.get_mut(ino)?;
        self.touched.insert(*ino);
        Some(inode)
    }

    pub(super) fn insert(&mut self, ino: Ino, inode: Inode) {
        self.touched.insert(ino);
        self.map.insert(ino, inode);
    }

    pub(super) fn remove(&mut self, ino: &Ino) -> Option<Inode> {
        self.touched.insert(*ino);
        self.map.remove(ino)
    }

    pub(super) fn contains_key(&self, ino: &Ino) -> bool {
        self.map.contains_key(ino)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Inode> {
        self.map.values()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&Ino, &Inode)> {
        self.map.iter()
    }

    /// An inode restored from the journal: already journaled as it is.
    pub(super) fn restore(&mut self, ino: Ino, inode: Inode) {
        self.map.insert(ino, inode);
    }

    /// `name` in `dir` now names `to` (cookie, inode), or nothing.
    pub(super) fn entry_changed(&mut self, dir: Ino, name: &[u8], to: Option<(u64, Ino)>) {
        self.entries.push(Change::Entry { dir, name: name.to_vec(), to });
    }

    /// The changes since the last call: entry changes in order, then each
    /// touched inode whose persistent image changed (or that is gone).
    pub(super) fn take_changes(&mut self) -> Vec<Change> {
        let mut changes = std::mem::take(&mut self.entries);
        for ino in self.touched.drain() {
            match self.map.get_mut(&ino) {
                None => changes.push(Change::Inode(ino, None)),
                Some(inode) => {
                    let image = inode.image();
                    let print = fingerprint(&image);
                    if inode.journaled != Some(print) {
                        inode.journaled = Some(print);
                        changes.push(Change::Inode(ino, Some(image)));
                    }
                }
            }
        }
        changes
    }
}

/// A 64-bit digest of an image (SipHash of its encoding): equal images
/// have equal prints, and a change escapes notice only by a collision.
fn fingerprint(image: &InodeImage) -> u64 {
    let bytes = bincode::serialize(image).expect("an inode image always encodes");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

impl Inode {
    /// What the journal keeps of this inode: everything but a directory's
    /// entries (journaled one by one) and a file's opens and lock memory
    /// (held by clients, taken back at a restart).
    pub(super) fn image(&self) -> InodeImage {
        let content = match &self.content {
            Content::Dir(d) => ContentImage::Dir { parent: d.parent },
            Content::File(f) => ContentImage::File {
                slot: f.slot,
                chunks: f.chunks.iter().map(|(i, l)| (*i, *l)).collect(),
                allocated: f.allocated,
                epoch: f.epoch,
                ahead: f.ahead.iter().copied().collect(),
            },
            Content::Symlink(t) => ContentImage::Symlink(t.clone()),
            Content::Special => ContentImage::Special,
        };
        InodeImage { attr: self.attr.clone(), xattrs: self.xattrs.clone(), content }
    }
}
