//! How a file's bytes map onto chunks (DESIGN.md §5): fixed-size chunks,
//! chunk `i` holding bytes `[i * chunk_size, (i + 1) * chunk_size)`.

use serde::{Deserialize, Serialize};

use crate::types::ChunkIndex;

/// The chunk geometry of a file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkGeometry {
    chunk_size: u64,
}

/// The part of a byte range that falls in one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPiece {
    pub chunk: ChunkIndex,
    /// Offset of the piece inside its chunk.
    pub offset_in_chunk: u64,
    pub len: u64,
    /// Offset of the piece inside the caller's buffer.
    pub buf_offset: u64,
}

impl ChunkGeometry {
    /// `chunk_size` must be a power of two, at least 4 KiB.
    pub fn new(chunk_size: u64) -> Result<Self, String> {
        if !chunk_size.is_power_of_two() || chunk_size < 4096 {
            return Err(format!("chunk size {chunk_size} must be a power of two >= 4096"));
        }
        Ok(Self { chunk_size })
    }

    pub fn chunk_size(self) -> u64 {
        self.chunk_size
    }

    pub fn chunk_of(self, offset: u64) -> ChunkIndex {
        ChunkIndex(offset / self.chunk_size)
    }

    /// The chunks a file of `size` bytes can have data in: `0..count`.
    pub fn chunks_for_size(self, size: u64) -> u64 {
        size.div_ceil(self.chunk_size)
    }

    /// Splits `[offset, offset + len)` into per-chunk pieces, in order.
    pub fn split(self, offset: u64, len: u64) -> impl Iterator<Item = ChunkPiece> {
        let cs = self.chunk_size;
        let end = offset.saturating_add(len);
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let chunk = pos / cs;
            let offset_in_chunk = pos % cs;
            let piece_len = (cs - offset_in_chunk).min(end - pos);
            let piece = ChunkPiece {
                chunk: ChunkIndex(chunk),
                offset_in_chunk,
                len: piece_len,
                buf_offset: pos - offset,
            };
            pos += piece_len;
            Some(piece)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn splits_at_chunk_boundaries() {
        let g = ChunkGeometry::new(4096).unwrap();
        let p: Vec<_> = g.split(4000, 5000).collect();
        assert_eq!(
            p,
            vec![
                ChunkPiece { chunk: ChunkIndex(0), offset_in_chunk: 4000, len: 96, buf_offset: 0 },
                ChunkPiece { chunk: ChunkIndex(1), offset_in_chunk: 0, len: 4096, buf_offset: 96 },
                ChunkPiece { chunk: ChunkIndex(2), offset_in_chunk: 0, len: 808, buf_offset: 4192 },
            ]
        );
        assert_eq!(g.split(10, 0).count(), 0);
        assert_eq!(g.chunks_for_size(0), 0);
        assert_eq!(g.chunks_for_size(4096), 1);
        assert_eq!(g.chunks_for_size(4097), 2);
    }

    #[test]
    fn rejects_bad_geometry() {
        assert!(ChunkGeometry::new(0).is_err());
        assert!(ChunkGeometry::new(5000).is_err());
        assert!(ChunkGeometry::new(2048).is_err());
    }

    proptest! {
        #[test]
        fn pieces_tile_the_range(shift in 12u32..22, offset in 0u64..(1 << 40), len in 0u64..(1 << 24)) {
            let g = ChunkGeometry::new(1 << shift).unwrap();
            let mut expect_pos = offset;
            let mut total = 0;
            for p in g.split(offset, len) {
                prop_assert_eq!(p.chunk.0 * g.chunk_size() + p.offset_in_chunk, expect_pos);
                prop_assert!(p.offset_in_chunk + p.len <= g.chunk_size());
                prop_assert!(p.len > 0);
                prop_assert_eq!(p.buf_offset, total);
                expect_pos += p.len;
                total += p.len;
            }
            prop_assert_eq!(total, len);
        }
    }
}
