//! The data servers as the meta-server sees them: registering one (anew,
//! or again under the identity it had), telling one that stopped answering
//! down or lost (the prober), and the calls the meta-server makes on their
//! memory (zeroing freed extents, filling new ones).
//!
//! # Down or lost
//!
//! A data server whose memory is *kept* (it runs with a data directory,
//! `MetaRequest::RegisterDataServer::kept`) re-adopts it when it restarts
//! and registers again with the id it had (`rejoin`). For such a server:
//!
//! * silent for a whole lease (a crash, SIGKILL, SIGTERM, a hung host): it
//!   is **down**. No new extent goes to it; its files keep their layouts and
//!   names, and I/O on them waits in the clients (up to their `--timeout`,
//!   then EIO) for it to come back. It answers probes again, or registers
//!   again under its id (a new NIC address, shm name, region mapping), and
//!   it is up: the same extents, the same bytes. It stays down, never lost,
//!   however long it is away: only the operator knows whether it will come
//!   back. A rejoin under an id this meta-server does not know is refused
//!   with an error that says so: a server holding data is never given a
//!   new identity silently.
//! * SIGTERM is a restart like any other: it sends no goodbye (its memory
//!   stays in its data directory), and is down until it registers again.
//!
//! A data server whose memory is *not* kept (no data directory) loses its
//! memory when it stops, so it is **lost**: when it says it leaves
//! (`DataServerLeaves`, on SIGTERM) or when it is silent for a lease. Its
//! files keep their names and answer EIO at once and for good (their
//! layouts are refused). A lost server that registers again under its id
//! (a kept one that said it left) comes back as it was.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use citron_lock::rdma::RegionId;
use citronfs_core::proto::{Allocated, DataServerInfo, FileLayout, MetaResponse, MAX_AHEAD_CHUNKS};
use citronfs_core::types::{ChunkIndex, ChunkLoc, DataServerId, Ino};
use citronfs_core::FsError;

use crate::access::Placed;
use crate::data_link::{DataServerLink, Probe};
use crate::namespace::{extent_memory, DataServerSpace, ExtentPlan, Namespace, ZeroRange};

use super::{server_credentials, MetaService};

impl MetaService {
    pub(super) fn link(&self, server: DataServerId) -> Result<Arc<DataServerLink>, FsError> {
        let links = self.data_servers.lock();
        links
            .iter()
            .find(|l| l.info.id == server)
            .cloned()
            .ok_or_else(|| FsError::Io(format!("unknown data server {}", server.0)))
    }

    pub(super) fn zero(&self, ranges: &[ZeroRange]) -> Result<(), FsError> {
        for r in ranges {
            self.link(r.loc.server)?.zero(r.loc.addr + r.offset_in_chunk, r.len)?;
        }
        Ok(())
    }

    /// Registers a data server: a new one gets the next id; one that
    /// re-adopted its memory (`rejoin`) is re-linked under the id it had, if
    /// that id is this meta-server's and its memory is the same region and
    /// capacity, and is up again with its extents as they were.
    /// `info` is where it is (its id is assigned here).
    pub(super) fn register_data_server(
        &self,
        info: DataServerInfo,
        region: u32,
        capacity: u64,
        rejoin: Option<DataServerId>,
        kept: bool,
    ) -> Result<MetaResponse, FsError> {
        let id = match rejoin {
            None => DataServerId(self.next_data_server.fetch_add(1, Ordering::Relaxed) as u32),
            Some(id) => {
                // Known from the journal: across restarts of this
                // meta-server too.
                let known = self.ns.lock().known_data_servers().get(&id).map(|s| (s.region, s.capacity));
                match known {
                    None => {
                        return Err(FsError::Invalid(format!(
                            "data server {} is not known to this meta-server: its data directory holds \
                             the memory of another file system, or of a meta-server whose state is \
                             gone. Point it at the meta-server it belongs to, or start it with another \
                             (empty) data directory; its data is then lost",
                            id.0
                        )))
                    }
                    Some((r, c)) if r != region || c != capacity => {
                        return Err(FsError::Invalid(format!(
                            "data server {} had region {r} of {c} bytes, and now offers region {region} \
                             of {capacity} bytes: its memory is not the one it had",
                            id.0
                        )))
                    }
                    Some(_) => id,
                }
            }
        };
        self.link_data_server(DataServerInfo { id, ..info }, region, capacity, rejoin.is_some(), kept)?;
        Ok(MetaResponse::DataServerRegistered(id, self.identity.fs))
    }

