//! Cordon (client required): carries out a rollout's [`Orders`] and
//! [`crate::rollout::Limits`] on the shards. Each order goes to the
//! shard's admin endpoint (`POST /cordon` or `/uncordon`, bearer token);
//! once the shard has answered, the pod's [`CORDONED_ANNOTATION`] records
//! it (set to the connections the shard reported holding, or removed), so
//! the cordon order is sent once, survives a
//! restart or a change of leader, and what the shard must still close
//! paces the rollout ([`crate::rollout::Rollout::pace`]). A cordoned shard
//! also gets a pod-deletion-cost of minus what it held, so its ReplicaSet
//! removes the fullest old shards first: each step then lasts as long as
//! its own fullest shard's drain, which is what the step is paced by, and
//! the emptier shards go in shorter steps at the end.
//!
//! Cordons go out only once an updated shard they send clients to answers
//! its readiness probe (`GET /healthz`): a pod's Ready condition can come
//! before its server listens.
//!
//! A shard that does not answer (starting, gone, unreachable) keeps its
//! annotation as it was and gets the order again on the next reconcile; a
//! rollout never waits for it, because the Deployment's strategy alone
//! bounds the close rate ([`crate::rollout`]). A failed annotation write is
//! the reconcile's error (retried with backoff).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use tracing::{debug, info, warn};

use c10m_wire::admin::{
    CONNECTIONS_KEY, CORDON_PATH, HEALTHZ_PATH, LIMIT_PATH, SECONDS_KEY, UNCORDON_PATH,
};

use super::Error;
use crate::autoscale::act;
use crate::names::{CORDONED_ANNOTATION, POD_DELETION_COST};
use crate::rollout::{Orders, Shard};

/// Sends `orders` to the shards of namespace `ns` (admin `port`, bearer
/// `token`) and records each answered one on its pod. Returns the orders
/// carried out (answered and recorded), each cordoned shard with what it
/// held ([`held`]), and, as vacant, the shards to be cordoned whose admin
/// endpoint refused the connection ([`act::refused`]).
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
    let mut cordons = orders.cordon.as_slice();
    if !cordons.is_empty() && !any_answers(http, &orders.landing, port).await {
        // Nowhere to land yet: shards with a server keep serving; those
        // without one hold nothing and are vacant all the same.
        for shard in cordons {
            if let Some(ip) = &shard.ip
                && probe(http, ip, port).await.is_err_and(|e| act::refused(&e))
            {
                done.vacant.push(shard.clone());
            }
        }
        debug!(
            cordons = cordons.len(),
            vacant = done.vacant.len(),
            "no updated shard answers its readiness probe yet: the cordons wait"
        );
        cordons = &[];
    }
    let cordon = cordons.iter().map(|s| (s, true));
    let uncordon = orders.uncordon.iter().map(|s| (s, false));
    for (shard, on) in cordon.chain(uncordon) {
        let Some(ip) = &shard.ip else { continue };
        let path = if on { CORDON_PATH } else { UNCORDON_PATH };
        let answer = match act::post(http, &shard.name, ip, port, token, path).await {
            Ok(answer) => answer,
            Err(e) if on && act::refused(&e) => {
                // Nothing listens: no server runs there, and it holds no
                // clients. Nothing to record; asked again next time.
                done.vacant.push(shard.clone());
                continue;
            }
            Err(e) => {
                warn!(pod = %shard.name, error = %e, "rollout order not carried out; retried on the next reconcile");
                continue;
            }
        };
        let held = on.then(|| held(&answer)).flatten();
        let patch = record(on, held);
        pods.patch(&shard.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|source| Error::Rollout {
                what: format!("record {path} on pod {}", shard.name),
                source,
            })?;
        info!(pod = %shard.name, order = path, ?held, "rollout order carried out");
        if on {
            done.cordon.push(Shard {
                held,
                ..shard.clone()
            });
        } else {
            done.uncordon.push(shard.clone());
        }
    }
    Ok(done)
}

/// Sends `limits` to the updated shards of a rollout (`POST /limit` on
/// admin `port`, bearer `token`; [`crate::rollout::Rollout::limits`]) and
/// returns how many took it. Nothing is recorded: each reconcile of a
/// rollout sends it again, and it lapses by itself once the rollout ends.
/// A shard that does not take it (its server not up yet, or without the
/// order: a user's server that implements only the cordon) is logged and
/// admits up to its cap; the rollout goes on either way.
pub async fn limit(
    http: &reqwest::Client,
    port: i32,
    token: &str,
    limits: &crate::rollout::Limits,
) -> usize {
    let target = format!(
        "{LIMIT_PATH}?{CONNECTIONS_KEY}={}&{SECONDS_KEY}={}",
        limits.connections,
        limits.seconds.max(1)
    );
    let mut took = 0;
    for shard in &limits.shards {
        let Some(ip) = &shard.ip else { continue };
        match act::post(http, &shard.name, ip, port, token, &target).await {
            Ok(_) => took += 1,
            Err(e) if act::refused(&e) => {}
            Err(e) => {
                debug!(pod = %shard.name, error = %e, "admission limit not taken; sent again on the next reconcile")
            }
        }
    }
    took
}

