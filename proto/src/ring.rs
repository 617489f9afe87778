//! The per-consumer delivery ring: how a stream hands samples to a trainer rank without a
//! daemon round trip per sample.
//!
//! The daemon owns one small shared-memory ring per attached consumer. It writes, the consumer
//! maps it read-only. Entry `seq` (the rank's sequence number) lives in slot `seq mod capacity`,
//! so the ring doubles as a reorder buffer: producers finish samples in any order, and each is
//! published straight into its own slot. The consumer reads the slot of the sequence number it
//! wants next; if the slot holds it, the sample's handle and location are right there, and
//! taking it costs a few loads. The consumer returns slots in batches over the socket
//! (`StreamRelease`), and the daemon never writes slot `s mod capacity` for `s + capacity` before
//! `s` is returned.
//!
//! Layout, all little-endian 64-bit words (the ring never leaves the node):
//!
//! | words          | field                                                            |
//! |----------------|------------------------------------------------------------------|
//! | 0              | [`RING_MAGIC`]                                                   |
//! | 1              | capacity (slots)                                                 |
//! | 2              | rank                                                             |
//! | 3              | the stream spec's digest                                         |
//! | 4..8           | reserved, zero                                                   |
//! | 8 + 8·i + 0    | slot i: `seq + 1` of the entry it holds, 0 while empty or written |
//! | 8 + 8·i + 1..3 | the handle (node, epoch / id)                                    |
//! | 8 + 8·i + 3    | segment (low 32 bits), [`ENTRY_FAILED`] flags (high 32)          |
//! | 8 + 8·i + 4..6 | offset, length                                                   |
//! | 8 + 8·i + 6    | the record (manifest index) the sample came from                 |
//! | 8 + 8·i + 7    | the uid that wrote the object (low 32 bits; high 32 reserved)     |
//!
//! Publishing is a sequence lock per slot: the writer zeroes the sequence word, writes the
//! fields, then stores `seq + 1` with release ordering. A reader loads the sequence word
//! (acquire), the fields, then the sequence word again after an acquire fence, and accepts the
//! entry only if both loads saw `seq + 1`: even a writer breaking the protocol cannot make it
//! accept a torn entry. The protocol is checked under loom (`RUSTFLAGS="--cfg loom"`).

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering, fence};

use crate::{Handle, Location};

/// First word of every ring: "FSRING01".
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"FSRING01");
/// Words before the first slot.
pub const HEADER_WORDS: usize = 8;
/// Words per slot (one cache line).
pub const SLOT_WORDS: usize = 8;
/// Slot flag: no sample could be made for this sequence number (every candidate record was
/// rejected); the consumer gets an error for it and moves on.
pub const ENTRY_FAILED: u32 = 1;

/// Bytes a ring of `capacity` slots occupies.
pub const fn ring_bytes(capacity: u32) -> usize {
    (HEADER_WORDS + SLOT_WORDS * capacity as usize) * 8
}

/// Read access to a ring's words: a read-only mapping allows relaxed loads only.
pub trait RingWords {
    /// Loads word `i` with relaxed ordering (callers order with fences).
    fn load_relaxed(&self, i: usize) -> u64;
    /// Number of words.
    fn len(&self) -> usize;
    /// Whether there are no words.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RingWords for [AtomicU64] {
    fn load_relaxed(&self, i: usize) -> u64 {
        self[i].load(Ordering::Relaxed)
    }
    fn len(&self) -> usize {
        <[AtomicU64]>::len(self)
    }
}

/// One published sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingEntry {
    /// The rank's sequence number.
    pub seq: u64,
    /// The sample's object.
    pub handle: Handle,
    /// Where it lives.
    pub location: Location,
    /// The record it was made from.
    pub record: u64,
    /// [`ENTRY_FAILED`] and future flags.
    pub flags: u32,
    /// The uid of the client that wrote the object, as the daemon recorded it at creation (for a
    /// copy pulled from another node, as the owner's daemon recorded it): what a reader checks
    /// before it trusts a batch object's structure.
    pub writer: u32,
}

/// Why a ring's header is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// Too short for its header or its slots.
    #[error("ring of {words} words is too short for {capacity} slots")]
    TooShort {
        /// Words available.
        words: usize,
        /// Capacity claimed.
        capacity: u64,
    },
    /// Not a ring.
    #[error("bad ring magic {found:#018x}")]
    BadMagic {
        /// What was there.
        found: u64,
    },
}

/// The checked header of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingHeader {
    /// Slots.
    pub capacity: u32,
    /// The consumer's rank.
    pub rank: u32,
    /// The stream spec's digest.
    pub spec_digest: u64,
}

