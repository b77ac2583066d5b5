//! The meta-server's answer to each request ([`MetaService::dispatch`]),
//! split from `service.rs`: what every [`MetaRequest`] does to the
//! namespace, the opens and the lock memory, and what it changed that
//! caching clients must be called back for ([`crate::grants`]).

use std::time::{Duration, Instant};

use citron_rpc::auth::{Credential, KeyOptions};
use citronfs_core::proto::{
    ClientInfo, ClusterInfo, Delegated, EntryPlus, FileRelease, Grant, HeldAgain, Invalidation, LateChange,
    LateCreate, LateDone, LateUnlink, MetaRequest, MetaResponse, MAX_AHEAD_CHUNKS,
};
use citronfs_core::session::SessionKeys;
use citronfs_core::types::{Attr, Caller, ClientId, DirEntry, FileKind, Ino, Timestamp};
use citronfs_core::FsError;

use super::{ClientLease, MetaService};
use crate::grants::POLL_WAIT;
use crate::identity::Asker;
use crate::namespace::{Lent, NewInode};
use crate::permissions::Checks;

/// Most entries one `ReadDir` or `ReadDirPlus` answers.
const MAX_READDIR: u32 = 4096;

/// How a create makes its inode.
#[derive(Clone, Copy, Debug)]
enum Making {
    /// The next inode, now; an existing name is refused if `exclusive`,
    /// else opened.
    Now { exclusive: bool },
    /// A late create: the inode lent for it, made at its time.
    Lent { ino: Ino, at: Timestamp },
}

/// What a request changed that kernels may cache ([`crate::grants`]).
#[derive(Default)]
struct Changed {
    keys: Vec<Invalidation>,
    /// The changer's own kernel does not update its cache from the answer
    /// (it is called back too).
    changer_too: bool,
}

impl MetaService {
    /// Answers `request`; with `caching` (a [`MetaRequest::Caching`]
    /// request: its client and grant TTL) lookups are granted, and the
    /// caches of other clients that hold grants of what a change changed
    /// are invalidated before the answer ([`crate::grants`]), even when
    /// the change fails after a part of it was applied.
    pub(super) fn dispatch(
        &self,
        asker: &Asker,
        caching: Option<(ClientId, Duration)>,
        request: MetaRequest,
    ) -> Result<MetaResponse, FsError> {
        let asker_id = match asker {
            Asker::Client(client, _) => Some(*client),
            _ => caching.map(|(client, _)| client),
        };
        self.recall_for(asker_id, &request);
        let mut changed = Changed::default();
        let answer = self.dispatch_changing(asker, caching, request, &mut changed);
        if !changed.keys.is_empty() {
            let spared = caching.map(|(c, _)| c).filter(|_| !changed.changer_too);
            self.grants.revoke(spared, &changed.keys);
        }
        answer
    }

    /// Recalls the delegations of clients other than `asker` that
    /// `request` names ([`MetaRequest::named`]: a delegated directory, a
    /// name in one, a child held with one; and for a `ReadDirPlus`, the
    /// directories it lists, whose attributes it answers) and waits for
    /// them, before the request is served: their holders may have answered
    /// unlinks there that they have not sent yet ([`crate::grants`], "Late
    /// unlinks"). Nothing to resolve while no other client holds one.
    fn recall_for(&self, asker: Option<ClientId>, request: &MetaRequest) {
        if !self.grants.delegated_to_another_than(asker) {
            return;
        }
        let named = request.named();
        let mut inos = named.inos;
        {
            let ns = self.ns.lock();
            inos.extend(
                named.names.iter().filter_map(|(dir, name)| ns.lookup(*dir, name).ok().map(|a| a.ino)),
            );
            if let MetaRequest::ReadDirPlus { ino, after, max, .. } = request.inner() {
                let listed = ns.readdir_plus(*ino, *after, (*max).min(MAX_READDIR)).unwrap_or_default();
                inos.extend(listed.into_iter().filter(|(_, a)| a.kind == FileKind::Dir).map(|(_, a)| a.ino));
            }
        }
        self.grants.recall(asker, &inos);
    }

