//! Directory listings: `READDIR`, and `READDIRPLUS` for caching mounts
//! (coherent caching), paged from the meta-server — or from this mount's
//! delegation of the directory ([`crate::delegation`], `page`) — into the
//! kernel's buffer.
//!
//! A caching mount has the kernel list with READDIRPLUS always
//! (`FUSE_DO_READDIRPLUS` without `FUSE_READDIRPLUS_AUTO`): each entry comes
//! with its attributes, which the meta-server grants as it grants a
//! lookup's answer (its `grants` module; neither for a regular file open
//! for writing, then the kernel gets TTL zero for it), so the `lstat` of
//! each listed name is answered by the kernel alone.
//!
//! Why not the kernel's AUTO guess, which asks READDIRPLUS only for a
//! listing's first buffer and for buffers after the caller looked names
//! up: the tools that read a whole directory before they stat what they
//! found (`du`, `tar`, `rsync`, `cp -r`, GNU `find` with `-newer`, `-size`
//! or `-user`: fts reads a directory to its end first) then paid a `LOOKUP`
//! round trip per name past the first buffer. Measured on another mount
//! of a cluster, over 4 × 2,500 files (ms; MooseFS in the same sitting):
//!
//! | | always | AUTO | MooseFS |
//! |---|---|---|---|
//! | `du -s` | 43–49 | 423–520 | 139–194 |
//! | `find -newer -size 0c -name '*01*'` (4,536 stat'ed) | 41–43 | 221–289 | 78–95 |
//! | `find -newer -size 0c -name '*01?5'` (40 stat'ed) | 37–41 | 17–18 | 13–14 |
//! | `find -name '*01?5'` (nothing stat'ed) | 47–49 | 18–20 | 35–53 |
//!
//! The price is the last two rows: a listing whose names are only matched
//! makes the kernel build an inode per name, and the meta-server look up
//! and grant each one's attributes. (An earlier mount asked for
//! READDIRPLUS always too, with a meta-server then several times slower
//! per entry; a later one chose AUTO on `find -name`'s figures alone.) A mount
//! without caching never asks for READDIRPLUS.
//!
//! Races, as for lookups ([`crate::invalidation`]): a page whose RPC an
//! invalidation overtook (the counter of all invalidations moved while it
//! was out) goes to the kernel with TTL zero. The kernel installs neither
//! "." nor ".." from a listing, and drops attributes of an inode
//! invalidated since its request began (its `attr_version`).
//!
//! fuser does not tell the kernel's buffer size (one page, about 25
//! entries, on older kernels; recent ones size it from the caller's
//! `getdents` buffer, 32 KiB from glibc: 6.18 here lists a directory of 100
//! entries in one request), and an entry fetched but not fitting is
//! fetched and granted for nothing (meta-server work, and a needless
//! callback later, never a stale answer). So the mount learns it: the
//! first page asks for as many entries as the last full buffer took
//! ([`PlusFit`], [`PLUS_FIRST_PAGE`] at first), and a buffer that still has
//! room asks for a small page more. A listing of a big directory then
//! costs one meta-server call per kernel request (pages of 64 and then
//! 128, as before, took two for a 32 KiB buffer of about 190 entries),
//! and fetches one entry per request in vain instead of up to 60% of them
//! (39 of 64 for a one-page buffer of 25).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use citronfs_core::types::{Caller, Ino};
use fuser::{Generation, INodeNo, ReplyDirectory, ReplyDirectoryPlus};

use crate::{dot_attr, errno, file_type, fuse_attr, CitronFuse};

/// Entries asked of the meta-server at once by `readdir` (it answers up to
/// 4096), and at most by one page of `readdirplus`.
const READDIR_PAGE: u32 = 512;

/// The first page of a `readdirplus` until a kernel buffer was seen full
/// (an entry takes 152 bytes and its name, padded to 8).
const PLUS_FIRST_PAGE: u32 = 64;

/// The least page asked for when a buffer still has room after a page:
/// names vary in length, so a buffer that took N entries last time may
/// take a few more.
const PLUS_TOP_UP: u32 = 16;

/// How many entries the kernel's last full `READDIRPLUS` buffer took: the
/// next request's first page. Buffers differ by caller (`getdents` sizes)
/// and names by length, so it is a guess, corrected at every full buffer.
#[derive(Debug)]
pub(crate) struct PlusFit(AtomicU32);

