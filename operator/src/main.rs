//! `c10m-operator`: `run` the controller, print the `crd`, `plan` a fleet
//! offline, or `calibrate` its server image on the cluster.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::Deserialize;

use c10m_operator::api::{self, ConnectionFleet};
use c10m_operator::plan::nodes;
use c10m_operator::plan::{self, NodeFacts, NodeRuntime};
use c10m_operator::policy::Policy;
use c10m_operator::{calibrate, controller, leader, reconcile, table};

#[derive(Parser)]
#[command(
    name = "c10m-operator",
    version,
    about = "Plans, deploys and scales sharded fleets of connection servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller against the cluster in KUBECONFIG / in-cluster config.
    Run {
        /// Watch only this namespace (default: all namespaces).
        #[arg(long, env = "C10M_NAMESPACE")]
        namespace: Option<String>,
        /// Log format.
        #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "C10M_LOG_FORMAT")]
        log_format: LogFormat,
        /// Server-side apply the ConnectionFleet CRD at start-up, unless the installed one has a higher schema revision (false where CRDs are managed elsewhere, e.g. GitOps).
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "C10M_MANAGE_CRD")]
        manage_crd: bool,
        /// Prometheus base URL (http://host:port) for live connections, autoscaling and rebalancing.
        #[arg(long, env = "C10M_PROMETHEUS_URL")]
        prometheus_url: Option<String>,
        /// Serve /metrics and /healthz on this address ("" to disable).
        #[arg(long, default_value = "0.0.0.0:8080", env = "C10M_METRICS_ADDR")]
        metrics_addr: String,
        /// The cluster admin's policy (YAML: sysctl init-container image, namespaces allowed
        /// InitContainer mode, reserved taints and allowed tolerations, grace bound, sysctl
        /// ceilings); read once at start. Default: the built-in policy.
        #[arg(long, env = "C10M_POLICY_FILE")]
        policy_file: Option<PathBuf>,
        /// Run as one of several replicas: only the holder of the Lease
        /// --leader-elect-lease acts (installs the CRD, watches, reconciles);
        /// the others serve /healthz and /metrics and wait. Off by default for a
        /// single process; the Helm chart turns it on.
        #[arg(long, default_value_t = false, action = clap::ArgAction::Set, env = "C10M_LEADER_ELECT")]
        leader_elect: bool,
        /// Name of the leader Lease (coordination.k8s.io/v1).
        #[arg(long, default_value = "c10m-operator", env = "C10M_LEADER_ELECT_LEASE")]
        leader_elect_lease: String,
        /// Namespace of the leader Lease (default: the pod's own namespace, or
        /// the kubeconfig context's).
        #[arg(long, env = "POD_NAMESPACE")]
        leader_elect_namespace: Option<String>,
        /// Seconds the Lease stays valid after a renewal: the longest a
        /// failover waits for a leader that died without releasing it.
        #[arg(long, default_value_t = 15, env = "C10M_LEADER_ELECT_LEASE_DURATION")]
        leader_elect_lease_duration: u64,
        /// Seconds between renewals by the leader.
        #[arg(long, default_value_t = 5, env = "C10M_LEADER_ELECT_RENEW_PERIOD")]
        leader_elect_renew_period: u64,
        /// Seconds after its last renewal at which a leader that could not renew
        /// stops and exits (less than the lease duration, so it stops before
        /// another replica may take the Lease).
        #[arg(long, default_value_t = 10, env = "C10M_LEADER_ELECT_RENEW_DEADLINE")]
        leader_elect_renew_deadline: u64,
    },
    /// Print the ConnectionFleet CustomResourceDefinition as YAML.
    Crd,
    /// Print the plan and conditions the operator wrote for each fleet in the cluster.
    Status {
        /// Only this namespace (default: all namespaces).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
    },
    /// Plan fleets from a manifest without a cluster.
    Plan {
        /// Manifest with one or more ConnectionFleet documents ("-" for stdin).
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Allocatable memory of the nodes, standing in for the cluster's (e.g. 256Gi):
        /// the plan uses the smaller of this and spec.node.memory.
        #[arg(long)]
        node_memory: Option<String>,
        /// Allocatable CPUs of the nodes, standing in for the cluster's: the plan uses
        /// the smaller of this and spec.node.cpus.
        #[arg(long, value_parser = clap::value_parser!(i64).range(1..=100_000))]
        node_cpus: Option<i64>,
        /// Plan under this policy file (sysctl ceilings, grace bound) instead of the built-in one.
        #[arg(long)]
        policy_file: Option<PathBuf>,
    },
    /// Measure what one connection of a fleet's server image costs: run one
    /// shard of it on the cluster, as planned, with the calibration probe
    /// next to it; print the figures, the plan before and after, and the
    /// `spec.backend` to paste. Removes its pods when done.
    Calibrate {
        /// Manifest with one ConnectionFleet ("-" for stdin); it need not be applied.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Idle connections at which to sample, ascending (default: half and all of what
        /// the shard's cap and one probe process allow).
        #[arg(long, value_delimiter = ',')]
        steps: Vec<u64>,
        /// Slow readers opened after the last step, each sending 1 MiB and reading
        /// nothing (default: 1 % of the last step).
        #[arg(long)]
        slow_readers: Option<u64>,
        /// Image holding the calibration probe (default: the policy's
        /// `calibrationProbeImage`, c10m/loadgen:0.1.0 without a policy file).
        #[arg(long)]
        probe_image: Option<String>,
        /// Seconds the calibration may take, pods' start included.
        #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(60..=86_400))]
        timeout_seconds: u64,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Plan under this policy file instead of the built-in one.
        #[arg(long)]
        policy_file: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
    Yaml,
}

