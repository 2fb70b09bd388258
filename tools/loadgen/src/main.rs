//! `c10m-loadgen` binary: see the `c10m_loadgen` library. Prints the result
//! as JSON on stdout (with `--events`, NDJSON progress events before it).

use std::process::ExitCode;

use c10m_loadgen::{self as loadgen, Args, Event};
use clap::Parser;

fn main() -> ExitCode {
    let args = Args::parse();
    let child = args.child.is_some();
    let events = args.events;
    match loadgen::run(args) {
        Ok(report) => {
            if !child {
                let line = if events {
                    serde_json::to_string(&Event::Result(Box::new(report)))
                } else {
                    serde_json::to_string_pretty(&report)
                };
                println!("{}", line.expect("serializable report"));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("c10m-loadgen: {e:#}");
            ExitCode::FAILURE
        }
    }
}
