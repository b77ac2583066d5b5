//! The client's side of byte-range locks: `getlk`, `setlk`, blocking
//! `setlk` handed to the waiter thread, and the releases at close
//! (DESIGN.md §4, §7). The protocol itself is [`crate::locks::protocol`].

use std::sync::Arc;

use citron_lock::rdma::{Endpoint, RemoteAddr};

use super::holds::HoldKey;
use super::opens::Pinned;
use super::tokens::Local;
use super::{unexpected, FsClient, Shared};
use crate::error::FsError;
use crate::locks::table::TableGrowth;
use crate::locks::token::{LocalOutcome, TokenWord};
use crate::locks::waiter::{Interrupted, LockDone, Pending, WaiterContext, Waiters};
use crate::locks::waits_for::WaitsForGrowth;
use crate::locks::{
    ByteRange, FileLocks, LockArea, LockFlavor, LockMode, LockOwner, LockRecord, LockTiming, Outcome,
    OwnerKey, Request, WaitSpec, WaitsFor,
};
use crate::proto::{MetaRequest, MetaResponse};
use crate::types::{ClientId, Ino};

/// One lock call as the kernel makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockCall {
    pub ino: Ino,
    pub owner: LockOwner,
    pub flavor: LockFlavor,
    /// `None` unlocks.
    pub mode: Option<LockMode>,
    pub range: ByteRange,
    /// The locking process on this node (reported by `F_GETLK`).
    pub pid: u32,
    /// The open file it comes through (flock and OFD locks go at its last
    /// close).
    pub fh: u64,
}

/// Grows a table through the meta-server.
pub(super) struct RpcGrowth<'a> {
    pub shared: &'a Shared,
    pub ino: Ino,
}

impl TableGrowth for RpcGrowth<'_> {
    fn grow(&self, last: Option<RemoteAddr>) -> Result<RemoteAddr, FsError> {
        match super::answer(self.shared.call(&MetaRequest::GrowLockTable { ino: self.ino, last }))? {
            MetaResponse::LockTable(first) => Ok(first),
            other => Err(unexpected(other)),
        }
    }
}

impl WaitsForGrowth for RpcGrowth<'_> {
    fn grow_waits_for(&self, last: RemoteAddr) -> Result<RemoteAddr, FsError> {
        match super::answer(self.shared.call(&MetaRequest::GrowWaitsFor { last }))? {
            MetaResponse::WaitsForBlock(next) => Ok(next),
            other => Err(unexpected(other)),
        }
    }
}

/// What the waiter thread borrows from the client.
struct Context {
    shared: Arc<Shared>,
    timing: LockTiming,
    waits_for: WaitsFor,
}

impl WaiterContext for Context {
    fn client(&self) -> ClientId {
        ClientId(self.shared.client.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn fenced(&self) -> bool {
        self.shared.fenced()
    }

    fn timing(&self) -> LockTiming {
        self.timing.clone()
    }

    fn waits_for(&self) -> WaitsFor {
        self.waits_for
    }

    fn growth(&self, ino: Ino) -> Box<dyn TableGrowth + '_> {
        Box::new(RpcGrowth { shared: &self.shared, ino })
    }

    fn meta_server_away(&self) -> bool {
        self.shared.away_now()
    }

    fn area(&self, ino: Ino) -> Option<LockArea> {
        self.shared.opens.get(ino).and_then(|e| e.lock().area)
    }
}

impl FsClient {
    pub(super) fn start_waiters(&mut self, ep: Endpoint) -> Result<(), FsError> {
        let context = Arc::new(Context {
            shared: self.shared.clone(),
            timing: self.timing.clone(),
            waits_for: self.waits_for,
        });
        // One endpoint (and mailbox) per waiter thread; `ep` is the first.
        let node = self.meta_node.clone();
        let open = Box::new(move || Ok(node.endpoint()?));
        self.waiters = Some(Waiters::start(ep, open, context)?);
        Ok(())
    }