/// Whether one of the `landing` shards answers its readiness probe
/// ([`probe`] gives 200), tried in turn.
async fn any_answers(http: &reqwest::Client, landing: &[Shard], port: i32) -> bool {
    for ip in landing.iter().filter_map(|s| s.ip.as_deref()) {
        if probe(http, ip, port)
            .await
            .is_ok_and(|status| status == 200)
        {
            return true;
        }
    }
    false
}

/// The status of a shard's readiness probe (`GET /healthz` on the admin
/// `port` at `ip`, within 2 s); an error when it does not answer
/// ([`act::refused`] tells a shard where nothing listens).
async fn probe(http: &reqwest::Client, ip: &str, port: i32) -> anyhow::Result<u16> {
    let url = format!("http://{ip}:{port}{HEALTHZ_PATH}");
    let answer = http
        .get(&url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("GET {url}")))?;
    Ok(answer.status().as_u16())
}

/// The pod annotations that record an order carried out: a cordon with
/// what the shard `held` (`unknown` when it did not say: the rollout then
/// paces it as holding its cap) and a pod-deletion-cost of minus that
/// (the fullest goes first; none when unknown); an uncordon removes both.
pub fn record(cordoned: bool, held: Option<i64>) -> serde_json::Value {
    let value = cordoned.then(|| held.map_or_else(|| "unknown".to_string(), |n| n.to_string()));
    // pod-deletion-cost is an int32; a shard holds far fewer connections.
    let cost = held
        .filter(|_| cordoned)
        .map(|n| (-n.min(i64::from(i32::MAX))).to_string());
    serde_json::json!({"metadata": {"annotations": {
        CORDONED_ANNOTATION: value,
        POD_DELETION_COST: cost,
    }}})
}

/// The connections a shard reported holding in its answer to an order
/// (`{"action":"cordon","live":N}`, `c10m-server`'s admin API); `None`
/// when the answer has no such count.
pub fn held(answer: &str) -> Option<i64> {
    serde_json::from_str::<serde_json::Value>(answer)
        .ok()?
        .get("live")?
        .as_i64()
        .filter(|n| *n >= 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cordon_answer_gives_what_the_shard_held() {
        assert_eq!(held(r#"{"action":"cordon","live":1234}"#), Some(1234));
        assert_eq!(held(r#"{"action":"cordon"}"#), None);
        assert_eq!(held("ok"), None);
        assert_eq!(held(r#"{"live":-1}"#), None);
    }

    #[test]
    fn a_cordon_records_what_the_shard_held_and_puts_the_fullest_first() {
        let annotations = |v: serde_json::Value| v["metadata"]["annotations"].clone();
        assert_eq!(
            annotations(record(true, Some(980))),
            serde_json::json!({CORDONED_ANNOTATION: "980", POD_DELETION_COST: "-980"})
        );
        assert_eq!(
            annotations(record(true, None)),
            serde_json::json!({CORDONED_ANNOTATION: "unknown", POD_DELETION_COST: null})
        );
        // An uncordon removes both (null in a merge patch).
        assert_eq!(
            annotations(record(false, Some(5))),
            serde_json::json!({CORDONED_ANNOTATION: null, POD_DELETION_COST: null})
        );
    }

    /// With no updated shard answering yet, no cordon is sent; old shards
    /// where nothing listens are vacant (they hold nothing), as a cordon
    /// refused would have found them: a fleet whose pods run no server
    /// still rolls.
    #[tokio::test]
    async fn cordons_wait_for_a_landing_shard_and_shards_without_a_server_are_vacant() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        }; // closed: nothing listens there
        let shard = |name: &str, updated: bool| Shard {
            name: name.into(),
            ip: Some("127.0.0.1".into()),
            updated,
            revision: None,
            cordoned: false,
            held: None,
            terminating: false,
            ready: true,
            ready_since: None,
        };
        let orders = Orders {
            cordon: vec![shard("old-1", false)],
            landing: vec![shard("new-1", true)],
            ..Default::default()
        };
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let done = carry_out(
            &client,
            &reqwest::Client::new(),
            "ns",
            port.into(),
            "t",
            &orders,
        )
        .await
        .unwrap();
        assert!(done.cordon.is_empty(), "{done:?}");
        assert_eq!(done.vacant.len(), 1, "{done:?}");
        assert_eq!(done.vacant[0].name, "old-1");
    }
}
