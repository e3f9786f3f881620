//! `amberd`, the node daemon: one process per node (per `AMBER_HOME`) that owns every
//! sandbox (`service::Node`) and serves the node API (`http`) on `<home>/amberd.sock`,
//! and on TCP with a bearer token when asked.
//!
//! Lifecycle: it holds an exclusive lock on `<home>/amberd.lock` for its whole life, so
//! there is never more than one (the file holds its PID); before serving it stops any VM a dead predecessor left
//! and reports those sandboxes lost (`Node::recover`). SIGTERM or SIGINT stop every
//! sandbox, then the daemon. Started by the CLI on demand (`exit_when_idle`), it exits
//! `LINGER` after its last sandbox, prefetch or API request ended.
//!
//! `ensure_running` is the client side: it starts a daemon when none answers (a
//! detached process of its own, which prints `ready` once it serves, or `running` when
//! another holds the lock).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use amber_snapshotter::source::RegistryClient;

use crate::exports::{ExportError, Exports};
use crate::service::{Limits, Node};

/// How long a daemon started on demand waits for a new sandbox before it exits.
pub const LINGER: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("another amberd is running on {0}")]
    AlreadyRunning(PathBuf),
    #[error("amberd I/O on {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error("amberd did not start: {0}")]
    NotStarted(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DaemonError + '_ {
    move |error| DaemonError::Io {
        path: path.to_path_buf(),
        error,
    }
}

pub fn socket_path(home: &Path) -> PathBuf {
    home.join("amberd.sock")
}

pub struct DaemonConfig {
    pub home: PathBuf,
    pub registry: RegistryClient,
    pub limits: Limits,
    /// Also serve on this TCP address, requiring this bearer token.
    pub tcp: Option<(SocketAddr, String)>,
    /// Exit `LINGER` after the last sandbox, prefetch or request ended (a daemon the CLI
    /// started).
    pub exit_when_idle: bool,
}

/// Serves the node until a signal arrives (or it is idle, with `exit_when_idle`). Calls
/// `ready` with the TCP address (when serving TCP) once every listener accepts.
pub async fn serve(
    config: DaemonConfig,
    ready: impl FnOnce(Option<SocketAddr>),
) -> Result<(), DaemonError> {
    let home = &config.home;
    std::fs::create_dir_all(home).map_err(io(home))?;
    let lock_path = home.join("amberd.lock");
    // Not truncated on open: the file holds the lock holder's PID, for whoever must stop
    // it (a test harness, an operator).
    let mut lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io(&lock_path))?;
    if lock.try_lock().is_err() {
        return Err(DaemonError::AlreadyRunning(home.clone()));
    }
    {
        use std::io::Write;
        lock.set_len(0)
            .and_then(|()| writeln!(lock, "{}", std::process::id()))
            .map_err(io(&lock_path))?;
    }
    let exports = Arc::new(Exports::open(home, &config.registry).await?);
    let node = Arc::new(Node::new(
        home,
        config.registry.clone(),
        exports,
        config.limits.clone(),
    ));
    for lost in node.recover().await {
        tracing::warn!(id = %lost.id, reason = ?lost.reason, "a sandbox was lost");
    }
    let sock = socket_path(home);
    // Only the lock holder binds, so a socket file left here is a dead daemon's.
    let _ = std::fs::remove_file(&sock);
    let unix = tokio::net::UnixListener::bind(&sock).map_err(io(&sock))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o660))
            .map_err(io(&sock))?;
    }
    // Servers stop gracefully (answering what they were asked) once `stop` says so.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let mut servers = tokio::task::JoinSet::new();
    let app = counted(&node, &config, crate::http::router(node.clone(), None));
    let shutdown = until_stopped();
    servers.spawn(async move {
        let _ = axum::serve(unix, app)
            .with_graceful_shutdown(shutdown)
            .await;
    });
    let mut tcp_addr = None;
    if let Some((addr, token)) = &config.tcp {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(io(Path::new(&addr.to_string())))?;
        tcp_addr = listener.local_addr().ok();
        let app = counted(
            &node,
            &config,
            crate::http::router(node.clone(), Some(token.clone())),
        );
        let shutdown = until_stopped();
        servers.spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await;
        });
    }
    ready(tcp_addr);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io(&sock))?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(io(&sock))?;
    loop {
        let idle = async {
            if config.exit_when_idle && !node.busy() {
                tokio::time::sleep(LINGER).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = node.changed.notified() => continue,
            _ = idle => {
                if !node.busy() {
                    break;
                }
            }
        }
    }
    node.stop_all("amberd stopped").await;
    // New clients find no socket (and start a daemon, which waits for this one's lock);
    // requests already accepted are answered, within a bound (an attached stream ends
    // with its sandbox, but a client may hold its connection open).
    let _ = std::fs::remove_file(&sock);
    let _ = stop.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, async {
        while servers.join_next().await.is_some() {}
    })
    .await
    .is_err()
    {
        servers.abort_all();
    }
    drop(lock);
    Ok(())
}

