//! The verbs layer's bincode configuration: the project's one codec
//! ([`citron_rpc::codec`]), re-exported under its old path.

pub use citron_rpc::codec::{decode, encode, encode_into, MAX_FRAME};

use super::verb::MAX_TRANSFER;

// A verb's largest transfer and its header must fit a frame.
const _: () = assert!(MAX_TRANSFER + 4096 <= MAX_FRAME);

/// The bytes of a verb or reply (`#[serde(with = "…::codec::bytes")]`),
/// encoded as one byte string instead of a sequence of `u8`s. The bincode
/// bytes are the same either way (a length, then the bytes), so the wire
/// format does not change; but a sequence goes through serde one byte at a
/// time, which cost a 1 MiB read or write some milliseconds of the
/// sender's and the receiver's CPU, and a byte string is one copy.
pub mod bytes {
    use std::fmt;

    use serde::de::{Deserializer, SeqAccess, Visitor};
    use serde::Serializer;

    pub fn serialize<S: Serializer>(data: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(data)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        deserializer.deserialize_byte_buf(ByteBuf)
    }

    struct ByteBuf;

    impl<'de> Visitor<'de> for ByteBuf {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("bytes")
        }

        fn visit_byte_buf<E>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_bytes<E>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        /// Formats without byte strings (JSON) answer a sequence.
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut out = Vec::new();
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::addr::{RegionId, RemoteAddr};
    use super::super::verb::{Verb, VerbReply};
    use super::*;

    /// What the wire carried before the bytes were a byte string: a
    /// sequence of `u8`s.
    #[derive(serde::Serialize)]
    enum SeqVerb {
        #[allow(dead_code)]
        Read {
            addr: RemoteAddr,
            len: u32,
        },
        Write {
            addr: RemoteAddr,
            data: Vec<u8>,
        },
    }

    #[derive(serde::Serialize)]
    enum SeqReply {
        Data(Vec<u8>),
    }

    #[test]
    fn bytes_encode_as_a_sequence_of_u8_did() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let addr = RemoteAddr::new(RegionId(2), 64);
        let verb = Verb::Write { addr, data: data.clone() };
        let old = encode(&SeqVerb::Write { addr, data: data.clone() });
        assert_eq!(encode(&verb), old, "the wire format of a write is unchanged");
        assert_eq!(decode::<Verb>(&old).unwrap(), verb);
        let reply = VerbReply::Data(data.clone());
        let old = encode(&SeqReply::Data(data));
        assert_eq!(encode(&reply), old, "the wire format of a read's answer is unchanged");
        assert_eq!(decode::<VerbReply>(&old).unwrap(), reply);
    }

    #[test]
    fn a_length_past_the_bytes_is_refused() {
        let mut bad = encode(&Verb::Write { addr: RemoteAddr::new(RegionId(1), 0), data: vec![1, 2, 3] });
        bad.truncate(bad.len() - 1);
        assert!(decode::<Verb>(&bad).is_err());
    }
}
