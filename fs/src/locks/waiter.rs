//! Blocked lock requests (`F_SETLKW`, blocking `flock`) of one client,
//! served by a small pool of waiter threads, sharded by file, so that no
//! FUSE worker waits (DESIGN.md §7) and waits on many files do not queue
//! behind one thread.
//!
//! A request that finds a conflict registers a waiting record (with its
//! shard's mailbox) and is handed to the shard of its file with a
//! completion. The shard's thread then tries it again
//! * when a releaser's [`LockMessage::Wake`] for its file arrives,
//! * at once when it is handed over (a wake may have come first),
//! * every [`RETRY_EVERY`] anyway (a releaser that died before sending);
//!
//! and, every [`WATCH_EVERY`], asks each request's `interrupted` probe
//! (the mount watches the caller's pending signals), withdrawing and
//! answering `EINTR` for those that were interrupted.
//!
//! # Why a pool sharded by file
//!
//! A retry, a withdrawal and an `EINTR` check are blocking work: a range
//! lock acquisition (which may wait behind another client's I/O on the
//! same bytes), table reads and writes, a `/proc` read. With one thread per
//! mount, a retry stuck behind a busy range of one file delayed the grants
//! of every other file. Each shard ([`WAITER_THREADS`] of them) has its own
//! thread, endpoint and mailbox, and serves the files whose inode number
//! falls to it (`ino mod shards`: consecutive inodes spread over every
//! shard); a shard other than the first starts at its first wait, so a
//! mount that never waits costs one thread and one endpoint, as before. A file's requests all live in one shard, so its wakes, retries
//! and cancellation stay ordered as before (a releaser wakes the mailbox a
//! waiting record names, which is its file's shard); only files of one
//! shard can delay each other. A few threads, not one per wait: a mount
//! may have thousands of waits, and each thread is idle but for the few
//! that are woken. (Per-wait non-blocking state machines would remove even
//! that sharing, at the price of making every verb of the lock protocol
//! asynchronous.)
//!
//! A pending request holds its file's table address, which is valid only
//! while the file is open on this client: before the client's last release
//! of a file, [`Waiters::cancel_file`] withdraws the file's requests (a
//! caller the kernel abandoned) and waits until that is done. Requests
//! handed over are counted by file until answered, so the last release of
//! a file nobody waited on (nearly every file) exchanges nothing with a
//! thread: before, it was a round trip to the thread's mailbox for every
//! file of the first shard, a quarter of all closes.
//!
//! # Waits across a fence (no orphaned locks)
//!
//! A request belongs to the identity (client id) it was registered under.
//! Once the client is fenced, the meta-server removes that identity's
//! records, and nothing will ever release a record written under it
//! afterwards: the client's closes release locks of its *new* identity. So
//! * while the client is fenced, its requests are not retried (they touch
//!   no lock memory);
//! * a request of an older identity (the client registered again) is
//!   answered EIO without touching lock memory;
//! * a retry already in flight when the fence came may still write its
//!   grant (no server refuses a fenced client's verbs yet: see the lease
//!   ordering in `guard`). So a grant is kept only if, after it was written, the client
//!   is neither fenced nor registered anew: the client fences itself
//!   (3/4 of a lease without renewal) before the meta-server removes its
//!   records (a whole lease), so a grant written after that removal is
//!   always seen here, and is released again under the identity it was
//!   written for, and the caller is answered EIO. A grant written before
//!   the removal is removed by it. EIO rather than a re-issue under the new
//!   identity: the caller's descriptor was opened under the old
//!   registration and answers EIO from now on anyway (the client dropped
//!   those opens), so a lock granted to it could not be used or released
//!   through it.
//!
//! # A waiter that dies
//!
//! A grant to a waiter whose whole mount died is removed with the mount's
//! lease, like its held locks. A waiter *process* killed on a live mount
//! leaves no grant behind: on the kernels we run (6.18) a FUSE request that
//! the daemon has read is not abandoned when its caller gets SIGKILL; the
//! caller waits (in D state) for the answer, and its close (FUSE's flush,
//! which releases its POSIX locks) comes after that.
//!
//! A completion is called exactly once: granted, failed, interrupted, or
//! shut down.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use citron_lock::rdma::{ClientAddr, Endpoint, RemoteAddr};
use crossbeam_channel::{select, Receiver, Sender};

