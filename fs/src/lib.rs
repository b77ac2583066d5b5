//! File-system types (inode, attributes, layouts), the wire protocol and the
//! client-side file logic of CitronFS (DESIGN.md §2, §5).
//!
//! This crate is a member of the workspace from the start so that the crate
//! graph of DESIGN.md §2 holds; it has no contents yet. Its code arrives with
//! the issue "The file system: meta-server, data servers, citronfs mount".
