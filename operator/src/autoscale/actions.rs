//! What the metrics loop does to shards: pod-deletion-cost on scale-in
//! victims, and shed orders to the bundled server's admin endpoint
//! (`POST /shed?count=N&rate=R`, bearer token).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};

use c10m_wire::admin;

use super::rebalance::ShedOrder;
use crate::names::{FLEET_LABEL, POD_DELETION_COST};

/// A shard pod as the metrics loop sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPod {
    /// Pod name.
    pub name: String,
    /// Pod IP, once assigned.
    pub ip: Option<String>,
    /// Ready and not terminating.
    pub ready: bool,
}

/// The fleet's pods.
pub async fn shard_pods(api: &Api<Pod>, fleet: &str) -> Result<Vec<ShardPod>, kube::Error> {
    let pods = api
        .list(&ListParams::default().labels(&format!("{FLEET_LABEL}={fleet}")))
        .await?;
    Ok(pods
        .items
        .into_iter()
        .map(|p| {
            let ready = p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            ShardPod {
                name: p.metadata.name.unwrap_or_default(),
                ip: p.status.and_then(|s| s.pod_ip),
                ready,
            }
        })
        .collect())
}

/// Marks `victims` to be deleted first on the next scale-in
/// (pod-deletion-cost −1000; other pods keep the default 0).
pub async fn mark_for_deletion(api: &Api<Pod>, victims: &[String]) -> Result<(), kube::Error> {
    let patch = serde_json::json!({"metadata": {"annotations": {POD_DELETION_COST: "-1000"}}});
    for v in victims {
        api.patch(v, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    Ok(())
}

/// Sends a shed order to a shard's admin endpoint. Errors name the pod and the answer.
pub async fn shed(
    http: &reqwest::Client,
    ip: &str,
    port: i32,
    token: &str,
    order: &ShedOrder,
) -> anyhow::Result<()> {
    let url = format!(
        "http://{ip}:{port}{}?{}={}&{}={}",
        admin::SHED_PATH,
        admin::COUNT_KEY,
        order.count,
        admin::RATE_KEY,
        order.rate
    );
    let res = http
        .post(&url)
        .bearer_auth(token)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("shed order to {} ({url}): {e}", order.pod))?;
    if !res.status().is_success() {
        anyhow::bail!("shed order to {} ({url}): HTTP {}", order.pod, res.status());
    }
    Ok(())
}
