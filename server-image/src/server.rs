//! Start-up and shutdown: limits, listeners, admin thread, workers, signals,
//! and the drain with its accept window ([`crate::door`]).

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
use crate::door;
use crate::limits::{self, CapLimit};
use crate::listen;
use crate::metrics::Metrics;
use crate::privilege;
use crate::token::{AdminToken, TokenSource};
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
/// `/healthz` answers 503 at once; the workers stop taking new connections
/// and close every held one at the drain rate with a protocol goodbye
/// (WebSocket close 1001; FIN for echo); meanwhile, for
/// `--drain-accept-secs`, the listeners stay open and new connections get
/// the same goodbye instead of a refusal ([`crate::door`]), then they
/// close. Returns `Ok` once every connection is closed (or, at the drain
/// deadline, after closing the rest at once) and the accept window is
/// over. A second signal exits at once with status 1. Returns `Err` if
/// start-up fails or a worker dies.
pub fn run(config: Config) -> anyhow::Result<()> {
    // Limits first: everything after opens descriptors. Raising the hard
    // limit may need CAP_SYS_RESOURCE, which only a process started as root
    // holds (Kubernetes sets no ambient capabilities), so it comes before
    // the drop to C10M_RUN_AS; RLIMIT_NOFILE belongs to the process and
    // survives the drop. The drop comes before any thread (it changes the
    // calling thread's credentials only) and before any socket or file the
    // server opens; the admin token file is read after it, as the serving
    // uid (and again as it changes, by the admin thread).
    let nofile = limits::raise_nofile(config.nofile);
    let identity = privilege::apply(config.run_as)?;
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

    let pinning = limits::pinning(&cpus, workers);
    match &pinning {
        limits::Pinning::Pinned(pinned) => tracing::info!(
            workers,
            cpus = ?pinned,
            "CPU pinning on: the affinity mask holds one CPU per worker, worker i runs on the i-th"
        ),
        limits::Pinning::Unpinned(why) => tracing::info!(
            workers,
            mask = ?cpus,
            reason = why.as_str(),
            "CPU pinning off: the kernel schedules the workers"
        ),
    }

    let metrics = Arc::new(Metrics::new(workers as u32));
    metrics.cpu_pinned.set(i64::from(pinning.pinned()));
    metrics
        .capacity
        .set(i64::try_from(cap.cap).unwrap_or(i64::MAX));
    metrics
        .fd_limit
        .set(i64::try_from(nofile.effective).unwrap_or(i64::MAX));
    metrics.set_identity();

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
    let token = AdminToken::from_config(&config).with_context(|| {
        let who = identity.as_ref().map_or(String::new(), |id| {
            format!(" as uid {} gid {}", id.uid[1], id.gid[1])
        });
        match &config.admin_token_file {
            Some(path) => format!("reading --admin-token-file {}{who}", path.display()),
            None => "reading the admin token".to_string(),
        }
    })?;
    match (token.source(), &config.admin_token_file) {
        (TokenSource::File, Some(path)) => tracing::info!(
            path = %path.display(),
            "admin token from a file, re-read when an order arrives (at most once per second): a rotated token takes effect without a restart"
        ),
        (TokenSource::Fixed, _) => tracing::info!(
            "admin token from C10M_ADMIN_TOKEN, fixed for the life of the process (--admin-token-file can be rotated)"
        ),
        _ => tracing::info!(
            "no admin token (--admin-token-file, C10M_ADMIN_TOKEN): POST /drain and /shed answer 401"
        ),
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
    // A second descriptor of each listener keeps it open through the drain's
    // accept window, after the workers drop theirs.
    let door_listeners = listeners
        .iter()
        .map(std::net::TcpListener::try_clone)
        .collect::<std::io::Result<Vec<_>>>()
        .context("copying the listeners for the drain's accept window")?;

    let shared = Arc::new(Shared::new(cap.cap, Arc::clone(&draining)));
    let (tx, rx) = mpsc::channel::<Event>();
    let mut handles = Vec::with_capacity(workers);
    for (id, listener) in listeners.into_iter().enumerate() {
        let id = id as u32;
        let tx = tx.clone();
        let spec = WorkerSpec {
            id,
            listener,
            cpu: pinning.cpu(id as usize),
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
        pinned = pinning.pinned(),
        cap = cap.cap,
        fd_limit = nofile.effective,
        fd_soft_before = nofile.soft_before,
        backlog = config.backlog,
        protocol = ?config.protocol,
        subprotocols = %config.subprotocols,
        close_timeout_secs = config.close_timeout_secs,
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

    // Drain: readiness drops, the workers stop accepting and close their
    // connections at the rate, the door says goodbye to newcomers for the
    // accept window; exit when all workers are empty (or at the deadline)
    // and the window is over.
    metrics.draining.set(1);
    shared.start_drain(rate);
    let window = Duration::from_secs(config.drain_accept_secs);
    let door = if failure.is_none() && !window.is_zero() {
        tracing::info!(
            secs = config.drain_accept_secs,
            "accept window: new connections get a goodbye until it ends"
        );
        match door::spawn(
            door_listeners,
            config.protocol,
            config.subprotocols.clone(),
            window,
            Arc::clone(&metrics),
        ) {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::error!(error = %e, "could not start the accept window; listeners close now");
                None
            }
        }
    } else {
        drop(door_listeners);
        None
    };
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
    if let Some(door) = door
        && door.join().is_err()
    {
        tracing::error!("accept window thread panicked");
    }
    signal_handle.close();
    tracing::info!(live = shared.live(), "drained; exiting");
    match failure {
        None => Ok(()),
        Some(f) => bail!(f),
    }
}
