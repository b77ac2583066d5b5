//! Citron: the distributed range lock manager (citron-fast23.md §3).
//!
//! * [`tree`]: the lock tree's shape, index arithmetic and range splitting
//!   (§3.3, §3.5.1);
//! * [`word`]: the 64-bit node words (§3.4, Fig. 3);
//! * [`lock`]: acquisition, release, fast paths, lease recovery, scale-up
//!   and scale-down (Algorithms 1–4, §3.5–3.10);
//! * [`geometry`]: where nodes live once the tree has been scaled up (§3.9.1);
//! * [`scale`]: what a scale-up marks and carries, and what a release owes
//!   after one (Algorithm 4, Algorithm 3 lines 10–12);
//! * [`host`]: the lock host's allocation and configuration service, which
//!   can also run the scale-ups itself (what the file system does);
//! * [`tuning`]: one `T_wait` for the whole cluster, published by the cluster
//!   manager in lock memory and changed in two phases (§3.5.5).

pub mod geometry;
pub mod host;
pub mod lock;
pub mod scale;
pub mod tree;
pub mod tuning;
pub mod word;
