//! Free-space allocator for one segment.
//!
//! Best fit over a size-ordered set of free ranges, with immediate coalescing through an
//! offset-ordered map. Both are `BTreeMap`s: `O(log n)` allocate and free for any object size from
//! one byte to the whole segment, no size classes to tune, and the largest free range (what
//! fragmentation is measured against) is the last key of the size index.
//!
//! The allocator's metadata lives in the daemon's private heap, never in shared memory, so no
//! client — crashed or malicious — can corrupt it.

use std::collections::{BTreeMap, BTreeSet};

use feedstore_proto::OBJECT_ALIGN_BYTES;

/// A reserved byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Block {
    /// Offset from the segment start, a multiple of [`OBJECT_ALIGN_BYTES`].
    pub offset: u64,
    /// Reserved length, a multiple of [`OBJECT_ALIGN_BYTES`].
    pub len: u64,
}

/// Allocator state for one segment of `capacity` bytes.
#[derive(Debug, Clone)]
pub struct Allocator {
    capacity: u64,
    /// Free ranges by offset -> length.
    by_offset: BTreeMap<u64, u64>,
    /// Free ranges by (length, offset), for best fit.
    by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl Allocator {
    /// An allocator whose whole range is free. `capacity` is rounded down to the alignment.
    pub fn new(capacity: u64) -> Allocator {
        let capacity = capacity - capacity % OBJECT_ALIGN_BYTES;
        let mut a = Allocator {
            capacity,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_bytes: 0,
        };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    /// The aligned length reserved for an object of `size` bytes, `None` on overflow.
    pub fn reserved_len(size: u64) -> Option<u64> {
        size.max(1).checked_next_multiple_of(OBJECT_ALIGN_BYTES)
    }

    /// Reserves room for `size` bytes, best fit. `None` when no free range is large enough.
    pub fn allocate(&mut self, size: u64) -> Option<Block> {
        let len = Self::reserved_len(size)?;
        let &(free_len, offset) = self.by_size.range((len, 0)..).next()?;
        self.remove_free(offset, free_len);
        if free_len > len {
            self.insert_free(offset + len, free_len - len);
        }
        Some(Block { offset, len })
    }

    /// Reserves exactly `block` (an object a daemon handed over lives there): false, and
    /// nothing reserved, unless it is aligned and lies wholly in one free range.
    pub fn claim(&mut self, block: Block) -> bool {
        let aligned = block.offset.is_multiple_of(OBJECT_ALIGN_BYTES)
            && block.len.is_multiple_of(OBJECT_ALIGN_BYTES)
            && block.len > 0;
        let Some(end) = block.offset.checked_add(block.len) else {
            return false;
        };
        let Some((&free_offset, &free_len)) = self.by_offset.range(..=block.offset).next_back()
        else {
            return false;
        };
        if !aligned || end > free_offset + free_len {
            return false;
        }
        self.remove_free(free_offset, free_len);
        if block.offset > free_offset {
            self.insert_free(free_offset, block.offset - free_offset);
        }
        if free_offset + free_len > end {
            self.insert_free(end, free_offset + free_len - end);
        }
        true
    }

    /// Returns a block to the free set, merging it with free neighbours.
    ///
    /// # Panics
    /// If the block overlaps free space: a double free is a daemon bug that must not silently hand
    /// the same bytes to two objects.
    pub fn free(&mut self, block: Block) {
        let Block {
            mut offset,
            mut len,
        } = block;
        assert!(
            offset + len <= self.capacity,
            "free of {block:?} beyond capacity"
        );
        if let Some((&prev_off, &prev_len)) = self.by_offset.range(..=offset).next_back() {
            assert!(prev_off + prev_len <= offset, "double free of {block:?}");
            if prev_off + prev_len == offset {
                self.remove_free(prev_off, prev_len);
                offset = prev_off;
                len += prev_len;
            }
        }
        if let Some((&next_off, &next_len)) = self.by_offset.range(offset..).next() {
            assert!(offset + len <= next_off, "double free of {block:?}");
            if offset + len == next_off {
                self.remove_free(next_off, next_len);
                len += next_len;
            }
        }
        self.insert_free(offset, len);
    }

    /// Whether an object of `size` bytes would fit now.
    pub fn fits(&self, size: u64) -> bool {
        Self::reserved_len(size).is_some_and(|len| self.largest_free() >= len)
    }

    /// Total bytes under management.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Free bytes, in all ranges.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The largest free range.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Number of free ranges.
    pub fn free_ranges(&self) -> usize {
        self.by_offset.len()
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }

    /// Free ranges in offset order (for tests and diagnostics).
    pub fn free_list(&self) -> impl Iterator<Item = Block> + '_ {
        self.by_offset
            .iter()
            .map(|(&offset, &len)| Block { offset, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_from_one_byte_to_the_whole_segment() {
        let mut a = Allocator::new(1 << 30);
        let one = a.allocate(1).unwrap();
        assert_eq!(one, Block { offset: 0, len: 64 });
        assert!(a.allocate(1 << 30).is_none(), "only 1 GiB - 64 B left");
        a.free(one);
        let whole = a.allocate(1 << 30).unwrap();
        assert_eq!(
            whole,
            Block {
                offset: 0,
                len: 1 << 30
            }
        );
        assert_eq!(a.free_bytes(), 0);
    }

    #[test]
    fn best_fit_keeps_the_large_range_whole() {
        let mut a = Allocator::new(64 * 100);
        let b: Vec<_> = (0..4).map(|_| a.allocate(64).unwrap()).collect();
        a.free(b[1]); // a one-block hole at 64
        let small = a.allocate(10).unwrap();
        assert_eq!(small.offset, 64, "the hole is the best fit");
        assert_eq!(a.largest_free(), 64 * 96);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = Allocator::new(64 * 4);
        let b = a.allocate(64).unwrap();
        a.free(b);
        a.free(b);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            3 => (1u64..20_000).prop_map(Op::Alloc),
            1 => (1u64..(1 << 20)).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
        ];
        proptest::collection::vec(op, 1..300)
    }

    proptest! {
        /// Live blocks never overlap each other or free space; free + live = capacity; freeing
        /// everything leaves one range covering the whole segment.
        #[test]
        fn no_overlap_and_full_reclamation(ops in ops()) {
            let capacity = 4 << 20;
            let mut a = Allocator::new(capacity);
            let mut live: Vec<Block> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        let fits = a.fits(size);
                        match a.allocate(size) {
                            Some(b) => {
                                prop_assert!(fits);
                                prop_assert_eq!(b.offset % OBJECT_ALIGN_BYTES, 0);
                                prop_assert!(b.len >= size);
                                live.push(b);
                            }
                            None => prop_assert!(!fits),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let b = live.swap_remove(i % live.len());
                        a.free(b);
                    }
                    Op::Free(_) => {}
                }
                let mut all: Vec<Block> = live.iter().copied().chain(a.free_list()).collect();
                all.sort();
                let mut end = 0;
                for b in &all {
                    prop_assert!(b.offset >= end, "overlap at {:?}", b);
                    end = b.offset + b.len;
                }
                let total: u64 = all.iter().map(|b| b.len).sum();
                prop_assert_eq!(total, capacity);
                // Free ranges are always coalesced: no two are adjacent.
                let free: Vec<Block> = a.free_list().collect();
                for w in free.windows(2) {
                    prop_assert!(w[0].offset + w[0].len < w[1].offset);
                }
            }
            for b in live.drain(..) {
                a.free(b);
            }
            prop_assert_eq!(a.free_ranges(), 1);
            prop_assert_eq!(a.largest_free(), capacity);
        }
    }
}
