use super::*;

fn store(capacity: u64) -> (Objects, ConnId, ConnId) {
    store_with(Objects::new(7, 99, &[capacity], false))
}

/// `o` with a writer and a reader connected.
fn store_with(mut o: Objects) -> (Objects, ConnId, ConnId) {
    let info = |role| ClientInfo {
        role,
        uid: 0,
        pid: 1,
        process: Process::default(),
        name: "t".into(),
        internal: false,
        capped: false,
    };
    let w = o.connect(info(Role::Writer));
    let r = o.connect(info(Role::Reader));
    (o, w, r)
}

fn put(o: &mut Objects, w: ConnId, size: u64) -> Handle {
    let c = o.create(w, size, false).unwrap();
    o.seal(w, c.handle).unwrap();
    c.handle
}

#[test]
fn unsealed_objects_are_invisible() {
    let (mut o, w, r) = store(1 << 20);
    let c = o.create(w, 100, false).unwrap();
    assert_eq!(o.get(r, c.handle), Err(Status::NotSealed));
    o.seal(w, c.handle).unwrap();
    assert_eq!(o.get(r, c.handle).unwrap().len, 100);
}

#[test]
fn readers_cannot_write() {
    let (mut o, _, r) = store(1 << 20);
    assert_eq!(
        o.create(r, 10, false).unwrap_err(),
        Status::PermissionDenied
    );
}

#[test]
fn only_the_owner_seals() {
    let mut o = Objects::new(1, 1, &[1 << 20], false);
    let info = || ClientInfo {
        role: Role::Writer,
        uid: 0,
        pid: 1,
        process: Process::default(),
        name: "t".into(),
        internal: false,
        capped: false,
    };
    let (a, b) = (o.connect(info()), o.connect(info()));
    let c = o.create(a, 10, false).unwrap();
    assert_eq!(o.seal(b, c.handle), Err(Status::NotOwner));
    o.seal(a, c.handle).unwrap();
    assert_eq!(o.seal(a, c.handle), Err(Status::InvalidState));
}

#[test]
fn forged_and_stale_handles_never_resolve_to_another_object() {
    let (mut o, w, r) = store(1 << 20);
    let h = put(&mut o, w, 64);
    o.delete(w, h).unwrap();
    assert_eq!(o.get(r, h), Err(Status::NotFound));
    let h2 = put(&mut o, w, 64);
    assert_eq!(o.slot_count(), 1, "the slot is reused");
    assert_ne!(h2.id, h.id, "under another id");
    assert_eq!(o.get(r, h), Err(Status::NotFound));
    let forged = |f: fn(&mut Handle)| {
        let mut x = h2;
        f(&mut x);
        x
    };
    assert_eq!(o.get(r, forged(|h| h.epoch ^= 1)), Err(Status::Stale));
    assert_eq!(o.get(r, forged(|h| h.node_id ^= 1)), Err(Status::WrongNode));
    assert_eq!(o.get(r, forged(|h| h.id ^= 1)), Err(Status::NotFound));
    assert_eq!(o.get(r, forged(|h| h.id += 1)), Err(Status::NotFound));
}

/// Ids are not a count: a reader holding some handles cannot name the others. Thousands of
/// objects' ids share no structure a guess could use (distinct, spread over all 64 bits,
/// neighbours unrelated).
#[test]
fn handles_cannot_be_enumerated() {
    let (mut o, w, r) = store(1 << 20);
    let ids: Vec<u64> = (0..4096)
        .map(|_| {
            let h = put(&mut o, w, 64);
            o.delete(w, h).unwrap();
            h.id
        })
        .collect();
    let distinct: HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len());
    // Each bit is set in about half the ids (4096 draws: 2048 +- 5 sigma).
    for bit in 0..64 {
        let ones = ids.iter().filter(|&&id| id >> bit & 1 == 1).count();
        assert!((1728..=2368).contains(&ones), "bit {bit}: {ones} of 4096");
    }
    // A live object's neighbours in id space name nothing.
    let live = put(&mut o, w, 64);
    for delta in 1..=1000u64 {
        for id in [live.id.wrapping_add(delta), live.id.wrapping_sub(delta)] {
            assert_eq!(o.get(r, Handle { id, ..live }), Err(Status::NotFound));
        }
    }
    // Another store's ids come from another key.
    let (mut other, w2, _) = store(1 << 20);
    assert!(!ids.contains(&put(&mut other, w2, 64).id));
}

