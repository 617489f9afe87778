use std::time::Duration;

use feedstore_proto::frame::{RankFigures, StreamInfo, StreamItem, StreamTask};
use feedstore_proto::{Role, Status};

use super::ring::ring_size;
use super::*;
use feedstore_proto::stream::{Shuffle, Tail};

fn spec(epochs: u64) -> StreamSpec {
    StreamSpec {
        name: "s".into(),
        records: 8,
        seed: 1,
        world: 2,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: Some(epochs),
        reshard: None,
    }
}

use crate::objects::test_client as client;

fn setup() -> (Objects, Streams, ConnId, ConnId) {
    setup_with(&StreamLimits::default())
}

fn setup_with(limits: &StreamLimits) -> (Objects, Streams, ConnId, ConnId) {
    let mut o = Objects::new(1, 1, &[1 << 20], false);
    let producer = client(&mut o, Role::Writer, 1000);
    let consumer = client(&mut o, Role::Reader, 1000);
    (o, Streams::new(limits, 1000), producer, consumer)
}

fn starts(ranks: &[u32]) -> Vec<StreamTask> {
    ranks
        .iter()
        .map(|&rank| StreamTask { rank, seq: 0 })
        .collect()
}

fn make(o: &mut Objects, producer: ConnId, task: StreamTask) -> StreamItem {
    let created = o.create(producer, 64, false).unwrap();
    StreamItem {
        task,
        handle: created.handle,
        record: task.seq,
        flags: 0,
        key: u128::from(task.seq) + 1,
        offset: 0,
    }
}

/// Takes and puts everything the windows allow.
fn fill(o: &mut Objects, s: &mut Streams, p: ConnId, id: u32) -> Vec<StreamItem> {
    let tasks = s.take(p, id, 100, None).unwrap();
    let items: Vec<_> = tasks.iter().map(|&t| make(o, p, t)).collect();
    assert!(
        s.put(o, p, id, &items, true)
            .unwrap()
            .iter()
            .all(|s| *s == Status::Ok)
    );
    items
}

#[test]
fn windows_bound_the_work_and_slide_on_release() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(
            &mut o,
            p,
            &spec(1),
            2,
            &starts(&[0, 1]),
            &Placement::default(),
        )
        .map(|(id, _)| id)
        .unwrap();
    let tasks = s.take(p, id, 100, None).unwrap();
    assert_eq!(tasks.len(), 4, "depth 2 × 2 ranks: {tasks:?}");
    assert!(s.take(p, id, 100, None).unwrap().is_empty(), "windows full");
    let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
    assert_eq!(
        s.put(&mut o, p, id, &items, true).unwrap(),
        vec![Status::Ok; 4]
    );
    assert_eq!(o.stats().objects_sealed, 4);
    let (_, ring) = s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    assert!(ring.size_bytes() > 0);
    assert_eq!(
        o.stats().leases,
        4 + 2,
        "the stream's four, the consumer's own two"
    );
    assert_eq!(s.poll(c, id, 0, 0).unwrap(), Some(Status::Ok));
    assert_eq!(s.poll(c, id, 0, 2).unwrap(), None);
    s.release(&mut o, c, id, 0, 1, RankFigures::default())
        .unwrap();
    assert_eq!(
        s.take(p, id, 100, None).unwrap(),
        vec![StreamTask { rank: 0, seq: 2 }]
    );
    assert_eq!(
        o.stats().leases,
        3 + 2,
        "the stream let go; the views still hold theirs"
    );
    // The consumer's views go: its client returns their leases.
    o.release(c, items[0].handle).unwrap();
    assert_eq!(o.stats().leases, 3 + 1);
}

