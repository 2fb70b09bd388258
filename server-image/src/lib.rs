//! `c10m-server`: the bundled server c10m fleets run.
//!
//! Thread-per-core: each worker owns one SO_REUSEPORT listener, one
//! edge-triggered epoll loop (`mio`) and a slab of compact connection
//! entries that hold no buffer while idle. A small admin thread serves
//! `/metrics` and `/healthz`. SIGTERM/SIGINT drain and exit 0.
//!
//! Modules, in start-up order: [`config`] (flags), [`limits`] (RLIMIT_NOFILE,
//! connection cap, CPU pinning), [`metrics`] and [`system`] (/proc readers),
//! [`worker`] (listeners, event loops, timeouts, drain and shed orders) over
//! [`conn`] (per-connection state, echo and WebSocket pumps) and [`ws`]
//! (RFC 6455 as pure functions), [`admin`] (HTTP), and [`server`], which
//! wires them together. [`loadgen`] is the `c10m-loadgen` binary's code;
//! [`sysctl`] is `c10m-sysctl`'s.

#![warn(missing_docs)]

pub mod admin;
pub mod config;
pub mod conn;
pub mod limits;
pub mod loadgen;
pub mod metrics;
pub mod server;
pub mod sysctl;
pub mod system;
pub mod worker;
pub mod ws;

pub use config::{Config, Protocol};
pub use server::run;
