//! The verbs layer's bincode configuration: the project's one codec
//! ([`citron_rpc::codec`]), re-exported under its old path.

pub use citron_rpc::codec::{decode, encode, encode_into, MAX_FRAME};

use super::verb::MAX_TRANSFER;

// A verb's largest transfer and its header must fit a frame.
const _: () = assert!(MAX_TRANSFER + 4096 <= MAX_FRAME);