use super::area::LockArea;
use super::guard::LockTiming;
use super::plan::Request;
use super::protocol::{FileLocks, LockMessage, Outcome, Registration, WaitSpec};
use super::table::TableGrowth;
use super::waits_for::WaitsFor;
use crate::error::FsError;
use crate::types::{ClientId, Ino};

/// How often pending requests are checked for interruption.
pub const WATCH_EVERY: Duration = Duration::from_millis(10);
/// How often every pending request is retried without a wake-up.
pub const RETRY_EVERY: Duration = Duration::from_millis(500);
/// How long a request whose retries fail for want of the meta-server's
/// lock memory keeps waiting once the meta-server answers again (its
/// connections to a restarted meta-server are made anew meanwhile).
const AWAY_PATIENCE: Duration = Duration::from_secs(5);
/// How often an idle waiter thread looks at its stop flag.
const IDLE_TICK: Duration = Duration::from_millis(100);
/// Waiter threads (shards) per client.
pub const WAITER_THREADS: usize = 4;

/// Called once with the request's result.
pub type LockDone = Box<dyn FnOnce(Result<(), FsError>) + Send>;
/// Whether the waiting caller has been interrupted (or is gone).
pub type Interrupted = Box<dyn Fn() -> bool + Send>;

/// One blocked request.
pub struct Pending {
    pub ino: Ino,
    pub area: LockArea,
    pub table: RemoteAddr,
    pub req: Request,
    pub registration: Registration,
    pub interrupted: Interrupted,
    pub done: LockDone,
    /// Since when its retries fail though the meta-server answers.
    pub failing_since: Option<Instant>,
}

/// What the waiter thread needs from its client.
pub trait WaiterContext: Send + Sync + 'static {
    fn client(&self) -> ClientId;
    /// Whether the client is fenced right now (its records may be gone).
    fn fenced(&self) -> bool;
    fn timing(&self) -> LockTiming;
    fn waits_for(&self) -> WaitsFor;
    /// Grows `ino`'s table (an RPC to the meta-server).
    fn growth(&self, ino: Ino) -> Box<dyn TableGrowth + '_>;
    /// Whether the meta-server is away now (it stopped answering, or
    /// restarted and the client has not reclaimed yet), asking it if need
    /// be: then the lock memory is out of reach for a while, and waits wait
    /// on instead of failing.
    fn meta_server_away(&self) -> bool;
    /// The lock area `ino` is open with now (a restarted meta-server may
    /// have lent it with a new range lock), if it is open here.
    fn area(&self, ino: Ino) -> Option<LockArea>;
}

/// What the client hands its waiter thread.
enum Handoff {
    Wait(Box<Pending>),
    /// Withdraw every request on this file, then answer on the channel.
    Cancel(Ino, Sender<()>),
}

/// How long the last release of a file waits for its waits to be withdrawn
/// (the waiter thread may be in the middle of one retry).
const CANCEL_WAIT: Duration = Duration::from_secs(30);

/// One waiter thread as the client sees it.
#[derive(Clone)]
struct Shard {
    mailbox: ClientAddr,
    handoff: Sender<Handoff>,
}

/// Opens an endpoint for a new waiter thread.
pub type OpenEndpoint = Box<dyn Fn() -> Result<Endpoint, FsError> + Send + Sync>;

/// The client's side of its waiter threads.
///
/// Shard 0 starts with the client on the endpoint it is given; the others
/// start at their first wait (a mount that never waits on their files opens
/// no endpoint, so no connection, for them).
pub struct Waiters {
    shards: Vec<parking_lot::Mutex<Option<Shard>>>,
    open: OpenEndpoint,
    context: Arc<dyn WaiterContext>,
    stop: Arc<AtomicBool>,
    /// Joined at shutdown. Its lock also orders starting a shard against
    /// the stop flag: no thread starts after `shutdown` has taken the list.
    threads: parking_lot::Mutex<Vec<JoinHandle<()>>>,
    /// Requests handed to the threads and not yet answered, by file: the
    /// last release of a file nobody waits on needs no word with a thread.
    handed: Arc<HandedWaits>,
}

/// Requests handed to the waiter threads and not yet answered, by file.
#[derive(Default)]
struct HandedWaits(parking_lot::Mutex<HashMap<Ino, u32>>);

impl HandedWaits {
    fn enter(&self, ino: Ino) {
        *self.0.lock().entry(ino).or_default() += 1;
    }

    fn leave(&self, ino: Ino) {
        let mut map = self.0.lock();
        if let Some(n) = map.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                map.remove(&ino);
            }
        }
    }

    fn any(&self, ino: Ino) -> bool {
        self.0.lock().contains_key(&ino)
    }
}

