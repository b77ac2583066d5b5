//! Citron: the distributed range lock manager (citron-fast23.md §3).
//!
//! This module grows in steps; [`tree`] holds the lock tree's shape and the
//! range splitting (§3.3, §3.5.1).

pub mod lock;
pub mod tree;
pub mod word;
