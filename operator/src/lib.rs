//! c10m operator: plans, deploys and scales sharded fleets of connection
//! servers (`ConnectionFleet`, group `c10m.dev`).
//!
//! The pipeline is visible in the modules: [`api`] (types and schema) →
//! [`nodes`] (node profile) → [`model`] + [`sysctl`] (capacity plan, pure) →
//! [`render`] (owned objects, pure) → [`reconcile`] (I/O) with [`status`]
//! (conditions, pure).

pub mod api;
pub mod autoscale;
pub mod model;
pub mod nodes;
pub mod reconcile;
pub mod render;
pub mod status;
pub mod sysctl;
pub mod table;
pub mod telemetry;