/// How long a stopping daemon answers the requests it already accepted.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// `app` with each request counted as work of `node` when the daemon exits once idle
/// (`Node::work`): it must not exit under a client. A daemon that runs until stopped
/// counts nothing.
fn counted(node: &Arc<Node>, config: &DaemonConfig, app: axum::Router) -> axum::Router {
    if !config.exit_when_idle {
        return app;
    }
    let node = node.clone();
    app.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let work = node.work();
            async move {
                let response = next.run(req).await;
                drop(work);
                response
            }
        },
    ))
}

/// Makes sure an amberd serves `home`, starting one with `start_daemon` when none
/// answers.
pub async fn ensure_running(
    home: &Path,
    start_daemon: impl Fn() -> std::process::Command,
) -> Result<(), DaemonError> {
    let sock = socket_path(home);
    let mut last = String::from("no amberd answered");
    for attempt in 0..50u64 {
        if crate::client::NodeClient::unix(&sock)
            .health()
            .await
            .is_ok()
        {
            return Ok(());
        }
        let said = start(home, &start_daemon).await?;
        if said == "ready" {
            return Ok(());
        }
        // Another daemon holds the lock but does not serve yet (or is exiting): give
        // it a moment, then ask again.
        last = format!("amberd said {said:?}");
        tokio::time::sleep(Duration::from_millis(20 * (attempt + 1))).await;
    }
    Err(DaemonError::NotStarted(last))
}

/// Starts a daemon; returns the first line it printed (`ready`, or `running` when
/// another daemon holds the node).
async fn start(
    home: &Path,
    start_daemon: &impl Fn() -> std::process::Command,
) -> Result<String, DaemonError> {
    use std::os::unix::process::CommandExt;
    std::fs::create_dir_all(home).map_err(io(home))?;
    let log_path = home.join("amberd.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io(&log_path))?;
    // The daemon outlives this command: its own process group, stdin closed.
    let mut child = start_daemon()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(io(&log_path))?;
    let stdout = child.stdout.take().expect("piped");
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).map(|_| line)
    })
    .await
    .expect("reader task")
    .map_err(io(&log_path))?;
    let said = line.trim().to_string();
    if said == "ready" {
        // The daemon lives on alone; its exit is reaped by init once this process ends.
        return Ok(said);
    }
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("wait task")
        .map_err(io(&log_path))?;
    if said == "running" {
        return Ok(said);
    }
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(10).collect();
    Err(DaemonError::NotStarted(format!(
        "it exited with {status}: {}",
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    )))
}

/// amberd's flags, shared by the `amberd` binary and `amber daemon`.
#[derive(clap::Args, Debug, Clone)]
pub struct DaemonArgs {
    /// Also serve the node API on this TCP address (bearer token required).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// A file holding the bearer token for TCP clients.
    #[arg(long, env = "AMBERD_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// The most sandboxes at once (default 256).
    #[arg(long)]
    pub max_sandboxes: Option<u32>,
    /// The most vCPUs given out at once (default 32 per host CPU).
    #[arg(long)]
    pub max_cpus: Option<u32>,
    /// The most guest memory given out at once, MiB (default twice the host's).
    #[arg(long)]
    pub max_memory_mib: Option<u64>,
    /// Exit shortly after the last sandbox ended (how the CLI starts amberd).
    #[arg(long)]
    pub exit_when_idle: bool,
}

impl DaemonArgs {
    /// The configuration these flags describe, for `home` and `registry`.
    pub fn config(&self, home: &Path, registry: RegistryClient) -> Result<DaemonConfig, String> {
        let mut limits = Limits::for_host();
        if let Some(n) = self.max_sandboxes {
            limits.sandboxes = n;
        }
        if let Some(n) = self.max_cpus {
            limits.cpus = n;
        }
        if let Some(n) = self.max_memory_mib {
            limits.memory_mib = n;
        }
        let tcp = match (&self.listen, &self.token_file) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(
                    "--listen needs --token-file: the TCP API requires a bearer token".into(),
                )
            }
            (Some(addr), Some(f)) => {
                let token = std::fs::read_to_string(f)
                    .map_err(|e| format!("reading the token file {}: {e}", f.display()))?
                    .trim()
                    .to_string();
                if token.len() < 16 {
                    return Err(format!(
                        "the token in {} is shorter than 16 characters",
                        f.display()
                    ));
                }
                Some((*addr, token))
            }
        };
        Ok(DaemonConfig {
            home: home.to_path_buf(),
            registry,
            limits,
            tcp,
            exit_when_idle: self.exit_when_idle,
        })
    }
}

/// Runs amberd as a command: prints `ready` (and `listening on ADDR` for TCP) once it
/// serves, or `running` when another amberd holds `home`. Its exit code.
pub async fn run_daemon(args: &DaemonArgs, home: &Path, registry: RegistryClient) -> i32 {
    let config = match args.config(home, registry) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("amberd: {e}");
            return 2;
        }
    };
    let served = serve(config, |addr| {
        use std::io::Write;
        let mut out = std::io::stdout();
        let mut text = String::from("ready\n");
        if let Some(a) = addr {
            text += &format!("listening on {a}\n");
        }
        let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    })
    .await;
    match served {
        Ok(()) => 0,
        Err(DaemonError::AlreadyRunning(_)) => {
            println!("running");
            0
        }
        Err(e) => {
            eprintln!("amberd: {e}");
            1
        }
    }
}
