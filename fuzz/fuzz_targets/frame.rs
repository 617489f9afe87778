//! Whatever bytes a client or a daemon sends, frame parsing and decoding return a value or an
//! error — never a panic, never an allocation sized by a forged count — and whatever decodes
//! re-encodes, in the frame's version, to exactly the bytes it came from (one encoding per
//! value; a hello, which skips fields of versions newer than this one, to a prefix of them).
//!
//! Every opcode is reached: the input's first two bytes choose an opcode, a direction and a
//! version this crate speaks, and the rest is taken as that frame's payload; the whole input is
//! also parsed as raw frames, and as a daemon's hand-over to its successor.

#![no_main]

use feedstore_proto::frame::{
    Frame, HEADER_BYTES, MAGIC, MAX_PAYLOAD_BYTES, MIN_VERSION, Opcode, REPLY_BIT, Request,
    Response, VERSION,
};
use libfuzzer_sys::fuzz_target;

/// Whether `again` re-encodes `bytes`: the same bytes, or for a hello the same header (its
/// length aside) and a prefix of its payload.
fn same(again: &[u8], bytes: &[u8], hello: bool) -> bool {
    if hello {
        again[..12] == bytes[..12] && bytes[HEADER_BYTES..].starts_with(&again[HEADER_BYTES..])
    } else {
        again == bytes
    }
}

/// Decodes `frame` both ways and checks what decodes re-encodes to `bytes`.
fn check(frame: &Frame<'_>, bytes: &[u8]) {
    let (id, version) = (frame.header.request_id, frame.header.version);
    let hello = frame.header.opcode & !REPLY_BIT == Opcode::Hello as u16;
    if let Ok(request) = Request::decode(frame) {
        let mut again = Vec::new();
        request.encode_in(version, id, u32::MAX, &mut again).expect("no limit");
        assert!(same(&again, bytes, hello), "request {request:?} re-encodes to the same bytes");
    }
    if let Ok(response) = Response::decode(frame) {
        let op = Opcode::from_u16(frame.header.opcode & !REPLY_BIT).expect("decoded, so known");
        let mut again = Vec::new();
        response.encode_in(version, op, id, u32::MAX, &mut again).expect("no limit");
        assert!(same(&again, bytes, hello), "response {response:?} re-encodes to the same bytes");
    }
}

fuzz_target!(|data: &[u8]| {
    // A daemon's hand-over to its successor (`feedstored --takeover`) decodes or fails, and
    // re-encodes to the same bytes.
    if let Ok(handover) = feedstore_proto::handover::Handover::decode(data) {
        assert_eq!(handover.encode(), data, "a hand-over re-encodes to the same bytes");
    }
    if let [op, direction, payload @ ..] = data {
        let op = Opcode::ALL[*op as usize % Opcode::ALL.len()];
        let reply = if direction & 1 == 1 { REPLY_BIT } else { 0 };
        let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
        frame.extend_from_slice(&MAGIC.to_le_bytes());
        let version = MIN_VERSION + u16::from(*direction >> 1) % (VERSION - MIN_VERSION + 1);
        frame.extend_from_slice(&version.to_le_bytes());
        frame.extend_from_slice(&(op as u16 | reply).to_le_bytes());
        frame.extend_from_slice(&0u16.to_le_bytes());
        frame.extend_from_slice(&u32::from(*direction).to_le_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(payload);
        if let Ok(Some(parsed)) = Frame::parse(&frame, MAX_PAYLOAD_BYTES) {
            check(&parsed, &frame);
        }
    }
    let mut rest = data;
    while let Ok(Some(frame)) = Frame::parse(rest, MAX_PAYLOAD_BYTES) {
        check(&frame, &rest[..frame.len()]);
        rest = &rest[frame.len()..];
    }
});