    /// Attributes of `attr`'s inode may be granted: not a regular file
    /// that some client has open for writing, and not contended
    /// ([`crate::grants`], "Contended attributes").
    fn attr_grantable(&self, attr: &Attr) -> bool {
        self.grants.attr_grantable(attr.ino, attr.kind == FileKind::File)
    }

    /// What a lookup or getattr answers: granted to a caching client.
    /// Called with the namespace mutex held (see [`crate::grants`]).
    fn granted(
        &self,
        ns: &crate::namespace::Namespace,
        caching: Option<(ClientId, Duration)>,
        attr: Attr,
        entry: Option<Invalidation>,
    ) -> MetaResponse {
        let Some((client, ttl)) = caching else { return MetaResponse::Attr(attr) };
        let attr_granted = self.attr_grantable(&attr);
        let mut grant = Grant {
            entry: entry.is_some(),
            attr: attr_granted,
            held: false,
            // What of a written file does not change one-sidedly, to a
            // client that has it open ([`crate::grants`], "Written files").
            live: !attr_granted && ns.is_open_by(attr.ino, client),
        };
        if let Some(e) = entry {
            if let (true, Invalidation::Entry { parent, .. }) = (grant.attr, &e) {
                grant.held = self.grants.hold_child(client, *parent, attr.ino);
            }
            self.grants.grant(client, e, ttl);
        }
        if grant.attr {
            self.grants.grant(client, Invalidation::Attr(attr.ino), ttl);
        } else if grant.live {
            self.grants.grant_until_closed(client, attr.ino, ttl);
        }
        MetaResponse::Granted(attr, grant)
    }

    /// The request made or removed entry `name` of `parent`: every other
    /// client's grant of it is called back (`changed`), and the caching
    /// changer's own ends at once, without a callback — its kernel learns
    /// the entry anew from the answer (a create's new dentry; an unlink's
    /// dentry dropped), and the grant, most often the absence granted to
    /// the lookup before a create, would make another client's later
    /// change of the name wait for it. Called with the namespace mutex
    /// held, with the change: a lookup after it is granted again
    /// ([`crate::grants`], "Absent names").
    fn entry_changed(
        &self,
        caching: Option<(ClientId, Duration)>,
        changed: &mut Changed,
        parent: Ino,
        name: Vec<u8>,
    ) {
        let key = Invalidation::Entry { parent, name };
        if let Some((client, _)) = caching {
            self.grants.end(client, &key);
        }
        changed.keys.push(key);
    }

    /// Registers `client` (a new one, or one of the previous process that
    /// reclaims): its lease, its session keys in a keyed cluster, its
    /// access at the NICs, and the journal's record of it.
    fn admit_client(&self, asker: &Asker, client: ClientId, hostname: String, pid: u32) -> ClusterInfo {
        let (session, options) = match asker {
            Asker::Registering(key) => {
                let secrets = self.access.session_credential(client).zip(self.access.member_secret());
                let session = secrets.and_then(|(s, member)| match s {
                    Credential::Session { secret, .. } => {
                        Some(SessionKeys::wrap(key, self.access.incarnation(), client, &secret, &member))
                    }
                    _ => None,
                });
                (session, key.options)
            }
            _ => (None, KeyOptions::default()),
        };
        self.clients.lock().insert(
            client,
            ClientLease { renewed: Instant::now(), leaving: false, hostname: hostname.clone(), pid, options },
        );
        self.access.admit(client);
        self.ns.lock().client_joined(client);
        log::info!("client {} registered: {hostname} pid {pid}", client.0);
        ClusterInfo {
            client,
            chunk_size: self.chunk_size,
            meta_nic: self.nic,
            meta_shm: self.shm.clone(),
            meta_ib: self.ib,
            data_servers: self.data_servers.lock().iter().map(|l| l.info.clone()).collect(),
            lease_ms: self.lease.as_millis() as u64,
            waits_for: self.waits_for,
            lock_params: self.lock_params,
            lock_host: self.lock_host.clone(),
            session,
            incarnation: self.access.incarnation(),
            fs: self.identity.fs,
        }
    }