impl Waiters {
    /// Starts the first of [`WAITER_THREADS`] shards on `ep`; the others
    /// start on endpoints from `open` when first needed.
    pub fn start(ep: Endpoint, open: OpenEndpoint, context: Arc<dyn WaiterContext>) -> Result<Self, FsError> {
        let waiters = Self {
            shards: (0..WAITER_THREADS).map(|_| parking_lot::Mutex::new(None)).collect(),
            open,
            context,
            stop: Arc::new(AtomicBool::new(false)),
            threads: parking_lot::Mutex::new(Vec::new()),
            handed: Arc::default(),
        };
        *waiters.shards[0].lock() = Some(waiters.spawn(0, ep)?);
        Ok(waiters)
    }

    fn spawn(&self, i: usize, ep: Endpoint) -> Result<Shard, FsError> {
        let mut threads = self.threads.lock();
        // Relaxed: read under the `threads` lock, which `shutdown` holds
        // while it sets the flag.
        if self.stop.load(Ordering::Relaxed) {
            return Err(FsError::Io("the lock waiter has stopped".into()));
        }
        let mailbox = ep.addr();
        let (handoff, incoming) = crossbeam_channel::unbounded();
        let (stop, context) = (self.stop.clone(), self.context.clone());
        let thread = std::thread::Builder::new()
            .name(format!("citronfs-lock-waiter-{i}"))
            .spawn(move || WaiterThread { ep, context, incoming, pending: Vec::new(), stop }.run())
            .map_err(|e| FsError::Io(format!("starting a lock waiter: {e}")))?;
        threads.push(thread);
        Ok(Shard { mailbox, handoff })
    }

    /// The shard that serves `ino`, started if it was not.
    fn shard(&self, ino: Ino) -> Result<Shard, FsError> {
        let i = shard_of(ino, self.shards.len());
        let mut slot = self.shards[i].lock();
        if let Some(s) = slot.as_ref() {
            return Ok(s.clone());
        }
        let shard = self.spawn(i, (self.open)()?)?;
        *slot = Some(shard.clone());
        Ok(shard)
    }

    /// Where waiting records of `ino` on this client are woken.
    pub fn mailbox(&self, ino: Ino) -> Result<ClientAddr, FsError> {
        Ok(self.shard(ino)?.mailbox)
    }

    /// Hands a registered request to its file's thread.
    pub fn wait(&self, mut pending: Pending) {
        let shard = match self.shard(pending.ino) {
            Ok(s) => s,
            Err(e) => return (pending.done)(Err(e)),
        };
        // Counted until answered: a thread that answered a request holds
        // no address of it any more. Counted before the caller's call
        // ends, so before the file's last release can look.
        let (ino, handed, done) = (pending.ino, self.handed.clone(), pending.done);
        handed.enter(ino);
        pending.done = Box::new(move |r| {
            handed.leave(ino);
            done(r)
        });
        if let Err(e) = shard.handoff.send(Handoff::Wait(Box::new(pending))) {
            // The thread is gone (shutting down): answer now.
            if let Handoff::Wait(p) = e.0 {
                (p.done)(Err(FsError::Io("the lock waiter has stopped".into())));
            }
        }
    }

    /// Withdraws every request waiting on `ino` (answered
    /// [`FsError::Interrupted`]) and returns once they are withdrawn: after
    /// this no waiter thread holds an address of the file's lock memory.
    pub fn cancel_file(&self, ino: Ino) {
        if !self.handed.any(ino) {
            return; // no thread holds a request of it
        }
        let shard = self.shards[shard_of(ino, self.shards.len())].lock().clone();
        let Some(shard) = shard else { return }; // never started: it holds nothing
        let (ack, acked) = crossbeam_channel::bounded(1);
        if shard.handoff.send(Handoff::Cancel(ino, ack)).is_err() {
            return; // stopped: it holds nothing
        }
        if acked.recv_timeout(CANCEL_WAIT).is_err() {
            log::error!("the lock waiter did not withdraw the waits on inode {} in {CANCEL_WAIT:?}", ino.0);
        }
    }

    /// Stops the threads: every request still waiting is answered with an
    /// error (EIO at the mount), and later ones at once. Returns when the
    /// answers are given.
    pub fn shutdown(&self) {
        let threads: Vec<_> = {
            let mut threads = self.threads.lock();
            // Relaxed: the threads poll it and their join orders the rest;
            // starting a shard reads it under this lock.
            self.stop.store(true, Ordering::Relaxed);
            threads.drain(..).collect()
        };
        for t in threads {
            let _ = t.join();
        }
    }
}