/// The soundness bug: a rank reopened at a later position used to return the stream's
/// lease on samples a view still read, and the store reused their bytes.
#[test]
fn a_reattach_never_frees_what_a_view_holds() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(&mut o, p, &spec(4), 4, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    let items = fill(&mut o, &mut s, p, id);
    s.attach(&mut o, c, &spec(4), 0, 0).unwrap();
    // The consumer read 0..3 (holding 0), then its stream went: a detach at 3.
    s.release(&mut o, c, id, 0, 0, RankFigures::default())
        .unwrap();
    s.detach(&mut o, c, id, 0, 3).unwrap();
    assert_eq!(
        o.stats().leases,
        4 + 3,
        "entry 3 was never read: its lease went back"
    );
    // A new consumer resumes at 3: the stream drops 0..3, but views 0..3 keep theirs.
    let c2 = client(&mut o, Role::Reader, 1000);
    s.attach(&mut o, c2, &spec(4), 0, 3).unwrap();
    // Room for all but one object: only evicting views' objects could make it.
    assert_eq!(
        o.create(p, (1 << 20) - 64, false).unwrap_err(),
        Status::Full,
        "nothing a view holds is evictable"
    );
    for item in &items[..3] {
        assert!(o.is_sealed(item.handle), "{} still stored", item.handle);
    }
    // And a close keeps them too.
    s.close(&mut o, p, id).unwrap();
    for item in &items[..3] {
        assert!(o.is_sealed(item.handle));
    }
    for item in &items[..3] {
        o.release(c, item.handle).unwrap();
    }
    assert_eq!(
        o.stats().leases,
        1,
        "only c2's own lease on entry 3, until it detaches"
    );
}

