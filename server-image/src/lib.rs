//! `c10m-server`: the bundled server c10m fleets run.
//!
//! Thread-per-core: each worker owns one SO_REUSEPORT listener, one
//! edge-triggered epoll loop (`mio`) and a slab of compact connection
//! entries that hold no buffer while idle. A small admin thread serves
//! `/metrics` and `/healthz` from its own event loop. SIGTERM/SIGINT drain
//! (with an accept window that answers newcomers with a goodbye) and exit 0.
//!
//! Modules, one concern each, in start-up order:
//!
//! - [`config`]: flags and their `C10M_*` environment fallbacks (the names
//!   come from `c10m-wire`); [`Config::from_env_pairs`] parses an explicit
//!   environment.
//! - [`limits`]: RLIMIT_NOFILE, the connection cap, whether to pin workers
//!   to CPUs (only with one CPU per worker in the affinity mask).
//! - [`privilege`]: with `C10M_RUN_AS`, the drop from root to an
//!   unprivileged uid:gid with no capabilities, right after the limit is
//!   raised and while the process is single-threaded.
//! - [`metrics`] (the Prometheus registry) and [`system`] (`/proc` readers).
//! - [`listen`]: the SO_REUSEPORT listeners, one per worker, on one port.
//! - [`control`]: state shared across threads: admission under the cap, the
//!   draining flag, drain and shed orders.
//! - [`worker`]: the event loop only: accept, drive, sweep timeouts, carry
//!   out orders.
//! - [`conn`]: one connection's state machine, the echo and WebSocket
//!   pumps, and [`conn::CloseReason`]; over [`ws`], RFC 6455 as pure
//!   functions.
//! - [`admin`]: the admin HTTP server (`/metrics`, `/healthz`, `/drain`,
//!   `/shed`): one event loop, whole-request deadlines, bounded
//!   connections; the orders' bearer token comes from [`token`], which
//!   re-reads a token file as it changes (a rotated Secret volume).
//! - [`door`]: the drain's accept window: goodbyes instead of refusals
//!   while endpoint removal propagates, then the listeners close.
//! - [`server`]: wires them together, runs until a signal, drains.
//!
//! [`sysctl`] is the `c10m-sysctl` init tool's code. The load generator is
//! its own crate, `c10m-loadgen` (`tools/loadgen`).

pub mod admin;
pub mod config;
pub mod conn;
pub mod control;
pub mod door;
pub mod limits;
pub mod listen;
pub mod metrics;
pub mod privilege;
pub mod server;
pub mod sysctl;
pub mod system;
pub mod token;
pub mod worker;
pub mod ws;

pub use config::{Config, Protocol};
pub use server::run;
