//! fcntl and flock locks at the mount: telling a request's flavour from
//! the caller's system call ([`crate::caller`]), running a lock call (a
//! blocking one is answered by the client's waiter thread, never waited
//! for on a FUSE worker), and the [`LOCKS_XATTR`] listing of a file's lock
//! records.

use citronfs_core::client::{FsClient, LockCall};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, OFFSET_MAX};
use citronfs_core::types::Ino;
use citronfs_core::FsError;
use fuser::{Errno, FileHandle, INodeNo, LockOwner, ReplyEmpty, Request};

use crate::{caller, coherence, done, CitronFuse};

impl CitronFuse {
    /// The value of [`LOCKS_XATTR`] for `ino`: a snapshot of its lock
    /// records, each with the host and process of the mount that holds it.
    pub(crate) fn lock_listing(&self, ino: Ino) -> Result<Vec<u8>, FsError> {
        use citronfs_core::locks::record::RecordState;
        let records = self.client.lock_records(ino)?;
        let clients = self.client.clients()?;
        let mut out = String::new();
        for r in records {
            let host = clients
                .iter()
                .find(|c| c.id == r.owner.client)
                .map_or_else(|| "?".to_string(), |c| format!("{}:{}", c.hostname, c.pid));
            let last = if r.range.last == OFFSET_MAX { "EOF".to_string() } else { r.range.last.to_string() };
            out += &format!(
                "{} {} {} {} {} {} {} {}\n",
                if r.state == RecordState::Held { "held" } else { "waiting" },
                match r.flavor {
                    LockFlavor::Posix => "POSIX",
                    LockFlavor::Ofd => "OFDLCK",
                    LockFlavor::Flock => "FLOCK",
                },
                if r.mode == LockMode::Write { "WRITE" } else { "READ" },
                r.range.start,
                last,
                r.pid,
                r.owner.client.0,
                host,
            );
        }
        Ok(out.into_bytes())
    }

    /// The flavour of a lock call by thread `tid` through `fh` for `owner`.
    ///
    /// Reading `/proc/<tid>/syscall` costs about 15 µs to open and read (a
    /// third of a lock call; the file is kept open per thread, see
    /// [`caller::SyscallFiles`]), so POSIX calls are remembered per (handle,
    /// owner): a POSIX owner
    /// is a process's file table, while OFD and flock calls through a handle
    /// are owned by that handle's open file itself; the two are different
    /// live objects, so an owner seen making POSIX calls through a handle
    /// makes only POSIX calls through it until the handle is released (when
    /// the memory is forgotten). OFD and flock calls share their owner, so
    /// they are read every time. A call `/proc` cannot name is refused
    /// with `ENOLCK`, never guessed (see [`caller`]).
    pub(crate) fn lock_flavor(
        &self,
        tid: caller::Tid,
        fh: FileHandle,
        owner: LockOwner,
    ) -> Result<LockFlavor, Errno> {
        if self.posix_owners.lock().get(&fh.0).is_some_and(|o| o.contains(&owner.0)) {
            return Ok(LockFlavor::Posix);
        }
        let Some(flavor) = self.syscalls.lock_flavor(tid) else {
            log::warn!(
                "lock call of thread {} through handle {}: /proc does not say whether it is flock or fcntl \
                 (caller outside this daemon's pid namespace, or gone); refused with ENOLCK",
                tid.0,
                fh.0
            );
            return Err(Errno::ENOLCK);
        };
        if flavor == LockFlavor::Posix {
            self.posix_owners.lock().entry(fh.0).or_default().insert(owner.0);
        }
        Ok(flavor)
    }

    /// A lock request as the kernel sent it, with its flavour read from the
    /// caller's system call (see [`caller`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lock_call(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
    ) -> Result<LockCall, Errno> {
        self.check_handle(fh)?;
        let mode = match typ {
            libc::F_RDLCK => Some(LockMode::Read),
            libc::F_WRLCK => Some(LockMode::Write),
            libc::F_UNLCK => None,
            _ => return Err(Errno::EINVAL),
        };
        let range = ByteRange::new(start, end.min(OFFSET_MAX)).ok_or(Errno::EINVAL)?;
        let flavor = self.lock_flavor(caller::Tid(req.pid()), fh, owner)?;
        Ok(LockCall {
            ino: Ino(ino.0),
            owner: citronfs_core::locks::LockOwner(owner.0),
            flavor,
            mode,
            range,
            pid,
            fh: fh.0,
        })
    }
}

/// Runs a lock call and answers it; a blocking one (`F_SETLKW`, blocking
/// `flock`) is answered by the waiter thread, never waited for here. With
/// `coherent`, a granted lock's range of the page cache is dropped on a
/// coherence thread before the answer.
pub(crate) fn lock(
    client: &FsClient,
    call: LockCall,
    sleep: bool,
    tid: u32,
    coherent: Option<coherence::Invalidator>,
    reply: ReplyEmpty,
) {
    let answer = move |r: Result<(), FsError>| match coherent {
        Some(inval) if r.is_ok() && call.mode.is_some() => inval.clone().run(Box::new(move || {
            inval.invalidate(call.ino, call.range);
            done(reply, r)
        })),
        _ => done(reply, r),
    };
    if sleep && call.mode.is_some() {
        client.setlkw(&call, Box::new(move || caller::interrupted(caller::Tid(tid))), Box::new(answer));
    } else {
        answer(client.setlk(&call))
    }
}
