//! The servers of CitronFS: namespace and inodes, chunk and lock-memory
//! allocation, client leases, and the data-server role (DESIGN.md §2, §6).
//!
//! A member of the workspace from the start so the crate graph of DESIGN.md
//! §2 holds; it has no contents yet. Its code arrives with the file-system
//! issue; the memory it serves is already `citron_lock::rdma`'s regions.
