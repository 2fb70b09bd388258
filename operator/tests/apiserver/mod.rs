//! A mock Kubernetes API server for driving the operator's reconcile
//! without a cluster, in the manner of kube-rs/controller-rs's fixtures:
//! a `tower_test` mock service behind a real `kube::Client`.
//!
//! [`ApiServer::start`] loops on the mock's requests, records each one as a
//! [`Call`] (method, path with query, JSON body) and answers it with what a
//! routing closure returns. Tests route by method and path, not by the
//! order of requests, so a reordered or added read does not break them;
//! they assert on the recorded calls afterwards.

use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::watch;

/// One request the operator sent.
#[derive(Clone, Debug)]
pub struct Call {
    /// HTTP method.
    pub method: Method,
    /// Path and query, as sent (`/apis/apps/v1/namespaces/ns/deployments/x?fieldManager=...`).
    pub uri: String,
    /// The JSON body, if any.
    pub body: Option<Value>,
}

impl Call {
    /// The path without its query.
    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or_default()
    }

    /// The query string (empty without one).
    pub fn query(&self) -> &str {
        self.uri.split_once('?').map_or("", |(_, q)| q)
    }

    /// `method` on exactly `path` (query ignored).
    pub fn is(&self, method: Method, path: &str) -> bool {
        self.method == method && self.path() == path
    }
}

/// An answer to one call: a status code and a JSON body, sent at once or
/// when a test lets it go ([`Reply::held_until`]).
#[derive(Clone, Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: StatusCode,
    /// JSON body.
    pub body: Value,
    /// Sent once this turns `true`; the other calls are answered meanwhile.
    pub held: Option<watch::Receiver<bool>>,
}

impl Reply {
    /// 200 with `body`.
    pub fn ok(body: impl Serialize) -> Reply {
        Reply {
            status: StatusCode::OK,
            body: serde_json::to_value(body).expect("a JSON body"),
            held: None,
        }
    }

    /// This reply, sent only once `gate` turns `true` (a slow API server).
    pub fn held_until(self, gate: watch::Receiver<bool>) -> Reply {
        Reply {
            held: Some(gate),
            ..self
        }
    }

    /// 201 with `body`.
    pub fn created(body: impl Serialize) -> Reply {
        Reply {
            status: StatusCode::CREATED,
            ..Reply::ok(body)
        }
    }

    /// A `meta/v1` `Status` failure, as the API server sends for errors.
    pub fn failure(code: u16, reason: &str, message: impl Into<String>) -> Reply {
        Reply {
            status: StatusCode::from_u16(code).expect("an HTTP status"),
            body: json!({
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message.into(),
                "reason": reason,
                "code": code,
            }),
            held: None,
        }
    }

    /// 404 for the object `call` names (its resource and name taken from
    /// the path's last two segments).
    pub fn not_found(call: &Call) -> Reply {
        let mut segments = call.path().rsplit('/');
        let name = segments.next().unwrap_or_default();
        let resource = segments.next().unwrap_or_default();
        let mut reply = Reply::failure(404, "NotFound", format!("{resource} \"{name}\" not found"));
        reply.body["details"] = json!({"name": name, "kind": resource});
        reply
    }
}

/// The running mock: the calls it has answered so far.
pub struct ApiServer {
    calls: Arc<Mutex<Vec<Call>>>,
}

impl ApiServer {
    /// A client whose every request is answered by `route`, and the server
    /// recording them. The server task ends when the last clone of the
    /// client is dropped. Must be called inside a Tokio runtime.
    pub fn start<F>(mut route: F) -> (kube::Client, ApiServer)
    where
        F: FnMut(&Call) -> Reply + Send + 'static,
    {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let recorded = calls.clone();
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.expect("a readable body");
                let body = (!bytes.is_empty()).then(|| {
                    serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                        panic!(
                            "{} {}: body is not JSON ({e}): {}",
                            parts.method,
                            parts.uri,
                            String::from_utf8_lossy(&bytes)
                        )
                    })
                });
                let call = Call {
                    method: parts.method,
                    uri: parts
                        .uri
                        .path_and_query()
                        .map_or_else(String::new, |pq| pq.to_string()),
                    body,
                };
                let reply = route(&call);
                recorded.lock().unwrap().push(call);
                let response = Response::builder()
                    .status(reply.status)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&reply.body).unwrap()))
                    .unwrap();
                match reply.held {
                    None => send.send_response(response),
                    Some(mut gate) => {
                        tokio::spawn(async move {
                            // A dropped gate lets the reply go too.
                            let _ = gate.wait_for(|open| *open).await;
                            send.send_response(response);
                        });
                    }
                }
            }
        });
        (kube::Client::new(service, "default"), ApiServer { calls })
    }

    /// Every call answered so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The calls answered so far, forgetting them (for a test in passes).
    pub fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}
