//! Why a plan could not be made.

/// Why no plan could be made. Each message names the spec field to change.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The spec is invalid in a way the schema could not catch.
    #[error("{0}")]
    Invalid(String),
    /// Not even one connection fits one shard on one node.
    #[error("{0}")]
    Infeasible(String),
}
