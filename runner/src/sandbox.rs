//! A sandbox: one microVM booted on an env's lazy, verified NBD export (node cache shared
//! with every other sandbox on the node). `amber run` starts one in-process for a single
//! command; `amber create` starts one in a detached daemon that keeps it alive and serves
//! `amber exec`, `amber cp` and `amber rm` on a Unix socket, relaying the guest protocol's
//! sessions between those clients and the VM.
//!
//! On disk, per sandbox: `<node>/sandboxes/<id>/` holding `sandbox.json` (what it runs),
//! `api.sock`, `daemon.log`, and the VM's sockets and console. The directory exists
//! exactly as long as the daemon does (it removes it on the way out; `amber rm` removes
//! it when the daemon has died).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use amber_converter::manifest::EnvDigest;
use amber_guest::{Boot, ERROR, EXEC, EXIT, GET, PUT, SHUTDOWN};
use amber_snapshotter::cache::ChunkCache;
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::{RegistrySource, SourceError};
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering::Relaxed;

use crate::mux::{Mux, SessionTx};
use crate::receipt;
use crate::vm::{Root, Vm, VmSpec};

/// The node cache's size bound.
pub const NODE_CACHE_BYTES: u64 = 20 << 30;

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

/// A running sandbox: its VM, the NBD export feeding it, and its work directory.
pub struct Sandbox {
    pub vm: Vm,
    pub cache: Arc<ChunkCache>,
    nbd: tokio::task::JoinHandle<std::io::Result<()>>,
    work: PathBuf,
}

impl Sandbox {
    /// Boots `l` with its sockets and console under `work` (created, removed by `stop`).
    pub async fn start(node: &Path, work: PathBuf, l: &Launch) -> anyhow::Result<Sandbox> {
        std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
        let source = Arc::new(RegistrySource::new(&l.registry));
        let envelope = match source.manifest(&l.env).await {
            Err(SourceError::NotFound(_)) => {
                anyhow::bail!("env {} is not in the registry at {}", l.env, l.registry)
            }
            r => r?,
        };
        let cache = Arc::new(ChunkCache::open(
            node.join("chunks"),
            NODE_CACHE_BYTES,
            source,
        )?);
        if l.prefetch {
            use futures_util::StreamExt;
            let reads = envelope
                .manifest
                .extents
                .iter()
                .map(|e| cache.read(&e.chunk, e.length, 0, 1));
            let results: Vec<_> = futures_util::stream::iter(reads)
                .buffer_unordered(8)
                .collect()
                .await;
            for r in results {
                r.map_err(|e| anyhow::anyhow!("prefetching: {e}"))?;
            }
        }
        let device = Arc::new(LazyDevice::new(envelope.manifest, cache.clone()));
        let nbd_socket = work.join("root.sock");
        let listener = tokio::net::UnixListener::bind(&nbd_socket)
            .with_context(|| format!("binding {}", nbd_socket.display()))?;
        let nbd = tokio::spawn(amber_snapshotter::nbd::serve(
            listener,
            "amber".into(),
            device,
        ));
        let spec = VmSpec {
            qemu: PathBuf::from("qemu-system-x86_64"),
            accel: l.shape.accel.clone(),
            cpus: l.shape.cpus,
            memory_mib: l.shape.memory_mib,
            kernel: l.kernel.clone(),
            initramfs: l.initramfs.clone(),
            root: match &l.root_image {
                Some(p) => Root::RawFile(p.clone()),
                None => Root::Nbd(nbd_socket),
            },
            work: work.clone(),
        };
        let vm = match Vm::boot(&spec, &l.boot).await {
            Ok(vm) => vm,
            Err(e) => {
                nbd.abort();
                let _ = std::fs::remove_dir_all(&work);
                return Err(match integrity_error(&cache) {
                    Some(i) => anyhow::anyhow!("{i}"),
                    None => e,
                });
            }
        };
        Ok(Sandbox {
            vm,
            cache,
            nbd,
            work,
        })
    }

    /// The latest chunk that failed verification, if any did: the guest got an I/O
    /// error instead of its bytes.
    pub fn integrity_error(&self) -> Option<String> {
        integrity_error(&self.cache)
    }

    /// Stops the VM at once and removes the work directory.
    pub async fn stop(mut self) {
        self.vm.kill().await;
        self.nbd.abort();
        let _ = std::fs::remove_dir_all(&self.work);
    }

    /// Lets the guest sync and power off, then cleans up.
    pub async fn shutdown(self) {
        let Sandbox { vm, nbd, work, .. } = self;
        vm.shutdown(Duration::from_secs(10)).await;
        nbd.abort();
        let _ = std::fs::remove_dir_all(&work);
    }
}

fn integrity_error(cache: &ChunkCache) -> Option<String> {
    if cache.stats.integrity_failures.load(Relaxed) == 0 {
        return None;
    }
    cache
        .stats
        .last_integrity_error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
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

/// The daemon: boots the sandbox described in `dir/sandbox.json`, says `ready` on stdout,
/// and serves the API socket until `amber rm`, SIGTERM, or the VM stopping.
pub async fn daemon(node: &Path, dir: &Path) -> anyhow::Result<()> {
    let text = std::fs::read(dir.join("sandbox.json"))?;
    let record: Record = serde_json::from_slice(&text)?;
    let result = serve(node, dir, &record).await;
    let _ = std::fs::remove_dir_all(dir);
    result
}

async fn serve(node: &Path, dir: &Path, record: &Record) -> anyhow::Result<()> {
    use tokio::io::AsyncWriteExt;
    let sandbox = Sandbox::start(node, dir.join("vm"), &record.launch).await?;
    let listener = tokio::net::UnixListener::bind(dir.join("api.sock"))?;
    let mut stdout = tokio::io::stdout();
    stdout.write_all(b"ready\n").await?;
    stdout.flush().await?;
    drop(stdout);
    let (mux, cache) = (sandbox.vm.mux.clone(), sandbox.cache.clone());
    let shutdown = Arc::new(tokio::sync::Notify::new());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            conn = listener.accept() => {
                let (conn, _) = conn?;
                tokio::spawn(relay(conn, mux.clone(), cache.clone(), shutdown.clone()));
            }
            _ = shutdown.notified() => break,
            _ = term.recv() => break,
        }
    }
    sandbox.shutdown().await;
    Ok(())
}

/// Relays one client's sessions to fresh VM sessions and back.
async fn relay(
    conn: tokio::net::UnixStream,
    vm: Mux,
    cache: Arc<ChunkCache>,
    shutdown: Arc<tokio::sync::Notify>,
) {
    let (client, mut incoming) = Mux::new(conn);
    let mut open: HashMap<u32, SessionTx> = HashMap::new();
    while let Some(f) = incoming.recv().await {
        if f.session == 0 {
            if f.kind == SHUTDOWN {
                shutdown.notify_one();
            }
            continue;
        }
        if matches!(f.kind, EXEC | PUT | GET) && !open.contains_key(&f.session) {
            let mut s = vm.open();
            open.insert(f.session, s.tx.clone());
            let (client, cache, id) = (client.clone(), cache.clone(), f.session);
            tokio::spawn(async move {
                while let Some(g) = s.recv().await {
                    if g.kind == EXIT {
                        if let Some(e) = integrity_error(&cache) {
                            let _ = client.send(ERROR, id, e.as_bytes()).await;
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
}
