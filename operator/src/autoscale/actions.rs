//! What the metrics loop does to shards: the fleet's admin-token Secret,
//! pod-deletion-cost on scale-in victims, and shed orders to the bundled
//! server's admin endpoint (`POST /shed?count=N&rate=R`, bearer token).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};

use super::POD_DELETION_COST;
use super::rebalance::ShedOrder;

/// Key of the token in the fleet's admin Secret.
pub const TOKEN_KEY: &str = "token";

/// Name of a fleet's admin-token Secret.
pub fn secret_name(fleet: &str) -> String {
    format!("{fleet}-admin")
}

/// The fleet's admin token: read from its Secret, or created once (32
/// random bytes, hex) with the fleet as owner. Never rotated by the operator.
pub async fn ensure_admin_secret(
    api: &Api<Secret>,
    fleet: &str,
    owner: OwnerReference,
) -> Result<String, kube::Error> {
    let name = secret_name(fleet);
    if let Some(s) = api.get_opt(&name).await?
        && let Some(t) = s.data.as_ref().and_then(|d| d.get(TOKEN_KEY))
    {
        return Ok(String::from_utf8_lossy(&t.0).into_owned());
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random source works");
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(crate::render::labels(fleet)),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            ByteString(token.clone().into_bytes()),
        )])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(token),
        // Another reconcile created it first: use theirs.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            Box::pin(ensure_admin_secret(
                api,
                fleet,
                secret.metadata.owner_references.unwrap()[0].clone(),
            ))
            .await
        }
        Err(e) => Err(e),
    }
}

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
        .list(&ListParams::default().labels(&format!("{}={fleet}", crate::render::FLEET_LABEL)))
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
        "http://{ip}:{port}/shed?count={}&rate={}",
        order.count, order.rate
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