#[test]
fn only_the_owners_writers_close_a_stream() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(&mut o, p, &spec(1), 4, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    let err = s.close(&mut o, c, id).unwrap_err();
    assert_eq!(err.status, Status::PermissionDenied, "a reader: {err}");
    let stranger = client(&mut o, Role::Writer, 2000);
    let err = s.close(&mut o, stranger, id).unwrap_err();
    assert_eq!(err.status, Status::PermissionDenied, "another uid: {err}");
    let err = s
        .join(&mut o, c, &spec(1), 4, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap_err();
    assert_eq!(
        err.status,
        Status::PermissionDenied,
        "readers do not create or join"
    );
    let root = client(&mut o, Role::Writer, 0);
    s.close(&mut o, root, id).unwrap();
}

#[test]
fn readers_attach_only_to_streams_writers_made() {
    let (mut o, mut s, p, c) = setup();
    let err = s.attach(&mut o, c, &spec(1), 0, 0).unwrap_err();
    assert_eq!(err.status, Status::NotFound);
    assert_eq!(s.list(&o, c, 0, 1 << 20).0.len(), 0);
    s.join(&mut o, p, &spec(1), 4, &[], &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    let other = client(&mut o, Role::Reader, 1000);
    let err = s.attach(&mut o, other, &spec(1), 0, 0).unwrap_err();
    assert_eq!(err.status, Status::InUse, "one consumer per rank");
}

#[test]
fn rings_and_streams_are_bounded() {
    let limits = StreamLimits {
        max_streams: 2,
        max_ring_bytes: 3 * ring_size(64),
        ..StreamLimits::default()
    };
    let (mut o, mut s, p, c) = setup_with(&limits);
    let wide = StreamSpec {
        world: 8,
        records: 64,
        ..spec(1)
    };
    s.join(&mut o, p, &wide, 64, &[], &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    for rank in 0..3 {
        let conn = client(&mut o, Role::Reader, 1000);
        s.attach(&mut o, conn, &wide, rank, 0).unwrap();
    }
    let err = s.attach(&mut o, c, &wide, 3, 0).unwrap_err();
    assert_eq!(err.status, Status::LimitReached, "{err}");
    assert!(err.message.contains("--max-ring-bytes"), "{err}");
    let mut stats = o.stats();
    s.add_stats(&mut stats);
    assert_eq!(stats.ring_bytes, 3 * ring_size(64));
    let two = StreamSpec {
        name: "t".into(),
        ..spec(1)
    };
    s.join(&mut o, p, &two, 4, &[], &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    let three = StreamSpec {
        name: "u".into(),
        ..spec(1)
    };
    let err = s
        .join(&mut o, p, &three, 4, &[], &Placement::default())
        .map(|(id, _)| id)
        .unwrap_err();
    assert_eq!(err.status, Status::LimitReached);
    assert!(err.message.contains("--max-streams"), "{err}");
}

/// Names are per uid: another user can neither see, feed, rewind nor squat a stream.
#[test]
fn streams_belong_to_their_uid() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(&mut o, p, &spec(1), 4, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    let tasks = s.take(p, id, 1, None).unwrap();
    let other_reader = client(&mut o, Role::Reader, 2000);
    let err = s.attach(&mut o, other_reader, &spec(1), 0, 0).unwrap_err();
    assert_eq!(
        err.status,
        Status::NotFound,
        "uid 2000 sees no stream of uid 1000"
    );
    let other_writer = client(&mut o, Role::Writer, 2000);
    let theirs = s
        .join(
            &mut o,
            other_writer,
            &spec(1),
            4,
            &[],
            &Placement::default(),
        )
        .map(|(id, _)| id)
        .unwrap();
    assert_ne!(
        theirs, id,
        "the same name is another stream for another uid"
    );
    let item = make(&mut o, other_writer, tasks[0]);
    let err = s.put(&mut o, other_writer, id, &[item], true).unwrap_err();
    assert_eq!(
        err.status,
        Status::Protocol,
        "only the stream's producers put into it"
    );
    assert!(s.take(other_writer, id, 1, None).is_err());
    s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
}

/// A ring stays counted until the connection that received it closes (the client may keep
/// it mapped), and a connection attaches to one rank at a time.
#[test]
fn rings_are_counted_until_their_connection_closes() {
    let (mut o, mut s, p, c) = setup();
    let wide = StreamSpec {
        world: 4,
        ..spec(1)
    };
    let id = s
        .join(&mut o, p, &wide, 64, &[], &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    s.attach(&mut o, c, &wide, 0, 0).unwrap();
    let err = s.attach(&mut o, c, &wide, 1, 0).unwrap_err();
    assert_eq!(err.status, Status::InvalidState, "one rank per connection");
    s.detach(&mut o, c, id, 0, 0).unwrap();
    let ring_bytes = |s: &Streams| {
        let mut stats = feedstore_proto::StoreStats::default();
        s.add_stats(&mut stats);
        stats.ring_bytes
    };
    assert_eq!(
        ring_bytes(&s),
        ring_size(64),
        "still counted after the detach"
    );
    s.attach(&mut o, c, &wide, 1, 0).unwrap();
    assert_eq!(ring_bytes(&s), 2 * ring_size(64));
    s.disconnect(c);
    assert_eq!(ring_bytes(&s), 0, "given back with the connection");
    let looping = client(&mut o, Role::Reader, 1000);
    for _ in 0..MAX_RINGS_PER_CONNECTION {
        s.attach(&mut o, looping, &wide, 2, 0).unwrap();
        s.detach(&mut o, looping, id, 2, 0).unwrap();
    }
    let err = s.attach(&mut o, looping, &wide, 2, 0).unwrap_err();
    assert_eq!(err.status, Status::LimitReached, "{err}");
}

#[test]
fn idle_streams_expire_and_give_their_samples_back() {
    let limits = StreamLimits {
        stream_idle_timeout: Duration::from_secs(60),
        ..StreamLimits::default()
    };
    let (mut o, mut s, p, c) = setup_with(&limits);
    let id = s
        .join(&mut o, p, &spec(1), 4, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    fill(&mut o, &mut s, p, id);
    let later = Instant::now() + Duration::from_secs(120);
    assert_eq!(s.expire(&mut o, later), 0, "a producer is joined");
    s.disconnect(p);
    s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    assert_eq!(s.expire(&mut o, later), 0, "a consumer is attached");
    s.disconnect(c);
    o.disconnect(c);
    assert_eq!(s.expire(&mut o, Instant::now()), 0, "not idle for long yet");
    assert_eq!(s.expire(&mut o, later), 1);
    assert_eq!(o.stats().leases, 0);
    let mut stats = o.stats();
    s.add_stats(&mut stats);
    assert_eq!((stats.streams, stats.streams_expired), (0, 1));
}

#[test]
fn a_batched_stream_hands_out_whole_batches_that_share_an_object() {
    let (mut o, mut s, p, _) = setup();
    let tasks = |rank, seqs: std::ops::Range<u64>| -> Vec<StreamTask> {
        seqs.map(|seq| StreamTask { rank, seq }).collect()
    };
    let narrow = Window { depth: 3, batch: 4 };
    let err = s
        .join(
            &mut o,
            p,
            &spec(2),
            narrow,
            &starts(&[0]),
            &Placement::default(),
        )
        .unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(
        err.message.contains("a batch of 4 samples"),
        "{}",
        err.message
    );
    let huge = Window {
        depth: MAX_DEPTH,
        batch: MAX_BATCH + 1,
    };
    let err = s
        .join(
            &mut o,
            p,
            &spec(2),
            huge,
            &starts(&[0]),
            &Placement::default(),
        )
        .unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    let window = Window { depth: 8, batch: 4 };
    let id = s
        .join(
            &mut o,
            p,
            &spec(2),
            window,
            &starts(&[0, 1]),
            &Placement::default(),
        )
        .map(|(id, _)| id)
        .unwrap();
    assert_eq!(
        s.take(p, id, 1, None).unwrap(),
        tasks(0, 0..4),
        "a whole batch past max"
    );
    let rest = s.take(p, id, 100, None).unwrap();
    let want: Vec<StreamTask> = [tasks(1, 0..4), tasks(0, 4..8), tasks(1, 4..8)].concat();
    assert_eq!(rest, want);
    assert!(s.take(p, id, 100, None).unwrap().is_empty(), "windows full");

    // Rank 0's first batch in one object of four 64-byte samples; a fifth offset past its
    // end is refused, and only that task is made again.
    let object = o.create(p, 256, false).unwrap().handle;
    let items: Vec<StreamItem> = tasks(0, 0..4)
        .into_iter()
        .zip([0, 64, 128, 256])
        .map(|(task, offset)| StreamItem {
            task,
            handle: object,
            record: task.seq,
            flags: 0,
            key: 0,
            offset,
        })
        .collect();
    assert_eq!(
        s.put(&mut o, p, id, &items, true).unwrap(),
        vec![Status::Ok, Status::Ok, Status::Ok, Status::InvalidArgument]
    );
    assert_eq!(o.stats().objects_sealed, 1);
    assert_eq!(
        o.stats().leases,
        3,
        "the stream leases the object once per sample"
    );
    let stream = &s.streams[&id];
    let entries = &stream.ranks[&0].ready;
    let at = |seq: u64| entries[&seq].location;
    assert_eq!(
        (at(1).offset - at(0).offset, at(0).len - at(1).len),
        (64, 64)
    );
    assert_eq!(
        at(2).offset + at(2).len,
        at(0).offset + 256,
        "each runs to the end"
    );

    // A producer dies with batches out: a new one gets the missing ones a batch at a time.
    s.disconnect(p);
    let p2 = client(&mut o, Role::Writer, 1000);
    s.join(
        &mut o,
        p2,
        &spec(2),
        window,
        &starts(&[0]),
        &Placement::default(),
    )
    .unwrap();
    let again = s.take(p2, id, 100, None).unwrap();
    let want = [
        tasks(1, 0..4),
        tasks(0, 3..4),
        tasks(1, 4..8),
        tasks(0, 4..8),
    ]
    .concat();
    assert_eq!(again, want);
}

#[test]
fn a_dead_producers_tasks_are_made_again() {
    let (mut o, mut s, p, _) = setup();
    let id = s
        .join(&mut o, p, &spec(1), 2, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    let first = s.take(p, id, 1, None).unwrap();
    s.disconnect(p);
    let p2 = client(&mut o, Role::Writer, 1000);
    s.join(
        &mut o,
        p2,
        &spec(1),
        2,
        &starts(&[0]),
        &Placement::default(),
    )
    .map(|(id, _)| id)
    .unwrap();
    let again = s.take(p2, id, 2, None).unwrap();
    assert_eq!(again[0], first[0], "redo first");
    let item = make(&mut o, p2, first[0]);
    assert_eq!(
        s.put(&mut o, p2, id, &[item], true).unwrap(),
        vec![Status::Ok]
    );
    let twice = make(&mut o, p2, first[0]);
    assert_eq!(
        s.put(&mut o, p2, id, &[twice], true).unwrap(),
        vec![Status::Stale],
        "put once"
    );
}

#[test]
fn attach_rewinds_and_keeps_what_it_can() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(&mut o, p, &spec(2), 4, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    fill(&mut o, &mut s, p, id);
    s.attach(&mut o, c, &spec(2), 0, 0).unwrap();
    s.release(&mut o, c, id, 0, 3, RankFigures::default())
        .unwrap();
    s.disconnect(c);
    // The checkpoint said 1: 1 and 2 were returned, 3 is still held.
    let c2 = client(&mut o, Role::Reader, 1000);
    s.attach(&mut o, c2, &spec(2), 0, 1).unwrap();
    assert_eq!(s.poll(c2, id, 0, 3).unwrap(), Some(Status::Ok), "kept");
    assert_eq!(s.poll(c2, id, 0, 1).unwrap(), None, "to be made again");
    let again = s.take(p, id, 10, None).unwrap();
    let seqs: Vec<u64> = again.iter().map(|t| t.seq).collect();
    assert_eq!(seqs, vec![1, 2, 4]);
    assert!(
        s.poll(c, id, 0, 1).is_err(),
        "only the attached consumer waits"
    );
}

#[test]
fn a_finished_stream_ends_and_a_close_returns_everything() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(&mut o, p, &spec(1), 8, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    let tasks = s.take(p, id, 100, None).unwrap();
    assert_eq!(tasks.len(), 4, "one epoch of 8 records over 2 ranks");
    let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
    s.put(&mut o, p, id, &items, true).unwrap();
    assert!(
        s.take(p, id, 1, None).unwrap().is_empty(),
        "made but not read: a resuming consumer may still rewind"
    );
    s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    assert_eq!(s.poll(c, id, 0, 4).unwrap(), Some(Status::Ended));
    let before = s.version();
    s.finish(c, id, 0, 3);
    assert_eq!(s.version(), before, "not past the end: nothing changed");
    s.finish(c, id, 0, 4);
    assert_ne!(
        s.version(),
        before,
        "read past the end: producers are woken"
    );
    assert_eq!(s.take(p, id, 1, None).unwrap_err().status, Status::Ended);
    let other = StreamSpec { seed: 2, ..spec(1) };
    assert_eq!(
        s.attach(&mut o, c, &other, 0, 0).unwrap_err().status,
        Status::SpecMismatch
    );
    s.close(&mut o, p, id).unwrap();
    assert_eq!(o.stats().leases, 4, "the consumer's own, until it detaches");
    s.detach(&mut o, c, id, 0, 0).unwrap();
    assert_eq!(o.stats().leases, 0);
}

#[test]
fn a_consumer_leaving_with_its_share_read_has_finished_it() {
    let (mut o, mut s, p, c) = setup();
    let id = s
        .join(&mut o, p, &spec(1), 8, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    fill(&mut o, &mut s, p, id);
    s.attach(&mut o, c, &spec(1), 0, 0).unwrap();
    // All four read; the last is still held when the consumer leaves (a trainer dropping its
    // stream before its last batch).
    s.release(&mut o, c, id, 0, 3, RankFigures::default())
        .unwrap();
    s.detach(&mut o, c, id, 0, 3).unwrap();
    assert!(
        s.take(p, id, 1, None).unwrap().is_empty(),
        "left before its last sample: a consumer may still come for it"
    );
    s.attach(&mut o, c, &spec(1), 0, 3).unwrap();
    let before = s.version();
    s.detach(&mut o, c, id, 0, 4).unwrap();
    assert_ne!(s.version(), before, "producers are woken");
    assert_eq!(
        s.take(p, id, 1, None).unwrap_err().status,
        Status::Ended,
        "left having read all: the producers need not wait for the sample it holds"
    );
}

#[test]
fn the_cache_finds_samples_still_stored() {
    let (mut o, mut s, p, _) = setup();
    let id = s
        .join(&mut o, p, &spec(1), 8, &starts(&[0]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    let tasks = s.take(p, id, 2, None).unwrap();
    let items: Vec<_> = tasks.iter().map(|&t| make(&mut o, p, t)).collect();
    s.put(&mut o, p, id, &items, true).unwrap();
    let found = s.lookup(&o, p, &[1, 2, 99]);
    assert_eq!(
        found,
        vec![Some(items[0].handle), Some(items[1].handle), None]
    );
    s.close(&mut o, p, id).unwrap();
    o.delete(p, items[0].handle).unwrap();
    assert_eq!(
        s.lookup(&o, p, &[1, 2]),
        vec![None, Some(items[1].handle)],
        "gone once deleted"
    );
    let stranger = client(&mut o, Role::Writer, 2000);
    assert_eq!(
        s.lookup(&o, stranger, &[2]),
        vec![None],
        "another uid finds nothing under the same key"
    );
    let mut stats = o.stats();
    s.add_stats(&mut stats);
    assert_eq!(
        (stats.cache_lookups, stats.cache_hits, stats.cache_entries),
        (6, 3, 1)
    );
}

#[test]
fn stream_lists_come_in_pages_that_fit() {
    let (mut o, mut s, p, _) = setup();
    for i in 0..10 {
        let spec = StreamSpec {
            name: format!("stream-{i}"),
            ..spec(1)
        };
        s.join(&mut o, p, &spec, 4, &[], &Placement::default())
            .map(|(id, _)| id)
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut after = 0;
    let stranger = client(&mut o, Role::Reader, 2000);
    assert!(
        s.list(&o, stranger, 0, 1 << 20).0.is_empty(),
        "another uid's"
    );
    loop {
        // Room for three entries (each about 280 bytes).
        let (page, more) = s.list(&o, p, after, 900);
        assert!(page.iter().map(StreamInfo::wire_bytes).sum::<usize>() <= 900);
        after = page.last().unwrap().id;
        seen.extend(page.into_iter().map(|i| i.name));
        if !more {
            break;
        }
    }
    assert_eq!(seen.len(), 10);
}

/// Rank 1 lives on node 9: its tasks come only from what node 9 grants, its samples wait
/// (sealed, leased by the stream) in node 9's outbox, and its consumer cannot attach here.
#[test]
fn another_nodes_ranks_take_only_granted_tasks_and_forward_their_samples() {
    let (mut o, mut s, p, c) = setup();
    let owners = Placement {
        owners: HashMap::from([(1, 9)]),
        relay: None,
    };
    let (id, feeders) = s
        .join(&mut o, p, &spec(1), 2, &starts(&[0, 1]), &owners)
        .unwrap();
    assert_eq!(feeders, vec![9], "one feeder for node 9");
    let (_, again) = s
        .join(&mut o, p, &spec(1), 2, &starts(&[0, 1]), &owners)
        .unwrap();
    assert!(again.is_empty(), "the feeder runs already");
    let err = s
        .join(&mut o, p, &spec(1), 2, &starts(&[1]), &Placement::default())
        .unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    let err = s.attach(&mut o, c, &spec(1), 1, 0).unwrap_err();
    assert!(err.message.contains("node 00000009"), "{}", err.message);

    let local = s.take(p, id, 100, None).unwrap();
    assert!(
        local.iter().all(|t| t.rank == 0),
        "nothing granted yet: {local:?}"
    );
    assert_eq!(s.demand(id, 9), Demand::Rejoin, "node 9 not told yet");
    let (uid, _, depth, ranks) = s.remote_join(id, 9).unwrap();
    assert_eq!((uid, depth, ranks), (1000, 2, starts(&[1])));
    s.remote_joined(id, 9, Some(4), 1);
    assert_eq!(s.demand(id, 9), Demand::Tasks(8));
    let granted = [
        StreamTask { rank: 1, seq: 0 },
        StreamTask { rank: 1, seq: 1 },
    ];
    s.grant(id, 9, &granted);
    assert_eq!(s.demand(id, 9), Demand::Tasks(6));
    assert_eq!(s.take(p, id, 100, None).unwrap(), granted.to_vec());
    assert!(
        s.take(p, id, 100, Some(&BTreeSet::from([0, 1])))
            .unwrap()
            .iter()
            .all(|t| t.rank == 0),
        "another node's session is never handed a third node's tasks"
    );
    let items: Vec<_> = granted.iter().map(|&t| make(&mut o, p, t)).collect();
    // A session may not put them back here (that would forward in a loop).
    let other_session = client(&mut o, Role::Writer, 1000);
    s.join(
        &mut o,
        other_session,
        &spec(1),
        2,
        &[],
        &Placement::default(),
    )
    .unwrap();
    assert_eq!(
        s.put(&mut o, other_session, id, &items[..1], false)
            .unwrap(),
        vec![Status::Stale]
    );
    assert_eq!(
        s.put(&mut o, p, id, &items, true).unwrap(),
        vec![Status::Ok; 2]
    );
    let forwards = s.forwards(&mut o);
    assert_eq!(forwards.len(), 1);
    assert_eq!((forwards[0].node, forwards[0].remote_stream), (9, 4));
    assert_eq!(forwards[0].items, items);
    assert_eq!(
        o.stats().leases,
        2,
        "the stream leases both until node 9 answers"
    );
    for item in &items {
        o.release(forwards[0].leases, item.handle).unwrap();
    }
    assert!(s.forwards(&mut o).is_empty());

    // A lost session forgets its grants; the owner said it ended; the last producer left.
    s.grant(id, 9, &[StreamTask { rank: 1, seq: 2 }]);
    s.remote_joined(id, 9, None, 0);
    s.remote_joined(id, 9, Some(4), 1);
    assert!(
        s.take(p, id, 100, None)
            .unwrap()
            .iter()
            .all(|t| t.rank == 0)
    );
    s.remote_ended(id, 9);
    s.register_session(other_session);
    s.disconnect(p);
    assert_eq!(
        s.demand(id, 9),
        Demand::Leave,
        "another node's session keeps no feeder of this node going"
    );
    // Leaving, a producer comes back: the same feeder joins again instead of ending.
    assert!(s.begin_leave(id, 9));
    s.join(&mut o, p, &spec(1), 2, &starts(&[0, 1]), &owners)
        .map(|(_, feeders)| assert!(feeders.is_empty(), "no second feeder"))
        .unwrap();
    assert!(!s.end_leave(id, 9), "joins again");
    s.disconnect(p);
    assert!(s.begin_leave(id, 9));
    assert!(s.end_leave(id, 9), "gone for good");
    assert!(s.remote_join(id, 9).is_none());
}

/// A task whose sample could not be pulled goes back to its window; a session leaving a
/// stream gives back what it took.
#[test]
fn tasks_given_back_or_left_are_made_again() {
    let (mut o, mut s, p, _c) = setup();
    let (id, _) = s
        .join(&mut o, p, &spec(1), 2, &starts(&[0]), &Placement::default())
        .unwrap();
    let only = BTreeSet::from([0]);
    let first = s.take(p, id, 1, Some(&only)).unwrap();
    let p2 = client(&mut o, Role::Writer, 1000);
    s.give_back(p2, id, first[0]);
    assert!(
        s.take(p, id, 1, Some(&only)).unwrap() != first,
        "only the connection that took a task gives it back"
    );
    s.give_back(p, id, first[0]);
    assert_eq!(s.take(p, id, 1, Some(&only)).unwrap(), first, "made again");
    s.leave(p, id);
    s.join(&mut o, p2, &spec(1), 2, &[], &Placement::default())
        .unwrap();
    let again = s.take(p2, id, 2, Some(&only)).unwrap();
    assert!(again.contains(&first[0]), "{again:?}");
    assert!(
        s.take(p, id, 1, Some(&only)).is_err(),
        "left: no longer a producer"
    );
}

/// The owner takes its own object back from a peer only when it is the stream's cached
/// sample for that key (a peer's cache hit on a copy of it), never any other object.
#[test]
fn only_the_streams_own_cached_sample_is_taken_back() {
    let (mut o, mut s, p, _c) = setup();
    let (id, _) = s
        .join(&mut o, p, &spec(1), 2, &starts(&[0]), &Placement::default())
        .unwrap();
    let tasks = s.take(p, id, 1, None).unwrap();
    let item = make(&mut o, p, tasks[0]);
    assert_eq!(
        s.put(&mut o, p, id, &[item], true).unwrap(),
        vec![Status::Ok]
    );
    assert!(s.cached_sample(id, item.key, item.handle));
    assert!(
        !s.cached_sample(id, item.key + 1, item.handle),
        "another key"
    );
    assert!(!s.cached_sample(id, 0, item.handle), "no key");
    let other = o.create(p, 64, false).unwrap().handle;
    assert!(!s.cached_sample(id, item.key, other), "another object");
}

/// A stream resumed at another world size: its ranks end one sample apart where their shares
/// say, and the old run's stream gives way to it once nobody uses it (no producer, no
/// consumer; a consumer of the new run arriving first waits for that), and only to it.
#[test]
fn a_resharded_stream_replaces_the_idle_old_one_and_ends_each_rank_at_its_share() {
    use feedstore_proto::reshard::Reshard;
    use feedstore_proto::stream::StreamState;

    let (mut o, mut s, p, c) = setup();
    let old = spec(1);
    let id = s
        .join(&mut o, p, &old, 8, &starts(&[0, 1]), &Placement::default())
        .map(|(id, _)| id)
        .unwrap();
    // Rank 0 read 1 of its 4, rank 1 read 2: 5 left for 3 new ranks.
    let states = [StreamState::at(&old, 0, 1), StreamState::at(&old, 1, 2)];
    let reshard = Reshard::new(&old, &states, 3).unwrap();
    let new = reshard.spec();
    let tasks = reshard.states();
    let tasks: Vec<StreamTask> = tasks
        .iter()
        .map(|t| StreamTask {
            rank: t.rank,
            seq: t.seq(&new),
        })
        .collect();
    // While the old run's producer is there, the name is taken.
    let p2 = client(&mut o, Role::Writer, 1000);
    let err = s
        .join(&mut o, p2, &new, 8, &tasks, &Placement::default())
        .unwrap_err();
    assert_eq!(err.status, Status::SpecMismatch);
    s.disconnect(p);
    // Nor while a consumer of the old run is attached.
    let old_reader = client(&mut o, Role::Reader, 1000);
    s.attach(&mut o, old_reader, &old, 0, 1).unwrap();
    let err = s
        .join(&mut o, p2, &new, 8, &tasks, &Placement::default())
        .unwrap_err();
    assert_eq!(err.status, Status::SpecMismatch);
    s.disconnect(old_reader);
    // Idle, it gives way only to the same stream at another size: another seed is another
    // stream, refused as before.
    let reseeded = StreamSpec {
        seed: 9,
        ..old.clone()
    };
    let err = s
        .join(
            &mut o,
            p2,
            &reseeded,
            8,
            &starts(&[0]),
            &Placement::default(),
        )
        .unwrap_err();
    assert_eq!(err.status, Status::SpecMismatch);
    // A consumer of the new run waits (not found yet), then the producer replaces it.
    let err = s.attach(&mut o, c, &new, 0, 0).unwrap_err();
    assert_eq!(err.status, Status::NotFound, "{}", err.message);
    let (new_id, _) = s
        .join(&mut o, p2, &new, 8, &tasks, &Placement::default())
        .unwrap();
    assert_ne!(new_id, id);
    // Shares of 2, 2 and 1, then nothing more (one epoch): each rank's tasks stop there.
    let mut made = vec![0u64; 3];
    for t in s.take(p2, new_id, 100, None).unwrap() {
        made[t.rank as usize] = made[t.rank as usize].max(t.seq + 1);
    }
    assert_eq!(made, [2, 2, 1]);
    assert_eq!(
        (0..3).map(|r| reshard.share(r)).collect::<Vec<_>>(),
        [2, 2, 1]
    );
}
