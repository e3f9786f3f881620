//! The node daemon: one process per node (per `AMBER_HOME`) that owns every sandbox
//! `amber create` starts, so they share one chunk cache (one fetch per chunk, one size
//! bound) and one export per env. The node service of the next step (`amberd`, with its
//! HTTP API, limits and lifetimes) grows from this process.
//!
//! Control: `<node>/node.sock`, one request per connection, one JSON line each way
//! (`DaemonRequest`, `DaemonReply`). The daemon holds an exclusive lock on
//! `<node>/node.lock` for its whole life, so there is never more than one; it exits a
//! short while after its last sandbox ended, and on SIGTERM or SIGINT after stopping
//! every sandbox.
//!
//! `create` is the client side: it starts the daemon when none answers (a detached
//! process of its own, which prints `ready` once it serves), and retries when it met a
//! daemon on its way out.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use amber_snapshotter::source::RegistryClient;

use crate::exports::{ExportError, Exports};
use crate::sandbox::{self, Record};

/// How long an idle daemon waits for a new sandbox before it exits.
pub const LINGER: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum DaemonRequest {
    /// Boot the sandbox of `record` (its directory holds `sandbox.json` already).
    Create { record: Record },
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum DaemonReply {
    /// The sandbox answers on its socket.
    Ready,
    Failed {
        error: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("another node daemon is running on {0}")]
    AlreadyRunning(PathBuf),
    #[error("node daemon I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error("the node daemon did not start: {0}")]
    NotStarted(String),
    #[error("the sandbox did not start: {0}")]
    SandboxFailed(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DaemonError + '_ {
    move |source| DaemonError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub fn socket_path(node: &Path) -> PathBuf {
    node.join("node.sock")
}

/// Serves the node until it is idle for `LINGER` or a signal arrives. Calls `ready`
/// once the socket accepts requests.
pub async fn serve(
    node: &Path,
    registry: &RegistryClient,
    ready: impl FnOnce(),
) -> Result<(), DaemonError> {
    std::fs::create_dir_all(node).map_err(io(node))?;
    let lock_path = node.join("node.lock");
    let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
    if lock.try_lock().is_err() {
        return Err(DaemonError::AlreadyRunning(node.to_path_buf()));
    }
    let exports = Arc::new(Exports::open(node, registry).await?);
    let sock = socket_path(node);
    // Only the lock holder binds, so a socket file left here is a dead daemon's.
    let _ = std::fs::remove_file(&sock);
    let listener = tokio::net::UnixListener::bind(&sock).map_err(io(&sock))?;
    ready();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let live = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(tokio::sync::Notify::new());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io(&sock))?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(io(&sock))?;
    let mut stopping = false;
    let mut idle_since = Some(tokio::time::Instant::now());
    loop {
        let linger = async {
            match idle_since {
                Some(t) => tokio::time::sleep_until(t + LINGER).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            conn = listener.accept(), if !stopping => {
                let Ok((conn, _)) = conn else { continue };
                live.fetch_add(1, Ordering::SeqCst);
                idle_since = None;
                let (exports, stop, live, ended) =
                    (exports.clone(), stop_rx.clone(), live.clone(), ended.clone());
                let node = node.to_path_buf();
                tokio::spawn(async move {
                    handle(conn, &node, &exports, stop).await;
                    live.fetch_sub(1, Ordering::SeqCst);
                    ended.notify_one();
                });
            }
            _ = ended.notified() => {
                if live.load(Ordering::SeqCst) == 0 {
                    if stopping {
                        break;
                    }
                    idle_since = Some(tokio::time::Instant::now());
                }
            }
            _ = linger => break,
            _ = async { tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} } } => {
                stopping = true;
                let _ = stop_tx.send(true);
                if live.load(Ordering::SeqCst) == 0 { break; }
            }
        }
    }
    drop(listener);
    let _ = std::fs::remove_file(&sock);
    drop(lock);
    Ok(())
}

/// One request: boot the sandbox, answer when it is ready (or why not), then keep it
/// until it ends.
async fn handle(
    conn: tokio::net::UnixStream,
    node: &Path,
    exports: &Exports,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let (read, mut write) = conn.into_split();
    let mut line = String::new();
    if BufReader::new(read).read_line(&mut line).await.is_err() {
        return;
    }
    let reply = |r: DaemonReply| {
        let mut text = serde_json::to_vec(&r).expect("json");
        text.push(b'\n');
        text
    };
    let record = match serde_json::from_str::<DaemonRequest>(&line) {
        Ok(DaemonRequest::Create { record }) => record,
        Err(e) => {
            let error = format!("bad request: {e}");
            let _ = write.write_all(&reply(DaemonReply::Failed { error })).await;
            return;
        }
    };
    if record.launch.registry != exports.registry() {
        let error = format!(
            "this node's daemon serves registry {}, not {}; remove its sandboxes first",
            exports.registry(),
            record.launch.registry
        );
        let _ = write.write_all(&reply(DaemonReply::Failed { error })).await;
        return;
    }
    let dir = match sandbox::sandbox_dir(node, &record.id) {
        Ok(d) => d,
        Err(e) => {
            let error = e.to_string();
            let _ = write.write_all(&reply(DaemonReply::Failed { error })).await;
            return;
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let answer = tokio::spawn(async move {
        if let Ok(r) = rx.await {
            let r = match r {
                Ok(()) => DaemonReply::Ready,
                Err(error) => DaemonReply::Failed { error },
            };
            let _ = write.write_all(&reply(r)).await;
        }
    });
    sandbox::serve(exports, &dir, &record, tx, stop).await;
    let _ = answer.await;
}

/// Asks the node daemon to boot `record`'s sandbox, starting the daemon with
/// `start_daemon` when none answers. Returns once the sandbox is ready.
pub async fn create(
    node: &Path,
    record: &Record,
    start_daemon: impl Fn() -> std::process::Command,
) -> Result<(), DaemonError> {
    let sock = socket_path(node);
    let request = {
        let mut r = serde_json::to_vec(&DaemonRequest::Create {
            record: record.clone(),
        })
        .expect("json");
        r.push(b'\n');
        r
    };
    let mut last = String::from("no daemon answered");
    for attempt in 0..50u64 {
        match tokio::net::UnixStream::connect(&sock).await {
            Ok(conn) => {
                let (read, mut write) = conn.into_split();
                if write.write_all(&request).await.is_err() {
                    last = "the daemon closed its socket".into();
                    continue;
                }
                let mut line = String::new();
                let n = BufReader::new(read)
                    .read_line(&mut line)
                    .await
                    .map_err(io(&sock))?;
                if n == 0 {
                    // A daemon on its way out: start another.
                    last = "the daemon exited before answering".into();
                    continue;
                }
                return match serde_json::from_str(&line) {
                    Ok(DaemonReply::Ready) => Ok(()),
                    Ok(DaemonReply::Failed { error }) => Err(DaemonError::SandboxFailed(error)),
                    Err(e) => Err(DaemonError::SandboxFailed(format!(
                        "unreadable daemon answer {line:?}: {e}"
                    ))),
                };
            }
            Err(_) => {
                let said = start(node, &start_daemon).await?;
                if said != "ready" {
                    // Another daemon holds the lock but does not serve yet (or is
                    // exiting): give it a moment.
                    last = format!("the node daemon said {said:?}");
                    tokio::time::sleep(Duration::from_millis(20 * (attempt + 1))).await;
                }
            }
        }
    }
    Err(DaemonError::NotStarted(last))
}

/// Starts a daemon; returns the first line it printed (`ready`, or `running` when
/// another daemon holds the node).
async fn start(
    node: &Path,
    start_daemon: &impl Fn() -> std::process::Command,
) -> Result<String, DaemonError> {
    use std::os::unix::process::CommandExt;
    let log_path = node.join("node.log");
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