impl RingHeader {
    /// Reads and checks a ring's header against its length.
    pub fn read(words: &(impl RingWords + ?Sized)) -> Result<RingHeader, RingError> {
        if words.len() < HEADER_WORDS {
            return Err(RingError::TooShort {
                words: words.len(),
                capacity: 0,
            });
        }
        let magic = words.load_relaxed(0);
        // Pairs with the release store of the magic: the fields below were written before it.
        fence(Ordering::Acquire);
        if magic != RING_MAGIC {
            return Err(RingError::BadMagic { found: magic });
        }
        let capacity = words.load_relaxed(1);
        let fits = usize::try_from(capacity)
            .ok()
            .and_then(|c| c.checked_mul(SLOT_WORDS))
            .and_then(|w| w.checked_add(HEADER_WORDS))
            .is_some_and(|w| w <= words.len());
        if capacity == 0 || capacity > u64::from(u32::MAX) || !fits {
            return Err(RingError::TooShort {
                words: words.len(),
                capacity,
            });
        }
        Ok(RingHeader {
            capacity: capacity as u32,
            rank: words.load_relaxed(2) as u32,
            spec_digest: words.load_relaxed(3),
        })
    }

    /// Writes the header of a fresh (zeroed) ring. The magic goes last, with release ordering.
    pub fn write(&self, words: &[AtomicU64]) -> Result<(), RingError> {
        let need = HEADER_WORDS + SLOT_WORDS * self.capacity as usize;
        if words.len() < need || self.capacity == 0 {
            return Err(RingError::TooShort {
                words: words.len(),
                capacity: u64::from(self.capacity),
            });
        }
        words[1].store(u64::from(self.capacity), Ordering::Relaxed);
        words[2].store(u64::from(self.rank), Ordering::Relaxed);
        words[3].store(self.spec_digest, Ordering::Relaxed);
        words[0].store(RING_MAGIC, Ordering::Release);
        Ok(())
    }

    fn slot(&self, seq: u64) -> usize {
        HEADER_WORDS + SLOT_WORDS * (seq % u64::from(self.capacity)) as usize
    }

    /// Publishes an entry into its slot. The caller (the daemon) guarantees the slot's previous
    /// entry was returned by the consumer.
    pub fn publish(&self, words: &[AtomicU64], entry: &RingEntry) {
        let base = self.slot(entry.seq);
        let w = &words[base..base + SLOT_WORDS];
        w[0].store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        let h = entry.handle;
        w[1].store(
            u64::from(h.node_id) | u64::from(h.epoch) << 32,
            Ordering::Relaxed,
        );
        w[2].store(h.id, Ordering::Relaxed);
        w[3].store(
            u64::from(entry.location.segment) | u64::from(entry.flags) << 32,
            Ordering::Relaxed,
        );
        w[4].store(entry.location.offset, Ordering::Relaxed);
        w[5].store(entry.location.len, Ordering::Relaxed);
        w[6].store(entry.record, Ordering::Relaxed);
        w[7].store(u64::from(entry.writer), Ordering::Relaxed);
        w[0].store(entry.seq + 1, Ordering::Release);
    }

