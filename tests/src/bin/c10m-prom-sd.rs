//! `c10m-prom-sd`: Kubernetes pod discovery for Debian's Prometheus.
//!
//! Debian builds Prometheus without `kubernetes_sd_configs` (its packaging
//! removed Kubernetes discovery for client-go's dependency tree), so
//! `tests/cluster/prometheus.sh` runs this watcher beside it: it watches every
//! pod through the API server and keeps a `file_sd_configs` target file
//! up to date (atomically replaced on each change; Prometheus reloads it
//! through inotify). Each pod with an IP is one target at `<podIP>` carrying
//! the `__meta_kubernetes_*` labels that Prometheus's own role-pod discovery
//! would attach, so the scrape config relabels exactly as it would with
//! `kubernetes_sd_configs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tracing::{info, warn};

/// Command line of `c10m-prom-sd`.
#[derive(Parser, Debug)]
#[command(about = "Writes a Prometheus file_sd target file from the cluster's pods")]
struct Args {
    /// The target file (JSON) Prometheus's file_sd_configs reads.
    #[arg(long)]
    output: PathBuf,
}

/// Prometheus's label-name sanitation: every character outside
/// `[a-zA-Z0-9_]` becomes `_`.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The target group of one pod, or `None` while it has no IP.
fn target(pod: &Pod) -> Option<Value> {
    let status = pod.status.as_ref()?;
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    let m = "__meta_kubernetes_";
    let mut labels = BTreeMap::new();
    let mut put = |k: String, v: String| {
        labels.insert(k, v);
    };
    put(format!("{m}namespace"), pod.namespace().unwrap_or_default());
    put(format!("{m}pod_name"), pod.name_any());
    put(format!("{m}pod_uid"), pod.uid().unwrap_or_default());
    put(format!("{m}pod_ip"), ip.to_string());
    put(
        format!("{m}pod_phase"),
        status.phase.clone().unwrap_or_default(),
    );
    put(
        format!("{m}pod_host_ip"),
        status.host_ip.clone().unwrap_or_default(),
    );
    put(
        format!("{m}pod_node_name"),
        pod.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
    );
    let ready = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .map_or("unknown".to_string(), |c| c.status.to_lowercase());
    put(format!("{m}pod_ready"), ready);
    for (k, v) in pod.labels() {
        put(format!("{m}pod_label_{}", sanitize(k)), v.clone());
        put(
            format!("{m}pod_labelpresent_{}", sanitize(k)),
            "true".into(),
        );
    }
    for (k, v) in pod.annotations() {
        put(format!("{m}pod_annotation_{}", sanitize(k)), v.clone());
        put(
            format!("{m}pod_annotationpresent_{}", sanitize(k)),
            "true".into(),
        );
    }
    put("__address__".into(), ip.to_string());
    Some(json!({"targets": [ip], "labels": labels}))
}

/// Replaces `path` with `contents` atomically (write, then rename).
fn write_atomic(path: &Path, contents: &str) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, contents).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    c10m_e2e::init_stderr_logging();
    let args = Args::parse();
    let client = Client::try_default().await.context("kube client")?;
    let (store, writer) = reflector::store::<Pod>();
    let pods: Api<Pod> = Api::all(client);
    let mut events = std::pin::pin!(reflector(
        writer,
        watcher(pods, watcher::Config::default()).default_backoff()
    ));
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut ready = false;
    let mut last = String::new();
    info!(output = %args.output.display(), "c10m-prom-sd watching pods");
    loop {
        tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(watcher::Event::InitDone)) => ready = true,
                Some(Ok(_)) => {}
                Some(Err(e)) => { warn!("watch: {e}"); continue }
                None => break,
            },
            _ = sigterm.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        if !ready {
            continue;
        }
        let mut state = store.state();
        state.sort_by_key(|p| (p.namespace(), p.name_any()));
        let groups: Vec<Value> = state.iter().filter_map(|p| target(p)).collect();
        let text = serde_json::to_string_pretty(&groups)?;
        if text != last {
            write_atomic(&args.output, &text)?;
            info!(targets = groups.len(), "target file updated");
            last = text;
        }
    }
    Ok(())
}
