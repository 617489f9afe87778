//! The client against a peer that breaks the protocol, over a real Unix socket: a wrong request
//! id or a truncated reply must give a clear error, and the connection must refuse further use
//! instead of misreading the next reply.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use feedstore_consumer::{ConnectOptions, Error, Handle, Role};
use feedstore_proto::frame::{Frame, HEADER_BYTES, MAX_PAYLOAD_BYTES, Opcode, Response};

/// A socket in /tmp whose one connection `serve` handles on a thread of its own.
fn fake_socket(name: &str, serve: impl FnOnce(UnixStream) + Send + 'static) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("feedstore-fake-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let file = path.clone();
    std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        // Its one connection is made: the socket's file is left behind in /tmp otherwise.
        let _ = std::fs::remove_file(&file);
        serve(s);
    });
    path
}

/// Serves one connection: a hello reply with no segments, then `answer` for each request.
fn fake_daemon(name: &str, answer: fn(u32, &mut UnixStream)) -> PathBuf {
    fake_socket(name, move |mut s| {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let (request_id, opcode, len) = loop {
                if let Some(f) = Frame::parse(&buf, MAX_PAYLOAD_BYTES).unwrap() {
                    break (f.header.request_id, f.header.opcode, f.len());
                }
                let n = s.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
            };
            buf.drain(..len);
            if opcode == Opcode::Hello as u16 {
                let ours = feedstore_proto::frame::Speaks::ours();
                s.write_all(&hello_reply(ours.max, ours, request_id))
                    .unwrap();
            } else if opcode != Opcode::Release as u16 {
                answer(request_id, &mut s);
            }
        }
    })
}

/// A hello reply in protocol `version` announcing no segments.
fn hello_reply(version: u16, speaks: feedstore_proto::frame::Speaks, request_id: u32) -> Vec<u8> {
    let mut out = Vec::new();
    Response::Hello {
        node_id: 1,
        epoch: 1,
        segments: vec![],
        max_frame_bytes: MAX_PAYLOAD_BYTES,
        speaks,
    }
    .encode_in(
        version,
        Opcode::Hello,
        request_id,
        MAX_PAYLOAD_BYTES,
        &mut out,
    )
    .unwrap();
    out
}

fn handle() -> Handle {
    Handle {
        node_id: 1,
        epoch: 1,
        id: 1,
    }
}

#[test]
fn reply_to_another_request_breaks_the_connection() {
    let path = fake_daemon("wrong-id", |id, s| {
        let mut out = Vec::new();
        Response::Got(vec![Err(feedstore_proto::Status::NotFound)])
            .encode(
                Opcode::Get,
                id + 7,
                feedstore_proto::frame::MAX_PAYLOAD_BYTES,
                &mut out,
            )
            .unwrap();
        s.write_all(&out).unwrap();
    });
    let client = ConnectOptions::new(Role::Reader)
        .socket(&path)
        .connect()
        .unwrap();
    let err = client.get(handle()).unwrap_err();
    assert!(
        matches!(&err, Error::Protocol(m) if m.contains("while waiting for")),
        "{err:?}"
    );
    assert!(
        client.stats().unwrap_err().is_disconnected(),
        "no further use after a protocol error"
    );
}

#[test]
fn truncated_reply_then_close_is_disconnected() {
    let path = fake_daemon("truncated", |id, s| {
        let mut out = Vec::new();
        Response::Got(vec![Err(feedstore_proto::Status::NotFound)])
            .encode(
                Opcode::Get,
                id,
                feedstore_proto::frame::MAX_PAYLOAD_BYTES,
                &mut out,
            )
            .unwrap();
        s.write_all(&out[..HEADER_BYTES + 3]).unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
    });
    let client = ConnectOptions::new(Role::Reader)
        .socket(&path)
        .connect()
        .unwrap();
    assert!(client.get(handle()).unwrap_err().is_disconnected());
}

#[test]
fn malformed_reply_payload_is_a_decode_error() {
    let path = fake_daemon("garbage", |id, s| {
        // A valid header whose payload claims a million results.
        let mut out = Vec::new();
        Response::Got(vec![])
            .encode(
                Opcode::Get,
                id,
                feedstore_proto::frame::MAX_PAYLOAD_BYTES,
                &mut out,
            )
            .unwrap();
        out[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&1_000_000u32.to_le_bytes());
        s.write_all(&out).unwrap();
    });
    let client = ConnectOptions::new(Role::Reader)
        .socket(&path)
        .connect()
        .unwrap();
    assert!(matches!(client.get(handle()), Err(Error::Decode(_))));
    assert!(client.get(handle()).unwrap_err().is_disconnected());
}

