//! The arithmetic of masked atomic verbs, as pure functions.
//!
//! Semantics follow the Citron paper §2.1 (citron-fast23.md, lines 67–71) and
//! the ShiftLock paper §3.1 (shiftlock-fast25.md, lines 159–173), which both
//! describe the Mellanox "extended atomics":
//!
//! * **masked-CAS** `(cmp, cmp_mask, swap, swap_mask)`: the bits selected by
//!   `cmp_mask` are compared with `cmp`; if they are all equal, the bits
//!   selected by `swap_mask` are replaced with those of `swap`. The whole old
//!   value is returned either way. With `cmp_mask == 0` the compare always
//!   succeeds, so `swap == swap_mask == x` is a fetch-and-OR of `x`, and
//!   `swap_mask == !0` a fetch-and-store.
//! * **masked-FAA** `(add, boundary_mask)`: every set bit of `boundary_mask`
//!   marks the most significant ("left") bit of a field; the addition is done
//!   separately in each field, so a carry out of a field's top bit is dropped
//!   instead of reaching the next field. Subtraction is adding the field-wide
//!   two's complement; its borrow is dropped at the boundary the same way. A
//!   zero mask is a plain 64-bit (or 128-bit) fetch-and-add.
//!
//! Every backend calls these functions, so the semantics are defined once.

/// Result of applying a masked compare-and-swap to `old`.
#[inline]
pub fn masked_cas_u64(old: u64, cmp: u64, cmp_mask: u64, swap: u64, swap_mask: u64) -> Option<u64> {
    if (old ^ cmp) & cmp_mask == 0 {
        Some((old & !swap_mask) | (swap & swap_mask))
    } else {
        None
    }
}

/// 128-bit form of [`masked_cas_u64`].
#[inline]
pub fn masked_cas_u128(old: u128, cmp: u128, cmp_mask: u128, swap: u128, swap_mask: u128) -> Option<u128> {
    if (old ^ cmp) & cmp_mask == 0 {
        Some((old & !swap_mask) | (swap & swap_mask))
    } else {
        None
    }
}

/// Field-wise addition of `add` to `old`, with fields delimited by the set
/// bits of `boundary_mask` (each marks a field's top bit).
///
/// Classic SWAR: clear every field's top bit in both operands, so that a carry
/// can reach a top bit but never leave it; then put the top bits back with XOR,
/// which is their sum without a carry out.
#[inline]
pub fn masked_faa_u64(old: u64, add: u64, boundary_mask: u64) -> u64 {
    let low = !boundary_mask;
    ((old & low).wrapping_add(add & low)) ^ ((old ^ add) & boundary_mask)
}

/// 128-bit form of [`masked_faa_u64`].
#[inline]
pub fn masked_faa_u128(old: u128, add: u128, boundary_mask: u128) -> u128 {
    let low = !boundary_mask;
    ((old & low).wrapping_add(add & low)) ^ ((old ^ add) & boundary_mask)
}

/// Boundary mask for a list of fields given as `(lowest bit, width)`: a set
/// bit at each field's top bit. Fields must not overlap.
pub const fn field_boundaries(fields: &[(u32, u32)]) -> u64 {
    let mut mask = 0u64;
    let mut i = 0;
    while i < fields.len() {
        let (lo, width) = fields[i];
        assert!(width > 0 && lo + width <= 64, "field out of the word");
        mask |= 1u64 << (lo + width - 1);
        i += 1;
    }
    mask
}

