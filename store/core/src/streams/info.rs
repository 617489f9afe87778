//! What the streams say about themselves: producers' reports in, stream listings and the
//! store's counters out.

use std::time::Instant;

use feedstore_proto::Status;
use feedstore_proto::frame::{ProducerFigures, RankInfo, StreamInfo};

use super::{Stream, StreamError, Streams, fail};
use crate::objects::{ConnId, Objects};

impl Streams {
    /// A producer of the stream reports its figures: kept per producer, its counters never
    /// going back (see [`ProducerFigures::update`]).
    pub fn producer_report(
        &mut self,
        conn: ConnId,
        id: u32,
        figures: &ProducerFigures,
    ) -> Result<(), StreamError> {
        let stream = self.stream(id)?;
        if !stream.producers.contains(&conn) {
            return Err(fail(
                Status::Protocol,
                "a producer report from a connection that did not join the stream",
            ));
        }
        stream
            .producer_figures
            .entry(conn)
            .or_default()
            .update(figures);
        Ok(())
    }

    /// The streams `conn` may see (its uid's; every stream for root and the daemon's uid)
    /// with ids above `after`, in id order, as many as fit in `budget_bytes` of encoded entries
    /// (at least one); whether more follow.
    pub fn list(
        &self,
        objects: &Objects,
        conn: ConnId,
        after: u32,
        budget_bytes: usize,
    ) -> (Vec<StreamInfo>, bool) {
        let uid = objects.client(conn).map_or(u32::MAX, |c| c.uid);
        let sees_all = uid == 0 || uid == self.daemon_uid;
        let mut page = Vec::new();
        let mut used = 0;
        let visible = self
            .streams
            .range(after.saturating_add(1)..)
            .filter(|(_, s)| sees_all || s.owner_uid == uid);
        for (&id, s) in visible {
            let info = Self::info(id, s, StreamInfo::RANKS_LISTED);
            if !page.is_empty() && used + info.wire_bytes() > budget_bytes {
                return (page, true);
            }
            used += info.wire_bytes();
            page.push(info);
        }
        (page, false)
    }

    /// Every open stream, whoever owns it, with every attached rank: for the daemon's own
    /// metrics.
    pub fn all(&self) -> Vec<StreamInfo> {
        self.streams
            .iter()
            .map(|(&id, s)| Self::info(id, s, usize::MAX))
            .collect()
    }

    /// A stream as listed, with at most `ranks` of its attached ranks.
    pub(super) fn info(id: u32, s: &Stream, ranks: usize) -> StreamInfo {
        let now = Instant::now();
        StreamInfo {
            id,
            owner_uid: s.owner_uid,
            name: s.spec.name.clone(),
            depth: s.depth,
            producers: s.producers.len() as u32,
            consumers: s.ranks.values().filter(|r| r.consumer.is_some()).count() as u32,
            ranks: s.ranks.len() as u32,
            ready: s.ranks.values().map(|r| r.ready.len() as u64).sum(),
            making: s.ranks.values().map(|r| r.assigned.len() as u64).sum(),
            put: s.samples_put,
            returned: s.samples_returned,
            slowest: s.ranks.values().map(|r| r.released).min().unwrap_or(0),
            fastest: s.ranks.values().map(|r| r.released).max().unwrap_or(0),
            cold_start_us: s.cold_start.map_or(0, |d| d.as_micros().max(1) as u64),
            ranks_attached: s
                .ranks
                .iter()
                .filter_map(|(&rank, r)| {
                    r.consumer.as_ref().map(|c| RankInfo {
                        rank,
                        released: r.released,
                        ready: r.ready.len() as u32,
                        figures: c.figures_now(now, r.finished),
                    })
                })
                .take(ranks)
                .collect(),
            producer: s
                .producer_figures
                .values()
                .fold(s.producers_departed, |mut sum, f| {
                    sum.add(f);
                    sum
                }),
        }
    }

    /// Adds the streams' and the cache's counters to the store's.
    pub fn add_stats(&self, stats: &mut feedstore_proto::StoreStats) {
        stats.streams = self.streams.len() as u64;
        self.cache.add_stats(stats);
        stats.ring_bytes = self.ring_bytes;
        stats.limits_hit += self.limits_hit;
        stats.streams_expired = self.expired;
    }
}
