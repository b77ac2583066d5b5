//! The one bincode configuration used for everything the verbs layer puts on
//! a wire or in a datagram: little-endian, variable-length integers, a size
//! limit so a hostile length prefix cannot make the decoder allocate, and no
//! trailing bytes.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

use super::verb::MAX_TRANSFER;

/// Upper bound of an encoded frame body.
pub const MAX_FRAME: u64 = MAX_TRANSFER + 4096;

fn options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_FRAME).reject_trailing_bytes()
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising our own types into a Vec can only fail past the size limit,
    // which every sender checks first (MAX_TRANSFER, MAX_MESSAGE).
    options().serialize(value).expect("frame within MAX_FRAME")
}

pub fn encode_into<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    options().serialize_into(out, value).expect("frame within MAX_FRAME")
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    options().deserialize(bytes).map_err(|e| e.to_string())
}
