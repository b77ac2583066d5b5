//! FUSE requests counted by kind (metadata cost): with the client's metadata
//! call counters ([`citronfs_core::client::FsClient::rpc_counts`]) they say
//! what one system call costs — how many requests the kernel sends, and how
//! many round trips to the meta-server those make. A request is counted
//! as it arrives, except `Release`, counted once answered: the kernel sends
//! it after close(2) has returned, so a test waits for the count to know
//! the release is done.

use citronfs_core::counts::{Counters, Counts};

citronfs_core::counted_kinds! {
    /// A kind of FUSE request this file system answers.
    pub enum FuseOp {
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
        OpenDir,
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
    }
}

/// Live counters of one mount, shared with whoever reads them while it
/// serves ([`crate::CitronFuse::requests`]).
pub type FuseCounters = Counters<FuseOp>;

/// Requests by kind at one moment (or between two, by subtraction).
pub type FuseCounts = Counts<FuseOp>;
