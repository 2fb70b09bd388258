//! `c10m-sysctl`: applies a fleet plan's sysctls from a privileged init
//! container. See `c10m_server::sysctl`.

use std::path::PathBuf;
use std::process::ExitCode;

use c10m_server::sysctl::{self, Applied, Setting};
use c10m_wire::sysctl_tool;
use clap::Parser;

/// A flag's long name as clap wants it: the operator's `--flag` without
/// the dashes.
fn long(flag: &'static str) -> &'static str {
    flag.trim_start_matches('-')
}

// The flags are the operator's contract (`c10m_wire::sysctl_tool`): it
// renders them into the fleet's init container.
#[derive(Parser)]
#[command(
    name = sysctl_tool::BINARY,
    version,
    about = "Set namespaced sysctls and raise (never lower) node-level ones"
)]
struct Args {
    /// Namespaced sysctl to write in this network namespace (repeatable).
    #[arg(long = long(sysctl_tool::SET_FLAG), value_name = "NAME=VALUE", value_parser = sysctl::parse_setting)]
    set: Vec<Setting>,
    /// Node-level sysctl to raise in the host network namespace (repeatable).
    #[arg(long = long(sysctl_tool::RAISE_NODE_FLAG), value_name = "NAME=VALUE", value_parser = sysctl::parse_setting)]
    raise_node: Vec<Setting>,
    /// Where the host's /proc is mounted (its PID 1's netns is entered for node-level sysctls).
    #[arg(long = long(sysctl_tool::HOST_PROC_FLAG), default_value = sysctl_tool::HOST_PROC_MOUNT)]
    host_proc: PathBuf,
    /// Root of the sysctl tree.
    #[arg(long, default_value = "/proc/sys")]
    proc_sys: PathBuf,
}

fn report(s: &Setting, r: &Applied) {
    match r {
        Applied::Set => println!("{}: set to {}", s.name, s.value),
        Applied::Raised { from, to } => println!("{}: raised {from} -> {to}", s.name),
        Applied::Kept { current } => println!("{}: kept {current} (meets {})", s.name, s.value),
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    for s in &args.set {
        report(s, &sysctl::set(&args.proc_sys, s)?);
    }
    if !args.raise_node.is_empty() {
        sysctl::enter_host_netns(&args.host_proc)?;
        for s in &args.raise_node {
            report(s, &sysctl::raise_node(&args.proc_sys, s)?);
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("c10m-sysctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}
