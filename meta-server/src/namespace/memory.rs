//! What server memory a file occupies and who has it open: what the
//! meta-server grants a client that opens the file ([`crate::access`]).

use citron_lock::rdma::tcp::Extent;
use citronfs_core::locks::record::BLOCK_BYTES;
use citronfs_core::proto::AttrSlot;
use citronfs_core::types::{ChunkLoc, ClientId, Ino};

use super::{Content, Namespace};
use crate::access::{Class, Placed, ServerRef};

/// The memory of one data extent, as grants name it.
pub fn extent_memory(loc: ChunkLoc) -> Placed {
    Placed::new(ServerRef::Data(loc.server), Extent::new(loc.addr, loc.capacity), Class::Data)
}

impl Namespace {
    /// Every extent of server memory a client needs to use the open file
    /// `ino`: its attribute slot, its lock area and lock-record blocks (on
    /// the meta-server's NIC) and its chunks (on the data servers). Empty
    /// for anything but a regular file.
    pub fn file_memory(&self, ino: Ino) -> Vec<Placed> {
        let Some(inode) = self.inodes.get(&ino) else { return Vec::new() };
        let Content::File(f) = &inode.content else { return Vec::new() };
        let meta = |start, len, class| Placed::new(ServerRef::Meta, Extent::new(start, len), class);
        let mut out = Vec::with_capacity(2 + f.chunks.len());
        out.push(meta(f.slot.0, AttrSlot::BYTES, Class::Data));
        if let Some(locks) = &f.locks {
            out.push(meta(locks.area.base, locks.area.bytes, Class::Lock));
            out.extend(locks.blocks.iter().map(|b| meta(*b, BLOCK_BYTES, Class::Lock)));
        }
        out.extend(f.chunks.values().map(|loc| extent_memory(*loc)));
        out
    }

    /// Whether `client` has `ino` open now.
    pub fn is_open_by(&self, ino: Ino, client: ClientId) -> bool {
        matches!(self.inodes.get(&ino), Some(i) if matches!(&i.content, Content::File(f) if f.opens.contains_key(&client)))
    }
}