    /// A create of regular file `name` in `parent` by `caller` for
    /// `client`, opened for it (`CreateOpen`; a late create's, made as
    /// the inode lent for it at its time).
    fn create_open(
        &self,
        checks: Checks,
        caching: Option<(ClientId, Duration)>,
        changed: &mut Changed,
        (caller, client, parent, name): (Caller, ClientId, Ino, Vec<u8>),
        perm: u16,
        making: Making,
    ) -> Result<MetaResponse, FsError> {
        use Invalidation::Attr as AttrOf;
        use MetaResponse as A;
        let new = NewInode { kind: FileKind::File, perm, rdev: 0, symlink_target: None };
        let mut ns = self.ns.lock();
        checks.add_entry(&ns, caller, parent)?;
        let (made, exclusive) = match making {
            Making::Now { exclusive } => (ns.create(caller, parent, &name, new), exclusive),
            Making::Lent { ino, at } => {
                match ns.create_lent(client, (caller, parent, &name), perm, ino, at)? {
                    Lent::Made(attr) => (Ok(attr), true),
                    // Its first arrival's answer was lost: that one opened it.
                    Lent::Again(attr) => return Ok(A::Opened(attr, ns.layout_again(ino)?)),
                }
            }
        };
        let opened = match made {
            Ok(attr) => match ns.open(client, attr.ino) {
                Ok(layout) => A::Opened(attr, layout),
                Err(e) => {
                    // As a kernel does, refuse without leaving a file.
                    if let Err(u) = ns.unlink(parent, &name) {
                        log::error!("undoing the create of inode {}: {u}", attr.ino.0);
                    }
                    return Err(e);
                }
            },
            // O_CREAT without O_EXCL opens what is there (under the
            // same namespace lock, so the file cannot go between).
            Err(FsError::Exists) if !exclusive => {
                let attr = ns.lookup(parent, &name)?;
                match attr.kind {
                    FileKind::File => {}
                    FileKind::Dir => return Err(FsError::IsDir),
                    _ => return Err(FsError::Exists),
                }
                let layout = ns.open(client, attr.ino)?;
                A::OpenedExisting(attr, layout)
            }
            Err(e) => return Err(e),
        };
        if let A::Opened(attr, _) | A::OpenedExisting(attr, _) = &opened {
            // Pushed before the answer leaves (a NIC holds a verb that
            // outruns its grant).
            self.access.opened(client, attr.ino, ns.file_memory(attr.ino), true);
            // Its size and mtime may now change one-sidedly.
            self.grants.writing(client, attr.ino);
            changed.keys.extend([AttrOf(parent), AttrOf(attr.ino)]);
        }
        let mut new = None;
        if let (A::Opened(attr, _), Some((creator, ttl))) = (&opened, caching) {
            // The new file's attributes, granted to its creator, its
            // only opener, until its release ([`crate::grants`],
            // "Creators"; after `writing`, which grants nothing).
            self.grants.grant_until_closed(creator, attr.ino, ttl);
            new = Some(attr.clone());
        }
        let made = matches!(opened, A::Opened(..));
        let answer = self.with_parent(
            &ns,
            caching,
            parent,
            opened,
            new.is_some(),
            new.as_ref().map(|a| (a, &name[..])),
        );
        if made {
            self.entry_changed(caching, changed, parent, name);
        }
        Ok(answer)
    }

    /// What a change of `dir`'s entries answers a caching changer: the
    /// directory's attributes after it, granted to the changer (whose
    /// grant a change never revokes, [`Grants::revoke`]) unless they are
    /// contended ([`crate::grants`], "Contended attributes"), with `answer`;
    /// `created`: the created file's attributes in `answer` were granted to
    /// the changer until its release ([`crate::grants`], "Creators");
    /// `new`: the inode the change made and its name, held with the
    /// changer's delegation of `dir` if it has one (with the entry's
    /// cookie), and delegated to it if a directory ([`crate::grants`],
    /// "Delegations"). Called
    /// with the namespace mutex held, as [`Self::granted`], so a change of
    /// `dir` by another client either came before (and is in the answer)
    /// or comes after and revokes this grant.
    ///
    /// [`Grants::revoke`]: crate::grants::Grants::revoke
    fn with_parent(
        &self,
        ns: &crate::namespace::Namespace,
        caching: Option<(ClientId, Duration)>,
        dir: Ino,
        answer: MetaResponse,
        created: bool,
        new: Option<(&Attr, &[u8])>,
    ) -> MetaResponse {
        let Some((client, ttl)) = caching else { return answer };
        let Ok(parent) = ns.attr(dir) else { return answer };
        let parent = self.grants.grant_attr_unless_contended(client, dir, ttl).then_some(parent);
        let mut delegated = Delegated::default();
        if let Some((new, name)) = new {
            delegated.child = self.grants.hold_child(client, dir, new.ino);
            if delegated.child {
                delegated.cookie = ns.cookie(dir, name);
            }
            if new.kind == FileKind::Dir {
                self.grants.delegate(client, new.ino, ttl);
                delegated.dir = true;
            }
        }
        MetaResponse::ParentGranted { answer: Box::new(answer), parent, created, delegated }
    }