    /// Links data server `at` and gives its space to the extent allocator;
    /// `reused`: its memory held file data before (it joins again), so
    /// it keeps the extents the namespace's files hold there.
    fn link_data_server(
        &self,
        at: DataServerInfo,
        region: u32,
        capacity: u64,
        reused: bool,
        kept: bool,
    ) -> Result<(), FsError> {
        let mut links = self.data_servers.lock();
        let credentials = server_credentials(&self.access);
        let link = DataServerLink::connect(at.clone(), RegionId(region), kept, credentials)?;
        self.access.add_data_server(at.id, at.nic);
        let space = DataServerSpace { region: RegionId(region), capacity, reused, kept };
        let found = self.ns.lock().add_data_server(&at, space, link.discard());
        links.retain(|l| l.info.id != at.id);
        links.push(Arc::new(link));
        match found {
            Some(files) => log::info!(
                "data server {} is back at {} with its memory ({files} files found again)",
                at.id.0,
                at.nic
            ),
            None => log::info!("data server {} at {}: {capacity} bytes", at.id.0, at.nic),
        }
        Ok(())
    }

    /// After a restart: links again every data server the journal knows
    /// and did not lose, where it was last reached. One that does not
    /// answer is left out; it joins again when it registers.
    pub(super) fn relink_known_data_servers(&self) {
        let known: Vec<_> = {
            let ns = self.ns.lock();
            let lost = |id| ns.is_lost(id);
            ns.known_data_servers().values().filter(|s| !lost(s.at.id)).cloned().collect()
        };
        for server in known {
            let (id, nic) = (server.at.id, server.at.nic);
            match self.link_data_server(server.at, server.region, server.capacity, true, server.kept) {
                Ok(()) => log::info!("data server {} at {nic} is linked again", id.0),
                Err(e) => log::warn!(
                    "data server {} at {nic} does not answer ({e}); its files wait for it to register again",
                    id.0
                ),
            }
        }
    }

    /// Data server `id` is gone (it left, or stopped answering), and the
    /// file data in its memory with it. New extents go to the others; files
    /// that had extents there keep their names and attributes, and opening
    /// them or doing I/O answers EIO (their epochs change, so clients with
    /// a layout refetch it and learn); truncating or removing them works.
    pub(super) fn lose_data_server(&self, id: DataServerId, why: &str) {
        let gone = {
            let mut links = self.data_servers.lock();
            let before = links.len();
            links.retain(|l| l.info.id != id);
            links.len() < before
        };
        if gone {
            let files = self.ns.lock().lose_data_server(id);
            log::warn!("data server {} is gone ({why}): {files} files lost data on it", id.0);
        }
    }

    /// Probes every data server through its NIC ([`DataServerLink::probe`]).
    /// One that has not answered for a whole lease is down if its memory is
    /// kept, lost otherwise (see the module header); the lease is the
    /// bound a busy machine gets before anyone is declared dead, as for
    /// clients. A down server that answers again is up.
    pub(super) fn probe_data_servers(&self) {
        let links = self.data_servers.lock().clone();
        let wait = (self.lease / 4).max(Duration::from_millis(100));
        for link in links {
            let id = link.info.id;
            let probe = link.probe(wait, self.lease);
            // Under the list's lock, and only for the link that is still the
            // server's: one that registered again meanwhile has a new link,
            // and what the old one's probes found is about a dead process.
            let current = self.data_servers.lock();
            if !current.iter().any(|l| Arc::ptr_eq(l, &link)) {
                continue;
            }
            match probe {
                Probe::Silent if !link.kept => {
                    drop(current);
                    self.lose_data_server(id, "it stopped answering for a lease");
                }
                Probe::Silent => {
                    if !link.down.swap(true, Ordering::SeqCst) {
                        self.ns.lock().extents.set_available(id, false);
                        log::warn!(
                            "data server {} is down (silent for a lease): I/O on its files waits for it \
                             to come back",
                            id.0
                        );
                    }
                }
                Probe::Answered => {
                    if link.down.swap(false, Ordering::SeqCst) {
                        self.ns.lock().extents.set_available(id, true);
                        log::info!("data server {} answers again", id.0);
                    }
                }
                Probe::Failing => {}
            }
        }
    }

