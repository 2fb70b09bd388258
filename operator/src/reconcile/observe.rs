//! Observe (client required): what the cluster holds for one fleet: the
//! stored fleet, the node profile its pods can land on, any object in the
//! way, the replicas its Deployment runs now, and (after the apply) the
//! ReplicaSets and pods its workload's failures show on.

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::Error;
use crate::api::ConnectionFleet;
use crate::api::status::NodeSource;
use crate::names::{FLEET_LABEL, secret_name};
use crate::plan::{NodeFacts, PlanError, nodes};

/// The latest stored `fleet`, or `None` when it is gone. The cached copy a
/// reconcile is triggered with may predate the operator's last status write
/// (an owned object's event can arrive first): deciding from the stored
/// status means a stale cache never flips a condition's transition time or
/// repeats an event.
pub async fn fleet(
    client: &Client,
    fleet: &ConnectionFleet,
) -> Result<Option<ConnectionFleet>, Error> {
    let name = fleet.name_any();
    Api::<ConnectionFleet>::namespaced(client.clone(), &fleet.namespace().unwrap_or_default())
        .get_opt(&name)
        .await
        .map_err(Error::observe(format!("get ConnectionFleet {name}")))
}

/// Node profile for the fleet and where its sizes came from: the
/// allocatable of the smallest node matching its nodeSelector whose taints
/// it tolerates, `spec.node`
/// only where it is smaller ([`nodes::resolve_sourced`]). The nodes are
/// listed even when `spec.node` gives every size: a fleet's claim never
/// sizes node-level limits past the real node. The inner error is the
/// plan's (no profile), the outer one an API failure.
pub async fn node_facts(
    client: &Client,
    fleet: &ConnectionFleet,
) -> Result<Result<(NodeFacts, NodeSource), PlanError>, Error> {
    let selector = fleet
        .spec
        .placement
        .node_selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let list = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|source| Error::Nodes { source })?;
    let placeable = nodes::placeable(&list.items, &fleet.spec.placement.tolerations);
    Ok(nodes::resolve_sourced(
        &fleet.spec,
        nodes::observed(&placeable),
    ))
}

/// The first object the fleet would own (Deployment, Service,
/// PodDisruptionBudget, admin Secret) that exists but is controlled by
/// something else: a message naming it. The operator never adopts or
/// rewrites such an object.
pub async fn foreign_object(
    client: &Client,
    ns: &str,
    name: &str,
    uid: &str,
) -> Result<Option<String>, Error> {
    async fn check<K>(api: Api<K>, name: &str, uid: &str) -> Result<Option<String>, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let kind = K::kind(&());
        let obj = api
            .get_opt(name)
            .await
            .map_err(Error::observe(format!("get {kind} {name}")))?;
        let ours = |o: &K| {
            o.meta()
                .owner_references
                .iter()
                .flatten()
                .any(|r| r.controller == Some(true) && r.uid == uid)
        };
        Ok(obj.filter(|o| !ours(o)).map(|_| {
            format!("{kind} {name} already exists and is not owned by this ConnectionFleet; rename the fleet or remove the {kind}")
        }))
    }
    let found = [
        check(Api::<Deployment>::namespaced(client.clone(), ns), name, uid).await?,
        check(Api::<Service>::namespaced(client.clone(), ns), name, uid).await?,
        check(
            Api::<PodDisruptionBudget>::namespaced(client.clone(), ns),
            name,
            uid,
        )
        .await?,
        check(
            Api::<Secret>::namespaced(client.clone(), ns),
            &secret_name(name),
            uid,
        )
        .await?,
    ];
    Ok(found.into_iter().flatten().next())
}

/// Replicas the fleet's Deployment runs now (`None` before it exists).
pub async fn current_replicas(client: &Client, ns: &str, name: &str) -> Result<Option<i32>, Error> {
    Ok(Api::<Deployment>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(Error::observe(format!("get Deployment {name}")))?
        .and_then(|d| d.spec.and_then(|s| s.replicas)))
}

/// The fleet's ReplicaSets and, while its Deployment has fewer ready
/// replicas than it asks for or a rollout is under way, its pods: what
/// [`crate::status::workload_failure`] reads a refusal or an image pull
/// error from, and [`crate::rollout::observe`] the rollout.
#[derive(Clone, Debug, Default)]
pub struct Workload {
    /// ReplicaSets labelled with the fleet (the Deployment's, old and new).
    pub replica_sets: Vec<ReplicaSet>,
    /// The fleet's pods; empty while every replica is ready and one
    /// ReplicaSet holds them all.
    pub pods: Vec<Pod>,
}

/// Lists the workload of fleet `name`, as the Deployment stored after the
/// apply stands. ReplicaSets carry the pod template's labels, so the fleet
/// label selects them without a watch on every ReplicaSet in the cluster.
pub async fn workload(
    client: &Client,
    ns: &str,
    name: &str,
    deployment: &Deployment,
) -> Result<Workload, Error> {
    let by_fleet = ListParams::default().labels(&format!("{FLEET_LABEL}={name}"));
    let replica_sets = Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .list(&by_fleet)
        .await
        .map_err(Error::observe(format!("list ReplicaSets of {name}")))?
        .items;
    let wanted = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    let ready = deployment
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    let rolling = replica_sets
        .iter()
        .filter(|rs| rs.status.as_ref().is_some_and(|s| s.replicas > 0))
        .count()
        > 1;
    let pods = if ready < wanted || rolling {
        Api::<Pod>::namespaced(client.clone(), ns)
            .list(&by_fleet)
            .await
            .map_err(Error::observe(format!("list pods of {name}")))?
            .items
    } else {
        Vec::new()
    };
    Ok(Workload { replica_sets, pods })
}
