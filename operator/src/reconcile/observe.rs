//! Observe (client required): what the cluster holds for one fleet: the
//! stored fleet, the node profile its pods can land on, any object in the
//! way, and the replicas its Deployment runs now.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::Error;
use crate::api::ConnectionFleet;
use crate::names::secret_name;
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

/// Node profile for the fleet: spec values first, else the allocatable of
/// the smallest node matching its nodeSelector. The inner error is the
/// plan's (no profile), the outer one an API failure.
pub async fn node_facts(
    client: &Client,
    fleet: &ConnectionFleet,
) -> Result<Result<NodeFacts, PlanError>, Error> {
    let spec_complete = fleet
        .spec
        .node
        .as_ref()
        .is_some_and(|n| n.memory.is_some() && n.cpus.is_some());
    let observed = if spec_complete {
        None
    } else {
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
        nodes::smallest_allocatable(&list.items)
    };
    Ok(nodes::resolve(&fleet.spec, observed))
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
