//! What the journal keeps of the namespace: an image of every inode and
//! directory entry, and the changes that turn one image into the next.
//!
//! An image holds only what must outlive the meta-server process: names,
//! attributes, extended attributes, symlink targets and the extents of
//! regular files, the counters that hand out inode numbers and listing
//! cookies (never reused, so a handle from before a restart can't name a
//! newer file), and the data servers that hold extents. What clients hold
//! and the meta-server rebuilds or takes back at a restart is left out:
//! opens, lock memory, cache grants, inode loans. The extent and slot
//! allocators are derived from the files' extents and slots at start. The
//! registered clients are kept (ids only), with the inodes lent to them:
//! a restarted meta-server waits a grace period for them to reclaim their
//! opens before it fences those that do not come back ([`crate::service`]'s
//! grace), and their creates answered before they were sent still land.
//!
//! Sizes and mtimes of regular files are not here: clients change them
//! one-sidedly in the attribute slots, so the slot region itself is a file
//! of the state directory that a restarted meta-server maps again
//! ([`super::Journal::slot_file`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use citronfs_core::proto::AttrSlot;
use citronfs_core::types::{
    Attr, ChangeSeq, ChunkIndex, ChunkLoc, ClientId, DataServerId, FsId, Ino, Timestamp,
};
use serde::{Deserialize, Serialize};

use super::kept_answers::KeptAnswers;

/// A directory's entries: name to (listing cookie, inode).
pub type Entries = BTreeMap<Vec<u8>, (u64, Ino)>;

/// One inode, without a directory's entries (those are journaled one by
/// one: a create in a directory of a million names writes one entry, not
/// the directory).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeImage {
    pub attr: Attr,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub content: ContentImage,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContentImage {
    Dir {
        parent: Ino,
    },
    File {
        slot: AttrSlot,
        chunks: Vec<(ChunkIndex, ChunkLoc)>,
        /// Bytes of the extents in `chunks`.
        allocated: u64,
        epoch: u64,
        /// Chunks allocated ahead of a sequential writer.
        ahead: Vec<ChunkIndex>,
    },
    Symlink(Vec<u8>),
    Special,
}

/// A data server that holds (or held) extents: its space, and where it
/// was last reached (a restarted meta-server links it again from there).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataServerImage {
    pub region: u32,
    pub capacity: u64,
    /// It keeps its memory across its own restarts (a data directory).
    pub kept: bool,
    pub at: citronfs_core::proto::DataServerInfo,
}

/// One change of the namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// An inode as it is now, or `None`: it is gone.
    Inode(Ino, Option<InodeImage>),
    /// A name in a directory now names `to` (cookie, inode), or nothing.
    Entry { dir: Ino, name: Vec<u8>, to: Option<(u64, Ino)> },
    /// A data server joined with this space.
    DataServer(DataServerId, DataServerImage),
    /// A data server was lost with its memory.
    LostServer(DataServerId),
    /// A lost data server came back with its memory.
    FoundServer(DataServerId),
    /// A client registered (`true`), or was fenced or left (`false`, its
    /// loan ends with it).
    Client(ClientId, bool),
    /// Inodes were lent to a client; each leaves its loan when it is made.
    Lent(ClientId, citronfs_core::proto::LentInodes),
    /// The batch is (part of) change `seq` of `client`, which the client
    /// asks at most once ([`super::kept_answers`]).
    Applied { client: ClientId, seq: ChangeSeq },
    /// Change `seq` of `client` was answered with `answer` (encoded); the
    /// client waits for none of its changes below `answered_below`.
    Answered { client: ClientId, seq: ChangeSeq, answered_below: ChangeSeq, answer: Vec<u8> },
}

/// The changes one hold of the namespace lock made: one journal record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub next_ino: u64,
    pub next_cookie: u64,
    /// Client ids are never handed out twice, across restarts too: a
    /// mount of the old process must not pass for a new one.
    pub next_client: u64,
    pub changes: Vec<Change>,
}

/// The whole persistent namespace: what a snapshot holds, and what a
/// restart rebuilds the live namespace from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceImage {
    pub fs: FsId,
    /// When the file system was made.
    pub born: Timestamp,
    pub next_ino: u64,
    pub next_cookie: u64,
    pub next_client: u64,
    pub inodes: HashMap<Ino, InodeImage>,
    /// Each directory's entries (only directories with any).
    pub entries: HashMap<Ino, Entries>,
    pub data_servers: BTreeMap<DataServerId, DataServerImage>,
    pub lost: BTreeSet<DataServerId>,
    /// Clients registered and not fenced nor gone.
    pub clients: BTreeSet<ClientId>,
    /// Inodes lent to clients and not made yet, each with its cookie.
    pub loans: BTreeMap<ClientId, BTreeMap<Ino, u64>>,
    /// The answers of changes kept for a second asking. A snapshot holds
    /// them in a record after the image's (`files::write_snapshot`), so
    /// the image encodes as it did before they were kept.
    #[serde(skip)]
    pub kept: KeptAnswers,
}