/// A uid allowed only to read holds at most its share of the store leased: past it, gets of
/// more objects are refused (counted), more leases on objects it holds are not, and what it
/// returns is its to take again. Writers' creates evict everything it does not hold.
#[test]
fn a_reader_uid_holds_at_most_its_share() {
    let mut o = Objects::new(7, 99, &[64 << 20], false).with_capped_lease_bytes(16 << 20);
    let w = o.connect(ClientInfo {
        role: Role::Writer,
        uid: 0,
        pid: 1,
        process: Process::default(),
        name: "root".into(),
        internal: false,
        capped: false,
    });
    let reader = |o: &mut Objects| {
        o.connect(ClientInfo {
            role: Role::Reader,
            uid: 65534,
            pid: 2,
            process: Process::default(),
            name: "nobody".into(),
            internal: false,
            capped: true,
        })
    };
    let (r1, r2) = (reader(&mut o), reader(&mut o));
    let objects: Vec<Handle> = (0..16).map(|_| put(&mut o, w, 4 << 20)).collect();
    // Two connections of the uid share one share: 4 objects of 4 MiB.
    for (i, &h) in objects.iter().enumerate().take(4) {
        o.get(if i % 2 == 0 { r1 } else { r2 }, h).unwrap();
    }
    assert_eq!(o.get(r1, objects[4]), Err(Status::OverShare));
    assert_eq!(o.get(r2, objects[5]), Err(Status::OverShare));
    o.get(r2, objects[0]).unwrap();
    assert_eq!(o.stats().lease_share_refusals, 2);
    // Root reserves 40 MiB of the 64: evicts what the reader does not hold.
    let big = o.create(w, 40 << 20, false).unwrap();
    o.abort(w, big.handle).unwrap();
    // Returning a lease gives the room back; the connection closing returns the rest.
    o.release(r1, objects[0]).unwrap();
    o.release(r2, objects[0]).unwrap();
    let fresh = put(&mut o, w, 4 << 20);
    o.get(r1, fresh).unwrap();
    o.disconnect(r1);
    o.disconnect(r2);
    assert!(o.capped.is_empty());
    let r3 = reader(&mut o);
    let again: Vec<Handle> = (0..4).map(|_| put(&mut o, w, 4 << 20)).collect();
    for &h in &again {
        o.get(r3, h).unwrap();
    }
}

#[test]
fn delete_waits_for_the_last_lease() {
    let (mut o, w, r) = store(1 << 20);
    let h = put(&mut o, w, 1000);
    o.get(r, h).unwrap();
    o.get(r, h).unwrap();
    o.delete(w, h).unwrap();
    assert_eq!(o.get(r, h), Err(Status::NotFound), "hidden once deleted");
    assert_eq!(o.stats().objects_delete_pending, 1);
    assert_eq!(o.stats().used_bytes, 1024);
    o.release(r, h).unwrap();
    assert_eq!(o.stats().used_bytes, 1024);
    o.release(r, h).unwrap();
    assert_eq!(o.stats().used_bytes, 0);
    assert_eq!(o.release(r, h), Err(Status::NotFound));
}

#[test]
fn eviction_is_lru_and_spares_leased_and_pinned_objects() {
    let (mut o, w, r) = store(64 * 4);
    let pinned = o.create(w, 64, true).unwrap().handle;
    o.seal(w, pinned).unwrap();
    let a = put(&mut o, w, 64);
    let b = put(&mut o, w, 64);
    let c = put(&mut o, w, 64);
    o.get(r, a).unwrap(); // leased: not evictable
    o.get(r, b).unwrap();
    o.release(r, b).unwrap(); // b now more recent than c
    let d = put(&mut o, w, 64);
    let gone = |r: Result<Location, Status>| matches!(r, Err(Status::NotFound | Status::Stale));
    assert!(gone(o.get(r, c)), "c was least recently used");
    let e = put(&mut o, w, 64);
    assert!(gone(o.get(r, b)), "then b");
    assert_eq!(o.stats().evictions, 2);
    // Everything left is leased or pinned, except e and d.
    o.get(r, d).unwrap();
    o.get(r, e).unwrap();
    assert_eq!(o.create(w, 64, false).unwrap_err(), Status::Full);
    assert!(o.get(r, pinned).is_ok());
}

