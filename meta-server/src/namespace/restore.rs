//! The namespace and the journal ([`crate::journal`]): the batch of changes
//! one hold of the namespace lock made, and the namespace rebuilt from an
//! image at a restart, with the allocators derived from it (the slots and
//! extents its files hold are taken, every other one is free).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use citron_lock::rdma::{RegionId, RegionMemory};

/// The memory a data server offers as it joins.
#[derive(Clone, Copy, Debug)]
pub struct DataServerSpace {
    pub region: RegionId,
    pub capacity: u64,
    /// It held this file system's data before (it joins again).
    pub reused: bool,
    /// It keeps its memory across its own restarts (a data directory).
    pub kept: bool,
}
use citronfs_core::proto::DataServerInfo;
use citronfs_core::types::{Caller, ChangeSeq, ClientId, DataServerId, Ino};

use super::{Content, Dir, FileLocking, Inode, Namespace, RegularFile};
use crate::extents::{Discard, ExtentAllocator};
use crate::journal::image::{Batch, Change, ContentImage, DataServerImage, NamespaceImage};
use crate::journal::kept_answers::KeptAnswers;
use crate::reclaim::Reclamation;

impl Namespace {
    /// What changed since the last call, as one journal record; `None`
    /// when nothing the journal keeps did.
    pub fn take_changes(&mut self) -> Option<Batch> {
        let mut changes = self.inodes.take_changes();
        changes.append(&mut self.server_changes);
        let counters = (self.next_ino, self.next_cookie, self.next_client);
        if changes.is_empty() && counters == self.journaled_counters {
            return None;
        }
        self.journaled_counters = counters;
        Some(Batch { next_ino: counters.0, next_cookie: counters.1, next_client: counters.2, changes })
    }

    /// A client id never handed out before, by this process or an earlier
    /// one of this file system.
    pub fn new_client_id(&mut self) -> citronfs_core::types::ClientId {
        self.next_client += 1;
        citronfs_core::types::ClientId(self.next_client - 1)
    }

    /// A client registered: journaled, so that a restart waits for it.
    pub fn client_joined(&mut self, client: citronfs_core::types::ClientId) {
        if self.clients.insert(client) {
            self.server_changes.push(Change::Client(client, true));
        }
    }

    /// A client was fenced or left.
    pub fn client_gone(&mut self, client: citronfs_core::types::ClientId) {
        self.kept.forget_client(client);
        if self.clients.remove(&client) {
            self.server_changes.push(Change::Client(client, false));
        }
    }

    /// The answers of changes kept for a second asking.
    pub fn kept_answers(&self) -> &KeptAnswers {
        &self.kept
    }

    pub fn kept_answers_mut(&mut self) -> &mut KeptAnswers {
        &mut self.kept
    }

    /// Keeps the answer of change `seq` of `client`, which changed the
    /// namespace, journaled in this hold's batch.
    pub fn keep_answer(
        &mut self,
        client: ClientId,
        seq: ChangeSeq,
        answered_below: ChangeSeq,
        answer: Vec<u8>,
    ) {
        self.kept.answered(client, seq, answered_below, answer.clone());
        self.server_changes.push(Change::Answered { client, seq, answered_below, answer });
    }

    /// The clients registered when the image was taken (at a restart: the
    /// clients of the old process, who may come back to reclaim).
    pub fn registered_clients(&self) -> Vec<citronfs_core::types::ClientId> {
        self.clients.iter().copied().collect()
    }

    /// Keeps unlinked files that were open before a restart until `at`
    /// at least: their openers reclaim their opens within the grace period.
    pub fn keep_orphans_until(&mut self, at: std::time::Instant) {
        for (_, since) in self.orphans.iter_mut() {
            *since = (*since).max(at);
        }
    }

