//! Inodes lent to clients for the creates they answer before they send
//! them (the client's `late_changes` module has the protocol).
//!
//! A caching mount answers the create of a regular file in a directory
//! delegated to it at once, with an inode number and a listing cookie it
//! already holds, and sends the create a moment later in a batch. So the
//! meta-server lends it numbers ahead ([`Namespace::lend`]):
//!
//! * each lent inode comes with its **cookie** (the name's place in the
//!   listing, which the mount's own listing of the directory keeps) and a
//!   **slot kept** for it ([`super::slots`]): the create, when it arrives,
//!   cannot find the attribute region full — the mount has told its kernel
//!   the file exists;
//! * a lent inode is **created once**, by the client it was lent to: the
//!   create takes it out of the client's loan. The same create sent again
//!   (its batch's answer was lost) finds the file it made and answers it
//!   again; any other use of a number not lent to the asker is refused;
//! * **a loan lasts as long as the client's registration**, across restarts
//!   of the meta-server too (loans are journaled): when the client
//!   leaves or is fenced the rest of its loan goes and the kept slots are
//!   free again ([`Namespace::forget_loan`]). A create it answered and did
//!   not send before it lost its lease is then refused (logged by the
//!   client), as its opens and locks were dropped.
//!
//! Numbers are never given twice: a loan takes them from the counters
//! that number every inode and cookie, 64 bits each.

use std::collections::HashMap;

use citronfs_core::proto::{FileLayout, LentInodes};
use citronfs_core::types::{Attr, Caller, ClientId, FileKind, Ino, Timestamp};
use citronfs_core::FsError;

use super::{Namespace, NewInode};

/// What [`Namespace::create_lent`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lent {
    Made(Attr),
    /// It had made the file already.
    Again(Attr),
}

/// The most inodes a client holds on loan: what a client keeps of the
/// attribute slots is bounded, however often it asks.
pub const MAX_LOAN: u32 = 1024;

impl Namespace {
    /// Lends `client` up to `count` inodes (fewer if few attribute slots
    /// are free, or if the client would hold more than [`MAX_LOAN`] on
    /// loan; none if none is), each with its cookie and a kept slot.
    pub fn lend(&mut self, client: ClientId, count: u32) -> LentInodes {
        let room = MAX_LOAN.saturating_sub(self.on_loan(client) as u32);
        let count = self.slots.keep(count.min(room) as u64) as u32;
        let lent = LentInodes { first_ino: Ino(self.next_ino), first_cookie: self.next_cookie, count };
        self.next_ino += count as u64;
        self.next_cookie += count as u64;
        let loan = self.lent.entry(client).or_default();
        loan.extend((0..count).filter_map(|i| lent.nth(i)));
        if count > 0 {
            // Journaled: a create the client answered before it sent it
            // still lands after a restart of the meta-server.
            self.server_changes.push(crate::journal::image::Change::Lent(client, lent));
        }
        lent
    }

    /// Ends `client`'s loan (it left or was fenced): the inodes it did not
    /// create will never be, and their kept slots are free again.
    pub fn forget_loan(&mut self, client: ClientId) {
        if let Some(loan) = self.lent.remove(&client) {
            self.slots.unkeep(loan.len() as u64);
        }
    }

    /// Inodes lent to `client` and not created yet (tests, diagnostics).
    pub fn on_loan(&self, client: ClientId) -> usize {
        self.lent.get(&client).map_or(0, HashMap::len)
    }

    /// Creates regular file `name` in `parent` as `ino`, lent to `client`,
    /// made by `caller` with `perm` at `at` (a late create), and answers
    /// its attributes. `ino` existing already under that name is the same
    /// create sent again ([`Lent::Again`]; it was opened then). The caller
    /// checks permissions.
    pub fn create_lent(
        &mut self,
        client: ClientId,
        (caller, parent, name): (Caller, Ino, &[u8]),
        perm: u16,
        ino: Ino,
        at: Timestamp,
    ) -> Result<Lent, FsError> {
        if self.inodes.contains_key(&ino) {
            return match self.dir(parent)?.by_name.get(name) {
                Some(&(_, there)) if there == ino => Ok(Lent::Again(self.attr(ino)?)),
                _ => Err(FsError::Invalid(format!("inode {} is taken", ino.0))),
            };
        }
        let Some(&cookie) = self.lent.get(&client).and_then(|loan| loan.get(&ino)) else {
            return Err(FsError::Invalid(format!("inode {} is not lent to client {}", ino.0, client.0)));
        };
        let new = NewInode { kind: FileKind::File, perm, rdev: 0, symlink_target: None };
        let attr = self.create_as(caller, parent, name, new, Some((ino, cookie)), at)?;
        if let Some(loan) = self.lent.get_mut(&client) {
            loan.remove(&ino);
        }
        Ok(Lent::Made(attr))
    }

    /// The layout a late create sent again answers, with the lock memory
    /// of the open its first arrival counted.
    pub fn layout_again(&self, ino: Ino) -> Result<FileLayout, FsError> {
        self.layout_for(ino, true)
    }
}
