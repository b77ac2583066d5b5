//! The one bincode configuration used for everything the project puts on a
//! wire or in a datagram: little-endian, variable-length integers, a size
//! limit so a hostile length prefix cannot make the decoder allocate, and no
//! trailing bytes.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

/// The largest payload a body may carry (the verbs layer's largest
/// transfer, `citron_lock::rdma::MAX_TRANSFER`, checked there at compile time).
pub const MAX_PAYLOAD: u64 = 8 << 20;

/// Upper bound of an encoded frame body: the payload and room for its header.
pub const MAX_FRAME: u64 = MAX_PAYLOAD + 4096;

fn options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_FRAME).reject_trailing_bytes()
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising our own types into a Vec can only fail past the size limit,
    // which every sender checks first (e.g. the verbs layer's MAX_TRANSFER).
    options().serialize(value).expect("frame within MAX_FRAME")
}

pub fn encode_into<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    options().serialize_into(out, value).expect("frame within MAX_FRAME")
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    options().deserialize(bytes).map_err(|e| e.to_string())
}