    /// The namespace of `image`, with no data server joined yet: each
    /// takes back its extents as it joins ([`Namespace::add_data_server`]).
    /// Unlinked files that were kept for their opens are freed after the
    /// orphan grace unless opened again (opens end with the old process).
    pub fn restore(
        image: NamespaceImage,
        slot_memory: Arc<RegionMemory>,
        extents: ExtentAllocator,
        locking: FileLocking,
        reclaim: Arc<Reclamation>,
        orphan_grace: std::time::Duration,
    ) -> Self {
        let mut ns = Self::new(slot_memory, extents, locking, reclaim, Caller::ROOT, orphan_grace);
        ns.inodes = Default::default();
        let NamespaceImage {
            next_ino,
            next_cookie,
            next_client,
            inodes,
            mut entries,
            data_servers,
            lost,
            clients,
            loans,
            kept,
            ..
        } = image;
        let mut slots = Vec::new();
        let now = std::time::Instant::now();
        for (ino, image) in inodes {
            let content = match image.content {
                ContentImage::Dir { parent } => {
                    let by_name: HashMap<Vec<u8>, (u64, Ino)> =
                        entries.remove(&ino).unwrap_or_default().into_iter().collect();
                    let by_cookie =
                        by_name.iter().map(|(name, &(cookie, i))| (cookie, (name.clone(), i))).collect();
                    Content::Dir(Dir { parent, by_name, by_cookie })
                }
                ContentImage::File { slot, chunks, allocated, epoch, ahead } => {
                    slots.push(slot);
                    if image.attr.nlink == 0 {
                        ns.orphans.push_back((ino, now));
                    }
                    Content::File(RegularFile {
                        slot,
                        chunks: chunks.into_iter().collect(),
                        allocated,
                        epoch,
                        opens: HashMap::new(),
                        locks: None,
                        ahead: ahead.into_iter().collect(),
                    })
                }
                ContentImage::Symlink(target) => Content::Symlink(target),
                ContentImage::Special => Content::Special,
            };
            ns.inodes
                .restore(ino, Inode { attr: image.attr, content, xattrs: image.xattrs, journaled: None });
        }
        if !entries.is_empty() {
            log::error!(
                "the journal names entries of {} directories that do not exist; ignored",
                entries.len()
            );
        }
        ns.slots.restore(slots);
        ns.next_ino = next_ino;
        ns.next_cookie = next_cookie;
        ns.next_client = next_client;
        ns.journaled_counters = (next_ino, next_cookie, next_client);
        ns.data_servers = data_servers;
        ns.lost_servers = lost.into_iter().collect();
        ns.clients = clients;
        ns.kept = kept;
        let on_loan: u64 = loans.values().map(|loan| loan.len() as u64).sum();
        if ns.slots.keep(on_loan) < on_loan {
            log::error!(
                "the attribute slots cannot keep the {on_loan} inodes on loan; some late creates may fail"
            );
        }
        ns.lent = loans.into_iter().map(|(client, loan)| (client, loan.into_iter().collect())).collect();
        ns
    }

    /// Whether data server `id` was lost with its memory.
    pub fn is_lost(&self, id: DataServerId) -> bool {
        self.lost_servers.contains(&id)
    }

    /// Data servers that hold or held extents, with the space they had.
    pub fn known_data_servers(&self) -> &BTreeMap<DataServerId, DataServerImage> {
        &self.data_servers
    }

    /// Data server `at` joins with `space`. One the allocator still has
    /// (it restarted, this meta-server did not) is up again with its
    /// extents as they were ([`Namespace::rejoin_data_server`]); returns
    /// how many files it had been lost for. Otherwise its space is added,
    /// and if this namespace knew it (`space.reused`: it joins again after
    /// a restart of the meta-server) it takes back the extents its files
    /// hold there, and every free block is zeroed before it is handed out
    /// (its memory may hold old bytes).
    pub fn add_data_server(
        &mut self,
        at: &DataServerInfo,
        space: DataServerSpace,
        discard: Option<Discard>,
    ) -> Option<usize> {
        let id = at.id;
        let image = DataServerImage {
            region: space.region.0,
            capacity: space.capacity,
            kept: space.kept,
            at: at.clone(),
        };
        if self.data_servers.get(&id) != Some(&image) {
            self.data_servers.insert(id, image.clone());
            self.server_changes.push(Change::DataServer(id, image));
        }
        if self.extents.server_memory(id).is_some() {
            return Some(self.rejoin_data_server(id, discard));
        }
        self.extents.add_server(id, space.region, space.capacity, discard);
        if space.reused {
            self.extents.mark_free_dirty(id);
        }
        let mut claimed = 0u64;
        for inode in self.inodes.values() {
            let Content::File(f) = &inode.content else { continue };
            for loc in f.chunks.values().filter(|l| l.server == id) {
                if self.extents.claim(*loc) {
                    claimed += 1;
                } else {
                    log::error!(
                        "inode {} holds an extent {loc:?} that data server {} cannot have",
                        inode.attr.ino.0,
                        id.0
                    );
                }
            }
        }
        if self.lost_servers.remove(&id) {
            self.server_changes.push(Change::FoundServer(id));
        }
        space.reused.then_some(claimed as usize)
    }
}