    /// What a `ReadDirPlus` answers: entries of `dir` after cookie `after`,
    /// with their attributes, each entry and its attributes granted
    /// together to a caching client as a lookup's answer would be (neither
    /// for a file open for writing, nor for "." and ".."). Called with the
    /// namespace mutex held, as [`Self::granted`].
    fn entries_plus(
        &self,
        ns: &crate::namespace::Namespace,
        caching: Option<(ClientId, Duration)>,
        dir: Ino,
        after: u64,
        max: u32,
    ) -> Result<MetaResponse, FsError> {
        let entries = ns.readdir_plus(dir, after, max.min(MAX_READDIR))?;
        let is_dots = |entry: &DirEntry| entry.name == b"." || entry.name == b"..";
        let granted = match caching {
            Some((client, ttl)) => self.grants.grant_listing(
                client,
                dir,
                ttl,
                entries
                    .iter()
                    .filter(|(entry, _)| !is_dots(entry))
                    .map(|(entry, attr)| (&entry.name[..], attr.ino, attr.kind == FileKind::File)),
            ),
            None => Vec::new(),
        };
        let mut granted = granted.into_iter();
        let out = entries
            .into_iter()
            .map(|(entry, attr)| {
                // `granted` holds one answer per entry but the dots, in order.
                let both = !is_dots(&entry) && granted.next().unwrap_or(false);
                let grant = Grant { entry: both, attr: both, ..Grant::default() };
                EntryPlus { entry, attr, grant }
            })
            .collect();
        Ok(MetaResponse::EntriesPlus(out))
    }

    /// Hands back `opens` of `client`'s opens of `ino`. At its last one,
    /// its memory grants and cache grants of the file end, and a file its
    /// creator wrote in its delegated directory has the attributes the
    /// writes changed held again: returned to a caching `client`.
    fn release(
        &self,
        caching: Option<(ClientId, Duration)>,
        client: ClientId,
        ino: Ino,
        opens: u32,
    ) -> Result<Option<HeldAgain>, FsError> {
        let mut ns = self.ns.lock();
        ns.release(client, ino, opens)?;
        let still_open = ns.is_open_by(ino, client);
        self.access.closed(client, ino, still_open);
        if still_open {
            return Ok(None);
        }
        self.grants.closed(client, ino);
        let holder = caching.map(|(c, _)| c).filter(|c| *c == client);
        match holder.and_then(|c| self.grants.held_again(c, ino)) {
            Some(dir) => Ok(Some(HeldAgain { dir, attr: ns.attr(ino)? })),
            None => Ok(None),
        }
    }

    /// `name` of `parent` removed by `caller`, made at `at` (now, or when a
    /// mount answered it before it sent it); `expected`: the inode a late
    /// unlink removed, which the name must still be ([`LateUnlink`]).
    fn unlink(
        &self,
        checks: Checks,
        caching: Option<(ClientId, Duration)>,
        changed: &mut Changed,
        (caller, parent, name): (Caller, Ino, Vec<u8>),
        at: Timestamp,
        expected: Option<Ino>,
    ) -> Result<MetaResponse, FsError> {
        let mut ns = self.ns.lock();
        let victim = ns.lookup(parent, &name).ok().map(|a| a.ino);
        if expected.is_some_and(|ino| victim != Some(ino)) {
            return Err(FsError::NotFound);
        }
        checks.remove_entry(&ns, caller, parent, &name)?;
        ns.unlink_at(parent, &name, at)?;
        self.entry_changed(caching, changed, parent, name);
        changed.keys.push(Invalidation::Attr(parent));
        changed.keys.extend(victim.map(Invalidation::Attr));
        let answer = victim.map_or(MetaResponse::Done, MetaResponse::Removed);
        Ok(self.with_parent(&ns, caching, parent, answer, false, None))
    }

