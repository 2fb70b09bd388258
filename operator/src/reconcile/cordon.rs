//! Cordon (client required): carries out a rollout's [`Orders`] on the
//! shards. Each order goes to the shard's admin endpoint (`POST /cordon`
//! or `/uncordon`, bearer token); once the shard has answered, the pod's
//! [`CORDONED_ANNOTATION`] records it (set, or removed), so the order is
//! sent once and survives a restart or a change of leader.
//!
//! A shard that does not answer (starting, gone, unreachable) keeps its
//! annotation as it was and gets the order again on the next reconcile; a
//! rollout never waits for it, because the Deployment's strategy alone
//! bounds the close rate ([`crate::rollout`]). A failed annotation write is
//! the reconcile's error (retried with backoff).

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use tracing::{info, warn};

use c10m_wire::admin::{CORDON_PATH, UNCORDON_PATH};

use super::Error;
use crate::autoscale::act;
use crate::names::CORDONED_ANNOTATION;
use crate::rollout::Orders;

/// Sends `orders` to the shards of namespace `ns` (admin `port`, bearer
/// `token`) and records each answered one on its pod. Returns the orders
/// carried out (answered and recorded).
pub async fn carry_out(
    client: &Client,
    http: &reqwest::Client,
    ns: &str,
    port: i32,
    token: &str,
    orders: &Orders,
) -> Result<Orders, Error> {
    let mut done = Orders::default();
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let cordon = orders.cordon.iter().map(|s| (s, true));
    let uncordon = orders.uncordon.iter().map(|s| (s, false));
    for (shard, on) in cordon.chain(uncordon) {
        let Some(ip) = &shard.ip else { continue };
        let path = if on { CORDON_PATH } else { UNCORDON_PATH };
        if let Err(e) = act::post(http, &shard.name, ip, port, token, path).await {
            warn!(pod = %shard.name, error = %e, "rollout order not carried out; retried on the next reconcile");
            continue;
        }
        let value = on.then_some("true");
        let patch = serde_json::json!({"metadata": {"annotations": {CORDONED_ANNOTATION: value}}});
        pods.patch(&shard.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|source| Error::Rollout {
                what: format!("record {path} on pod {}", shard.name),
                source,
            })?;
        info!(pod = %shard.name, order = path, "rollout order carried out");
        if on {
            done.cordon.push(shard.clone());
        } else {
            done.uncordon.push(shard.clone());
        }
    }
    Ok(done)
}