fn read_fleets(file: &PathBuf) -> anyhow::Result<Vec<ConnectionFleet>> {
    let mut text = String::new();
    if file.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut text)?;
    } else {
        text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read {}", file.display()))?;
    }
    let mut fleets = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc)
            .with_context(|| format!("document {} is not YAML", i + 1))?;
        if value.is_null() {
            continue;
        }
        if value.get("kind").and_then(|k| k.as_str()) != Some("ConnectionFleet") {
            continue;
        }
        let api_version = value
            .get("apiVersion")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        if api_version != "c10m.dev/v1alpha1" {
            bail!(
                "document {}: apiVersion {api_version:?} is not c10m.dev/v1alpha1",
                i + 1
            );
        }
        // The error names the field (`spec.availability.failureDomain: unknown variant ...`).
        let fleet: ConnectionFleet = serde_path_to_error::deserialize(value)
            .with_context(|| format!("document {} is not a valid ConnectionFleet", i + 1))?;
        fleets.push(fleet);
    }
    if fleets.is_empty() {
        bail!("{} holds no ConnectionFleet", file.display());
    }
    Ok(fleets)
}

fn plan_offline(
    file: &PathBuf,
    output: Output,
    node_memory: Option<String>,
    node_cpus: Option<i64>,
    policy: &Policy,
) -> anyhow::Result<()> {
    let observed = match (node_memory, node_cpus) {
        (Some(m), Some(c)) => Some(NodeFacts {
            memory_bytes: nodes::quantity_units(&Quantity(m.clone()))
                .with_context(|| format!("--node-memory {m:?} is not a quantity"))?,
            cpus: c,
            pods: nodes::DEFAULT_MAX_PODS,
            runtime: NodeRuntime::UNKNOWN,
        }),
        (None, None) => None,
        _ => bail!("--node-memory and --node-cpus go together"),
    };
    let mut out = Vec::new();
    for fleet in read_fleets(file)? {
        let base = fleet
            .metadata
            .name
            .clone()
            .unwrap_or_else(|| "<unnamed>".into());
        // Keyed as namespace/name when the manifest names a namespace.
        let name = match &fleet.metadata.namespace {
            Some(ns) => format!("{ns}/{base}"),
            None => base,
        };
        if out.iter().any(|(n, _, _)| *n == name) {
            bail!("two fleets named {name}");
        }
        let node = nodes::resolve_sourced(&fleet.spec, observed).with_context(|| {
            format!("fleet {name} (offline: set spec.node.memory and spec.node.cpus, or pass --node-memory and --node-cpus)")
        })?;
        let plan = plan::capacity::plan_sourced(&fleet.spec, node, policy)
            .with_context(|| format!("fleet {name}"))?;
        out.push((name, fleet.spec.connections, plan));
    }
    match output {
        Output::Table => {
            for (name, connections, plan) in &out {
                println!("{}\n", table::plan_table(name, *connections, plan));
            }
        }
        Output::Json if out.len() == 1 => println!("{}", serde_json::to_string_pretty(&out[0].2)?),
        Output::Json => {
            let all: serde_json::Map<_, _> = out
                .iter()
                .map(|(n, _, p)| (n.clone(), serde_json::to_value(p).unwrap()))
                .collect();
            println!("{}", serde_json::to_string_pretty(&all)?)
        }
        Output::Yaml if out.len() == 1 => print!("{}", serde_yaml::to_string(&out[0].2)?),
        Output::Yaml => {
            let all: std::collections::BTreeMap<_, _> =
                out.iter().map(|(n, _, p)| (n.clone(), p)).collect();
            print!("{}", serde_yaml::to_string(&all)?)
        }
    }
    Ok(())
}

