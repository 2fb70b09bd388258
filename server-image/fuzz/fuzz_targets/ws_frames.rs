//! WebSocket frame processor: any bytes, delivered in two reads split at any
//! point, with any frame limit, never panic; consumed never exceeds the
//! input; replies are well-formed unmasked frames.
#![no_main]

use c10m_server::ws::{self, Message, Outcome};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, rest)) = data.split_first() else {
        return;
    };
    let max = 1usize << (cfg % 20);
    let split = usize::from(cfg) % (rest.len() + 1);
    let mut msg = Message::default();
    let mut out = Vec::new();
    let mut pending = Vec::new();
    for chunk in [&rest[..split], &rest[split..]] {
        pending.extend_from_slice(chunk);
        let (n, o) = ws::process(&pending, &mut msg, &mut out, max);
        assert!(n <= pending.len());
        pending.drain(..n);
        if o != Outcome::Continue {
            break;
        }
    }
    let mut pos = 0;
    while pos < out.len() {
        let h = ws::parse_header(&out[pos..]).unwrap().unwrap();
        assert!(h.mask.is_none());
        pos += h.header_len + h.len as usize;
    }
    assert_eq!(pos, out.len());
});
