//! Every decoder against every encoder: arbitrary messages of every kind round-trip, the
//! declared sizes match the encodings, limits are enforced on both sides, and whatever decodes
//! re-encodes to the same bytes.

use proptest::prelude::*;

use super::*;
use crate::Location;
use crate::stream::{MAX_STREAM_NAME, Shuffle, Tail};
use crate::wire::testing::{min_bytes_is_tight, min_bytes_is_tight_at, round_trip};

fn handle() -> impl Strategy<Value = Handle> {
    (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(node_id, epoch, id)| Handle {
        node_id,
        epoch,
        id,
    })
}

fn handles() -> impl Strategy<Value = Vec<Handle>> {
    prop::collection::vec(handle(), 0..40)
}

/// Names of every length a sender may use, empty and maximal included, any characters.
fn text(max: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("x".repeat(max)),
        Just("é".repeat(max / 2)),
        ".{0,40}".prop_map(move |s| crate::wire::truncate(&s, max).to_owned()),
    ]
}

/// The highest wire code `Status` knows.
const LAST_STATUS: u16 = 20;

fn status() -> impl Strategy<Value = Status> {
    (1u16..=LAST_STATUS).prop_map(|c| Status::from_u16(c).expect("known code"))
}

fn any_status() -> impl Strategy<Value = Status> {
    (0u16..=LAST_STATUS).prop_map(|c| Status::from_u16(c).expect("known code"))
}

#[test]
fn every_status_code_up_to_the_last_decodes_and_none_after() {
    for code in 0..=LAST_STATUS {
        let status = Status::from_u16(code).expect("known code");
        assert_eq!(status as u16, code);
    }
    assert_eq!(Status::from_u16(LAST_STATUS + 1), None);
}

fn location() -> impl Strategy<Value = Location> {
    (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(segment, offset, len)| Location {
        segment,
        offset,
        len,
    })
}

fn spec() -> impl Strategy<Value = StreamSpec> {
    (
        text(MAX_STREAM_NAME),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        prop_oneof![
            Just(Shuffle::None),
            Just(Shuffle::Full),
            any::<u32>().prop_map(Shuffle::Block)
        ],
        prop_oneof![Just(Tail::Drop), Just(Tail::Pad)],
        prop_oneof![Just(None), (1u64..).prop_map(Some)],
    )
        .prop_map(
            |(name, records, seed, world, shuffle, tail, epochs)| StreamSpec {
                name,
                records,
                seed,
                world,
                shuffle,
                tail,
                epochs,
                reshard: None,
            },
        )
}

fn task() -> impl Strategy<Value = StreamTask> {
    (any::<u32>(), any::<u64>()).prop_map(|(rank, seq)| StreamTask { rank, seq })
}

fn item() -> impl Strategy<Value = StreamItem> {
    (
        task(),
        handle(),
        any::<u64>(),
        any::<u32>(),
        any::<u128>(),
        any::<u64>(),
    )
        .prop_map(|(task, handle, record, flags, key, offset)| StreamItem {
            task,
            handle,
            record,
            flags,
            key,
            offset,
        })
}

fn figures() -> impl Strategy<Value = RankFigures> {
    prop::array::uniform4(any::<u64>()).prop_map(|f| RankFigures {
        waited_us: f[0],
        taken: f[1],
        elapsed_us: f[2],
        first_sample_us: f[3],
    })
}

fn producer_figures() -> impl Strategy<Value = ProducerFigures> {
    prop::collection::vec(any::<u64>(), ProducerFigures::FIELDS)
        .prop_map(|v| ProducerFigures::from_fields(v.try_into().expect("FIELDS values")))
}

