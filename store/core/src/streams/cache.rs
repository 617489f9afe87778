//! The decode-once cache: sample keys to the store objects that hold those samples, per uid.
//!
//! Keys come from the clients that make samples (a stream's producers, a loader's workers), so
//! each uid has its own: no user can place bytes under a key another user looks up. The
//! objects are ordinary store objects, so eviction (LRU over samples nobody holds) is the
//! store's; an entry whose object is gone is dropped when looked up or swept.
//!
//! Bounded: an object is filed under one key at most (a handle filed by one uid is never moved
//! by another), and a client files only objects its own uid created ([`SampleCache::insert`]),
//! so the entries of live objects never outnumber the live handles: the store's objects, and
//! the origin handles of its pulled copies, twice its slots at most. The map keeps at most four
//! times the store's slots (a free bound) plus 1024 entries; past that, entries of objects gone
//! are swept, which frees at least half of it: a sweep costs O(1) per entry filed.

use std::collections::HashMap;

use feedstore_proto::Status;
use feedstore_proto::frame::CacheEntry;
use feedstore_proto::{Handle, StoreStats};

use super::Streams;
use crate::objects::{ConnId, Objects};

/// Sample keys to objects, per uid, and the counters `feedstore stat` shows.
#[derive(Debug, Default)]
pub struct SampleCache {
    by_key: HashMap<(u32, u128), Handle>,
    /// The same entries by object: each object under one key at most.
    by_handle: HashMap<Handle, (u32, u128)>,
    lookups: u64,
    hits: u64,
}

impl SampleCache {
    /// Files `handle` under `key` for `uid`, replacing what the key named (a stream's put: the
    /// sample its producer made last) and the key the object was filed under before by this
    /// uid. (A stream's put files only objects `uid` created, and none a peer's session puts;
    /// an object another uid filed stays where it is all the same.)
    pub fn file(&mut self, objects: &Objects, uid: u32, key: u128, handle: Handle) {
        if self
            .by_handle
            .get(&handle)
            .is_some_and(|&(filer, _)| filer != uid)
        {
            return;
        }
        if let Some(old) = self.by_key.insert((uid, key), handle)
            && old != handle
        {
            self.by_handle.remove(&old);
        }
        if let Some(old) = self.by_handle.insert(handle, (uid, key))
            && old != (uid, key)
        {
            self.by_key.remove(&old);
        }
        self.sweep(objects);
    }

    /// What `uid` filed under `key`, whether or not the object is still there.
    pub fn get(&self, uid: u32, key: u128) -> Option<Handle> {
        self.by_key.get(&(uid, key)).copied()
    }

    /// Per key, the object `uid` filed under it if the store still holds it (counted).
    pub fn lookup(&mut self, objects: &Objects, uid: u32, keys: &[u128]) -> Vec<Option<Handle>> {
        self.lookups += keys.len() as u64;
        keys.iter()
            .map(|&key| {
                let handle = self.get(uid, key)?;
                if objects.is_sealed(handle) {
                    self.hits += 1;
                    Some(handle)
                } else {
                    self.by_key.remove(&(uid, key));
                    self.by_handle.remove(&handle);
                    None
                }
            })
            .collect()
    }

    /// Files objects a client of `uid` made, each under its key. Per entry: `Ok`;
    /// `InvalidArgument` for the key 0 ("no key"); `NotFound` for a handle that names no
    /// sealed object; `NotOwner` for an object another uid created; `InUse` when the key names
    /// another live object (two workers made the sample at once: the first one filed stays) or
    /// the object is filed under another key; `LimitReached` at the bound.
    pub fn insert(&mut self, objects: &Objects, uid: u32, entries: &[CacheEntry]) -> Vec<Status> {
        let bound = Self::bound(objects);
        let mut swept = false;
        entries
            .iter()
            .map(|&CacheEntry { key, handle }| {
                if key == 0 {
                    return Status::InvalidArgument;
                }
                match objects.creator(handle) {
                    None => return Status::NotFound,
                    Some(creator) if creator != uid => return Status::NotOwner,
                    Some(_) => {}
                }
                match self.by_handle.get(&handle) {
                    Some(&filed) if filed == (uid, key) => return Status::Ok,
                    Some(_) => return Status::InUse,
                    None => {}
                }
                if self.get(uid, key).is_some_and(|h| objects.is_sealed(h)) {
                    return Status::InUse;
                }
                if self.by_key.len() >= bound && !swept {
                    // Once a request at most: what it frees (half at least) lasts a while.
                    self.retain_live(objects);
                    swept = true;
                }
                if self.by_key.len() >= bound {
                    return Status::LimitReached;
                }
                self.file(objects, uid, key, handle);
                Status::Ok
            })
            .collect()
    }

    /// Drops the entries of objects gone once the map has grown past its bound.
    pub fn sweep(&mut self, objects: &Objects) {
        if self.by_key.len() > Self::bound(objects) {
            self.retain_live(objects);
        }
    }

    fn retain_live(&mut self, objects: &Objects) {
        self.by_key.retain(|_, h| objects.is_sealed(*h));
        self.by_handle.retain(|h, _| objects.is_sealed(*h));
    }

    fn bound(objects: &Objects) -> usize {
        4 * objects.slot_count() + 1024
    }

    /// Adds the cache's counters to the store's.
    pub fn add_stats(&self, stats: &mut StoreStats) {
        stats.cache_lookups = self.lookups;
        stats.cache_hits = self.hits;
        stats.cache_entries = self.by_key.len() as u64;
    }

