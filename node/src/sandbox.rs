//! A sandbox: one microVM booted on its env's shared, lazy, verified NBD export
//! (`exports`). `amber run` starts one in-process for a single command; `amber create`
//! asks the node daemon (`daemon`), which keeps it alive and serves `amber exec`,
//! `amber cp` and `amber rm` on the sandbox's Unix socket, relaying the guest protocol's
//! sessions between those clients and the VM.
//!
//! On disk, per sandbox: `<node>/sandboxes/<id>/` holding `sandbox.json` (what it runs),
//! `api.sock`, and the VM's sockets and console. The directory exists exactly as long as
//! the sandbox does (the daemon removes it on the way out; `amber rm` removes it when
//! the daemon has died).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use amber_converter::manifest::EnvDigest;
use amber_guest::{Boot, ERROR, EXEC, EXIT, GET, PUT, SHUTDOWN};
use amber_snapshotter::cache::CacheError;
use amber_snapshotter::device::LazyDevice;
use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::exports::{Export, ExportError, Exports};
use crate::mux::{Mux, SessionTx};
use crate::receipt;
use crate::vm::{Root, Vm, VmError, VmSpec};

/// Everything needed to boot a sandbox.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Launch {
    pub registry: String,
    pub env: EnvDigest,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub shape: receipt::Vm,
    pub boot: Boot,
    /// Fetch every chunk into the node cache before booting (benchmarks).
    #[serde(default)]
    pub prefetch: bool,
    /// Boot from this local raw image instead of the NBD export (benchmarks).
    #[serde(default)]
    pub root_image: Option<PathBuf>,
}

/// Why a sandbox did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("creating {path}: {source}")]
    WorkDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error("prefetching: {0}")]
    Prefetch(Arc<CacheError>),
    /// A chunk of the env failed verification while the guest booted.
    #[error("{0}")]
    Integrity(Arc<CacheError>),
    #[error("the VM failed to start: {0}")]
    Vm(#[from] VmError),
}

/// A running sandbox: its VM, the env export feeding it, and its work directory.
pub struct Sandbox {
    pub vm: Vm,
    export: Arc<Export>,
    work: PathBuf,
}

impl Sandbox {
    /// Boots `l` with its sockets and console under `work` (created, removed by `stop`),
    /// its root on the env's shared export.
    pub async fn start(
        exports: &Exports,
        work: PathBuf,
        l: &Launch,
    ) -> Result<Sandbox, StartError> {
        std::fs::create_dir_all(&work).map_err(|source| StartError::WorkDir {
            path: work.clone(),
            source,
        })?;
        let export = match exports.export(&l.env).await {
            Ok(e) => e,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&work);
                return Err(e.into());
            }
        };
        if l.prefetch {
            use futures_util::StreamExt;
            let cache = exports.cache().clone();
            let extents = export.device.manifest().extents.clone();
            let reads = extents.into_iter().map(move |e| {
                let cache = cache.clone();
                async move { cache.read(&e.chunk, e.length, 0, 1).await }
            });
            let results: Vec<_> = futures_util::stream::iter(reads)
                .buffer_unordered(8)
                .collect()
                .await;
            for r in results {
                r.map_err(StartError::Prefetch)?;
            }
        }
        let spec = VmSpec {
            qemu: PathBuf::from("qemu-system-x86_64"),
            accel: l.shape.accel.clone(),
            cpus: l.shape.cpus,
            memory_mib: l.shape.memory_mib,
            kernel: l.kernel.clone(),
            initramfs: l.initramfs.clone(),
            root: match &l.root_image {
                Some(p) => Root::RawFile(p.clone()),
                None => Root::Nbd(export.socket.clone()),
            },
            work: work.clone(),
        };
        let vm = match Vm::boot(&spec, &l.boot).await {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&work);
                return Err(match export.device.integrity_failure() {
                    Some(i) => StartError::Integrity(i),
                    None => StartError::Vm(e),
                });
            }
        };
        Ok(Sandbox { vm, export, work })
    }

    /// The first chunk of this sandbox's env that failed verification, if any did: the
    /// guest got an I/O error instead of its bytes.
    pub fn integrity_failure(&self) -> Option<Arc<CacheError>> {
        self.export.device.integrity_failure()
    }

    /// Stops the VM at once and removes the work directory.
    pub async fn stop(mut self) {
        self.vm.kill().await;
        let _ = std::fs::remove_dir_all(&self.work);
    }

    /// Lets the guest sync and power off, then cleans up.
    pub async fn shutdown(self) {
        let Sandbox { vm, work, .. } = self;
        vm.shutdown(Duration::from_secs(10)).await;
        let _ = std::fs::remove_dir_all(&work);
    }
}

/// What `amber exec` needs to run a command as the image says (`docker exec` semantics).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub reference: String,
    pub image_digest: Option<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub user: String,
    pub launch: Launch,
}