    fn owner_key(&self, owner: LockOwner) -> OwnerKey {
        OwnerKey { client: self.client_id(), owner }
    }

    fn request(&self, call: &LockCall) -> Request {
        Request {
            owner: self.owner_key(call.owner),
            flavor: call.flavor,
            mode: call.mode,
            range: call.range,
            pid: call.pid,
            fh: call.fh,
        }
    }

    fn hold_key(call: &LockCall) -> HoldKey {
        match call.flavor {
            LockFlavor::Posix => HoldKey::Owner(call.ino, call.owner),
            LockFlavor::Ofd | LockFlavor::Flock => HoldKey::Handle(call.ino, call.fh),
        }
    }

    /// The file's lock area and its table's first block; creates the table
    /// when `create` (a lock is about to be taken), else `None` when there
    /// is no table (so nothing is locked). `pin` holds the addresses, lent
    /// by this client's open of the file ([`super::opens`]): the kernel sends
    /// lock calls only for open files.
    pub(super) fn lock_table(
        &self,
        ep: &Endpoint,
        pin: &Pinned,
        ino: Ino,
        create: bool,
    ) -> Result<Option<(LockArea, RemoteAddr)>, FsError> {
        let area = pin
            .area
            .ok_or_else(|| FsError::Io(format!("inode {} has no lock memory though it is open", ino.0)))?;
        if let Some(t) = pin.table {
            return Ok(Some((area, t)));
        }
        let head = ep.read_u64(area.table_head())?;
        let first = match crate::locks::record::unpack_addr(head) {
            Some(first) => first,
            None if create => RpcGrowth { shared: &self.shared, ino }.grow(None)?,
            None => return Ok(None),
        };
        pin.set_table(first);
        Ok(Some((area, first)))
    }