    /// Entries held (live or not yet swept).
    #[cfg(test)]
    fn entries(&self) -> usize {
        self.by_key.len()
    }
}

/// The streams' side of the cache: lookups and filings by a client of its own uid, and the check
/// another node's producer's hand-back passes.
impl Streams {
    /// Looks samples up by key, among those `conn`'s uid filed: the handle of each one still
    /// in the store.
    pub fn lookup(
        &mut self,
        objects: &Objects,
        conn: ConnId,
        keys: &[u128],
    ) -> Vec<Option<Handle>> {
        match objects.client(conn).map(|c| c.uid) {
            Some(uid) => self.cache.lookup(objects, uid, keys),
            None => vec![None; keys.len()],
        }
    }

    /// Files objects `conn`'s uid made under sample keys (a loader's worker sharing what it
    /// made): per entry, see [`SampleCache::insert`].
    pub fn insert(
        &mut self,
        objects: &Objects,
        conn: ConnId,
        entries: &[CacheEntry],
    ) -> Vec<Status> {
        match objects.client(conn).map(|c| c.uid) {
            Some(uid) => self.cache.insert(objects, uid, entries),
            None => vec![Status::NotFound; entries.len()],
        }
    }

    /// Whether `handle` is what stream `id`'s owner put under cache key `key`: a sample this
    /// node's producers of that uid made, which another node's producer may hand back for a
    /// rank of the stream (it found the sample in its own cache as a pulled copy).
    pub fn cached_sample(&self, id: u32, key: u128, handle: Handle) -> bool {
        key != 0
            && self
                .streams
                .get(&id)
                .is_some_and(|s| self.cache.get(s.owner_uid, key) == Some(handle))
    }
}

#[cfg(test)]
mod tests {
    use feedstore_proto::Role;

    use super::*;
    use crate::objects::ConnId;

    use crate::objects::test_client as client;

    fn sealed(o: &mut Objects, conn: ConnId) -> Handle {
        let h = o.create(conn, 64, false).unwrap().handle;
        o.seal(conn, h).unwrap();
        h
    }

    fn entry(key: u128, handle: Handle) -> CacheEntry {
        CacheEntry { key, handle }
    }

    /// A worker files what it made; lookups of its uid find it while it is stored, other uids
    /// never do, and nobody files an object another uid made.
    #[test]
    fn filed_samples_are_found_by_their_uid_alone() {
        let mut o = Objects::new(1, 1, &[1 << 20], false);
        let (me, stranger) = (
            client(&mut o, Role::Writer, 1000),
            client(&mut o, Role::Writer, 2000),
        );
        let mut c = SampleCache::default();
        let sample = sealed(&mut o, me);
        let writing = o.create(me, 64, false).unwrap().handle;
        let theirs = sealed(&mut o, stranger);
        assert_eq!(
            c.insert(
                &o,
                1000,
                &[
                    entry(7, sample),
                    entry(8, writing),
                    entry(0, sample),
                    entry(9, theirs)
                ]
            ),
            vec![
                Status::Ok,
                Status::NotFound,
                Status::InvalidArgument,
                Status::NotOwner
            ],
            "only sealed objects of one's own uid, never the key 0"
        );
        assert_eq!(
            c.lookup(&o, 1000, &[7, 8, 9]),
            vec![Some(sample), None, None]
        );
        assert_eq!(c.lookup(&o, 2000, &[7]), vec![None], "another uid's entry");
        let twin = sealed(&mut o, me);
        assert_eq!(
            c.insert(
                &o,
                1000,
                &[entry(7, twin), entry(10, sample), entry(7, sample)]
            ),
            vec![Status::InUse, Status::InUse, Status::Ok],
            "the first object filed under a key stays while it lives; one key per object"
        );
        // A stream's put may name any sealed object: another uid's put leaves this entry be.
        c.file(&o, 2000, 70, sample);
        assert_eq!(c.lookup(&o, 1000, &[7]), vec![Some(sample)]);
        assert_eq!(c.lookup(&o, 2000, &[70]), vec![None]);
        o.delete(me, sample).unwrap();
        assert_eq!(
            c.insert(&o, 1000, &[entry(7, twin)]),
            vec![Status::Ok],
            "once it is gone"
        );
        assert_eq!(c.lookup(&o, 1000, &[7]), vec![Some(twin)]);
    }

    /// Keys never outnumber the objects they name, so the map stays within its bound however
    /// many keys a client sends, and a sweep at the bound frees at least half of it.
    #[test]
    fn the_map_stays_bounded_by_the_stores_objects() {
        let mut o = Objects::new(1, 1, &[1 << 20], false);
        let me = client(&mut o, Role::Writer, 1000);
        let mut c = SampleCache::default();
        let one = sealed(&mut o, me);
        let flood: Vec<_> = (1..5000).map(|k| entry(k, one)).collect();
        let statuses = c.insert(&o, 1000, &flood);
        assert_eq!(statuses[0], Status::Ok);
        assert!(statuses[1..].iter().all(|&s| s == Status::InUse));
        assert_eq!(c.entries(), 1);
        // Objects filed and gone leave entries until the bound (four times the slots, plus 1024).
        for key in 10_000..12_000u128 {
            let h = sealed(&mut o, me);
            assert_eq!(c.insert(&o, 1000, &[entry(key, h)]), vec![Status::Ok]);
            o.delete(me, h).unwrap();
            assert!(c.entries() <= 4 * o.slot_count() + 1024);
        }
        assert!(c.entries() < 2000, "swept: {} entries", c.entries());
        assert_eq!(c.lookup(&o, 1000, &[1]), vec![Some(one)]);
    }
}
