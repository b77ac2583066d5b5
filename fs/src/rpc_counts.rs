//! Metadata round trips counted by request kind: what each file-system
//! operation costs in calls to the meta-server (metadata cost). A client counts
//! every call it sends ([`crate::client::FsClient::rpc_counts`]); benchmarks
//! and tests read the counters before and after an operation.

use crate::counts::{Counters, Counts};
use crate::proto::MetaRequest;

/// [`counted_kinds!`](crate::counted_kinds) for [`MetaKind`], and
/// [`MetaRequest::kind`] from the same list.
macro_rules! meta_kinds {
    ($($kind:ident),* $(,)? ; background: [$($background:ident),* $(,)?]) => {
        crate::counted_kinds! {
            /// The kind of a [`MetaRequest`], without its arguments.
            pub enum MetaKind {
                $($kind),*
            }
            background: [$($background),*]
        }

        impl MetaRequest {
            /// What kind of request this is.
            pub fn kind(&self) -> MetaKind {
                match self {
                    $(MetaRequest::$kind { .. } => MetaKind::$kind),*
                }
            }
        }
    };
}

meta_kinds!(
    RegisterClient,
    ReclaimClient,
    DataServers,
    Heartbeat,
    ClientLeaves,
    RegisterDataServer,
    DataServerLeaves,
    Lookup,
    GetAttr,
    SetAttr,
    Create,
    CreateOpen,
    Symlink,
    ReadLink,
    Link,
    Unlink,
    LateChanges,
    LendInodes,
    Rmdir,
    Rename,
    ReadDir,
    ReadDirPlus,
    Access,
    Open,
    Layout,
    Release,
    ReleaseMany,
    GrowLockTable,
    GrowWaitsFor,
    KillSuidGid,
    Clients,
    AllocChunks,
    GrowExtents,
    Fallocate,
    StatFs,
    Status,
    SetXattr,
    GetXattr,
    ListXattr,
    RemoveXattr,
    ReportLockTiming,
    Caching,
    Once,
    AwaitInvalidations;
    // Kinds sent by a client's background threads (lease, lock timing), not
    // by file-system operations: left out of `RpcCounts::operations` and
    // `RpcCounts::describe`.
    background: [Heartbeat, ReportLockTiming, AwaitInvalidations]
);

/// Live counters of a client's calls, one per kind.
pub type RpcCounters = Counters<MetaKind>;

/// Calls by kind at one moment (or between two, by subtraction).
pub type RpcCounts = Counts<MetaKind>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Ino;

    #[test]
    fn kinds_follow_requests_and_differences_count_calls() {
        let c = RpcCounters::default();
        let lookup = MetaRequest::GetAttr { ino: Ino(1) };
        assert_eq!(lookup.kind(), MetaKind::GetAttr);
        assert_eq!(MetaRequest::DataServers.kind().name(), "DataServers");
        let before = c.snapshot();
        c.count(lookup.kind());
        c.count(MetaKind::Heartbeat);
        let d = c.snapshot() - before;
        assert_eq!((d.get(MetaKind::GetAttr), d.total(), d.operations()), (1, 2, 1));
        assert_eq!(d.describe(), "GetAttr=1");
    }
}