#[test]
fn wrong_reply_kind_is_a_protocol_error() {
    let path = fake_daemon("kind", |id, s| {
        let mut out = Vec::new();
        Response::Done(vec![feedstore_proto::Status::Ok])
            .encode(
                Opcode::Seal,
                id,
                feedstore_proto::frame::MAX_PAYLOAD_BYTES,
                &mut out,
            )
            .unwrap();
        s.write_all(&out).unwrap();
    });
    let client = ConnectOptions::new(Role::Reader)
        .socket(&path)
        .connect()
        .unwrap();
    assert!(matches!(client.get(handle()), Err(Error::Protocol(_))));
}

/// A daemon of a newer protocol version answers the hello with an error in a header of its own
/// version: the client names both versions, which one to upgrade, and the daemon's words.
#[test]
fn a_daemon_of_another_version_is_named_with_both_versions() {
    use feedstore_proto::frame::VERSION;
    let path = fake_socket("newer", |mut s| {
        let mut head = [0u8; HEADER_BYTES];
        s.read_exact(&mut head).unwrap();
        let mut out = Vec::new();
        Response::Error {
            status: feedstore_proto::Status::Protocol,
            message: "feedstored speaks protocol 99".into(),
        }
        .encode(Opcode::Hello, 0, MAX_PAYLOAD_BYTES, &mut out)
        .unwrap();
        out[2..4].copy_from_slice(&99u16.to_le_bytes());
        s.write_all(&out).unwrap();
    });
    let err = ConnectOptions::new(Role::Reader)
        .socket(&path)
        .connect()
        .unwrap_err();
    assert!(
        matches!(err, Error::VersionMismatch { daemon: 99, client, .. } if client == VERSION),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "speaks protocol 99, this client {}-{VERSION}",
            feedstore_proto::frame::MIN_VERSION
        )) && text.contains("upgrade this client")
            && text.contains("the daemon says"),
        "{text}"
    );
}

/// A daemon of protocol 9 (0.1.0's) closes without a word at a hello of a version it does not
/// speak: the client tries its own version once more (a daemon restarting closes too), then
/// says hello in 9 and speaks 9 from then on, believing no writer uid.
#[test]
fn a_daemon_that_closes_at_hello_is_greeted_in_protocol_9() {
    use feedstore_proto::Location;
    use feedstore_proto::frame::{Request, Speaks, VERSION};
    let path =
        std::env::temp_dir().join(format!("feedstore-fake-{}-silent.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let file = path.clone();
    let daemon = std::thread::spawn(move || {
        let mut versions = Vec::new();
        for _ in 0..3 {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = [0u8; HEADER_BYTES];
            s.read_exact(&mut head).unwrap();
            let version = u16::from_le_bytes([head[2], head[3]]);
            versions.push(version);
            let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
            let mut payload = vec![0u8; len];
            s.read_exact(&mut payload).unwrap();
            if version != 9 {
                continue; // closed without a word
            }
            let _ = std::fs::remove_file(&file);
            s.write_all(&hello_reply(9, Speaks::implied(9), 0)).unwrap();
            // Then one get, answered as 0.1.0 does (no writer), and the close.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let (id, request) = loop {
                if let Some(f) = Frame::parse(&buf, MAX_PAYLOAD_BYTES).unwrap() {
                    assert_eq!(f.header.version, 9, "every frame in the agreed version");
                    break (f.header.request_id, Request::decode(&f).unwrap());
                }
                let n = s.read(&mut chunk).unwrap();
                buf.extend_from_slice(&chunk[..n]);
            };
            assert!(matches!(request, Request::Get { .. }), "{request:?}");
            let mut out = Vec::new();
            // Location 0..0 of segment 0: the client refuses the range, after decoding it.
            Response::Got(vec![Ok(feedstore_proto::frame::Got {
                location: Location::default(),
                writer: 0,
            })])
            .encode_in(9, Opcode::Get, id, MAX_PAYLOAD_BYTES, &mut out)
            .unwrap();
            s.write_all(&out).unwrap();
            break;
        }
        versions
    });
    let client = ConnectOptions::new(Role::Reader)
        .socket(&path)
        .connect()
        .unwrap();
    assert_eq!(client.protocol(), 9);
    assert_eq!(client.daemon(), Speaks::implied(9));
    assert!(!client.has_feature(feedstore_proto::frame::feature::WRITERS));
    // The reply decodes in protocol 9's layout (a misread would be a decode error, not this).
    let err = client.get(handle()).unwrap_err();
    assert!(
        matches!(&err, Error::Protocol(m) if m.contains("segment")),
        "{err:?}"
    );
    assert_eq!(daemon.join().unwrap(), vec![VERSION, VERSION, 9]);
}