/// `delta` (which may be negative) encoded for a masked-FAA into the field
/// starting at bit `lo` of width `width`: the field-wide two's complement,
/// shifted into place.
pub const fn field_delta(lo: u32, width: u32, delta: i64) -> u64 {
    let field_mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    ((delta as u64) & field_mask) << lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference model: add field by field with explicit masks.
    fn faa_by_fields(old: u64, add: u64, boundary: u64) -> u64 {
        let mut out = 0u64;
        let mut lo = 0u32;
        for bit in 0..64u32 {
            let is_top = boundary & (1 << bit) != 0 || bit == 63;
            if is_top {
                let width = bit - lo + 1;
                let m = if width == 64 { u64::MAX } else { ((1u64 << width) - 1) << lo };
                let sum = ((old & m) >> lo).wrapping_add((add & m) >> lo);
                out |= (sum << lo) & m;
                lo = bit + 1;
            }
        }
        out
    }

    #[test]
    fn carry_stops_at_field_boundary() {
        // Two 32-bit fields; the low one overflows.
        let mask = field_boundaries(&[(0, 32), (32, 32)]);
        assert_eq!(mask, (1 << 31) | (1 << 63));
        let old = 0x0000_0005_FFFF_FFFF;
        assert_eq!(masked_faa_u64(old, 1, mask), 0x0000_0005_0000_0000);
        // Plain FAA would have carried into the high field.
        assert_eq!(old.wrapping_add(1), 0x0000_0006_0000_0000);
    }

    #[test]
    fn borrow_stops_at_field_boundary() {
        // 16-bit field at bit 16, decrement from zero: wraps inside the field.
        let mask = field_boundaries(&[(0, 16), (16, 16), (32, 32)]);
        let old = 0x0000_0007_0000_0003u64;
        let new = masked_faa_u64(old, field_delta(16, 16, -1), mask);
        assert_eq!(new, 0x0000_0007_FFFF_0003);
    }

    #[test]
    fn non_byte_aligned_fields() {
        // Citron internal node: 1-bit flags then 15-bit counters.
        let mask = field_boundaries(&[(0, 1), (1, 1), (2, 15), (17, 15), (32, 15), (47, 15)]);
        let old = field_delta(2, 15, 0x7FFF) | 1;
        // TCnt (bit 2, 15 wide) wraps to 0, Occ (bit 0) toggles 1 -> 0 without a carry into Exp.
        let add = field_delta(2, 15, 1) | field_delta(0, 1, -1);
        assert_eq!(masked_faa_u64(old, add, mask), 0);
    }

    #[test]
    fn zero_mask_is_plain_faa() {
        assert_eq!(masked_faa_u64(u64::MAX, 2, 0), 1);
        assert_eq!(masked_faa_u128(u128::MAX, 2, 0), 1);
    }

    #[test]
    fn masked_cas_compares_only_masked_bits() {
        let old = 0xAB00_00CDu64;
        // Upper byte differs from cmp but is not compared.
        assert_eq!(masked_cas_u64(old, 0x00CD, 0xFF, 0x1100, 0xFF00), Some(0xAB00_11CD));
        assert_eq!(masked_cas_u64(old, 0x00CE, 0xFF, 0x1100, 0xFF00), None);
    }

    #[test]
    fn zero_compare_mask_is_fetch_or_and_fetch_store() {
        let old = 0b1010u64;
        assert_eq!(masked_cas_u64(old, 0, 0, 0b0101, 0b0101), Some(0b1111));
        assert_eq!(masked_cas_u64(old, 12345, 0, 77, u64::MAX), Some(77));
    }

    #[test]
    fn u128_fields_cross_the_word_halves() {
        // One field over bits 60..68 (crossing the 64-bit halves).
        let mask: u128 = (1 << 67) | (1 << 59);
        let old: u128 = 0xFF << 60; // field value 0xFF (8 bits) -> bits 60..67 set
        let new = masked_faa_u128(old, 1 << 60, mask);
        assert_eq!(new, 0, "carry out of bit 67 must be dropped");
    }

    proptest! {
        #[test]
        fn swar_faa_matches_field_model(old: u64, add: u64, boundary: u64) {
            prop_assert_eq!(masked_faa_u64(old, add, boundary), faa_by_fields(old, add, boundary));
        }

        #[test]
        fn u128_faa_agrees_with_u64_on_split_fields(lo_old: u64, hi_old: u64, lo_add: u64, hi_add: u64, lo_m: u64, hi_m: u64) {
            // With bit 63 a boundary, the halves are independent.
            let lo_m = lo_m | 1 << 63;
            let old = (hi_old as u128) << 64 | lo_old as u128;
            let add = (hi_add as u128) << 64 | lo_add as u128;
            let m = (hi_m as u128) << 64 | lo_m as u128;
            let got = masked_faa_u128(old, add, m);
            prop_assert_eq!(got as u64, masked_faa_u64(lo_old, lo_add, lo_m));
            prop_assert_eq!((got >> 64) as u64, masked_faa_u64(hi_old, hi_add, hi_m));
        }

        #[test]
        fn masked_cas_full_masks_is_plain_cas(old: u64, cmp: u64, swap: u64) {
            let r = masked_cas_u64(old, cmp, u64::MAX, swap, u64::MAX);
            prop_assert_eq!(r, if old == cmp { Some(swap) } else { None });
        }
    }
}
