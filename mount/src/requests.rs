//! FUSE requests counted by kind (issue 13): with the client's metadata
//! call counters ([`citronfs_core::client::FsClient::rpc_counts`]) they say
//! what one system call costs — how many requests the kernel sends, and how
//! many round trips to the meta-server those make. A request is counted
//! as it arrives, except `Release`, counted once answered: the kernel sends
//! it after close(2) has returned, so a test waits for the count to know
//! the release is done.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

macro_rules! fuse_ops {
    ($($op:ident),* $(,)?) => {
        /// A kind of FUSE request this file system answers.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum FuseOp {
            $($op),*
        }

        impl FuseOp {
            pub const ALL: &'static [FuseOp] = &[$(FuseOp::$op),*];

            pub fn name(self) -> &'static str {
                match self {
                    $(FuseOp::$op => stringify!($op)),*
                }
            }
        }
    };
}

fuse_ops!(
    Lookup,
    GetAttr,
    SetAttr,
    ReadLink,
    Mknod,
    Mkdir,
    Unlink,
    Rmdir,
    Symlink,
    Rename,
    Link,
    Open,
    Read,
    Write,
    Flush,
    Release,
    Fsync,
    ReadDir,
    ReadDirPlus,
    StatFs,
    SetXattr,
    GetXattr,
    ListXattr,
    RemoveXattr,
    Access,
    Create,
    GetLk,
    SetLk,
    Fallocate,
);

/// Live counters of one mount, shared with whoever reads them while it
/// serves ([`crate::CitronFuse::requests`]).
#[derive(Clone, Debug, Default)]
pub struct FuseCounters(Arc<[AtomicU64; FuseOp::ALL.len()]>);

impl FuseCounters {
    pub fn count(&self, op: FuseOp) {
        self.0[op as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `op` when the returned guard is dropped (at the end of the
    /// request's handling rather than its start).
    pub fn on_drop(&self, op: FuseOp) -> CountOnDrop<'_> {
        CountOnDrop { counters: self, op }
    }

    pub fn snapshot(&self) -> FuseCounts {
        FuseCounts(std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed)))
    }
}

/// See [`FuseCounters::on_drop`].
pub struct CountOnDrop<'a> {
    counters: &'a FuseCounters,
    op: FuseOp,
}

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        self.counters.count(self.op);
    }
}

/// Requests by kind at one moment (or between two, by subtraction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FuseCounts([u64; FuseOp::ALL.len()]);

impl Default for FuseCounts {
    fn default() -> Self {
        Self([0; FuseOp::ALL.len()])
    }
}

impl FuseCounts {
    pub fn get(&self, op: FuseOp) -> u64 {
        self.0[op as usize]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The kinds with requests, e.g. `Lookup=1 Create=1 Flush=1 Release=1`.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = FuseOp::ALL
            .iter()
            .filter(|o| self.get(**o) > 0)
            .map(|o| format!("{}={}", o.name(), self.get(*o)))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(" ")
        }
    }
}

impl std::ops::AddAssign for FuseCounts {
    fn add_assign(&mut self, other: Self) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }
}

impl std::ops::Sub for FuseCounts {
    type Output = FuseCounts;
    fn sub(self, earlier: Self) -> FuseCounts {
        FuseCounts(std::array::from_fn(|i| self.0[i].saturating_sub(earlier.0[i])))
    }
}