    /// The entry for `seq`, if its slot holds it.
    pub fn read_entry(&self, words: &(impl RingWords + ?Sized), seq: u64) -> Option<RingEntry> {
        let base = self.slot(seq);
        let first = words.load_relaxed(base);
        // Pairs with the writer's release store of `seq + 1`: the fields it wrote before are
        // visible to the loads below.
        fence(Ordering::Acquire);
        if first != seq + 1 {
            return None;
        }
        let w = |i| words.load_relaxed(base + i);
        let (a, b, c) = (w(1), w(2), w(3));
        let entry = RingEntry {
            seq,
            handle: Handle {
                node_id: a as u32,
                epoch: (a >> 32) as u32,
                id: b,
            },
            location: Location {
                segment: c as u32,
                offset: w(4),
                len: w(5),
            },
            record: w(6),
            flags: (c >> 32) as u32,
            writer: w(7) as u32,
        };
        // Pairs with the writer's release fence after it zeroed the word: if a newer publish
        // wrote any field read above, this load sees the zero (or the newer sequence number).
        fence(Ordering::Acquire);
        (words.load_relaxed(base) == seq + 1).then_some(entry)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn entry(seq: u64) -> RingEntry {
        RingEntry {
            seq,
            handle: Handle {
                node_id: 1,
                epoch: 2,
                id: seq << 20 | 7,
            },
            location: Location {
                segment: 0,
                offset: seq * 64,
                len: 100 + seq,
            },
            record: seq * 3,
            flags: 0,
            writer: 1000 + seq as u32,
        }
    }

    #[test]
    fn entries_land_in_their_slots_in_any_order() {
        let header = RingHeader {
            capacity: 4,
            rank: 3,
            spec_digest: 99,
        };
        let words: Vec<AtomicU64> = (0..ring_bytes(4) / 8).map(|_| AtomicU64::new(0)).collect();
        assert!(RingHeader::read(&words[..]).is_err(), "no magic yet");
        header.write(&words).unwrap();
        assert_eq!(RingHeader::read(&words[..]), Ok(header));
        for seq in [2, 0, 3, 1] {
            assert_eq!(header.read_entry(&words[..], seq), None);
            header.publish(&words, &entry(seq));
        }
        for seq in 0..4 {
            assert_eq!(header.read_entry(&words[..], seq), Some(entry(seq)));
        }
        // seq 4 shares slot 0 with seq 0, which it replaces once published.
        assert_eq!(header.read_entry(&words[..], 4), None);
        header.publish(&words, &entry(4));
        assert_eq!(header.read_entry(&words[..], 4), Some(entry(4)));
        assert_eq!(header.read_entry(&words[..], 0), None);
    }

    #[test]
    fn short_or_foreign_rings_are_refused() {
        let words: Vec<AtomicU64> = (0..12).map(|_| AtomicU64::new(0)).collect();
        let header = RingHeader {
            capacity: 4,
            rank: 0,
            spec_digest: 0,
        };
        assert!(header.write(&words).is_err());
        words[0].store(RING_MAGIC, Ordering::Relaxed);
        words[1].store(4, Ordering::Relaxed);
        assert!(matches!(
            RingHeader::read(&words[..]),
            Err(RingError::TooShort { .. })
        ));
        words[0].store(1, Ordering::Relaxed);
        assert!(matches!(
            RingHeader::read(&words[..]),
            Err(RingError::BadMagic { .. })
        ));
    }
}

/// The publish/read protocol under loom's model of the memory orderings.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    fn entry(seq: u64) -> RingEntry {
        RingEntry {
            seq,
            handle: Handle {
                node_id: seq as u32,
                epoch: seq as u32 + 1,
                id: seq + 2,
            },
            location: Location {
                segment: seq as u32,
                offset: seq * 10,
                len: seq * 100,
            },
            record: seq * 1000,
            flags: 0,
            writer: seq as u32 + 5,
        }
    }

    fn ring(capacity: u32) -> (RingHeader, Arc<Vec<AtomicU64>>) {
        let header = RingHeader {
            capacity,
            rank: 0,
            spec_digest: 0,
        };
        let words: Vec<AtomicU64> = (0..ring_bytes(capacity) / 8)
            .map(|_| AtomicU64::new(0))
            .collect();
        header.write(&words).unwrap();
        (header, Arc::new(words))
    }

    /// A writer publishing while a reader polls: the reader sees each entry whole, or not yet.
    #[test]
    fn a_reader_sees_whole_entries_only() {
        loom::model(|| {
            let (header, words) = ring(2);
            let writer = {
                let words = words.clone();
                loom::thread::spawn(move || {
                    header.publish(&words, &entry(0));
                    header.publish(&words, &entry(1));
                })
            };
            for seq in 0..2 {
                if let Some(got) = header.read_entry(&words[..], seq) {
                    assert_eq!(got, entry(seq));
                }
            }
            writer.join().unwrap();
            assert_eq!(header.read_entry(&words[..], 1), Some(entry(1)));
        });
    }

    /// A writer overwriting a slot the reader is still reading (a protocol violation the daemon
    /// never commits): the reader still never accepts a mix of two entries.
    #[test]
    fn an_overwrite_never_tears_an_entry() {
        loom::model(|| {
            let (header, words) = ring(1);
            header.publish(&words, &entry(0));
            let writer = {
                let words = words.clone();
                loom::thread::spawn(move || header.publish(&words, &entry(1)))
            };
            for seq in 0..2 {
                if let Some(got) = header.read_entry(&words[..], seq) {
                    assert_eq!(got, entry(seq));
                }
            }
            writer.join().unwrap();
        });
    }

    /// Publish, consume, return, republish: the release handshake (here an atomic standing in for
    /// the socket) keeps a slot from being reused before its entry is read.
    #[test]
    fn returned_slots_are_reused_in_order() {
        loom::model(|| {
            let (header, words) = ring(1);
            let returned = Arc::new(AtomicU64::new(0));
            let writer = {
                let (words, returned) = (words.clone(), returned.clone());
                loom::thread::spawn(move || {
                    for seq in 0..2u64 {
                        while returned.load(Ordering::Acquire) < seq {
                            loom::thread::yield_now();
                        }
                        header.publish(&words, &entry(seq));
                    }
                })
            };
            for seq in 0..2u64 {
                let got = loop {
                    match header.read_entry(&words[..], seq) {
                        Some(e) => break e,
                        None => loom::thread::yield_now(),
                    }
                };
                assert_eq!(got, entry(seq));
                returned.store(seq + 1, Ordering::Release);
            }
            writer.join().unwrap();
        });
    }
}
