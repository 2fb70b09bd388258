//! Act (client required): carries out a [`Decision`] on the shards.
//! Scale-in victims get pod-deletion-cost −1000, so the ReplicaSet
//! controller removes them first, and marks that outlived their scale-in
//! are removed; shed orders go to the bundled server's
//! admin endpoint (`POST /shed?count=N&rate=R`, bearer token). A failed API
//! call ends the sync; a failed shed order becomes a `ShedFailed` event.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};

use c10m_wire::admin;
use tracing::info;

use super::decide::{Acted, Decision};
use super::rebalance::ShedOrder;
use crate::names::POD_DELETION_COST;
use crate::reason::{Announcement, EventAction, Reason};

/// Orders to shards' admin endpoints (shed, cordon, limit, and the
/// readiness probes before cordons) one reconcile has in flight at once.
/// Each waits up to its timeout (5 s, [`post`]) on a shard that does not
/// answer; sent one after the other, 20 unreachable shards of a fleet (a
/// node lost mid-rollout) would hold its reconcile for 20 × 5 s = 100 s,
/// past the admission limit's lease of two cap steps + 10 s
/// (`rollout::limit_lease_seconds`). Bounded, so that 128 reconciles at
/// once (the controller's concurrency) open at most 2,048 sockets.
pub const ORDERS_AT_ONCE: usize = 16;

/// A fleet's admin bearer token as the operator holds it between
/// reconciles (`reconcile::token`), and whether a shard has rejected it: an
/// order answered 401 or 403 (the Secret was rotated and the shard's
/// mounted copy is newer, or the Secret was replaced), after which the
/// operator reads the Secret again instead of keeping this token.
#[derive(Debug)]
pub struct AdminToken {
    value: String,
    rejected: AtomicBool,
}

impl AdminToken {
    /// `value`, not rejected.
    pub fn new(value: String) -> Self {
        AdminToken {
            value,
            rejected: AtomicBool::new(false),
        }
    }

