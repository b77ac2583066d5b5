//! How records lie in a journal segment or a snapshot file:
//!
//! | bytes | what |
//! |---|---|
//! | 4 | payload length, little-endian (1 ..= [`MAX_RECORD`]) |
//! | 4 | CRC-32 (IEEE) of the payload, little-endian |
//! | n | payload (a bincode [`super::image::Batch`] or snapshot) |
//!
//! A segment is only ever appended to, so a crash in the middle of an
//! append leaves a *torn tail*: a header cut short, a payload that runs
//! past the end of the file, or (where the file system extended the file
//! before the bytes landed) a last record whose checksum fails or a run
//! of zeros. [`scan`] reads every whole record up to a torn tail and says
//! where it begins, so recovery replays up to the last whole record and
//! cuts the rest. A record that fails its checksum with whole records
//! after it is not a torn tail but damage in the middle, and is an error
//! naming its offset: replaying past it, or stopping silently before it,
//! would serve a namespace that never existed.

use thiserror::Error;

/// Header bytes before each payload.
pub const HEADER: usize = 8;
/// The largest payload: far above any batch (a batch is one hold of the
/// namespace lock) and any snapshot of a few million files, small enough
/// that a length damaged into nonsense is seen as such.
pub const MAX_RECORD: u32 = 1 << 31;

/// Appends `payload` as one record to `out`.
pub fn frame(payload: &[u8], out: &mut Vec<u8>) {
    let len = u32::try_from(payload.len()).ok().filter(|&l| l > 0 && l <= MAX_RECORD);
    let len = len.expect("a journal record is 1 byte to 2 GiB long");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Damage that is not a torn tail.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("damaged record at byte {offset}: {what}")]
pub struct Damage {
    pub offset: u64,
    pub what: &'static str,
}

/// The whole records of a segment, and where a torn tail begins (`None`:
/// the segment ends with a whole record).
#[derive(Debug, PartialEq, Eq)]
pub struct Scan<'a> {
    pub records: Vec<&'a [u8]>,
    pub torn_at: Option<u64>,
}

/// Reads the records of `bytes` (see the module header for the rules).
pub fn scan(bytes: &[u8]) -> Result<Scan<'_>, Damage> {
    let mut records = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let torn = Ok(Scan { records: Vec::new(), torn_at: Some(at as u64) });
        if rest.len() < HEADER || rest.iter().all(|&b| b == 0) {
            return torn.map(|s| Scan { records, ..s });
        }
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        if len == 0 || len > MAX_RECORD {
            return Err(Damage { offset: at as u64, what: "impossible length" });
        }
        let end = HEADER + len as usize;
        if end > rest.len() {
            return torn.map(|s| Scan { records, ..s });
        }
        let payload = &rest[HEADER..end];
        if crc32fast::hash(payload) != crc {
            if end == rest.len() || rest[end..].iter().all(|&b| b == 0) {
                return torn.map(|s| Scan { records, ..s });
            }
            return Err(Damage { offset: at as u64, what: "checksum mismatch" });
        }
        records.push(payload);
        at += end;
    }
    Ok(Scan { records, torn_at: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(payloads: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in payloads {
            frame(p, &mut out);
        }
        out
    }

    #[test]
    fn whole_records_read_back() {
        let bytes = segment(&[b"one", b"two", b"three"]);
        let scan = scan(&bytes).unwrap();
        assert_eq!(scan.records, vec![&b"one"[..], b"two", b"three"]);
        assert_eq!(scan.torn_at, None);
    }

    #[test]
    fn a_tail_cut_anywhere_is_torn_at_the_last_whole_record() {
        let bytes = segment(&[b"one", b"two", b"three"]);
        let whole = segment(&[b"one", b"two"]).len();
        for cut in whole + 1..bytes.len() {
            let scan = scan(&bytes[..cut]).unwrap();
            assert_eq!(scan.records.len(), 2, "cut at {cut}");
            assert_eq!(scan.torn_at, Some(whole as u64), "cut at {cut}");
        }
    }

    #[test]
    fn a_last_record_with_bad_bytes_or_zeros_after_it_is_torn() {
        let mut bytes = segment(&[b"one", b"two"]);
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        assert_eq!(scan(&bytes).unwrap().torn_at, Some(segment(&[b"one"]).len() as u64));
        let mut zero_filled = segment(&[b"one"]);
        zero_filled.extend_from_slice(&[0; 64]);
        assert_eq!(scan(&zero_filled).unwrap().records.len(), 1);
    }

    #[test]
    fn damage_in_the_middle_is_an_error_at_its_offset() {
        let mut bytes = segment(&[b"one", b"two", b"three"]);
        let second = segment(&[b"one"]).len();
        bytes[second + HEADER] ^= 0x01;
        assert_eq!(scan(&bytes), Err(Damage { offset: second as u64, what: "checksum mismatch" }));
        let mut bytes = segment(&[b"one", b"two"]);
        bytes[second..second + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(scan(&bytes).unwrap_err().what, "impossible length");
    }
}
