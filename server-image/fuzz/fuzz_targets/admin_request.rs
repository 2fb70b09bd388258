//! Admin HTTP request path: any bytes, delivered in reads of any size as
//! the admin event loop receives them, never panic; the incremental reader
//! reaches the same verdict as parsing the bytes at once and never holds
//! more than a request may be; orders are only ever carried out with the
//! right token.
#![no_main]

use c10m_server::admin::{self, Health, Parsed, RequestReader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, rest)) = data.split_first() else {
        return;
    };
    // Reads of `step` bytes, as a trickling or a pipelining client sends.
    let step = usize::from(cfg % 64) + 1;
    let mut reader = RequestReader::default();
    let mut verdict = Parsed::Partial;
    for chunk in rest.chunks(step) {
        verdict = reader.feed(chunk);
        assert!(reader.room() <= RequestReader::CAP);
        if verdict != Parsed::Partial {
            break;
        }
    }
    let at_once = admin::parse(&rest[..rest.len().min(RequestReader::CAP)]);
    assert_eq!(verdict, at_once);
    if let Parsed::Request(req) = verdict {
        assert!(req.len <= rest.len() && req.len <= RequestReader::CAP);
        let draining = cfg & 0x80 != 0;
        let health = if draining { Health::Draining } else { Health::Serving };
        let mut acted = false;
        let r = admin::route(
            &req,
            health,
            Some("secret"),
            &|_| String::new(),
            &mut |_| {
                acted = true;
                String::new()
            },
        );
        if acted {
            assert_eq!(r.status, 202);
            assert!(admin::authorized(
                req.authorization.as_deref(),
                Some("secret")
            ));
        }
        let out = admin::render(&r, req.method == "HEAD");
        assert!(out.starts_with(b"HTTP/1.1 "));
    }
});
