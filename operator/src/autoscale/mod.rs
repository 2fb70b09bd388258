//! Live-metrics loop: read Prometheus ([`metrics`]), decide shard counts
//! ([`policy`], pure) and rebalancing orders ([`rebalance`], pure), and carry
//! them out on the shards ([`actions`]).

pub mod actions;
pub mod metrics;
pub mod policy;
pub mod rebalance;
pub mod sync;

pub use sync::{Inputs, Memory, Outcome, sync};
