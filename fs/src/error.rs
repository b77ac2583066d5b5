//! Errors of file-system operations. They cross the wire from the
//! meta-server; the FUSE adapter maps them to errno in one place.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("directory not empty")]
    NotEmpty,
    #[error("is a directory")]
    IsDir,
    #[error("not a directory")]
    NotDir,
    #[error("permission denied")]
    Access,
    #[error("operation not permitted")]
    Perm,
    #[error("file name too long")]
    NameTooLong,
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no space left on the data servers")]
    NoSpace,
    #[error("file too large")]
    FileTooBig,
    #[error("no such attribute")]
    NoAttr,
    #[error("attribute value too large for the buffer")]
    Range,
    #[error("not supported: {0}")]
    NotSupported(String),
    #[error("would create a loop in the directory tree")]
    Loop,
    /// A conflicting lock is held (`F_SETLK`, `LOCK_NB`).
    #[error("a conflicting lock is held")]
    WouldBlock,
    /// Waiting would close a cycle of lock owners waiting for each other.
    #[error("resource deadlock would occur")]
    Deadlock,
    /// A blocked lock request was interrupted by a signal.
    #[error("interrupted")]
    Interrupted,
    /// No room left for another lock record.
    #[error("no locks available")]
    NoLocks,
    /// The cluster's lock memory holds as many open files as it can
    /// (`--lock-memory`): an open must wait for another file to close.
    #[error("too many files open in the cluster")]
    TooManyOpenFiles,
    /// A server could not be reached or answered garbage.
    #[error("i/o error: {0}")]
    Io(String),
    /// A data server did not answer a verb or a connection (it crashed,
    /// or restarts). Clients wait for it to come back, up to their
    /// timeout, and answer EIO only then.
    #[error("data server {} does not answer", .0 .0)]
    DataServerDown(crate::types::DataServerId),
    /// This client's registration ended (its lease ran out, or it registered
    /// anew) while a call it had begun under the old one was under way: the
    /// call must not go on under the new identity.
    #[error("this client was fenced: its registration ended during the call")]
    Fenced,
    /// The meta-server this client reconnected to serves another file
    /// system than the one it mounted (its state was lost, or it is
    /// another cluster's): nothing of the old one may be shown from it.
    #[error("the meta-server now serves file system {now}, not {was} which this client mounted")]
    OtherFileSystem { was: crate::types::FsId, now: crate::types::FsId },
    /// The meta-server restarted under this client and could not take it
    /// back (it came back after the grace period, or the restarted
    /// meta-server kept no lock memory): the file system is whole, but
    /// this client's opens and locks are gone; it must be mounted again.
    #[error("the meta-server restarted; the file system is whole, but this mount must be mounted again")]
    MetaRestarted,
    /// The meta-server restarted a moment ago and waits for the clients of
    /// its previous process to reclaim their opens and locks: a request
    /// that needs what they may hold (new lock memory, or a client that has
    /// not reclaimed yet) is asked again a moment later.
    #[error("the meta-server is in its grace period after a restart; ask again")]
    Grace,
    /// The meta-server does not answer (it crashed, or restarts): clients
    /// wait for it up to their timeout, and answer EIO only then.
    #[error("the meta-server does not answer")]
    MetaServerDown,
}

impl FsError {
    /// Whether the call that failed with this error may have left its
    /// endpoints (queue pairs, mailboxes, lock handles' per-endpoint state)
    /// in an unknown state. Only [`FsError::Io`] (a server or transport
    /// failure, a lock that timed out or was fenced) does; every other error
    /// is an answer (EAGAIN, EDEADLK, EINTR, ENOENT, …) after which the
    /// endpoints are as good as before, and reusing them costs no new
    /// connection and no new id.
    pub fn may_break_endpoints(&self) -> bool {
        matches!(
            self,
            FsError::Io(_) | FsError::Fenced | FsError::DataServerDown(_) | FsError::MetaServerDown
        )
    }
}

impl From<citron_lock::rdma::RdmaError> for FsError {
    fn from(e: citron_lock::rdma::RdmaError) -> Self {
        FsError::Io(e.to_string())
    }
}

impl From<citron_lock::rdma::TransportError> for FsError {
    fn from(e: citron_lock::rdma::TransportError) -> Self {
        FsError::Io(e.to_string())
    }
}

impl From<citron_lock::rdma::tcp::RpcError> for FsError {
    fn from(e: citron_lock::rdma::tcp::RpcError) -> Self {
        FsError::Io(e.to_string())
    }
}

impl From<citron_lock::rwlock::LockError> for FsError {
    fn from(e: citron_lock::rwlock::LockError) -> Self {
        FsError::Io(format!("lock: {e}"))
    }
}