pub fn sandboxes_dir(node: &Path) -> PathBuf {
    node.join("sandboxes")
}

/// A sandbox's directory; ids are validated so they cannot name anything else.
pub fn sandbox_dir(node: &Path, id: &str) -> anyhow::Result<PathBuf> {
    anyhow::ensure!(
        !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric()),
        "{id:?} is not a sandbox id"
    );
    Ok(sandboxes_dir(node).join(id))
}

pub fn read_record(node: &Path, id: &str) -> anyhow::Result<Record> {
    let p = sandbox_dir(node, id)?.join("sandbox.json");
    let text = std::fs::read(&p).with_context(|| format!("no sandbox {id} on this node"))?;
    serde_json::from_slice(&text).with_context(|| format!("reading {}", p.display()))
}

/// Connects to a sandbox's API socket.
pub async fn connect(node: &Path, id: &str) -> anyhow::Result<Mux> {
    let sock = sandbox_dir(node, id)?.join("api.sock");
    let s = tokio::net::UnixStream::connect(&sock)
        .await
        .with_context(|| format!("sandbox {id} is not running ({})", sock.display()))?;
    Ok(Mux::new(s).0)
}

/// Boots the sandbox of `record` under `dir`, serves its API socket (`dir/api.sock`) and
/// answers `ready` once it does; returns when `amber rm` asks or when `stop` fires.
/// Removes `dir` on the way out.
pub async fn serve(
    exports: &Exports,
    dir: &Path,
    record: &Record,
    ready: tokio::sync::oneshot::Sender<Result<(), String>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let sandbox = match Sandbox::start(exports, dir.join("vm"), &record.launch).await {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(dir);
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let listener = match tokio::net::UnixListener::bind(dir.join("api.sock")) {
        Ok(l) => l,
        Err(e) => {
            sandbox.stop().await;
            let _ = std::fs::remove_dir_all(dir);
            let _ = ready.send(Err(format!(
                "binding {}: {e}",
                dir.join("api.sock").display()
            )));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mux = sandbox.vm.mux.clone();
    let device = sandbox.export.device.clone();
    let shutdown = Arc::new(tokio::sync::Notify::new());
    // Every client connection's relay: told once the sandbox is gone, so a client waiting
    // for the end (`amber rm`) sees its socket close after the directory went.
    let mut relays = tokio::task::JoinSet::new();
    let (gone_tx, gone) = tokio::sync::watch::channel(false);
    loop {
        tokio::select! {
            conn = listener.accept() => match conn {
                Ok((conn, _)) => {
                    relays.spawn(relay(
                        conn,
                        mux.clone(),
                        device.clone(),
                        shutdown.clone(),
                        gone.clone(),
                    ));
                }
                Err(e) => {
                    tracing::error!(error = %e, id = %record.id, "accepting on the sandbox socket");
                    break;
                }
            },
            _ = shutdown.notified() => break,
            _ = stop.changed() => break,
        }
    }
    sandbox.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
    let _ = gone_tx.send(true);
    while relays.join_next().await.is_some() {}
}

/// Relays one client's sessions to fresh VM sessions and back.
async fn relay(
    conn: tokio::net::UnixStream,
    vm: Mux,
    device: Arc<LazyDevice>,
    shutdown: Arc<tokio::sync::Notify>,
    mut gone: tokio::sync::watch::Receiver<bool>,
) {
    let (client, mut incoming) = Mux::new(conn);
    let mut open: HashMap<u32, SessionTx> = HashMap::new();
    // The session forwarders end with this relay (dropping the set aborts them).
    let mut forwarders = tokio::task::JoinSet::new();
    loop {
        let f = tokio::select! {
            f = incoming.recv() => match f {
                Some(f) => f,
                None => break,
            },
            _ = gone.changed() => break,
        };
        if f.session == 0 {
            if f.kind == SHUTDOWN {
                shutdown.notify_one();
            }
            continue;
        }
        if matches!(f.kind, EXEC | PUT | GET) && !open.contains_key(&f.session) {
            let mut s = vm.open();
            open.insert(f.session, s.tx.clone());
            let (client, device, id) = (client.clone(), device.clone(), f.session);
            forwarders.spawn(async move {
                while let Some(g) = s.recv().await {
                    if g.kind == EXIT {
                        if let Some(e) = device.integrity_failure() {
                            let _ = client.send(ERROR, id, e.to_string().as_bytes()).await;
                        }
                    }
                    if client.send(g.kind, id, &g.payload).await.is_err() || g.kind == EXIT {
                        break;
                    }
                }
            });
        }
        if let Some(tx) = open.get(&f.session) {
            let _ = tx.send(f.kind, &f.payload).await;
        }
    }
    drop(forwarders);
    client.shutdown().await;
}