impl NamespaceImage {
    /// A file system with nothing in it yet (not even its root, which the
    /// first batch makes).
    pub fn empty(fs: FsId) -> Self {
        Self {
            fs,
            born: Timestamp::now(),
            next_ino: 0,
            next_cookie: 0,
            next_client: 1,
            inodes: HashMap::new(),
            entries: HashMap::new(),
            data_servers: BTreeMap::new(),
            lost: BTreeSet::new(),
            clients: BTreeSet::new(),
            loans: BTreeMap::new(),
            kept: KeptAnswers::default(),
        }
    }

    /// Applies one batch. Entry changes apply in their order; an inode's
    /// image is its state at the end of the batch, so their order among
    /// the entries does not matter.
    pub fn apply(&mut self, batch: Batch) {
        self.next_ino = batch.next_ino;
        self.next_cookie = batch.next_cookie;
        self.next_client = batch.next_client;
        for change in batch.changes {
            match change {
                Change::Inode(ino, Some(image)) => {
                    if self.inodes.insert(ino, image).is_none() {
                        // Made: out of the loan it came from, if any.
                        self.loans.values_mut().for_each(|loan| {
                            loan.remove(&ino);
                        });
                    }
                }
                Change::Inode(ino, None) => {
                    self.inodes.remove(&ino);
                    self.entries.remove(&ino);
                }
                Change::Entry { dir, name, to: Some(to) } => {
                    self.entries.entry(dir).or_default().insert(name, to);
                }
                Change::Entry { dir, name, to: None } => {
                    if let Some(entries) = self.entries.get_mut(&dir) {
                        entries.remove(&name);
                        if entries.is_empty() {
                            self.entries.remove(&dir);
                        }
                    }
                }
                Change::DataServer(id, space) => {
                    self.data_servers.insert(id, space);
                }
                Change::LostServer(id) => {
                    self.lost.insert(id);
                }
                Change::FoundServer(id) => {
                    self.lost.remove(&id);
                }
                Change::Client(id, true) => {
                    self.clients.insert(id);
                }
                Change::Client(id, false) => {
                    self.clients.remove(&id);
                    self.loans.remove(&id);
                    self.kept.forget_client(id);
                }
                Change::Lent(id, lent) => {
                    self.loans.entry(id).or_default().extend((0..lent.count).filter_map(|i| lent.nth(i)));
                }
                Change::Applied { client, seq } => {
                    self.kept.applied(client, seq);
                }
                Change::Answered { client, seq, answered_below, answer } => {
                    self.kept.answered(client, seq, answered_below, answer);
                }
            }
        }
    }

    /// Regular files.
    pub fn files(&self) -> usize {
        self.inodes.values().filter(|i| matches!(i.content, ContentImage::File { .. })).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use citronfs_core::types::{Caller, FileKind};

    fn dir_image(ino: Ino, parent: Ino) -> InodeImage {
        InodeImage {
            attr: Attr::fresh(ino, FileKind::Dir, 0o755, Caller::ROOT, Timestamp::now()),
            xattrs: BTreeMap::new(),
            content: ContentImage::Dir { parent },
        }
    }

    #[test]
    fn batches_make_and_remove_names_and_inodes() {
        let mut image = NamespaceImage::empty(FsId(7));
        let (root, sub) = (Ino::ROOT, Ino(2));
        image.apply(Batch {
            next_ino: 3,
            next_cookie: 4,
            next_client: 1,
            changes: vec![
                // The entry may come before the inode it names.
                Change::Entry { dir: root, name: b"sub".to_vec(), to: Some((3, sub)) },
                Change::Inode(root, Some(dir_image(root, root))),
                Change::Inode(sub, Some(dir_image(sub, root))),
            ],
        });
        assert_eq!(image.next_ino, 3);
        assert_eq!(image.entries[&root][&b"sub"[..]], (3, sub));
        assert_eq!(image.inodes.len(), 2);
        image.apply(Batch {
            next_ino: 3,
            next_cookie: 4,
            next_client: 1,
            changes: vec![
                Change::Entry { dir: root, name: b"sub".to_vec(), to: None },
                Change::Inode(sub, None),
            ],
        });
        assert!(!image.entries.contains_key(&root), "an emptied directory keeps no entry map");
        assert_eq!(image.inodes.len(), 1);
    }

    #[test]
    fn data_servers_are_lost_and_found() {
        let mut image = NamespaceImage::empty(FsId(7));
        let id = DataServerId(3);
        let at = citronfs_core::proto::DataServerInfo {
            id,
            nic: "127.0.0.1:1".parse().unwrap(),
            shm: None,
            ib: None,
            durable: false,
        };
        let space = DataServerImage { region: 1, capacity: 1 << 30, kept: true, at };
        let batch = |changes| Batch { next_ino: 2, next_cookie: 3, next_client: 1, changes };
        image.apply(batch(vec![Change::DataServer(id, space.clone()), Change::LostServer(id)]));
        assert!(image.lost.contains(&id));
        image.apply(batch(vec![Change::FoundServer(id)]));
        assert!(image.lost.is_empty());
        assert_eq!(image.data_servers[&id], space);
    }
}