fn info() -> impl Strategy<Value = StreamInfo> {
    let rank = (any::<u32>(), any::<u64>(), any::<u32>(), figures()).prop_map(
        |(rank, released, ready, figures)| RankInfo {
            rank,
            released,
            ready,
            figures,
        },
    );
    (
        (any::<u32>(), any::<u32>()),
        text(MAX_STREAM_NAME),
        prop::array::uniform4(any::<u32>()),
        prop::array::uniform7(any::<u64>()),
        prop::collection::vec(rank, 0..4),
        producer_figures(),
    )
        .prop_map(
            |((id, owner_uid), name, a, b, ranks_attached, producer)| StreamInfo {
                id,
                owner_uid,
                name,
                depth: a[0],
                producers: a[1],
                consumers: a[2],
                ranks: a[3],
                ready: b[0],
                making: b[1],
                put: b[2],
                returned: b[3],
                slowest: b[4],
                fastest: b[5],
                cold_start_us: b[6],
                ranks_attached,
                producer,
            },
        )
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (
            prop_oneof![Just(Role::Reader), Just(Role::Writer)],
            text(256),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(
                |(role, client_name, max_frame_bytes, reconnects)| Request::Hello {
                    role,
                    client_name,
                    max_frame_bytes,
                    speaks: Speaks::ours(),
                    reconnects,
                }
            ),
        (
            prop::collection::vec(any::<u64>(), 0..40),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(|(sizes, timeout_ms, flags)| Request::Create {
                sizes,
                timeout_ms,
                flags
            }),
        handles().prop_map(|handles| Request::Seal { handles }),
        handles().prop_map(|handles| Request::Abort { handles }),
        handles().prop_map(|handles| Request::Get { handles }),
        handles().prop_map(|handles| Request::Release { handles }),
        handles().prop_map(|handles| Request::Delete { handles }),
        Just(Request::Stats),
        (
            spec(),
            (any::<u32>(), any::<u32>()),
            prop::collection::vec(task(), 0..20),
            prop::collection::vec((any::<u32>(), "[a-z0-9.:]{0,24}"), 0..4),
            "[a-z0-9.:]{0,24}"
        )
            .prop_map(
                |(spec, (depth, batch), ranks, at, relay)| Request::StreamJoin {
                    relay,
                    spec,
                    depth,
                    batch,
                    ranks,
                    at: at
                        .into_iter()
                        .map(|(rank, addr)| RankAt { rank, addr })
                        .collect()
                }
            ),
        (spec(), any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
            |(spec, rank, seq, timeout_ms)| Request::StreamAttach {
                spec,
                rank,
                seq,
                timeout_ms
            }
        ),
        (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(stream, max, timeout_ms)| {
            Request::StreamTake(TakeTasks {
                stream,
                max,
                timeout_ms,
            })
        }),
        (any::<u32>(), prop::collection::vec(item(), 0..20))
            .prop_map(|(stream, items)| Request::StreamPut { stream, items }),
        (any::<u32>(), any::<u32>(), any::<u64>(), figures()).prop_map(
            |(stream, rank, upto, figures)| Request::StreamRelease {
                stream,
                rank,
                upto,
                figures
            }
        ),
        (any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
            |(stream, rank, seq, timeout_ms)| Request::StreamWait {
                stream,
                rank,
                seq,
                timeout_ms
            }
        ),
        any::<u32>().prop_map(|stream| Request::StreamClose { stream }),
        prop::collection::vec(any::<u128>(), 0..40).prop_map(|keys| Request::CacheLookup { keys }),
        any::<u32>().prop_map(|after| Request::StreamList { after }),
        (any::<u32>(), any::<u32>(), any::<u64>())
            .prop_map(|(stream, rank, next)| Request::StreamDetach { stream, rank, next }),
        (any::<u32>(), producer_figures())
            .prop_map(|(stream, figures)| Request::ProducerReport { stream, figures }),
        prop::collection::vec(
            (any::<u128>(), handle()).prop_map(|(key, handle)| CacheEntry { key, handle }),
            0..20
        )
        .prop_map(|entries| Request::CacheInsert { entries }),
        any::<u32>().prop_map(|format| Request::Takeover { format }),
    ]
}

fn stats() -> impl Strategy<Value = StoreStats> {
    prop::collection::vec(any::<u64>(), StoreStats::FIELDS)
        .prop_map(|v| StoreStats::from_fields(&v.try_into().expect("FIELDS values")))
}

/// A reply and the opcode of the request it answers.
fn response() -> impl Strategy<Value = (Opcode, Response)> {
    let created = prop_oneof![
        (handle(), location()).prop_map(|(handle, location)| Ok(Created { handle, location })),
        status().prop_map(Err),
    ];
    let got = prop_oneof![
        (location(), any::<u32>()).prop_map(|(location, writer)| Ok(Got { location, writer })),
        status().prop_map(Err)
    ];
    let done_ops = prop_oneof![
        Just(Opcode::Seal),
        Just(Opcode::Abort),
        Just(Opcode::Delete),
        Just(Opcode::StreamPut),
        Just(Opcode::StreamWait),
        Just(Opcode::StreamClose),
        Just(Opcode::StreamDetach),
        Just(Opcode::CacheInsert),
    ];
    prop_oneof![
        (
            any::<u32>(),
            any::<u32>(),
            prop::collection::vec(
                (any::<u32>(), any::<u64>(), any::<u32>()).prop_map(|(id, size_bytes, flags)| {
                    SegmentInfo {
                        id,
                        size_bytes,
                        flags,
                    }
                }),
                0..8
            ),
            any::<u32>()
        )
            .prop_map(|(node_id, epoch, segments, max_frame_bytes)| (
                Opcode::Hello,
                Response::Hello {
                    node_id,
                    epoch,
                    segments,
                    max_frame_bytes,
                    speaks: Speaks::ours(),
                }
            )),
        prop::collection::vec(created, 0..20).prop_map(|r| (Opcode::Create, Response::Created(r))),
        prop::collection::vec(got, 0..20).prop_map(|r| (Opcode::Get, Response::Got(r))),
        (done_ops, prop::collection::vec(any_status(), 0..20))
            .prop_map(|(op, s)| (op, Response::Done(s))),
        stats().prop_map(|s| (Opcode::Stats, Response::Stats(Box::new(s)))),
        (any_status(), text(1024))
            .prop_map(|(status, message)| (Opcode::Error, Response::Error { status, message })),
        any::<u32>().prop_map(|stream| (Opcode::StreamJoin, Response::StreamJoined { stream })),
        (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(stream, capacity, ring_bytes)| (
            Opcode::StreamAttach,
            Response::StreamAttached {
                stream,
                capacity,
                ring_bytes
            }
        )),
        prop::collection::vec(task(), 0..20).prop_map(|t| (Opcode::StreamTake, Response::Tasks(t))),
        prop::collection::vec(prop_oneof![Just(None), handle().prop_map(Some)], 0..20)
            .prop_map(|c| (Opcode::CacheLookup, Response::Cached(c))),
        (prop::collection::vec(info(), 0..8), any::<bool>())
            .prop_map(|(streams, more)| (Opcode::StreamList, Response::Streams { streams, more })),
    ]
}

fn encode_request(req: &Request, id: u32) -> Vec<u8> {
    let mut wire = Vec::new();
    req.encode(id, u32::MAX, &mut wire).unwrap();
    wire
}

fn encode_response(op: Opcode, resp: &Response, id: u32) -> Vec<u8> {
    let mut wire = Vec::new();
    resp.encode(op, id, u32::MAX, &mut wire).unwrap();
    wire
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Every request, with arbitrary contents, decodes back equal.
    #[test]
    fn every_request_round_trips(req in request(), id in any::<u32>()) {
        let wire = encode_request(&req, id);
        let frame = Frame::parse(&wire, u32::MAX).unwrap().unwrap();
        prop_assert_eq!(frame.len(), wire.len());
        prop_assert_eq!(frame.header.request_id, id);
        prop_assert_eq!(Request::decode(&frame).unwrap(), req);
    }

    /// Every reply, with arbitrary contents, decodes back equal.
    #[test]
    fn every_response_round_trips((op, resp) in response(), id in any::<u32>()) {
        let wire = encode_response(op, &resp, id);
        let frame = Frame::parse(&wire, u32::MAX).unwrap().unwrap();
        prop_assert_eq!(frame.header.request_id, id);
        prop_assert_eq!(Response::decode(&frame).unwrap(), resp);
    }

    /// The batch costs the clients split by are what the encoders write.
    #[test]
    fn batch_costs_match_the_encodings(req in request(), (op, resp) in response()) {
        if let Some(cost) = req.opcode().batch_cost() {
            let wire = encode_request(&req, 1);
            prop_assert_eq!(
                wire.len() - HEADER_BYTES,
                cost.request_fixed + req.batch_len() * cost.request_per_item
            );
        }
        if let (Some(cost), Response::Created(_) | Response::Got(_) | Response::Cached(_)) =
            (op.batch_cost(), &resp)
        {
            let wire = encode_response(op, &resp, 1);
            let n = match &resp {
                Response::Created(r) => r.len(),
                Response::Got(r) => r.len(),
                Response::Cached(r) => r.len(),
                _ => unreachable!(),
            };
            prop_assert_eq!(wire.len() - HEADER_BYTES, cost.reply_bytes(n));
        }
    }

    /// A message over the peer's limit is refused before anything is written.
    #[test]
    fn encoders_check_the_limit(req in request(), (op, resp) in response(), limit in 0u32..600) {
        let mut out = vec![7u8; 3];
        let full = encode_request(&req, 1).len() - HEADER_BYTES;
        match req.encode(1, limit, &mut out) {
            Ok(()) => prop_assert!(full <= limit as usize),
            Err(EncodeError::TooLarge { len, max, .. }) => {
                prop_assert_eq!((len, max), (full, limit));
                prop_assert_eq!(&out, &vec![7u8; 3], "nothing written");
            }
        }
        let full = encode_response(op, &resp, 1).len() - HEADER_BYTES;
        let mut out = Vec::new();
        prop_assert_eq!(resp.encode(op, 1, limit, &mut out).is_ok(), full <= limit as usize);
    }

    /// Whatever bytes a peer sends, decoding returns an error or a value, never panics, and a
    /// value re-encodes to exactly the bytes it came from.
    #[test]
    fn arbitrary_payloads_decode_canonically(
        op in prop::sample::select(Opcode::ALL.to_vec()),
        reply in any::<bool>(),
        payload in prop::collection::vec(any::<u8>(), 0..160),
    ) {
        let mut wire = Vec::new();
        framed(&mut wire, VERSION, op, reply, 9, u32::MAX, |w| w.buf.extend_from_slice(&payload))
            .unwrap();
        let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        // (A hello skips what a newer version appended: it re-encodes to a prefix.)
        let same = |again: Vec<u8>| {
            if op == Opcode::Hello {
                again[..12] == wire[..12] && wire[HEADER_BYTES..].starts_with(&again[HEADER_BYTES..])
            } else {
                again == wire
            }
        };
        if let Ok(req) = Request::decode(&frame) {
            prop_assert!(same(encode_request(&req, 9)));
        }
        if let Ok(resp) = Response::decode(&frame) {
            prop_assert!(same(encode_response(op, &resp, 9)));
        }
    }

    /// Arbitrary bytes, header included, never panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(Some(frame)) = Frame::parse(&bytes, MAX_PAYLOAD_BYTES) {
            let _ = Request::decode(&frame);
            let _ = Response::decode(&frame);
        }
    }

    #[test]
    fn parts_round_trip(s in spec(), t in task(), i in item(), inf in info(), st in stats()) {
        round_trip(&s);
        round_trip(&t);
        round_trip(&i);
        round_trip(&inf);
        // (In the parts' shared layout, protocol 11's, which has no reconnect counters; a
        // stats reply of this version carries them: `replies_round_trip`.)
        round_trip(&StoreStats {
            reconnects: 0,
            reconnected_clients: 0,
            ..st
        });
        let mut buf = Vec::new();
        inf.encode(&mut crate::wire::Writer::new(&mut buf));
        prop_assert_eq!(buf.len(), inf.wire_bytes());
    }
}