impl Default for PlusFit {
    fn default() -> Self {
        Self(AtomicU32::new(PLUS_FIRST_PAGE))
    }
}

impl PlusFit {
    fn first_page(&self) -> u32 {
        // Relaxed: a hint; any value is correct, only the cost differs.
        self.0.load(Relaxed).clamp(1, READDIR_PAGE)
    }

    /// A buffer was full after `entries`: the next asks for one more, so
    /// that a buffer taking as many again is filled by the first page
    /// (the one more does not fit) instead of a page more.
    fn filled(&self, entries: u32) {
        self.0.store(entries + 1, Relaxed);
    }
}

impl CitronFuse {
    /// `READDIR`: entries after cookie `offset` until the buffer is full or
    /// the directory ends.
    pub(crate) fn list(&self, caller: Caller, ino: Ino, offset: u64, mut reply: ReplyDirectory) {
        let mut after = offset;
        // A directory delegated here is listed here (`delegation::page`).
        while let Some(local) = self.page_delegated(ino, after, READDIR_PAGE as usize, false) {
            for e in local.entries {
                if reply.add(INodeNo(e.ino.0), e.cookie, file_type(e.kind), OsStr::from_bytes(&e.name)) {
                    return reply.ok();
                }
                after = e.cookie;
            }
            if local.end {
                return reply.ok();
            }
        }
        loop {
            let page = match self.client.readdir(caller, ino, after, READDIR_PAGE) {
                Ok(p) => p,
                Err(e) => return reply.error(errno(&e)),
            };
            // A short page is the directory's end: asking again would only
            // cost a round trip for an empty one.
            let last = page.len() < READDIR_PAGE as usize;
            for e in page {
                if reply.add(INodeNo(e.ino.0), e.cookie, file_type(e.kind), OsStr::from_bytes(&e.name)) {
                    return reply.ok();
                }
                after = e.cookie;
            }
            if last {
                break;
            }
        }
        reply.ok()
    }

    /// `READDIRPLUS`: as [`CitronFuse::list`], each entry with its
    /// attributes and the TTL the meta-server granted them.
    pub(crate) fn list_plus(&self, caller: Caller, ino: Ino, offset: u64, mut reply: ReplyDirectoryPlus) {
        let epochs = self.invalidations.epochs();
        let (mut after, mut page) = (offset, self.plus_fit.first_page());
        let mut added = 0u32;
        // A directory delegated here is listed here as far as it can be
        // (`delegation::page`), in pages sized as the meta-server's; the
        // meta-server goes on from there.
        let local_page = page as usize;
        while let Some(local) = self.page_delegated(ino, after, local_page, true) {
            let stopped = !local.end && local.entries.len() < local_page;
            for e in local.entries {
                let attr = e.attr.as_ref().map_or_else(|| dot_attr(e.ino), fuse_attr);
                let name = OsStr::from_bytes(&e.name);
                if reply.add(INodeNo(e.ino.0), e.cookie, name, &e.ttls.entry, &attr, Generation(0)) {
                    self.plus_fit.filled(added);
                    return reply.ok();
                }
                added += 1;
                after = e.cookie;
            }
            if local.end {
                return reply.ok();
            }
            if stopped {
                break;
            }
        }
        loop {
            let (sent, before) = (Instant::now(), epochs.all());
            let entries = match self.client.readdir_plus(caller, ino, after, page) {
                Ok(p) => p,
                Err(e) => return reply.error(errno(&e)),
            };
            let granted = self.granted_ttl(sent, before, epochs.all());
            let last = entries.len() < page as usize;
            for e in entries {
                let ttl = match e.grant.entry && e.grant.attr {
                    true => granted,
                    false => self.options.attr_ttl,
                };
                let name = OsStr::from_bytes(&e.entry.name);
                if reply.add(
                    INodeNo(e.entry.ino.0),
                    e.entry.cookie,
                    name,
                    &ttl,
                    &fuse_attr(&e.attr),
                    Generation(0),
                ) {
                    self.plus_fit.filled(added);
                    return reply.ok();
                }
                added += 1;
                after = e.entry.cookie;
            }
            if last {
                break;
            }
            // Room left: a small page more, growing if the guess was far
            // off (another caller's bigger buffer).
            page = (added / 2).clamp(PLUS_TOP_UP, READDIR_PAGE);
        }
        reply.ok()
    }
}
