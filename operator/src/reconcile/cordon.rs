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
//! Orders go out [`act::ORDERS_AT_ONCE`] at a time (each with its record),
//! so shards that do not answer cost a reconcile one timeout, not one each.
//!
//! A shard that does not answer (starting, gone, unreachable) keeps its
//! annotation as it was and gets the order again on the next reconcile; a
//! rollout never waits for it, because the Deployment's strategy alone
//! bounds the close rate ([`crate::rollout`]). A failed annotation write is
//! the reconcile's error (retried with backoff).

use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use tracing::{debug, info, warn};

use c10m_wire::admin::{
    CONNECTIONS_KEY, CORDON_PATH, HEALTHZ_PATH, LIMIT_PATH, SECONDS_KEY, UNCORDON_PATH,
};

use super::Error;
use crate::autoscale::act::{self, AdminToken};
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
    token: &AdminToken,
    orders: &Orders,
) -> Result<Orders, Error> {
    let mut done = Orders::default();
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let mut cordons = orders.cordon.as_slice();
    if !cordons.is_empty() && !any_answers(http, &orders.landing, port).await {
        // Nowhere to land yet: shards with a server keep serving; those
        // without one hold nothing and are vacant all the same.
        let probes = (cordons.iter())
            .map(|shard| async move {
                let ip = shard.ip.as_deref()?;
                let vacant = probe(http, ip, port).await.is_err_and(|e| act::refused(&e));
                vacant.then(|| shard.clone())
            })
            .collect();
        let found = act::at_once(probes).await;
        done.vacant = found.into_iter().flatten().collect();
        debug!(
            cordons = cordons.len(),
            vacant = done.vacant.len(),
            "no updated shard answers its readiness probe yet: the cordons wait"
        );
        cordons = &[];
    }
    let cordon = cordons.iter().map(|s| (s, true));
    let uncordon = orders.uncordon.iter().map(|s| (s, false));
    let orders = (cordon.chain(uncordon))
        .map(|(shard, on)| order(&pods, http, port, token, shard, on))
        .collect();
    for carried in act::at_once(orders).await {
        match carried? {
            Carried::Cordoned(shard) => done.cordon.push(shard),
            Carried::Uncordoned(shard) => done.uncordon.push(shard),
            Carried::Vacant(shard) => done.vacant.push(shard),
            Carried::Not => {}
        }
    }
    Ok(done)
}

/// What became of one order of [`carry_out`].
enum Carried {
    /// Cordoned and recorded, with what it held.
    Cordoned(Shard),
    /// Uncordoned and recorded.
    Uncordoned(Shard),
    /// To be cordoned, but nothing listens: no server, no clients.
    Vacant(Shard),
    /// Not carried out (no IP yet, or no answer): asked again next time.
    Not,
}

/// Sends `shard` its cordon (`on`) or uncordon and records the answer on
/// its pod in `pods`; a failed record is the reconcile's error.
async fn order(
    pods: &Api<Pod>,
    http: &reqwest::Client,
    port: i32,
    token: &AdminToken,
    shard: &Shard,
    on: bool,
) -> Result<Carried, Error> {
    let Some(ip) = &shard.ip else {
        return Ok(Carried::Not);
    };
    let path = if on { CORDON_PATH } else { UNCORDON_PATH };
    let answer = match act::post(http, &shard.name, ip, port, token, path).await {
        Ok(answer) => answer,
        // Nothing listens: no server runs there, and it holds no
        // clients. Nothing to record; asked again next time.
        Err(e) if on && act::refused(&e) => return Ok(Carried::Vacant(shard.clone())),
        Err(e) => {
            warn!(pod = %shard.name, error = %e, "rollout order not carried out; retried on the next reconcile");
            return Ok(Carried::Not);
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
    Ok(match on {
        true => Carried::Cordoned(Shard {
            held,
            ..shard.clone()
        }),
        false => Carried::Uncordoned(shard.clone()),
    })
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
    token: &AdminToken,
    limits: &crate::rollout::Limits,
) -> usize {
    let target = format!(
        "{LIMIT_PATH}?{CONNECTIONS_KEY}={}&{SECONDS_KEY}={}",
        limits.connections,
        limits.seconds.max(1)
    );
    let target = &target;
    let sends = (limits.shards.iter())
        .map(|shard| async move {
            let ip = shard.ip.as_deref()?;
            match act::post(http, &shard.name, ip, port, token, target).await {
                Ok(_) => Some(()),
                Err(e) if act::refused(&e) => None,
                Err(e) => {
                    debug!(pod = %shard.name, error = %e, "admission limit not taken; sent again on the next reconcile");
                    None
                }
            }
        })
        .collect();
    act::at_once(sends).await.iter().flatten().count()
}

/// Whether one of the `landing` shards answers its readiness probe
/// ([`probe`] gives 200), [`act::ORDERS_AT_ONCE`] probed at a time; the
/// first that does ends the wait.
async fn any_answers(http: &reqwest::Client, landing: &[Shard], port: i32) -> bool {
    let probes: Vec<_> = (landing.iter())
        .filter_map(|s| s.ip.as_deref())
        .map(|ip| async move {
            probe(http, ip, port)
                .await
                .is_ok_and(|status| status == 200)
        })
        .collect();
    let mut answers = stream::iter(probes).buffer_unordered(act::ORDERS_AT_ONCE);
    while let Some(ok) = answers.next().await {
        if ok {
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

    fn shard(name: &str, updated: bool) -> Shard {
        Shard {
            name: name.into(),
            ip: Some("127.0.0.1".into()),
            updated,
            revision: None,
            cordoned: false,
            held: None,
            terminating: false,
            ready: true,
            ready_since: None,
        }
    }

    /// Shards that do not answer cost a reconcile one order's timeout (5
    /// s) together, not one each in turn (8 × 5 s). The clock is tokio's
    /// paused one: it moves only when every order waits on its timeout.
    #[tokio::test(start_paused = true)]
    async fn orders_to_shards_that_do_not_answer_wait_out_one_timeout_together() {
        // Listening, never accepting: the connection completes in the
        // backlog and the order is never answered.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        let limits = crate::rollout::Limits {
            connections: 100,
            seconds: 30,
            shards: (0..8).map(|i| shard(&format!("new-{i}"), true)).collect(),
        };
        let start = tokio::time::Instant::now();
        let t = AdminToken::new("t".into());
        let took = limit(&reqwest::Client::new(), port.into(), &t, &limits).await;
        assert_eq!(took, 0);
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_secs(5) && waited < Duration::from_secs(10),
            "{waited:?}"
        );
        drop(silent);
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
            &AdminToken::new("t".into()),
            &orders,
        )
        .await
        .unwrap();
        assert!(done.cordon.is_empty(), "{done:?}");
        assert_eq!(done.vacant.len(), 1, "{done:?}");
        assert_eq!(done.vacant[0].name, "old-1");
    }
}