/// A stream listing entry with every counter zero.
fn listed(id: u32, name: &str) -> StreamInfo {
    StreamInfo {
        id,
        owner_uid: 0,
        name: name.into(),
        depth: 0,
        producers: 0,
        consumers: 0,
        ranks: 0,
        ready: 0,
        making: 0,
        put: 0,
        returned: 0,
        slowest: 0,
        fastest: 0,
        cold_start_us: 0,
        ranks_attached: Vec::new(),
        producer: ProducerFigures::default(),
    }
}

/// The declared smallest encodings are the real ones: a list decoder trusts them to bound a
/// forged count. (`StreamList` once assumed 76 bytes per stream where a one-byte name took 75,
/// so `feedstore stat` failed on such a stream.)
#[test]
fn min_bytes_are_the_smallest_encodings() {
    min_bytes_is_tight(&listed(0, ""));
    min_bytes_is_tight(&StreamSpec {
        name: String::new(),
        records: 0,
        seed: 0,
        world: 0,
        shuffle: Shuffle::None,
        tail: Tail::Drop,
        epochs: None,
        reshard: None,
    });
    min_bytes_is_tight(&StreamTask { rank: 0, seq: 0 });
    min_bytes_is_tight(&TakeTasks {
        stream: 0,
        max: 0,
        timeout_ms: 0,
    });
    min_bytes_is_tight(&RankInfo {
        rank: 0,
        released: 0,
        ready: 0,
        figures: RankFigures::default(),
    });
    min_bytes_is_tight(&ProducerFigures::default());
    min_bytes_is_tight(&RankAt {
        rank: 0,
        addr: String::new(),
    });
    min_bytes_is_tight(&Handle::default());
    min_bytes_is_tight_at(MIN_VERSION, &StoreStats::default());
    min_bytes_is_tight_at::<Result<Got, Status>>(MIN_VERSION, &Err(Status::NotFound));
    min_bytes_is_tight_at(
        MIN_VERSION,
        &Got {
            location: Location::default(),
            writer: 0,
        },
    );
    min_bytes_is_tight::<Result<Created, Status>>(&Err(Status::Full));
    min_bytes_is_tight::<Option<Handle>>(&None);
}

