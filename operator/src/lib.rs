//! c10m operator: plans, deploys and scales sharded fleets of connection
//! servers (`ConnectionFleet`, group `c10m.dev`).
//!
//! One reconcile is a pipeline (see [`reconcile`]): observe → plan →
//! metrics loop → render → apply → report. The modules, from the leaves up
//! (a module imports only modules listed before it):
//!
//! - [`names`], [`reason`]: the names the operator owns and its one
//!   vocabulary of condition types, reasons and event actions (leaves);
//! - [`api`]: the `ConnectionFleet` spec, its status (incl. the plan) and
//!   typed sysctls: what the API server stores;
//! - [`plan`]: the capacity model (pure);
//! - [`render`]: the owned objects from a plan (pure);
//! - [`autoscale`]: the metrics loop, observe (I/O) → decide (pure) → act (I/O);
//! - [`status`]: the next status and the events a change announces (pure);
//! - [`reconcile`]: the driver and the I/O of each step;
//! - [`calibrate`]: one shard and the calibration probe on the cluster, fitted
//!   by `plan::calibration` (`c10m-operator calibrate`);
//! - [`controller`]: watches, predicates, CRD install, run configuration;
//! - [`leader`]: leader election on a Lease; runs the controller while held;
//! - [`telemetry`], [`table`]: the operator's own metrics; plan tables.
//! - [`promql`]: tenant PromQL confined to the fleet's own series (a leaf);
//! - [`policy`]: the cluster admin's policy, what no fleet can choose (a leaf).
//! - [`events`]: Kubernetes Events with repeats folded into series (a leaf).

pub mod api;
pub mod autoscale;
pub mod calibrate;
pub mod controller;
pub mod events;
pub mod leader;
pub mod names;
pub mod plan;
pub mod policy;
pub mod promql;
pub mod reason;
pub mod reconcile;
pub mod render;
pub mod rollout;
pub mod status;
pub mod table;
pub mod telemetry;
pub mod unmanaged;
