//! The capacity plan (pure: no I/O): from a fleet's spec and a node profile,
//! shards, connections per shard, resources, file-descriptor limits and the
//! sysctls that let the kernel hold them.
//!
//! - [`kernel`]: measured kernel facts and the kernel's defaults;
//! - [`bundled`]: keepalive and the unfinished-input budget the plan gives
//!   the bundled server;
//! - [`nodes`]: the node profile (the cluster's placeable nodes, `spec.node`
//!   only where smaller; offline `spec.node`) and what their runtimes allow;
//! - [`validate`]: what the schema cannot check, parsed once;
//! - [`sysctl`]: which sysctls a plan raises, under which mode, up to the
//!   policy's ceilings;
//! - [`drain`]: how long a departing shard takes, within the policy's bound;
//! - [`capacity`]: the search for shards and the plan's self-check;
//! - [`error`]: why no plan could be made;
//! - [`calibration`]: per-connection bytes from a calibration probe's samples.

pub mod bundled;
pub mod calibration;
pub mod capacity;
pub mod drain;
pub mod error;
pub mod kernel;
pub mod nodes;
pub mod sysctl;
pub mod validate;

pub use capacity::{
    HOURS_PER_MONTH, SIZE_STEPS, check, nofile_ceiling, plan, plan_under, raises_own_nofile,
    size_step, tcp_mem_pressure_pages,
};
pub use error::PlanError;
pub use nodes::{NodeFacts, NodeRuntime, SysctlSet};
pub use sysctl::raises_node_sysctls;

#[cfg(test)]
mod admitted;