    /// The bearer token.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// Whether a shard answered an order sent with it 401 or 403.
    pub fn rejected(&self) -> bool {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Marks it rejected (a shard answered an order sent with it 401 or
    /// 403).
    pub(crate) fn reject(&self) {
        self.rejected.store(true, Ordering::Relaxed);
    }
}

/// Runs `orders` [`ORDERS_AT_ONCE`] at a time and returns what each gave,
/// in their order. They come made, in a `Vec`: a stream adapter's closure
/// that makes them inside the reconcile's future trips the compiler's
/// `Send` check ("`FnOnce` is not general enough").
pub async fn at_once<F: std::future::Future>(orders: Vec<F>) -> Vec<F::Output> {
    stream::iter(orders)
        .buffered(ORDERS_AT_ONCE)
        .collect()
        .await
}

/// Lifts the marks the decision unmarks, marks its victims, then sends its
/// shed orders with the fleet's admin `token` (orders to a pod with no IP
/// yet are skipped; only a loop that runs, [`super::decide::runs`], sheds,
/// and the reconcile gives it the token). Each lifted mark and each order a
/// shard accepts is logged.
pub async fn act(
    decision: &Decision,
    pods: &Api<Pod>,
    http: &reqwest::Client,
    token: Option<&AdminToken>,
) -> Result<Acted, kube::Error> {
    unmark(pods, &decision.unmark).await?;
    mark_for_deletion(pods, &decision.victims).await?;
    let mut acted = Acted::default();
    let (Some(plan), Some(token)) = (&decision.shed, token) else {
        debug_assert!(decision.shed.is_none(), "shed orders without the token");
        return Ok(acted);
    };
    let sends = (plan.orders.iter())
        .filter_map(|s| {
            let ip = s.ip.as_deref()?;
            Some(async move { (s, shed(http, ip, plan.port, token, &s.order).await) })
        })
        .collect();
    let sent = at_once(sends).await;
    for (s, result) in sent {
        match result {
            Ok(()) => {
                info!(pod = %s.order.pod, count = s.order.count, rate = s.order.rate, "shed order accepted");
                acted.sent = acted.sent.saturating_add(s.order.count);
            }
            Err(e) => acted.failures.push(Announcement::warning(
                Reason::ShedFailed,
                EventAction::Autoscale,
                e.to_string(),
            )),
        }
    }
    Ok(acted)
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

/// Removes the pod-deletion-cost of `pods` (marks of a scale-in that is
/// over or called off). A pod already gone is skipped.
pub async fn unmark(api: &Api<Pod>, pods: &[String]) -> Result<(), kube::Error> {
    let patch = serde_json::json!({"metadata": {"annotations": {POD_DELETION_COST: null}}});
    for p in pods {
        match api
            .patch(p, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => info!(pod = %p, "scale-in mark lifted: its scale-in is over or called off"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Sends a shed order to a shard's admin endpoint. Errors name the pod and the answer.
pub async fn shed(
    http: &reqwest::Client,
    ip: &str,
    port: i32,
    token: &AdminToken,
    order: &ShedOrder,
) -> anyhow::Result<()> {
    let target = format!(
        "{}?{}={}&{}={}",
        admin::SHED_PATH,
        admin::COUNT_KEY,
        order.count,
        admin::RATE_KEY,
        order.rate
    );
    post(http, &order.pod, ip, port, token, &target)
        .await
        .map(drop)
}

/// Sends an order (`POST <target>`, `target` a path and query of
/// [`c10m_wire::admin`]) with the fleet's bearer `token` to the admin
/// endpoint of shard `pod` at `ip:port`, within 5 s, and returns the
/// answer's body (the server's JSON report of the order). Errors name the
/// pod, the URL and the answer; a 401 or 403 also marks the `token`
/// rejected ([`AdminToken::rejected`]).
pub async fn post(
    http: &reqwest::Client,
    pod: &str,
    ip: &str,
    port: i32,
    token: &AdminToken,
    target: &str,
) -> anyhow::Result<String> {
    let url = format!("http://{ip}:{port}{target}");
    let failed = |e: reqwest::Error| {
        let message = format!("order to {pod} ({url}): {e}");
        anyhow::Error::new(e).context(message)
    };
    let res = http
        .post(&url)
        .bearer_auth(token.as_str())
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(failed)?;
    let status = res.status();
    if matches!(status.as_u16(), 401 | 403) {
        token.reject();
    }
    if !status.is_success() {
        anyhow::bail!("order to {pod} ({url}): HTTP {}", res.status());
    }
    res.text().await.map_err(failed)
}

/// Whether an order failed because nothing listens at the shard's admin
/// endpoint (the connection was refused): every shard the operator renders
/// serves its readiness probe there, so its server is not running, and
/// holds no clients.
pub fn refused(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn an_order_to_a_port_nothing_listens_on_is_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let http = reqwest::Client::new();
        let t = AdminToken::new("t".into());
        let err = post(&http, "push-0", "127.0.0.1", port.into(), &t, "/cordon")
            .await
            .unwrap_err();
        assert!(refused(&err), "{err:#}");
        assert!(err.to_string().contains("push-0"), "{err}");
        // A shard that answers, even with an error, is not refused.
        let (port, _head) = shard("404 Not Found").await;
        let err = post(&http, "push-0", "127.0.0.1", port.into(), &t, "/cordon")
            .await
            .unwrap_err();
        assert!(!refused(&err), "{err:#}");
        assert!(!t.rejected(), "a 404 says nothing of the token");
    }

    /// A one-request HTTP server answering `status`; yields the request head.
    async fn shard(status: &'static str) -> (u16, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                head.extend_from_slice(&buf[..n]);
            }
            let answer =
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            s.write_all(answer.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&head).into_owned()
        });
        (port, task)
    }

    /// Orders pod `push-0` (at 127.0.0.1:`port`) to shed 150 connections at 33/s.
    async fn send(port: u16, token: &AdminToken) -> anyhow::Result<()> {
        let order = ShedOrder {
            pod: "push-0".into(),
            count: 150,
            rate: 33,
        };
        shed(
            &reqwest::Client::new(),
            "127.0.0.1",
            port.into(),
            token,
            &order,
        )
        .await
    }

    #[tokio::test]
    async fn a_shed_order_posts_count_and_rate_with_the_token() {
        let (port, head) = shard("200 OK").await;
        let token = AdminToken::new("s3cret".into());
        send(port, &token).await.unwrap();
        assert!(!token.rejected());
        let head = head.await.unwrap().to_ascii_lowercase();
        assert!(
            head.starts_with("post /shed?count=150&rate=33 http/1.1"),
            "{head}"
        );
        assert!(head.contains("authorization: bearer s3cret"), "{head}");
    }

    #[tokio::test]
    async fn a_rejected_shed_order_names_the_pod_and_the_answer_and_marks_the_token() {
        for status in ["401 Unauthorized", "403 Forbidden"] {
            let (port, _head) = shard(status).await;
            let token = AdminToken::new("bad".into());
            let err = send(port, &token).await.unwrap_err().to_string();
            assert!(
                err.contains("push-0") && err.contains(&status[..3]),
                "{err}"
            );
            assert!(token.rejected(), "{status}");
        }
    }
}
