//! Admin HTTP request parser and router: any bytes never panic; orders are
//! only ever carried out with the right token.
#![no_main]

use c10m_server::admin::{self, Health, Parsed};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Parsed::Request(req) = admin::parse(data) {
        let mut acted = false;
        let r = admin::route(
            &req,
            Health::Serving,
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
        let _ = admin::render(&r, req.method == "HEAD");
    }
});
