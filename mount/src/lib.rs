//! The FUSE adapter of CitronFS over `fuser` (DESIGN.md §2, §7).
//!
//! A member of the workspace from the start so the crate graph of DESIGN.md
//! §2 holds; it has no contents yet. Its code arrives with the file-system
//! issue (`citronfs mount`).
