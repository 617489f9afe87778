//! The daemon's statistics as they cross the socket.

/// A snapshot of the store, as `feedstore stat` prints it.
///
/// On the wire this is a count followed by that many `u64`s in field order; a decoder reads the
/// fields it knows and ignores extra ones, so fields are only ever appended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Bytes of shared memory the daemon owns.
    pub capacity_bytes: u64,
    /// Bytes reserved by live objects (sealed, being written, or deleted but still leased),
    /// counted at their aligned size.
    pub used_bytes: u64,
    /// The largest single free range, i.e. the largest object that fits without eviction.
    pub largest_free_bytes: u64,
    /// Sealed objects.
    pub objects_sealed: u64,
    /// Objects reserved and not yet sealed or aborted.
    pub objects_writing: u64,
    /// Sealed objects that are pinned (never evicted).
    pub objects_pinned: u64,
    /// Leases held by clients, summed over objects.
    pub leases: u64,
    /// Connected clients.
    pub clients: u64,
    /// Objects evicted to make room since start.
    pub evictions: u64,
    /// Bytes evicted since start.
    pub evicted_bytes: u64,
    /// Creates that had to wait for space.
    pub creates_waited: u64,
    /// Creates that failed with `Full` after waiting.
    pub creates_full: u64,
    /// Objects aborted because their writer disconnected before sealing.
    pub aborted_on_disconnect: u64,
    /// Leases dropped because their holder disconnected.
    pub leases_reclaimed: u64,
    /// Number of segments.
    pub segments: u64,
    /// Whether the segments are on hugetlbfs pages (1) or not (0).
    pub huge_pages: u64,
    /// Deleted objects waiting for their last lease before their space is reused.
    pub objects_delete_pending: u64,
    /// Open streams.
    pub streams: u64,
    /// Decode-once cache: lookups by producers.
    pub cache_lookups: u64,
    /// Decode-once cache: lookups that found the sample still in the store.
    pub cache_hits: u64,
    /// Decode-once cache: keys known (some may have been evicted since).
    pub cache_entries: u64,
}

impl StoreStats {
    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.capacity_bytes - self.used_bytes.min(self.capacity_bytes)
    }

    /// Share of decode-once cache lookups that hit.
    pub fn cache_hit_rate(&self) -> f64 {
        if self.cache_lookups == 0 {
            0.0
        } else {
            self.cache_hits as f64 / self.cache_lookups as f64
        }
    }

    /// External fragmentation: `1 - largest_free / free`, 0 when all free space is one range.
    pub fn fragmentation(&self) -> f64 {
        let free = self.free_bytes();
        if free == 0 {
            0.0
        } else {
            1.0 - self.largest_free_bytes as f64 / free as f64
        }
    }

    /// Every counter with its name (the field's), in wire order: for dictionaries and exports.
    pub fn named(&self) -> [(&'static str, u64); 21] {
        const NAMES: [&str; 21] = [
            "capacity_bytes",
            "used_bytes",
            "largest_free_bytes",
            "objects_sealed",
            "objects_writing",
            "objects_pinned",
            "leases",
            "clients",
            "evictions",
            "evicted_bytes",
            "creates_waited",
            "creates_full",
            "aborted_on_disconnect",
            "leases_reclaimed",
            "segments",
            "huge_pages",
            "objects_delete_pending",
            "streams",
            "cache_lookups",
            "cache_hits",
            "cache_entries",
        ];
        let values = self.fields();
        std::array::from_fn(|i| (NAMES[i], values[i]))
    }

    pub(crate) fn fields(&self) -> [u64; 21] {
        [
            self.capacity_bytes,
            self.used_bytes,
            self.largest_free_bytes,
            self.objects_sealed,
            self.objects_writing,
            self.objects_pinned,
            self.leases,
            self.clients,
            self.evictions,
            self.evicted_bytes,
            self.creates_waited,
            self.creates_full,
            self.aborted_on_disconnect,
            self.leases_reclaimed,
            self.segments,
            self.huge_pages,
            self.objects_delete_pending,
            self.streams,
            self.cache_lookups,
            self.cache_hits,
            self.cache_entries,
        ]
    }

    pub(crate) fn from_fields(f: &[u64]) -> StoreStats {
        let g = |i: usize| f.get(i).copied().unwrap_or(0);
        StoreStats {
            capacity_bytes: g(0),
            used_bytes: g(1),
            largest_free_bytes: g(2),
            objects_sealed: g(3),
            objects_writing: g(4),
            objects_pinned: g(5),
            leases: g(6),
            clients: g(7),
            evictions: g(8),
            evicted_bytes: g(9),
            creates_waited: g(10),
            creates_full: g(11),
            aborted_on_disconnect: g(12),
            leases_reclaimed: g(13),
            segments: g(14),
            huge_pages: g(15),
            objects_delete_pending: g(16),
            streams: g(17),
            cache_lookups: g(18),
            cache_hits: g(19),
            cache_entries: g(20),
        }
    }
}