    pub(super) fn file_locks<'a>(
        &'a self,
        ep: &'a Endpoint,
        ino: Ino,
        area: LockArea,
        table: RemoteAddr,
        growth: &'a RpcGrowth<'a>,
    ) -> FileLocks<'a> {
        FileLocks {
            ep,
            client: self.client_id(),
            ino,
            area,
            table,
            timing: &self.timing,
            waits_for: self.waits_for,
            growth,
        }
    }

    /// `F_GETLK`: the first lock that would block `call` (its mode must be
    /// set), or `None`.
    pub fn getlk(&self, call: &LockCall) -> Result<Option<LockRecord>, FsError> {
        self.riding_out_restarts(|| self.getlk_once(call))
    }

    fn getlk_once(&self, call: &LockCall) -> Result<Option<LockRecord>, FsError> {
        let mode = call.mode.ok_or_else(|| FsError::Invalid("F_GETLK of F_UNLCK".into()))?;
        let pin = self.pin(call.ino)?;
        let owner = self.owner_key(call.owner);
        self.under_token(
            call.ino,
            &pin,
            false,
            |local| Local::Done(local.get(owner, call.flavor, mode, call.range)),
            || {
                self.with_endpoints(|eps| {
                    let Some((area, table)) = self.lock_table(&eps.meta, &pin, call.ino, false)? else {
                        return Ok(None);
                    };
                    let growth = RpcGrowth { shared: &self.shared, ino: call.ino };
                    let locks = self.file_locks(&eps.meta, call.ino, area, table, &growth);
                    locks.get(owner, call.flavor, mode, call.range)
                })
            },
        )
    }

    /// `F_SETLK`, `LOCK_NB`, unlock: never waits; a conflict is
    /// [`FsError::WouldBlock`].
    pub fn setlk(&self, call: &LockCall) -> Result<(), FsError> {
        self.riding_out_restarts(|| self.setlk_once(call))
    }

    fn setlk_once(&self, call: &LockCall) -> Result<(), FsError> {
        let pin = self.pin(call.ino)?;
        // Until the lock is written (or refused), closes keep the owner.
        let _acquiring = call.mode.map(|_| self.may_hold.acquiring(Self::hold_key(call)));
        let req = self.request(call);
        self.under_token(
            call.ino,
            &pin,
            call.mode.is_some(),
            |local| match local.set(&req, false) {
                LocalOutcome::Granted => Local::Done(Ok(())),
                LocalOutcome::Refused => Local::Done(Err(FsError::WouldBlock)),
                LocalOutcome::MustPublish => Local::Publish,
            },
            || {
                self.with_endpoints(|eps| {
                    let Some((area, table)) =
                        self.lock_table(&eps.meta, &pin, call.ino, call.mode.is_some())?
                    else {
                        return Ok(Ok(())); // unlocking where nothing was ever locked
                    };
                    let growth = RpcGrowth { shared: &self.shared, ino: call.ino };
                    let locks = self.file_locks(&eps.meta, call.ino, area, table, &growth);
                    match locks.set(&req, None)? {
                        Outcome::Granted => Ok(Ok(())),
                        Outcome::Refused(_) => Ok(Err(FsError::WouldBlock)),
                        Outcome::Waiting { .. } => {
                            Err(FsError::Io("a non-blocking request registered a wait".into()))
                        }
                    }
                })
            },
        )?
    }

    /// `F_SETLKW`, blocking `flock`: `done` is called once with the result,
    /// at once or later from the waiter thread; the caller's thread never
    /// waits for another owner. `interrupted` tells the waiter that the
    /// caller was signalled (answered with [`FsError::Interrupted`]).
    pub fn setlkw(&self, call: &LockCall, interrupted: Interrupted, done: LockDone) {
        let Some(waiters) = self.waiters.as_ref() else {
            return done(Err(FsError::Io("no lock waiter".into())));
        };
        // Until the lock is written (or the wait ends otherwise), closes
        // keep the owner: the answer drops this.
        let acquiring = call.mode.map(|_| self.may_hold.acquiring(Self::hold_key(call)));
        let done: LockDone = Box::new(move |r| {
            drop(acquiring);
            done(r)
        });
        let req = self.request(call);
        let attempt = self.riding_out_restarts(|| {
            // Held until the wait is handed to the waiter thread, so the
            // file's last release (which cancels its waits first) waits
            // for it.
            let pin = self.pin(call.ino)?;
            // `None`: granted under this client's lock token.
            let made = self.under_token(
                call.ino,
                &pin,
                call.mode.is_some(),
                |local| match local.set(&req, true) {
                    LocalOutcome::Granted => Local::Done(None),
                    LocalOutcome::Refused | LocalOutcome::MustPublish => Local::Publish,
                },
                || {
                    self.with_endpoints(|eps| {
                        let Some((area, table)) = self.lock_table(&eps.meta, &pin, call.ino, true)? else {
                            return Err(FsError::Io("no lock table after creating it".into()));
                        };
                        let growth = RpcGrowth { shared: &self.shared, ino: call.ino };
                        let locks = self.file_locks(&eps.meta, call.ino, area, table, &growth);
                        let spec = WaitSpec { mailbox: waiters.mailbox(call.ino)?, registered: None };
                        Ok(Some((locks.set(&req, Some(spec))?, area, table)))
                    })
                },
            )?;
            Ok((made, pin))
        });
        match attempt {
            Ok((None, _)) => done(Ok(())),
            Ok((Some((Outcome::Granted, _, _)), _)) => done(Ok(())),
            Ok((Some((Outcome::Waiting { registration, .. }, area, table)), pin)) => {
                let ino = call.ino;
                waiters.wait(Pending {
                    ino,
                    area,
                    table,
                    req,
                    registration,
                    interrupted,
                    done,
                    failing_since: None,
                });
                drop(pin);
            }
            Ok((Some((Outcome::Refused(_), _, _)), _)) => done(Err(FsError::WouldBlock)),
            Err(e) => done(Err(e)),
        }
    }

    /// Releases every POSIX lock `owner` holds on `ino` (any close of the
    /// file by that owner: FUSE's flush).
    pub fn release_owner_locks(&self, ino: Ino, owner: LockOwner) -> Result<(), FsError> {
        if !self.may_hold.closing(HoldKey::Owner(ino, owner)) {
            return Ok(());
        }
        let me = self.owner_key(owner);
        self.release_matching(ino, |r| r.owner == me && r.flavor == LockFlavor::Posix)
    }

    /// Releases every OFD and flock lock taken through the open file `fh`
    /// (its last close: FUSE's release).
    pub fn release_handle_locks(&self, ino: Ino, fh: u64) -> Result<(), FsError> {
        if !self.may_hold.closing(HoldKey::Handle(ino, fh)) {
            return Ok(());
        }
        let client = self.client_id();
        self.release_matching(ino, |r| {
            r.owner.client == client && r.fh == fh && r.flavor != LockFlavor::Posix
        })
    }

    fn release_matching(&self, ino: Ino, matches: impl Fn(&LockRecord) -> bool) -> Result<(), FsError> {
        self.riding_out_restarts(|| self.release_matching_once(ino, &matches))
    }

    fn release_matching_once(&self, ino: Ino, matches: &impl Fn(&LockRecord) -> bool) -> Result<(), FsError> {
        let pin = self.pin(ino)?;
        self.under_token(
            ino,
            &pin,
            false,
            |local| {
                local.release_matching(matches);
                Local::Done(())
            },
            || {
                self.with_endpoints(|eps| {
                    let Some((area, table)) = self.lock_table(&eps.meta, &pin, ino, false)? else {
                        return Ok(());
                    };
                    let growth = RpcGrowth { shared: &self.shared, ino };
                    let locks = self.file_locks(&eps.meta, ino, area, table, &growth);
                    locks.release_matching(|r| {
                        r.state == crate::locks::record::RecordState::Held && matches(r)
                    })?;
                    Ok(())
                })
            },
        )
    }

    /// Every lock record of `ino` (held and waiting), read without a range
    /// lock: a snapshot for `citronfs locks`. A file not open here is opened
    /// for the call (its lock memory exists only while it is open).
    pub fn lock_records(&self, ino: Ino) -> Result<Vec<LockRecord>, FsError> {
        // Opened as root for reading: in a keyed cluster a client may touch
        // the lock memory of files it has open only.
        self.while_open(crate::types::Caller::ROOT, ino, libc::O_RDONLY, |pin| {
            self.lock_records_pinned(pin, ino)
        })
    }

    fn lock_records_pinned(&self, pin: &Pinned, ino: Ino) -> Result<Vec<LockRecord>, FsError> {
        // Held under this client's token: the table has none of them.
        let mut records = self.token_records(ino).unwrap_or_default();
        let table_records = self.with_endpoints(|eps| {
            let Some((area, table)) = self.lock_table(&eps.meta, pin, ino, false)? else {
                return Ok(Vec::new());
            };
            // Another client's token: its records go to the table first.
            let first = crate::locks::table::read_first_block(&eps.meta, table)?;
            if let Some(token) = TokenWord::of_block(&first).filter(|t| t.holder != self.client_id()) {
                let growth = RpcGrowth { shared: &self.shared, ino };
                self.file_locks(&eps.meta, ino, area, table, &growth).await_revocation(token)?;
            }
            // A torn slot is being changed right now; read again a few
            // times for a clean picture.
            let mut snapshot = crate::locks::table::read(&eps.meta, table)?;
            for _ in 0..8 {
                if !snapshot.has_busy() {
                    break;
                }
                snapshot = crate::locks::table::read(&eps.meta, table)?;
            }
            Ok(snapshot.records().into_iter().map(|l| l.record).collect::<Vec<_>>())
        })?;
        records.extend(table_records);
        Ok(records)
    }

    /// The registered clients (hostname and pid of each mount).
    pub fn clients(&self) -> Result<Vec<crate::proto::ClientInfo>, FsError> {
        match self.call(&MetaRequest::Clients)? {
            MetaResponse::Clients(c) => Ok(c),
            other => Err(unexpected(other)),
        }
    }
}