    fn dispatch_changing(
        &self,
        asker: &Asker,
        caching: Option<(ClientId, Duration)>,
        request: MetaRequest,
        changed: &mut Changed,
    ) -> Result<MetaResponse, FsError> {
        use Invalidation::{Attr as AttrOf, Entry};
        use MetaRequest as R;
        use MetaResponse as A;
        let checks = if matches!(asker, Asker::Client(..)) { Checks::ON } else { Checks::OFF };
        // A registered client changes a file's memory only through its own
        // opens: writes (allocation) through a writing open, lock-record
        // tables through any.
        let must_hold = |ino: Ino, write: bool| match asker {
            Asker::Client(client, _) if !self.access.holds_open(*client, ino, write) => {
                log::warn!(
                    "client {} acts on inode {} it has not opened{}",
                    client.0,
                    ino.0,
                    if write { " for writing" } else { "" }
                );
                Err(FsError::Perm)
            }
            _ => Ok(()),
        };
        // Openers of `ino` follow its memory (chunks freed or added).
        let memory_changed = |ino: Ino| {
            if self.access.enforcing() {
                let memory = self.ns.lock().file_memory(ino);
                self.access.file_changed(ino, memory);
            }
        };
        Ok(match request {
            R::RegisterClient { hostname, pid } => {
                let client = self.ns.lock().new_client_id();
                if client.0 >= 1 << 24 {
                    // Claimed lock slots carry 24 bits of the claimer.
                    return Err(FsError::Invalid("client ids are exhausted; restart the meta-server".into()));
                }
                A::Registered(self.admit_client(asker, client, hostname, pid))
            }
            R::ReclaimClient { client, hostname, pid, opens } => {
                self.grace.reclaim(client)?;
                let info = self.admit_client(asker, client, hostname, pid);
                let mut ns = self.ns.lock();
                let (mut taken, asked) = (0, opens.len());
                let opens = opens
                    .into_iter()
                    .map(|o| {
                        let layout = ns.reclaim_open(client, o.ino, o.opens, o.area);
                        match &layout {
                            Ok(_) => {
                                taken += 1;
                                self.access.opened(client, o.ino, ns.file_memory(o.ino), o.write);
                                if o.write {
                                    self.grants.writing(client, o.ino);
                                }
                            }
                            Err(e) => log::warn!("client {}: reclaim of inode {}: {e}", client.0, o.ino.0),
                        }
                        (o.ino, layout)
                    })
                    .collect();
                log::info!("client {} reclaimed {taken} of its {asked} open files", client.0);
                A::Reclaimed(info, opens)
            }
            R::DataServers => {
                A::DataServers(self.data_servers.lock().iter().map(|l| l.info.clone()).collect())
            }
            R::Heartbeat { client } => {
                let mut clients = self.clients.lock();
                match clients.get_mut(&client) {
                    Some(l) => l.renewed = Instant::now(),
                    // Fenced: its opens are gone; it must register again.
                    None => return Err(FsError::Io("lease expired: client was fenced".into())),
                }
                A::Done
            }
            R::ClientLeaves { client } => {
                if let Some(l) = self.clients.lock().get_mut(&client) {
                    l.leaving = true;
                    log::info!("client {} leaves", client.0);
                }
                self.grants.left(client);
                self.ns.lock().forget_loan(client);
                let _ = self.reaper_wake.lock().send(());
                A::Done
            }
            R::RegisterDataServer { nic, shm, ib, region, capacity, rejoin, fs, kept, durable } => {
                if let Some(theirs) = fs.filter(|&f| f != self.identity.fs) {
                    return Err(FsError::Invalid(format!(
                        "this data server's memory belongs to file system {theirs}, and this meta-server \
                         serves {}: point it at its own meta-server, or give it another (empty) data \
                         directory",
                        self.identity.fs
                    )));
                }
                let id = citronfs_core::types::DataServerId(0);
                let info = citronfs_core::proto::DataServerInfo { id, nic, shm, ib, durable };
                self.register_data_server(info, region, capacity, rejoin, kept)?
            }
            R::DataServerLeaves { id } => {
                self.lose_data_server(id, "it left");
                A::Done
            }
            R::Lookup { parent, name, .. } => {
                let ns = self.ns.lock();
                match (ns.lookup(parent, &name), caching) {
                    (Ok(attr), _) => self.granted(&ns, caching, attr, Some(Entry { parent, name })),
                    // The name is not in the directory (which is there):
                    // its absence is granted as the entry ([`crate::grants`],
                    // "Absent names").
                    (Err(FsError::NotFound), Some((client, ttl))) if ns.is_dir(parent) => {
                        self.grants.grant(client, Entry { parent, name }, ttl);
                        A::Absent
                    }
                    (Err(e), _) => return Err(e),
                }
            }
            R::GetAttr { ino } => {
                let ns = self.ns.lock();
                self.granted(&ns, caching, ns.attr(ino)?, None)
            }
            R::SetAttr { caller, ino, set } => {
                checks.setattr(&self.ns.lock(), caller, ino, &set)?;
                changed.keys.push(AttrOf(ino));
                let (attr, zero) = if set.size.is_some() || set.mtime.is_some() {
                    self.with_attr_locked(ino, || self.ns.lock().setattr(ino, &set))?
                } else {
                    self.ns.lock().setattr(ino, &set)?
                };
                if set.size.is_some() {
                    memory_changed(ino);
                }
                self.zero(&zero)?;
                A::Attr(attr)
            }
            R::Create { caller, parent, name, kind, perm, rdev } => {
                if kind == FileKind::Symlink {
                    return Err(FsError::Invalid("symlinks are made with Symlink".into()));
                }
                let new = NewInode { kind, perm, rdev, symlink_target: None };
                let mut ns = self.ns.lock();
                checks.add_entry(&ns, caller, parent)?;
                let attr = ns.create(caller, parent, &name, new)?;
                let new = Some((&attr, &name[..]));
                let answer = self.with_parent(&ns, caching, parent, A::Attr(attr.clone()), false, new);
                self.entry_changed(caching, changed, parent, name);
                changed.keys.push(AttrOf(parent));
                answer
            }
            R::Symlink { caller, parent, name, target } => {
                let new =
                    NewInode { kind: FileKind::Symlink, perm: 0o777, rdev: 0, symlink_target: Some(target) };
                let mut ns = self.ns.lock();
                checks.add_entry(&ns, caller, parent)?;
                let attr = ns.create(caller, parent, &name, new)?;
                let new = Some((&attr, &name[..]));
                let answer = self.with_parent(&ns, caching, parent, A::Attr(attr.clone()), false, new);
                self.entry_changed(caching, changed, parent, name);
                changed.keys.push(AttrOf(parent));
                answer
            }
            R::ReadLink { ino } => A::Target(self.ns.lock().readlink(ino)?),
            R::Link { caller, ino, new_parent, new_name } => {
                let mut ns = self.ns.lock();
                checks.add_entry(&ns, caller, new_parent)?;
                let attr = ns.link(ino, new_parent, &new_name)?;
                self.entry_changed(caching, changed, new_parent, new_name);
                changed.keys.extend([AttrOf(ino), AttrOf(new_parent)]);
                A::Attr(attr)
            }
            R::Unlink { caller, parent, name } => {
                self.unlink(checks, caching, changed, (caller, parent, name), Timestamp::now(), None)?
            }
            R::Rmdir { caller, parent, name } => {
                let mut ns = self.ns.lock();
                if name != b"." && name != b".." {
                    checks.remove_entry(&ns, caller, parent, &name)?;
                }
                let victim = ns.lookup(parent, &name).ok().map(|a| a.ino);
                ns.rmdir(parent, &name)?;
                self.entry_changed(caching, changed, parent, name);
                changed.keys.push(AttrOf(parent));
                changed.keys.extend(victim.map(AttrOf));
                self.with_parent(&ns, caching, parent, A::Done, false, None)
            }
            R::Rename { caller, parent, name, new_parent, new_name, flags } => {
                let mut ns = self.ns.lock();
                checks.rename(&ns, caller, (parent, &name), (new_parent, &new_name))?;
                let moved = ns.lookup(parent, &name).ok().map(|a| a.ino);
                let replaced = ns.lookup(new_parent, &new_name).ok().map(|a| a.ino);
                ns.rename(parent, &name, new_parent, &new_name, flags)?;
                let (from, to) = (
                    Entry { parent, name: name.clone() },
                    Entry { parent: new_parent, name: new_name.clone() },
                );
                if let Some((client, _)) = caching {
                    // Its kernel moved the dentry, with its time
                    // ([`crate::grants`], "Absent names").
                    let exchange = flags == citronfs_core::proto::RenameMode::Exchange;
                    self.grants.moved(client, &from, &to, exchange);
                }
                changed.keys.extend([AttrOf(parent), AttrOf(new_parent)]);
                changed.keys.extend(moved.into_iter().chain(replaced).map(AttrOf));
                changed.keys.extend([from, to]);
                A::Done
            }
            R::ReadDir { ino, after, max, .. } => {
                A::Entries(self.ns.lock().readdir(ino, after, max.min(MAX_READDIR))?)
            }
            R::ReadDirPlus { ino, after, max, .. } => {
                let ns = self.ns.lock();
                self.entries_plus(&ns, caching, ino, after, max)?
            }
            R::Access { caller, ino, access } => {
                checks.access(&self.ns.lock(), caller, ino, access)?;
                A::Done
            }
            R::CreateOpen { caller, client, parent, name, perm, exclusive } => self.create_open(
                checks,
                caching,
                changed,
                (caller, client, parent, name),
                perm,
                Making::Now { exclusive },
            )?,
            R::LendInodes { client, count } => A::Lent(self.ns.lock().lend(client, count)),
            // Its creates need lock memory: none is handed out in the
            // grace period, and none of the batch is applied until then.
            R::LateChanges { .. } if self.ns.lock().lock_memory_frozen() => return Err(FsError::Grace),
            R::LateChanges { client, changes } => A::LateApplied(
                changes
                    .into_iter()
                    .map(|change| match change {
                        LateChange::Unlink(LateUnlink { caller, parent, name, ino, at }) => self
                            .unlink(checks, caching, changed, (caller, parent, name), at, Some(ino))
                            .map(|_| LateDone::Unlinked),
                        LateChange::Create(LateCreate {
                            caller,
                            parent,
                            name,
                            ino,
                            perm,
                            at,
                            first_write,
                        }) => {
                            let making = Making::Lent { ino, at };
                            let who = (caller, client, parent, name);
                            let answer =
                                match self.create_open(checks, caching, changed, who, perm, making)? {
                                    A::ParentGranted { answer, .. } => *answer,
                                    answer => answer,
                                };
                            match answer {
                                A::Opened(_, mut layout) => {
                                    self.allocate_first_write(&first_write, &mut layout);
                                    Ok(LateDone::Created(layout))
                                }
                                other => Err(FsError::Io(format!("a late create answered {other:?}"))),
                            }
                        }
                    })
                    .collect(),
            ),
            R::KillSuidGid { ino, groups } => {
                // Sent by a writer in the middle of its write: its kernel
                // does not know the mode changed.
                changed.keys.push(AttrOf(ino));
                changed.changer_too = true;
                A::Attr(self.ns.lock().kill_suidgid(ino, &groups)?)
            }
            R::Open { caller, client, ino, flags } => {
                let mut ns = self.ns.lock();
                checks.open(&ns, caller, ino, flags)?;
                let layout = ns.open(client, ino)?;
                let write = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
                self.access.opened(client, ino, ns.file_memory(ino), write);
                if write {
                    // Its size and mtime may now change one-sidedly.
                    self.grants.writing(client, ino);
                    changed.keys.push(AttrOf(ino));
                }
                A::Layout(layout)
            }
            R::Layout { ino } => A::Layout(self.ns.lock().layout(ino)?),
            R::Release { client, ino, opens } => match self.release(caching, client, ino, opens)? {
                Some(HeldAgain { dir, attr }) => A::Held { dir, attr },
                None => A::Done,
            },
            R::ReleaseMany { client, files } => {
                // Each file as its own `Release`: one that fails (a file
                // another request of this client already released) is
                // logged and does not keep the others from their release.
                let mut held = Vec::new();
                for FileRelease { ino, opens } in files {
                    match self.release(caching, client, ino, opens) {
                        Ok(again) => held.extend(again),
                        Err(e) => log::warn!("client {}: release of inode {}: {e}", client.0, ino.0),
                    }
                }
                A::HeldAgain(held)
            }
            R::GrowWaitsFor { last } => {
                A::WaitsForBlock(self.waits_for_chain.grow(last, &self.ns, &self.access)?)
            }
            R::GrowLockTable { ino, last } => {
                must_hold(ino, false)?;
                let mut ns = self.ns.lock();
                let first = ns.grow_lock_table(ino, last)?;
                self.access.file_changed(ino, ns.file_memory(ino));
                A::LockTable(first)
            }
            R::Clients => A::Clients(
                self.clients
                    .lock()
                    .iter()
                    .map(|(id, l)| ClientInfo { id: *id, hostname: l.hostname.clone(), pid: l.pid })
                    .collect(),
            ),
            R::AllocChunks { ino, chunks, ahead } => {
                must_hold(ino, true)?;
                if ahead.len() > MAX_AHEAD_CHUNKS {
                    let asked = ahead.len();
                    return Err(FsError::Invalid(format!(
                        "{asked} chunks asked ahead, at most {MAX_AHEAD_CHUNKS}"
                    )));
                }
                A::Chunks(self.with_extents(ino, |ns| {
                    let mut plan = ns.plan_extents(ino, &chunks, false)?;
                    ns.plan_ahead(&mut plan, &ahead);
                    Ok(plan)
                })?)
            }
            R::GrowExtents { ino, chunks } => {
                must_hold(ino, true)?;
                A::Chunks(self.with_extents(ino, |ns| ns.plan_extents(ino, &chunks, true))?)
            }
            R::Fallocate { ino, offset, len, keep_size } => {
                must_hold(ino, true)?;
                changed.keys.push(AttrOf(ino));
                self.with_extents(ino, |ns| ns.plan_fallocate(ino, offset, len))?;
                let grow = || self.ns.lock().fallocate_size(ino, offset, len, keep_size);
                if keep_size {
                    grow()?;
                } else {
                    self.with_attr_locked(ino, grow)?;
                }
                A::Done
            }
            R::StatFs => {
                let mut ns = self.ns.lock();
                ns.sweep_orphans();
                A::Stats(ns.stats())
            }
            R::Status => A::Status(Box::new(self.status())),
            R::SetXattr { caller, ino, name, value, mode } => {
                let mut ns = self.ns.lock();
                checks.xattr_write(&ns, caller, ino, &name)?;
                ns.set_xattr(ino, &name, &value, mode)?;
                changed.keys.push(AttrOf(ino));
                A::Done
            }
            R::GetXattr { ino, name, .. } => A::Xattr(self.ns.lock().get_xattr(ino, &name)?),
            R::ListXattr { ino, .. } => A::XattrNames(self.ns.lock().list_xattr(ino)?),
            R::RemoveXattr { caller, ino, name } => {
                let mut ns = self.ns.lock();
                checks.xattr_write(&ns, caller, ino, &name)?;
                ns.remove_xattr(ino, &name)?;
                changed.keys.push(AttrOf(ino));
                A::Done
            }
            R::Caching { .. } | R::Once { .. } => {
                return Err(FsError::Invalid("a Caching or Once request wraps one that is not".into()))
            }
            R::AwaitInvalidations { client, acked } => {
                let polled = self.grants.poll(client, acked, POLL_WAIT);
                A::Invalidations { through: polled.through, items: polled.items, renewed: polled.renewed }
            }
            R::ReportLockTiming { client, t_wait_us } => {
                if !self.clients.lock().contains_key(&client) {
                    return Err(FsError::Io("lease expired: client was fenced".into()));
                }
                self.tuning.report(client, Duration::from_micros(t_wait_us));
                A::Done
            }
        })
    }
}
