//! Metadata round trips counted by request kind: what each file-system
//! operation costs in calls to the meta-server (issue 13). A client counts
//! every call it sends ([`crate::client::FsClient::rpc_counts`]); benchmarks
//! and tests read the counters before and after an operation.

use std::ops::Sub;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::proto::MetaRequest;

macro_rules! meta_kinds {
    ($($kind:ident),* $(,)?) => {
        /// The kind of a [`MetaRequest`], without its arguments.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum MetaKind {
            $($kind),*
        }

        impl MetaKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [MetaKind] = &[$(MetaKind::$kind),*];

            pub fn name(self) -> &'static str {
                match self {
                    $(MetaKind::$kind => stringify!($kind)),*
                }
            }
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
    Rmdir,
    Rename,
    ReadDir,
    ReadDirPlus,
    Access,
    Open,
    Layout,
    Release,
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
    AwaitInvalidations,
);

/// Kinds sent by a client's background threads (lease, lock timing), not
/// by file-system operations: left out of [`RpcCounts::operations`].
const BACKGROUND: [MetaKind; 3] =
    [MetaKind::Heartbeat, MetaKind::ReportLockTiming, MetaKind::AwaitInvalidations];

/// Live counters, one per kind.
#[derive(Debug)]
pub struct RpcCounters([AtomicU64; MetaKind::ALL.len()]);

impl Default for RpcCounters {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl RpcCounters {
    pub fn count(&self, kind: MetaKind) {
        self.0[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> RpcCounts {
        RpcCounts(std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed)))
    }
}

/// Calls by kind at one moment (or between two, by subtraction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpcCounts([u64; MetaKind::ALL.len()]);

impl Default for RpcCounts {
    fn default() -> Self {
        Self([0; MetaKind::ALL.len()])
    }
}

impl RpcCounts {
    pub fn get(&self, kind: MetaKind) -> u64 {
        self.0[kind as usize]
    }

    /// Every call, background ones included.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Calls made by file-system operations (not the lease and lock-timing
    /// threads).
    pub fn operations(&self) -> u64 {
        self.total() - BACKGROUND.iter().map(|k| self.get(*k)).sum::<u64>()
    }

    /// The kinds with calls, by name, e.g. `Lookup=1 CreateOpen=1`
    /// (background kinds left out).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = MetaKind::ALL
            .iter()
            .filter(|k| !BACKGROUND.contains(k) && self.get(**k) > 0)
            .map(|k| format!("{}={}", k.name(), self.get(*k)))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(" ")
        }
    }
}

impl std::ops::AddAssign for RpcCounts {
    fn add_assign(&mut self, other: Self) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }
}

impl Sub for RpcCounts {
    type Output = RpcCounts;
    fn sub(self, earlier: Self) -> RpcCounts {
        RpcCounts(std::array::from_fn(|i| self.0[i].saturating_sub(earlier.0[i])))
    }
}

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