/// The shard of `ino` among `shards`.
pub fn shard_of(ino: Ino, shards: usize) -> usize {
    (ino.0 % shards.max(1) as u64) as usize
}

impl Drop for Waiters {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where a retry calls the test hook.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryPoint {
    /// Before the retry touches lock memory.
    Before,
    /// The retry was granted (the record is written); the caller is not
    /// answered yet.
    Granted,
}

/// A test hook: called with the file at each [`RetryPoint`] of every retry
/// on a waiter thread (a test blocks there to make a race happen: one
/// file's retry stuck while others go on, a fence or a close between a
/// retry's start and its grant). `None` removes it.
#[doc(hidden)]
pub fn set_retry_hook(hook: Option<Arc<dyn Fn(Ino, RetryPoint) + Send + Sync>>) {
    *RETRY_HOOK.write() = hook;
}

type RetryHook = Option<Arc<dyn Fn(Ino, RetryPoint) + Send + Sync>>;
static RETRY_HOOK: parking_lot::RwLock<RetryHook> = parking_lot::RwLock::new(None);

struct WaiterThread {
    ep: Endpoint,
    context: Arc<dyn WaiterContext>,
    incoming: Receiver<Handoff>,
    pending: Vec<Pending>,
    stop: Arc<AtomicBool>,
}

impl WaiterThread {
    fn run(mut self) {
        let mut last_sweep = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let mut dirty: HashSet<Ino> = HashSet::new();
            let mut fresh = Vec::new();
            let mut cancels = Vec::new();
            select! {
                recv(self.incoming) -> h => match h {
                    Ok(Handoff::Wait(p)) => fresh.push(*p),
                    Ok(Handoff::Cancel(ino, ack)) => cancels.push((ino, ack)),
                    Err(_) => break,
                },
                recv(self.ep.inbox()) -> m => if let Ok(m) = m {
                    self.ep.count_received();
                    match LockMessage::decode(&m.payload) {
                        Ok(LockMessage::Wake { ino }) => { dirty.insert(ino); }
                        // Tokens are revoked at the client's token mailbox.
                        Ok(LockMessage::Revoke { ino }) => log::debug!("a revocation of inode {} at a waiter", ino.0),
                        Err(e) => log::warn!("from {}: {e}", m.from),
                    }
                },
                default(if self.pending.is_empty() { IDLE_TICK } else { WATCH_EVERY }) => {},
            }
            // Take whatever else is queued without waiting.
            for h in self.incoming.try_iter() {
                match h {
                    Handoff::Wait(p) => fresh.push(*p),
                    Handoff::Cancel(ino, ack) => cancels.push((ino, ack)),
                }
            }
            if !cancels.is_empty() {
                let all: Vec<Pending> = self.pending.drain(..).chain(fresh.drain(..)).collect();
                for p in all {
                    if cancels.iter().any(|(ino, _)| *ino == p.ino) {
                        self.interrupt(p);
                    } else {
                        self.pending.push(p);
                    }
                }
                for (_, ack) in cancels {
                    let _ = ack.send(());
                }
            }
            while let Ok(m) = self.ep.inbox().try_recv() {
                self.ep.count_received();
                if let Ok(LockMessage::Wake { ino }) = LockMessage::decode(&m.payload) {
                    dirty.insert(ino);
                }
            }
            let sweep = last_sweep.elapsed() >= RETRY_EVERY;
            if sweep {
                last_sweep = Instant::now();
            }
            let mut kept = Vec::with_capacity(self.pending.len() + fresh.len());
            // A new request is retried at once: its wake may have come before
            // it was handed over.
            dirty.extend(fresh.iter().map(|p| p.ino));
            let all: Vec<Pending> = self.pending.drain(..).chain(fresh).collect();
            for p in all {
                // `Some` keeps the request waiting.
                let still_waiting = if p.req.owner.client != self.context.client() {
                    // The client lost its lease since: the meta-server has
                    // removed this wait, and the file may be another's now.
                    (p.done)(Err(FsError::Io("lease lost while waiting for a lock".into())));
                    None
                } else if (p.interrupted)() {
                    self.interrupt(p);
                    None
                } else if self.context.fenced() {
                    // Touch nothing until the client is registered again
                    // (answered EIO above then), renews in time, or has
                    // reclaimed its locks from a restarted meta-server.
                    Some(p)
                } else if sweep || dirty.contains(&p.ino) {
                    self.retry(p)
                } else {
                    Some(p)
                };
                kept.extend(still_waiting);
            }
            self.pending = kept;
        }
        for p in self.pending.drain(..) {
            (p.done)(Err(FsError::Io("the mount is shutting down".into())));
        }
        // Requests and cancellations still queued: nothing is held any more.
        for h in self.incoming.try_iter() {
            match h {
                Handoff::Wait(p) => (p.done)(Err(FsError::Io("the mount is shutting down".into()))),
                Handoff::Cancel(_, ack) => drop(ack.send(())),
            }
        }
    }

