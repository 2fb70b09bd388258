//! WebSocket upgrade parser: any bytes never panic, an accepted request
//! consumes no more than it was given, and a rejection is a 4xx or 505.
#![no_main]

use c10m_server::ws::{self, Handshake};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match ws::handshake(data) {
        Handshake::Accept { response, consumed } => {
            assert!(consumed <= data.len());
            assert!(response.starts_with(b"HTTP/1.1 101 "));
        }
        // 4xx, or 505 for a well-formed version other than HTTP/1.x.
        Handshake::Reject { response } => assert!(
            response.starts_with(b"HTTP/1.1 4") || response.starts_with(b"HTTP/1.1 505 ")
        ),
        Handshake::Partial => assert!(data.len() < ws::MAX_HANDSHAKE_BYTES),
    }
});
