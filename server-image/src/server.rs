//! Start-up and shutdown: limits, listeners, admin thread, workers, signals.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::flag;
use signal_hook::iterator::Signals;

use crate::config::Config;
use crate::control::Shared;
use crate::limits::{self, CapLimit};
use crate::listen;
use crate::metrics::Metrics;
use crate::worker::{self, WorkerSpec};
use crate::{admin, limits::connection_cap};

/// What the main thread waits for.
#[derive(Debug)]
enum Event {
    /// SIGTERM or SIGINT arrived.
    Signal(i32),
    /// `POST /drain` with this rate (connections per second; 0: at once).
    Drain(f64),
    /// A worker's loop ended; `Err` holds its error.
    WorkerExited(u32, Result<(), String>),
}

/// Runs the server until SIGTERM, SIGINT or `POST /drain`, then drains:
/// stops accepting, closes every connection at the drain rate with a
/// protocol goodbye (WebSocket close 1001; FIN for echo), and returns `Ok`
/// once all are closed or, at the drain deadline, after closing the rest at
/// once. A second signal exits at once with status 1. Returns `Err` if
/// start-up fails or a worker dies.
pub fn run(config: Config) -> anyhow::Result<()> {
    // Limits first: everything after opens descriptors.
    let nofile = limits::raise_nofile(config.nofile);
    let cpus = limits::allowed_cpus();
    let workers = config
        .workers
        .map_or(cpus.len(), usize::from)
        .clamp(1, usize::from(u16::MAX));
    let cap = connection_cap(
        config.max_connections,
        config.nofile,
        nofile.effective,
        workers as u64,
    );
    if let Some(expected) = cap.nofile_shortfall {
        tracing::warn!(
            expected,
            effective = nofile.effective,
            hard = nofile.hard,
            cap = cap.cap,
            "RLIMIT_NOFILE is below what the plan expects (--nofile); connection cap lowered to fit"
        );
    } else if cap.limited_by == CapLimit::FdLimit {
        tracing::info!(
            max_connections = config.max_connections,
            effective = nofile.effective,
            cap = cap.cap,
            "connection cap lowered to fit RLIMIT_NOFILE"
        );
    }

    let metrics = Arc::new(Metrics::new(workers as u32));
    metrics
        .capacity
        .set(i64::try_from(cap.cap).unwrap_or(i64::MAX));
    metrics
        .fd_limit
        .set(i64::try_from(nofile.effective).unwrap_or(i64::MAX));

    // Signals before any thread starts, so none of them sees the default
    // (terminate) disposition. A second signal while draining exits with 1;
    // the conditional exit must be registered before the flag-setting
    // iterator to run first.
    let draining = Arc::new(AtomicBool::new(false));
    let signalled = Arc::new(AtomicBool::new(false));
    for sig in [SIGTERM, SIGINT] {
        flag::register_conditional_shutdown(sig, 1, Arc::clone(&signalled))
            .context("registering signal handlers")?;
        flag::register(sig, Arc::clone(&signalled)).context("registering signal handlers")?;
    }
    let token = config.admin_token().context("reading --admin-token-file")?;
    if token.is_none() {
        tracing::info!(
            "no admin token (--admin-token-file, C10M_ADMIN_TOKEN): POST /drain and /shed answer 401"
        );
    }
    metrics.set_sysctls(&crate::system::read_sysctls(std::path::Path::new("/proc")));
    let mut signals = Signals::new([SIGTERM, SIGINT]).context("registering signal handlers")?;

    let addr = SocketAddr::new(config.bind, config.port);
    let (listeners, local) = listen::bind_listeners(addr, workers, config.backlog)
        .with_context(|| format!("binding {workers} SO_REUSEPORT listeners on {addr}"))?;
    let admin_addr = SocketAddr::new(config.bind, config.metrics_port);
    let admin_listener =
        admin::bind(admin_addr).with_context(|| format!("binding admin port {admin_addr}"))?;
    let admin_local = admin_listener.local_addr()?;

    let shared = Arc::new(Shared::new(cap.cap, Arc::clone(&draining)));
    let (tx, rx) = mpsc::channel::<Event>();
    let mut handles = Vec::with_capacity(workers);
    for (id, listener) in listeners.into_iter().enumerate() {
        let id = id as u32;
        let tx = tx.clone();
        let spec = WorkerSpec {
            id,
            listener,
            cpu: limits::cpu_for_worker(id as usize, &cpus),
            limits: worker::Limits::from_config(&config),
        };
        let on_exit = move |id, r: &std::io::Result<()>| {
            let r = r.as_ref().map(|_| ()).map_err(|e| e.to_string());
            let _ = tx.send(Event::WorkerExited(id, r));
        };
        let handle = worker::spawn(spec, Arc::clone(&shared), metrics.worker(id), on_exit)
            .with_context(|| format!("starting worker {id}"))?;
        handles.push(handle);
    }
    shared.set_wakers(handles.iter().map(|h| Arc::clone(&h.waker)).collect());
    let drain_tx = Mutex::new(tx.clone());
    let state = admin::AdminState {
        metrics: Arc::clone(&metrics),
        shared: Arc::clone(&shared),
        token,
        drain: Box::new(move |rate| {
            let _ = drain_tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .send(Event::Drain(rate));
        }),
        default_drain_rate: config.drain_rate,
    };
    admin::spawn(admin_listener, state).context("starting admin thread")?;

    let signal_handle = signals.handle();
    {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("c10m-signals".into())
            .spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    let _ = tx.send(Event::Signal(sig));
                }
            })
            .context("starting signal thread")?;
    }
    drop(tx);

    tracing::info!(
        listen = %local,
        admin = %admin_local,
        workers,
        cpus = ?cpus,
        cap = cap.cap,
        fd_limit = nofile.effective,
        fd_soft_before = nofile.soft_before,
        backlog = config.backlog,
        protocol = ?config.protocol,
        "c10m-server serving"
    );

    let mut failure = None;
    let rate = match rx.recv() {
        Ok(Event::Signal(sig)) => {
            tracing::info!(signal = sig, rate = config.drain_rate, "draining");
            config.drain_rate
        }
        Ok(Event::Drain(rate)) => {
            tracing::info!(rate, "draining on POST /drain");
            rate
        }
        Ok(Event::WorkerExited(id, r)) => {
            tracing::error!(worker = id, result = ?r, "worker stopped unexpectedly; shutting down");
            failure = Some(format!("worker {id} stopped: {r:?}"));
            0.0
        }
        Err(_) => bail!("all workers and the signal thread are gone"),
    };

    // Drain: stop accepting, close connections at the rate, exit when all
    // workers are empty or at the deadline.
    metrics.draining.set(1);
    shared.start_drain(rate);
    let deadline = Instant::now() + Duration::from_secs(config.drain_timeout_secs);
    let mut exited = 0;
    while exited < handles.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Event::WorkerExited(..)) => exited += 1,
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    live = shared.live(),
                    "drain deadline reached; closing the rest"
                );
                shared.force_close();
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for h in handles {
        match h.thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(worker = h.id, error = %e, "worker failed"),
            Err(_) => tracing::error!(worker = h.id, "worker panicked"),
        }
    }
    signal_handle.close();
    tracing::info!(live = shared.live(), "drained; exiting");
    match failure {
        None => Ok(()),
        Some(f) => bail!(f),
    }
}