#[test]
fn too_large_and_zero_sized_objects_are_refused() {
    let (mut o, w, _) = store(1 << 20);
    assert_eq!(
        o.create(w, (1 << 20) + 1, false).unwrap_err(),
        Status::TooLarge
    );
    assert_eq!(o.create(w, 0, false).unwrap_err(), Status::InvalidArgument);
    assert_eq!(o.create(w, u64::MAX, false).unwrap_err(), Status::TooLarge);
}

#[test]
fn a_connection_holds_at_most_its_lease_limit() {
    let (mut o, w, r) = store_with(Objects::new(7, 99, &[1 << 20], false).with_lease_limit(3));
    let h = put(&mut o, w, 64);
    for _ in 0..3 {
        o.get(r, h).unwrap();
    }
    assert_eq!(o.get(r, h), Err(Status::LimitReached));
    o.release(r, h).unwrap();
    o.get(r, h).unwrap();
    assert_eq!(o.stats().limits_hit, 1);
    assert_eq!(o.stats().leases, 3);
}

#[test]
fn a_shared_lease_needs_one_to_share() {
    let (mut o, w, r) = store(1 << 20);
    let h = put(&mut o, w, 64);
    assert_eq!(o.share_lease(w, r, h), Err(Status::InvalidState));
    o.get(w, h).unwrap();
    o.delete(w, h).unwrap();
    o.share_lease(w, r, h).unwrap();
    assert_eq!(o.get(r, h), Err(Status::NotFound), "hidden from new gets");
    o.release(w, h).unwrap();
    assert!(o.stats().used_bytes > 0, "the shared lease keeps it");
    o.release(r, h).unwrap();
    assert_eq!(o.stats().used_bytes, 0);
}

#[test]
fn a_copy_answers_to_its_owners_handle_until_it_goes() {
    let (mut o, w, r) = store(1 << 20);
    let origin = Handle {
        node_id: 8,
        epoch: 5,
        id: 3,
    };
    assert_eq!(o.get(r, origin), Err(Status::WrongNode), "not pulled yet");
    let c = o.create(w, 100, false).unwrap();
    assert_eq!(
        o.get(r, origin),
        Err(Status::WrongNode),
        "not visible while written"
    );
    o.seal_copy(w, c.handle, origin, 1000).unwrap();
    assert_eq!(
        o.lease(r, origin).unwrap().writer,
        1000,
        "the owner's writer"
    );
    o.release(r, origin).unwrap();
    assert_eq!(o.get(r, origin).unwrap(), c.location);
    assert_eq!(o.stats().objects_pulled, 1);
    let twice = o.create(w, 100, false).unwrap();
    assert_eq!(
        o.seal_copy(w, twice.handle, origin, 1000),
        Err(Status::InvalidState)
    );
    assert_eq!(o.stats().objects_writing, 0, "the second copy was aborted");
    o.release(r, origin).unwrap();
    o.delete(w, origin).unwrap();
    assert_eq!(o.get(r, origin), Err(Status::WrongNode), "gone: pull again");
    let own = o.create(w, 10, false).unwrap().handle;
    assert_eq!(o.seal_copy(w, own, own, 0), Err(Status::InvalidArgument));
}

#[test]
fn disconnect_aborts_unsealed_and_returns_leases() {
    let (mut o, w, r) = store(1 << 20);
    let sealed = put(&mut o, w, 4096);
    let _open = o.create(w, 4096, false).unwrap();
    o.get(r, sealed).unwrap();
    o.get(r, sealed).unwrap();
    assert_eq!(
        o.disconnect(r),
        Reclaimed {
            aborted: 0,
            leases: 2
        }
    );
    assert_eq!(
        o.disconnect(w),
        Reclaimed {
            aborted: 1,
            leases: 0
        }
    );
    let s = o.stats();
    assert_eq!((s.leases, s.objects_writing, s.objects_sealed), (0, 0, 1));
    assert_eq!(s.used_bytes, 4096);
}