    fn locks<'a>(
        &'a self,
        p: &Pending,
        timing: &'a LockTiming,
        growth: &'a dyn TableGrowth,
    ) -> FileLocks<'a> {
        FileLocks {
            ep: &self.ep,
            client: self.context.client(),
            ino: p.ino,
            area: p.area,
            table: p.table,
            timing,
            waits_for: self.context.waits_for(),
            growth,
        }
    }

    /// Tries a request again; `Some` if it still waits.
    fn retry(&self, mut p: Pending) -> Option<Pending> {
        if let Some(area) = self.context.area(p.ino) {
            // Reclaimed from a restarted meta-server: the same table, maybe
            // another range lock.
            p.area = area;
        }
        let hook = RETRY_HOOK.read().clone();
        if let Some(hook) = &hook {
            hook(p.ino, RetryPoint::Before);
        }
        let timing = self.context.timing();
        let growth = self.context.growth(p.ino);
        let locks = self.locks(&p, &timing, &*growth);
        let spec = WaitSpec { mailbox: self.ep.addr(), registered: Some(p.registration) };
        match locks.set(&p.req, Some(spec)) {
            Ok(Outcome::Granted) => {
                if let Some(hook) = &hook {
                    hook(p.ino, RetryPoint::Granted);
                }
                if p.req.owner.client != self.context.client() || self.context.fenced() {
                    // Granted to an identity that a fence took away while
                    // the retry was in flight (module docs).
                    let unlock = Request { mode: None, ..p.req };
                    if let Err(e) = locks.set(&unlock, None) {
                        log::warn!("releasing a grant made across a fence on inode {}: {e}", p.ino.0);
                    }
                    (p.done)(Err(FsError::Io("lease lost while waiting for a lock".into())));
                    return None;
                }
                (p.done)(Ok(()));
                None
            }
            Ok(Outcome::Waiting { registration, .. }) => {
                p.registration = registration;
                Some(p)
            }
            Ok(Outcome::Refused(_)) => {
                (p.done)(Err(FsError::WouldBlock));
                None
            }
            // The meta-server went away under the retry (a restart): the
            // request's record is in lock memory that outlives it, and a
            // retry once the client reclaimed finds it (the first verbs on
            // a connection to the old process fail, and it reconnects).
            Err(e) if e.may_break_endpoints() && self.still_patient(&mut p) => {
                log::info!("a lock wait on inode {} goes on after a failed retry: {e}", p.ino.0);
                Some(p)
            }
            Err(e) => {
                if e != FsError::Deadlock {
                    if let Err(c) = locks.cancel(&p.req, p.registration) {
                        log::warn!("withdrawing a failed lock wait on inode {}: {c}", p.ino.0);
                    }
                }
                (p.done)(Err(e));
                None
            }
        }
    }

    /// After a retry failed for want of the meta-server: whether to keep
    /// the request waiting (the meta-server is away, or has been back for
    /// less than [`AWAY_PATIENCE`]).
    fn still_patient(&self, p: &mut Pending) -> bool {
        if self.context.meta_server_away() {
            p.failing_since = None;
            return true;
        }
        p.failing_since.get_or_insert_with(Instant::now).elapsed() < AWAY_PATIENCE
    }

    fn interrupt(&self, p: Pending) {
        if p.req.owner.client != self.context.client() {
            (p.done)(Err(FsError::Interrupted));
            return;
        }
        let timing = self.context.timing();
        let growth = self.context.growth(p.ino);
        let locks = self.locks(&p, &timing, &*growth);
        if let Err(e) = locks.cancel(&p.req, p.registration) {
            log::warn!("withdrawing an interrupted lock wait on inode {}: {e}", p.ino.0);
        }
        (p.done)(Err(FsError::Interrupted));
    }
}
