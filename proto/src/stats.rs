//! The daemon's statistics as they cross the socket.

/// Declares [`StoreStats`] once: the struct, its field count and the names in wire order, so
/// the three can never disagree.
macro_rules! store_stats {
    ($($(#[doc = $doc:literal])+ $name:ident,)+) => {
        /// A snapshot of the store, as `feedstore stat` prints it.
        ///
        /// On the wire this is a count followed by that many `u64`s in field order. The count
        /// must equal the connection's version's count ([`StoreStats::FIELDS`] in this one): a new
        /// counter is a new protocol version, appended after the older ones.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct StoreStats {
            $($(#[doc = $doc])+ pub $name: u64,)+
        }

        impl StoreStats {
            /// Number of counters.
            pub const FIELDS: usize = [$(stringify!($name)),+].len();

            /// Every counter with its name (the field's), in wire order: for dictionaries and
            /// exports.
            pub fn named(&self) -> [(&'static str, u64); Self::FIELDS] {
                [$((stringify!($name), self.$name)),+]
            }

            /// Every counter with its name and its description (the field's documentation,
            /// lines joined): for exports that describe what they export.
            pub fn described(&self) -> [(&'static str, &'static str, u64); Self::FIELDS] {
                [$((stringify!($name), concat!($($doc),+), self.$name)),+]
            }

            /// The counters in wire order.
            pub(crate) fn from_fields(f: &[u64; Self::FIELDS]) -> StoreStats {
                let mut values = f.iter().copied();
                StoreStats {
                    $($name: values.next().unwrap_or(0),)+
                }
            }
        }
    };
}

store_stats! {
    /// Bytes of shared memory the daemon owns.
    capacity_bytes,
    /// Bytes reserved by live objects (sealed, being written, or deleted but still leased),
    /// counted at their aligned size.
    used_bytes,
    /// The largest single free range, i.e. the largest object that fits without eviction.
    largest_free_bytes,
    /// Sealed objects.
    objects_sealed,
    /// Objects reserved and not yet sealed or aborted.
    objects_writing,
    /// Sealed objects that are pinned (never evicted).
    objects_pinned,
    /// Leases held, summed over objects: clients' and the streams' own (a ready stream
    /// sample is leased by its stream, and once delivered by its consumer too).
    leases,
    /// Connected clients.
    clients,
    /// Objects evicted to make room since start.
    evictions,
    /// Bytes evicted since start.
    evicted_bytes,
    /// Creates that had to wait for space.
    creates_waited,
    /// Creates that failed with `Full` after waiting.
    creates_full,
    /// Objects aborted because their writer disconnected before sealing.
    aborted_on_disconnect,
    /// Leases dropped because their holder disconnected.
    leases_reclaimed,
    /// Number of segments.
    segments,
    /// Whether the segments are on hugetlbfs pages (1) or not (0).
    huge_pages,
    /// Deleted objects waiting for their last lease before their space is reused.
    objects_delete_pending,
    /// Open streams.
    streams,
    /// Decode-once cache: lookups by producers.
    cache_lookups,
    /// Decode-once cache: lookups that found the sample still in the store.
    cache_hits,
    /// Decode-once cache: keys known (some may have been evicted since).
    cache_entries,
    /// Bytes of shared memory in stream delivery rings (bounded by `--max-ring-bytes`).
    ring_bytes,
    /// Requests refused because a configured limit was reached (connections, streams, rings,
    /// leases, queued requests).
    limits_hit,
    /// Streams closed because no producer and no consumer used them for the idle timeout.
    streams_expired,
    /// Peers (other nodes' daemons) connected and authenticated now.
    peers_up,
    /// Sealed local copies of other nodes' objects (pulled once, then served like local ones).
    objects_pulled,
    /// Pulls from other nodes under way.
    pulls_in_flight,
    /// Objects pulled from other nodes since start.
    pulls,
    /// Bytes pulled from other nodes since start.
    pulled_bytes,
    /// Pulls that failed because the owner could not be reached, refused, reset or went away.
    pull_failures_unreachable,
    /// Pulls that failed because the owner stalled past `--pull-timeout-ms`.
    pull_failures_timeout,
    /// Pulls that failed because the owner no longer had the object (deleted, evicted, or the
    /// owner restarted).
    pull_failures_missing,
    /// Pulls whose bytes failed their authentication (a frame altered, replayed or reordered on
    /// the way), after the one retry from the owner.
    pull_failures_corrupt,
    /// Pulls that failed because this store had no room for the copy.
    pull_failures_full,
    /// Peer handshakes refused, by either side (wrong secret, clashing node id, other version).
    peers_refused,
    /// Ranges of this node's objects sent to other nodes since start.
    served_reads,
    /// Bytes of this node's objects sent to other nodes since start.
    served_bytes,
    /// Consumers waiting for a stream that does not exist yet (opened before any producer of
    /// it joined: a trainer blocked on a stream name no producer uses shows here).
    attaches_waiting,
    /// Gets refused because the uid asking, one allowed only to read, held its share of the
    /// store leased (`--reader-lease-fraction`); also counted in `limits_hit`.
    lease_share_refusals,
    /// Frames from peers that failed their authentication (altered, replayed, reordered or
    /// forged on the way): each ends its connection.
    peer_frames_rejected,
    /// Peer connections closed before they proved the cluster secret: the handshake budget was
    /// full (the oldest goes), their address held its share, or the handshake deadline passed.
    peer_handshakes_dropped,
    /// Connections, since this daemon started, of clients that connected again after the
    /// daemon before it went away (killed, crashed, restarted: their hello says so).
    reconnects,
    /// Connected clients that came back that way.
    reconnected_clients,
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
}
