//! The wire decoders (handshake and soft-HCA transport frames) on arbitrary bytes: a frame is
//! accepted only when every field checks out; anything else is a `WireError`, never a panic.
//! Accepted handshake frames and endpoint blobs must re-encode to the same bytes.
#![no_main]
use gdaki::wire::{check_frame, decode_endpoint, encode_endpoint, Hello, Kind, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = check_frame(data) {
        if h.kind == Kind::Hello {
            let hello = Hello::decode(&data[HEADER_LEN..]).expect("check_frame accepted it");
            assert_eq!(hello.encode().expect("a decoded hello encodes"), data);
        }
    }
    // The payload decoder alone, on bytes that never had a header.
    let _ = Hello::decode(data);
    // Endpoint blobs (what the C API exchanges through an application's own bootstrap).
    if let Ok(e) = decode_endpoint(data) {
        assert_eq!(encode_endpoint(&e).expect("a decoded endpoint encodes"), data);
    }
});
