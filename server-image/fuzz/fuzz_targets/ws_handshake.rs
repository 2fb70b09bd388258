//! WebSocket upgrade parser: any bytes never panic, and an accepted request
//! consumes no more than it was given.
#![no_main]

use c10m_server::ws::{self, Handshake};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match ws::handshake(data) {
        Handshake::Accept { response, consumed } => {
            assert!(consumed <= data.len());
            assert!(response.starts_with(b"HTTP/1.1 101 "));
        }
        Handshake::Reject { response } => assert!(response.starts_with(b"HTTP/1.1 4")),
        Handshake::Partial => assert!(data.len() < ws::MAX_HANDSHAKE_BYTES),
    }
});