    /// Takes extents with `plan` (under the namespace lock), fills them
    /// outside it (zeroes old bytes, copies a moving chunk) and commits them.
    /// When the data servers are full, orphans still in their grace are
    /// freed at once and the plan is tried again: no wait, no quarantine.
    pub(super) fn with_extents(
        &self,
        ino: Ino,
        plan: impl Fn(&mut Namespace) -> Result<ExtentPlan, FsError>,
    ) -> Result<Allocated, FsError> {
        let plan = {
            let mut ns = self.ns.lock();
            ns.sweep_orphans();
            let planned = match plan(&mut ns) {
                Err(FsError::NoSpace) if ns.free_orphans_now() => plan(&mut ns),
                other => other,
            };
            match planned {
                // Full without the servers that are down: the client waits
                // for one to come back rather than hear ENOSPC.
                Err(FsError::NoSpace) => {
                    return Err(ns.down_server().map_or(FsError::NoSpace, FsError::DataServerDown))
                }
                other => other?,
            }
        };
        if let Err(e) = self.fill(&plan) {
            log::error!("preparing extents of inode {}: {e}", ino.0);
            self.ns.lock().abandon_extents(plan);
            return Err(e);
        }
        // What each step would change, to tell openers only that (not the
        // whole file's memory at every chunk a writer adds).
        let steps: Option<Vec<(ChunkIndex, ChunkLoc, Option<ChunkLoc>)>> =
            self.access.enforcing().then(|| plan.steps.iter().map(|s| (s.chunk, s.new, s.old)).collect());
        let allocated = self.ns.lock().commit_extents(plan)?;
        if let Some(steps) = steps {
            // Openers gain the new extents and lose a moved chunk's old one;
            // a step that lost its race committed nothing.
            let (mut gained, mut lost) = (Vec::new(), Vec::new());
            for (chunk, new, old) in steps {
                if allocated.chunks.contains(&(chunk, new)) {
                    gained.push(extent_memory(new));
                    lost.extend(old.map(extent_memory));
                }
            }
            self.access.file_allocated(ino, gained, lost);
        }
        Ok(allocated)
    }

    /// The extents a late create asked for (`LateCreate::first_write`),
    /// allocated as `AllocChunks` of those chunks would be; `layout`, the
    /// create's answer, then carries the file's chunks as they now are (its
    /// lock memory stays the create's). The create stands whatever happens
    /// here: an allocation refused (the data servers full) is only logged,
    /// and the write that waited asks for its extents itself and is told
    /// why.
    pub(super) fn allocate_first_write(&self, chunks: &[(ChunkIndex, u64)], layout: &mut FileLayout) {
        let ino = layout.ino;
        if chunks.is_empty() {
            return;
        }
        if chunks.len() > MAX_AHEAD_CHUNKS {
            log::warn!("a late create of inode {} asked for {} extents; none allocated", ino.0, chunks.len());
            return;
        }
        let now = self
            .with_extents(ino, |ns| ns.plan_extents(ino, chunks, false))
            .and_then(|_| self.ns.lock().layout(ino));
        match now {
            Ok(now) => *layout = FileLayout { locks: layout.locks.take(), ..now },
            Err(e) => log::info!("the first extents of inode {}, created late: {e}", ino.0),
        }
    }

    /// Makes a plan's new extents ready for clients: a moving chunk's bytes
    /// copied, memory that may hold old bytes zeroed. Memory that held
    /// another file's bytes may still be granted to its former openers, so
    /// first nobody keeps a grant on it, as its NIC confirms (one round trip
    /// per data server, and only in a keyed cluster).
    pub(super) fn fill(&self, plan: &ExtentPlan) -> Result<(), FsError> {
        let reused: Vec<Placed> =
            plan.steps.iter().filter(|s| s.zero).map(|s| crate::namespace::extent_memory(s.new)).collect();
        self.access.revoke_everyone(&reused).map_err(|e| FsError::Io(e.to_string()))?;
        for step in &plan.steps {
            let dest = self.link(step.new.server)?;
            if let Some(old) = step.old {
                self.link(old.server)?
                    .copy(old.addr, step.copy, &dest, step.new.addr)
                    .map_err(|e| unreachable_as_down(e, &[old.server, step.new.server]))?;
            }
            if step.zero && step.copy < step.new.capacity {
                dest.zero(step.new.addr + step.copy, step.new.capacity - step.copy)
                    .map_err(|e| unreachable_as_down(e, &[step.new.server]))?;
            }
        }
        Ok(())
    }
}

/// A zero or copy on data servers `servers` that failed in transport (the
/// server crashed, or restarts, before the prober found it down): the
/// client waits for the server and asks again ([`FsError::DataServerDown`])
/// instead of answering EIO. Refusals stay errors.
fn unreachable_as_down(e: FsError, servers: &[DataServerId]) -> FsError {
    match e {
        FsError::Io(why) => {
            log::warn!("data server {} does not answer: {why}", servers[0].0);
            FsError::DataServerDown(*servers.last().unwrap_or(&servers[0]))
        }
        other => other,
    }
}