#[test]
fn a_stream_list_with_one_byte_names_decodes() {
    let one = listed(1, "a");
    for n in [1, 2, 3, 100] {
        let resp = Response::Streams {
            streams: vec![one.clone(); n],
            more: false,
        };
        let wire = encode_response(Opcode::StreamList, &resp, 3);
        let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
        assert_eq!(Response::decode(&frame).unwrap(), resp, "{n} streams");
    }
}

#[test]
fn a_stream_spec_has_one_encoding() {
    let spec = StreamSpec {
        name: "s".into(),
        records: 4,
        seed: 1,
        world: 1,
        shuffle: Shuffle::Full,
        tail: Tail::Drop,
        epochs: None,
        reshard: None,
    };
    let good = encode_request(
        &Request::StreamAttach {
            spec,
            rank: 0,
            seq: 0,
            timeout_ms: 0,
        },
        1,
    );
    // The block size of a full shuffle sits after the header, the name (u16 length + "s"),
    // records, seed, world and the shuffle kind.
    let block = HEADER_BYTES + 2 + 1 + 8 + 8 + 4 + 1;
    let mut bad = good.clone();
    bad[block] = 7;
    let frame = Frame::parse(&bad, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert!(
        Request::decode(&frame).is_err(),
        "a block size without block shuffle"
    );
    let frame = Frame::parse(&good, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert!(Request::decode(&frame).is_ok());
}

#[test]
fn oversized_frame_is_rejected_from_its_header_alone() {
    let wire = encode_request(
        &Request::Get {
            handles: vec![Handle::default(); 10],
        },
        1,
    );
    let err = Frame::parse(&wire[..HEADER_BYTES], 64).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Oversized {
            len: 4 + 160,
            max: 64
        }
    );
}

#[test]
fn forged_count_cannot_reserve_memory() {
    let mut wire = encode_request(
        &Request::Get {
            handles: vec![Handle::default()],
        },
        1,
    );
    wire[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert!(matches!(
        Request::decode(&frame),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn partial_frame_waits_for_more_bytes() {
    let mut wire = encode_request(&Request::Stats, 1);
    wire.extend(encode_request(
        &Request::Seal {
            handles: vec![Handle::default()],
        },
        2,
    ));
    let stats_len = HEADER_BYTES;
    for cut in 0..wire.len() {
        let parsed = Frame::parse(&wire[..cut], MAX_PAYLOAD_BYTES).unwrap();
        assert_eq!(parsed.is_some(), cut >= stats_len, "cut at {cut}");
    }
}

/// The largest batch a client may send fits both ways, and one more item would not.
#[test]
fn max_batch_items_fill_both_limits() {
    for op in Opcode::ALL {
        let Some(cost) = op.batch_cost() else {
            continue;
        };
        for (req_limit, reply_limit) in [
            (MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES),
            (MIN_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES),
            (MAX_PAYLOAD_BYTES, MIN_PAYLOAD_BYTES),
        ] {
            let n = max_batch_items(op, req_limit, reply_limit);
            let fits = |n: usize| {
                cost.request_fixed + n * cost.request_per_item <= req_limit as usize
                    && (cost.reply_per_item == 0 || cost.reply_bytes(n) <= reply_limit as usize)
            };
            assert!(fits(n) && !fits(n + 1), "{op:?}: {n}");
        }
    }
    // A get of ~48k handles fits the request (16 bytes each) but not its reply (22 each).
    assert!(max_batch_items(Opcode::Get, MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES) < 48_000);
}

/// A producer's counters never go back between its reports, and what leaves with it stays.
#[test]
fn producer_figures_only_grow() {
    let mut shown = ProducerFigures {
        elapsed_us: 10,
        cache_hits: 4,
        fetch_in_flight: 3,
        ..ProducerFigures::default()
    };
    shown.update(&ProducerFigures {
        elapsed_us: 7,
        cache_hits: 5,
        fetch_in_flight: 1,
        ..ProducerFigures::default()
    });
    assert_eq!(
        (shown.elapsed_us, shown.cache_hits, shown.fetch_in_flight),
        (10, 5, 1),
        "counters keep their largest value, gauges the latest"
    );
    let left = shown.counters();
    assert_eq!((left.elapsed_us, left.fetch_in_flight), (10, 0));
    let mut sum = left;
    sum.add(&shown);
    assert_eq!((sum.cache_hits, sum.fetch_in_flight), (10, 1));
    let grown = sum.since(&left);
    assert_eq!((grown.cache_hits, grown.fetch_in_flight), (5, 1));
}

/// The replies whose layout changed since protocol 9 (feedstore 0.1.0) are written in the
/// connection's version: an 0.1.0 client reads them as it always did.
#[test]
fn replies_to_a_protocol_9_client_are_in_its_layout() {
    let got = Response::Got(vec![
        Ok(Got {
            location: Location {
                segment: 1,
                offset: 4096,
                len: 10,
            },
            writer: 1000,
        }),
        Err(Status::OverShare),
    ]);
    let mut v9 = Vec::new();
    got.encode_in(9, Opcode::Get, 5, MAX_PAYLOAD_BYTES, &mut v9)
        .unwrap();
    let frame = Frame::parse(&v9, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert_eq!(frame.header.version, 9);
    // A count, then per result a status and a location: no writer.
    assert_eq!(frame.payload.len(), 4 + 2 * (2 + 20));
    let Response::Got(results) = Response::decode(&frame).unwrap() else {
        panic!("a get reply");
    };
    assert_eq!(results[0].unwrap().writer, Got::UNKNOWN_WRITER);
    assert_eq!(results[0].unwrap().location.offset, 4096);
    assert_eq!(
        results[1],
        Err(Status::LimitReached),
        "protocol 9 has no OverShare"
    );

    let stats = Response::Stats(Box::new(StoreStats {
        leases: 3,
        peer_handshakes_dropped: 7,
        ..StoreStats::default()
    }));
    let mut v9 = Vec::new();
    stats
        .encode_in(9, Opcode::Stats, 6, MAX_PAYLOAD_BYTES, &mut v9)
        .unwrap();
    let frame = Frame::parse(&v9, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert_eq!(frame.payload.len(), 4 + 8 * (StoreStats::FIELDS - 5));
    let Response::Stats(back) = Response::decode(&frame).unwrap() else {
        panic!("a stats reply");
    };
    assert_eq!((back.leases, back.peer_handshakes_dropped), (3, 0));

    // Protocol 11 has every counter but the reconnects'.
    let stats = Response::Stats(Box::new(StoreStats {
        peer_handshakes_dropped: 7,
        reconnects: 2,
        ..StoreStats::default()
    }));
    let mut v11 = Vec::new();
    stats
        .encode_in(11, Opcode::Stats, 7, MAX_PAYLOAD_BYTES, &mut v11)
        .unwrap();
    let frame = Frame::parse(&v11, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert_eq!(frame.payload.len(), 4 + 8 * (StoreStats::FIELDS - 2));
    let Response::Stats(back) = Response::decode(&frame).unwrap() else {
        panic!("a stats reply");
    };
    assert_eq!((back.peer_handshakes_dropped, back.reconnects), (7, 0));
}

/// A hello says what each side speaks from protocol 11 on; before, its version says it.
#[test]
fn hellos_say_what_each_side_speaks() {
    let ours = Speaks::ours();
    assert_eq!((ours.min, ours.max), (MIN_VERSION, VERSION));
    assert_eq!(ours.common(&Speaks::implied(9)), Some(9));
    assert_eq!(Speaks::implied(9).features & feature::WRITERS, 0);
    assert_eq!(Speaks::implied(9).release, "0.1.0");
    let future = Speaks {
        min: VERSION + 1,
        max: VERSION + 3,
        features: u64::MAX,
        release: "9.0.0".into(),
    };
    assert_eq!(ours.common(&future), None);
    let overlapping = Speaks {
        min: VERSION,
        ..future.clone()
    };
    assert_eq!(ours.common(&overlapping), Some(VERSION));
    assert_eq!(
        overlapping.describe(),
        format!("feedstore 9.0.0 (protocols {VERSION}-{})", VERSION + 3)
    );

    // A newer client's hello, in its own version, with fields this version does not know.
    let hello = Request::Hello {
        role: Role::Reader,
        client_name: "next".into(),
        max_frame_bytes: MAX_PAYLOAD_BYTES,
        speaks: overlapping.clone(),
        reconnects: 3,
    };
    let mut wire = Vec::new();
    hello
        .encode_in(VERSION + 3, 1, MAX_PAYLOAD_BYTES, &mut wire)
        .unwrap();
    wire.extend_from_slice(b"later fields");
    let len = (wire.len() - HEADER_BYTES) as u32;
    wire[12..16].copy_from_slice(&len.to_le_bytes());
    let frame = Frame::parse(&wire, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert_eq!(frame.header.version, VERSION + 3);
    assert_eq!(Request::decode(&frame).unwrap(), hello);

    // A hello of protocol 9 carries none of it.
    let mut old = Vec::new();
    let hello9 = Request::Hello {
        role: Role::Writer,
        client_name: "0.1.0".into(),
        max_frame_bytes: MAX_PAYLOAD_BYTES,
        speaks: Speaks::implied(9),
        reconnects: 0,
    };
    hello9.encode_in(9, 1, MAX_PAYLOAD_BYTES, &mut old).unwrap();
    assert_eq!(old.len(), HEADER_BYTES + 1 + 2 + 5 + 4);
    let frame = Frame::parse(&old, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert_eq!(Request::decode(&frame).unwrap(), hello9);
    // Protocol 11 says what it speaks but not how many times it reconnected: read as 0.
    let hello11 = |reconnects| Request::Hello {
        role: Role::Reader,
        client_name: "11".into(),
        max_frame_bytes: MAX_PAYLOAD_BYTES,
        speaks: Speaks::ours(),
        reconnects,
    };
    let mut v11 = Vec::new();
    hello11(4)
        .encode_in(11, 1, MAX_PAYLOAD_BYTES, &mut v11)
        .unwrap();
    let frame = Frame::parse(&v11, MAX_PAYLOAD_BYTES).unwrap().unwrap();
    assert_eq!(Request::decode(&frame).unwrap(), hello11(0));
    // Older than any version spoken: refused from the header.
    old[2..4].copy_from_slice(&(MIN_VERSION - 1).to_le_bytes());
    assert!(matches!(
        Frame::parse(&old, MAX_PAYLOAD_BYTES),
        Err(DecodeError::UnsupportedVersion { .. })
    ));
}