async fn calibrate(
    file: &PathBuf,
    options: calibrate::Options,
    output: Output,
    policy: &Policy,
) -> anyhow::Result<()> {
    let mut fleets = read_fleets(file)?;
    if fleets.len() != 1 {
        bail!(
            "{} holds {} ConnectionFleets; calibrate takes one",
            file.display(),
            fleets.len()
        );
    }
    let mut fleet = fleets.remove(0);
    let client = kube::Client::try_default()
        .await
        .context("cannot build a Kubernetes client")?;
    if fleet.metadata.namespace.is_none() {
        fleet.metadata.namespace = Some(client.default_namespace().to_string());
    }
    let name = format!(
        "{}/{}",
        fleet.metadata.namespace.clone().unwrap_or_default(),
        fleet.metadata.name.clone().unwrap_or_default()
    );
    let facts = reconcile::observe::node_facts(&client, None, &fleet)
        .await
        .context("cannot read the nodes")?
        .with_context(|| format!("no plan for {name} on the cluster's nodes"))?;
    let outcome = calibrate::run(&client, &fleet, facts, policy, &options)
        .await
        .with_context(|| format!("calibration of {name}"))?;
    let summary = calibrate::Summary::new(name, &outcome);
    match output {
        Output::Table => print!("{}", table::calibration_table(&summary)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&summary)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&summary)?),
    }
    Ok(())
}

async fn print_status(namespace: Option<String>) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("cannot build a Kubernetes client")?;
    let api: kube::Api<ConnectionFleet> = match &namespace {
        Some(ns) => kube::Api::namespaced(client, ns),
        None => kube::Api::all(client),
    };
    let fleets = api
        .list(&Default::default())
        .await
        .context("cannot list connectionfleets")?;
    if fleets.items.is_empty() {
        println!("no ConnectionFleets");
    }
    for f in fleets {
        let name = format!(
            "{}/{}",
            f.metadata.namespace.clone().unwrap_or_default(),
            f.metadata.name.clone().unwrap_or_default()
        );
        let Some(status) = &f.status else {
            println!("{name}: no status yet (is the operator running?)\n");
            continue;
        };
        if let Some(plan) = &status.plan {
            println!("{}", table::plan_table(&name, f.spec.connections, plan));
        }
        for c in &status.conditions {
            println!(
                "  {:<15} {:<6} {:<18} {}",
                c.type_, c.status, c.reason, c.message
            );
        }
        println!();
    }
    Ok(())
}

/// The process's allocator: mimalloc (3, without transparent huge pages:
/// `Cargo.toml`), not the C library's. The image's binary links musl
/// statically, and musl's malloc takes one lock for every allocation and
/// free: at 1,000 fleets its `malloc`, `free`, slot search and lock took
/// 28 % of the operator's CPU over `make bench-scale`'s ramp (perf at 299
/// Hz). With mimalloc the ramp took 14.9 CPU-seconds against 21.7, for
/// 57 MB of RSS steady against 51 (`docs/scale.md`, 2026-12-06).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Printing subcommands die quietly when their reader goes away (`| head`),
/// as command-line tools do; the controller keeps Rust's ignored SIGPIPE so a
/// closed socket is an error, not a signal.
#[allow(unsafe_code)]
fn default_sigpipe() {
    // SAFETY: restoring the default disposition of a signal has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    if !matches!(cli.command, Command::Run { .. }) {
        default_sigpipe();
    }
    match cli.command {
        Command::Crd => {
            print!("{}", api::crd_yaml());
            Ok(())
        }
        Command::Plan {
            file,
            output,
            node_memory,
            node_cpus,
            policy_file,
        } => {
            let policy = Policy::load(policy_file.as_deref())?;
            plan_offline(&file, output, node_memory, node_cpus, &policy)
        }
        Command::Calibrate {
            file,
            steps,
            slow_readers,
            probe_image,
            timeout_seconds,
            output,
            policy_file,
        } => {
            let policy = Policy::load(policy_file.as_deref())?;
            let options = calibrate::Options {
                steps,
                slow_readers,
                probe_image: probe_image.unwrap_or_else(|| policy.calibration_probe_image.clone()),
                timeout: std::time::Duration::from_secs(timeout_seconds),
            };
            tokio::runtime::Runtime::new()?.block_on(calibrate(&file, options, output, &policy))
        }
        Command::Status { namespace } => {
            tokio::runtime::Runtime::new()?.block_on(print_status(namespace))
        }
        Command::Run {
            namespace,
            log_format,
            manage_crd,
            metrics_addr,
            prometheus_url,
            policy_file,
            leader_elect,
            leader_elect_lease,
            leader_elect_namespace,
            leader_elect_lease_duration,
            leader_elect_renew_period,
            leader_elect_renew_deadline,
        } => {
            // A policy that cannot be read stops the operator before it acts.
            let policy = Policy::load(policy_file.as_deref())?;
            let instance = std::env::var("POD_NAME").ok();
            let leader = leader_elect
                .then(|| leader::LeaderConfig {
                    lease_name: leader_elect_lease,
                    namespace: leader_elect_namespace.filter(|n| !n.is_empty()),
                    identity: leader::identity(instance.as_deref()),
                    lease_duration: leader_elect_lease_duration,
                    renew_period: leader_elect_renew_period,
                    renew_deadline: leader_elect_renew_deadline,
                })
                .map(|l| l.validate().map(|()| l))
                .transpose()?;
            let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into());
            use std::io::IsTerminal;
            let builder = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal());
            match log_format {
                LogFormat::Json => builder.json().init(),
                LogFormat::Text => builder.init(),
            }
            // One thread runs the controller (a current-thread runtime; DNS
            // lookups still go to tokio's blocking pool). It waits on the API
            // server: at 1,000 fleets the ramp took 7.7 and 9.4 CPU-seconds
            // on one thread (two runs) against 10.8-10.9 on the default two
            // workers, RSS 52 / 70 MB steady / peak against 57 / 73-76 MB,
            // with apply -> Deployment and the re-plan within the spread
            // between runs (`make bench-scale`, docs/scale.md, 2026-12-07).
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let metrics =
                    controller::serve_metrics((!metrics_addr.is_empty()).then_some(metrics_addr));
                let client = controller::counting_client(metrics.clone())
                    .await
                    .context("cannot build a Kubernetes client")?;
                let config = controller::RunConfig {
                    namespace,
                    instance,
                    manage_crd,
                    prometheus_url: prometheus_url.filter(|u| !u.is_empty()),
                    policy,
                };
                match leader {
                    None => controller::run(client, config, metrics).await,
                    Some(leader) => leader::run(client, config, leader, metrics).await,
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_field_offline_is_named_by_its_path() {
        let dir = std::env::temp_dir().join(format!("c10m-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("fleet.yaml");
        std::fs::write(
            &file,
            "apiVersion: c10m.dev/v1alpha1\nkind: ConnectionFleet\nmetadata: {name: bad}\nspec:\n  connections: 1000\n  availability: {failureDomain: node}\n",
        )
        .unwrap();
        let err = format!("{:#}", read_fleets(&file).unwrap_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            err.contains("spec.availability.failureDomain: unknown variant `node`"),
            "{err}"
        );
    }
}
