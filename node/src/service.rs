//! The node as `amberd` serves it: every sandbox on this machine, their limits and
//! lifetimes, their commands and files. The HTTP layer (`http`) only translates requests
//! into calls of `Node` and its answers (or `NodeError`s) back; tests and the CLI reach
//! the same calls through it.
//!
//! Invariants kept here:
//! - the resources of every sandbox that is creating or running are counted in `used`,
//!   reserved before its VM starts and released once it has stopped; a create that would
//!   pass a limit is refused (`Capacity`, HTTP 429) and changes nothing; a paused sandbox
//!   holds only its place (its vCPUs and memory are reserved again before it resumes);
//! - each sandbox has one task (`lifecycle`) that owns its VM: it alone starts and stops
//!   it, at a delete, at the hard lifetime, at the idle timeout, or when the VM dies, so a
//!   sandbox ends on time whoever created it and whatever became of that client;
//! - `<home>/sandboxes/<id>/` exists exactly while the sandbox's VM may run; it holds
//!   `sandbox.json` and `vm/qemu.pid`, which is how a restarted `amberd` finds and stops a
//!   VM left by a dead one (`recover`);
//! - an ended sandbox stays visible (status and reason) among the last `ENDED_KEPT`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amber_api::node::{
    CachedEnv, CreateSandbox, CreateSnapshot, ErrorKind, ExecRequest, NodeInfo, PrefetchFrame,
    ProcessInfo, Resources, SandboxInfo, SandboxStatus, SnapshotInfo,
};
use amber_distribution::DistributionError;
use amber_guest::Request;
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::RegistryClient;
use serde::{Deserialize, Serialize};

use crate::command::{request, ExecDefaults};
use crate::exports::{ExportError, Exports};
use crate::image::{ImageError, RunConfig};
use crate::kernel::{self, BootFileError};
use crate::mux::Mux;
use crate::process::{Process, Retain};
use crate::run::{self, LaunchError, VmOptions};
use crate::sandbox::{Launch, Sandbox};
use crate::snapshot::{self, SnapshotError};
use amber_snapshotter::cache::CacheError;

/// Ended sandboxes kept for `get` and `list`.
const ENDED_KEPT: usize = 4096;
/// The most output a command answered in one piece keeps (stdout and stderr together).
pub const EXEC_OUTPUT_BOUND: usize = 16 << 20;
/// The most output a background process keeps for re-reading.
pub const PROCESS_OUTPUT_BOUND: usize = 8 << 20;
/// Background processes kept per sandbox, running or ended.
const PROCESSES_KEPT: usize = 256;

/// The most this node runs at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    pub sandboxes: u32,
    pub cpus: u32,
    pub memory_mib: u64,
}

impl Limits {
    /// Defaults for this machine: 32 vCPUs per host CPU (vCPUs are time-shared, and the
    /// sandboxes of a training loop mostly wait on the trainer), and twice its memory (a
    /// guest touches only what it uses; idle sandboxes cost far less than their size).
    pub fn for_host() -> Limits {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        // SAFETY: sysconf has no preconditions.
        let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) }.max(0) as u64;
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64;
        Limits {
            sandboxes: 256,
            cpus: cpus * 32,
            memory_mib: ((pages * page) >> 20) * 2,
        }
    }
}

/// What went wrong, by the kind a client branches on.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    ImageNotFound(String),
    #[error("sandbox {id} is {status}: {reason}")]
    NotRunning {
        id: String,
        status: &'static str,
        reason: String,
    },
    #[error("{0}")]
    Capacity(String),
    #[error("{0}")]
    Integrity(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl NodeError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            NodeError::BadRequest(_) => ErrorKind::BadRequest,
            NodeError::NotFound(_) => ErrorKind::NotFound,
            NodeError::ImageNotFound(_) => ErrorKind::ImageNotFound,
            NodeError::NotRunning { .. } => ErrorKind::NotRunning,
            NodeError::Capacity(_) => ErrorKind::Capacity,
            NodeError::Integrity(_) => ErrorKind::Integrity,
            NodeError::Unavailable(_) => ErrorKind::Unavailable,
            NodeError::Internal(_) => ErrorKind::Internal,
        }
    }
}

impl From<LaunchError> for NodeError {
    fn from(e: LaunchError) -> NodeError {
        let text = e.to_string();
        match e {
            LaunchError::Image(
                ImageError::Refused { status: 404, .. }
                | ImageError::Registry {
                    source: DistributionError::NotFound { .. },
                    ..
                },
            ) => NodeError::ImageNotFound(text),
            LaunchError::Image(
                ImageError::Integrity { .. }
                | ImageError::Registry {
                    source: DistributionError::Corrupt { .. },
                    ..
                },
            ) => NodeError::Integrity(text),
            LaunchError::Image(
                ImageError::BadReference(_)
                | ImageError::OtherRegistry { .. }
                | ImageError::NotAnImage(_)
                | ImageError::ConversionFailed { .. },
            ) => NodeError::BadRequest(text),
            LaunchError::BootFile(BootFileError::Missing { .. }) => NodeError::BadRequest(text),
            _ => NodeError::Unavailable(text),
        }
    }
}

impl From<SnapshotError> for NodeError {
    fn from(e: SnapshotError) -> NodeError {
        let text = e.to_string();
        match e {
            SnapshotError::Refused(_) => NodeError::BadRequest(text),
            SnapshotError::Image(i) => NodeError::from(LaunchError::Image(i)),
            SnapshotError::Guest(_) | SnapshotError::Io { .. } => NodeError::Internal(text),
            SnapshotError::VmGone | SnapshotError::Registry { .. } => NodeError::Unavailable(text),
        }
    }
}

fn status_name(s: SandboxStatus) -> &'static str {
    match s {
        SandboxStatus::Creating => "creating",
        SandboxStatus::Running => "running",
        SandboxStatus::Stopped => "stopped",
        SandboxStatus::Failed => "failed",
        SandboxStatus::Lost => "lost",
        SandboxStatus::Paused => "paused",
    }
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a sandbox's directory records, for `recover`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub info: SandboxInfo,
    pub launch: Launch,
    /// How commands run unless a request says otherwise (the image's config).
    pub env: Vec<String>,
    pub cwd: String,
    pub user: String,
}

/// Where a sandbox is in its life.
#[derive(Clone)]
enum Phase {
    Creating,
    Running(Running),
    /// Being paused or resumed: commands wait, as while creating.
    Busy,
    Paused,
    Ended,
}

impl Phase {
    /// Not in a transition: what waiters wait for.
    fn settled(&self) -> bool {
        !matches!(self, Phase::Creating | Phase::Busy)
    }
}

/// What the lifecycle task is asked to do with the VM it owns.
enum Control {
    Pause(tokio::sync::oneshot::Sender<Result<SandboxInfo, NodeError>>),
    Resume(tokio::sync::oneshot::Sender<Result<SandboxInfo, NodeError>>),
}

/// What sessions need of a running sandbox.
#[derive(Clone)]
pub struct Running {
    pub mux: Mux,
    pub device: Arc<LazyDevice>,
    pub defaults: Arc<ExecDefaults>,
    /// The guest agent's protocol version.
    pub protocol: u32,
}

struct Entry {
    id: String,
    info: Mutex<SandboxInfo>,
    record: Record,
    phase: tokio::sync::watch::Sender<Phase>,
    /// Set once: why the sandbox must end now.
    stop: tokio::sync::watch::Sender<Option<String>>,
    /// When its hard lifetime ends (moved by `set_timeout`).
    deadline: tokio::sync::watch::Sender<Option<Instant>>,
    last_active: Mutex<Instant>,
    busy: AtomicUsize,
    processes: Mutex<BTreeMap<u32, Arc<Process>>>,
    next_process: AtomicU32,
    control: tokio::sync::mpsc::Sender<Control>,
    /// The other end of `control`, taken by the lifecycle task.
    control_rx: Mutex<Option<tokio::sync::mpsc::Receiver<Control>>>,
    /// Held while a snapshot of the sandbox is taken: a second one waits its turn.
    snapshotting: tokio::sync::Mutex<()>,
}

/// How long a command cut short by its sandbox's end waits to say why: the lifecycle
/// sets the reason once the VM is stopped and its console read.
const END_REASON_WAIT: Duration = Duration::from_secs(30);

impl Entry {
    /// Why the sandbox ended, once it has (None if it has not within [`END_REASON_WAIT`]).
    async fn end_reason(self: Arc<Self>) -> Option<String> {
        let mut phase = self.phase.subscribe();
        let ended = phase.wait_for(|p| matches!(p, Phase::Ended));
        tokio::time::timeout(END_REASON_WAIT, ended)
            .await
            .ok()?
            .ok()?;
        self.info.lock().unwrap().reason.clone()
    }

    fn defaults(&self) -> ExecDefaults {
        ExecDefaults {
            config: RunConfig {
                env: self.record.env.clone(),
                working_dir: self.record.cwd.clone(),
                user: self.record.user.clone(),
                ..RunConfig::default()
            },
            hostname: self.record.info.hostname.clone(),
        }
    }
}

/// Holds a sandbox busy (not idle) while it lives.
pub struct Activity(Arc<Entry>);

impl Drop for Activity {
    fn drop(&mut self) {
        *self.0.last_active.lock().unwrap() = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct Inner {
    live: HashMap<String, Arc<Entry>>,
    ended: VecDeque<SandboxInfo>,
    keys: HashMap<String, String>,
    used: (u32, u32, u64),
}

/// Every sandbox of this node.
pub struct Node {
    home: PathBuf,
    registry: RegistryClient,
    exports: Arc<Exports>,
    limits: Limits,
    inner: Mutex<Inner>,
    /// The env of each digest-pinned reference `info` was asked about (`name@sha256:…`
    /// names one image for ever, and an image has one env): placement asks several
    /// nodes per create, and a pinned answer needs the registry once.
    pinned_envs: Mutex<HashMap<String, amber_oci::env::EnvDigest>>,
    /// Prefetches running and API requests being answered (`Node::work`): they keep an
    /// idle daemon up as sandboxes do, and the end of a request restarts its linger, so a
    /// client that just found the daemon gets its next request answered.
    work: Arc<AtomicUsize>,
    /// Told whenever a sandbox, a prefetch or a request ends (the daemon's idle exit
    /// waits on it).
    pub changed: Arc<tokio::sync::Notify>,
}

/// One prefetch or request under way (`Node::work`), counted while alive; tells
/// `Node::changed` when it ends.
pub struct Work(Arc<AtomicUsize>, Arc<tokio::sync::Notify>);

impl Drop for Work {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
        self.1.notify_waiters();
    }
}

/// Pinned references `Node::info` remembers before it starts over.
const PINNED_ENVS_KEPT: usize = 16384;

fn bad(msg: impl Into<String>) -> NodeError {
    NodeError::BadRequest(msg.into())
}

fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

pub fn sandboxes_dir(home: &Path) -> PathBuf {
    home.join("sandboxes")
}

impl Node {
    pub fn new(
        home: &Path,
        registry: RegistryClient,
        exports: Arc<Exports>,
        limits: Limits,
    ) -> Node {
        Node {
            home: home.to_path_buf(),
            registry,
            exports,
            limits,
            inner: Mutex::new(Inner::default()),
            pinned_envs: Mutex::new(HashMap::new()),
            work: Arc::new(AtomicUsize::new(0)),
            changed: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Whether anything runs: a sandbox (or a create), a prefetch, or a request.
    pub fn busy(&self) -> bool {
        self.live_count() > 0 || self.work.load(Ordering::SeqCst) > 0
    }

    /// Counts one prefetch, or one API request a daemon started on demand answers, while
    /// the returned guard lives.
    pub fn work(&self) -> Work {
        self.work.fetch_add(1, Ordering::SeqCst);
        Work(self.work.clone(), self.changed.clone())
    }

    /// Sandboxes creating or running, counting creates still resolving their image.
    pub fn live_count(&self) -> usize {
        self.inner.lock().unwrap().used.0 as usize
    }

    /// Stops every VM a dead `amberd` left under this home and records its sandboxes as
    /// lost, with the reason. Call once, before serving.
    pub async fn recover(&self) -> Vec<SandboxInfo> {
        let dir = sandboxes_dir(&self.home);
        let mut lost = Vec::new();
        let Ok(rd) = std::fs::read_dir(&dir) else {
            return lost;
        };
        for e in rd.flatten() {
            let path = e.path();
            let record: Option<Record> = std::fs::read(path.join("sandbox.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let stopped = stop_leftover_qemu(&path.join("vm")).await;
            let _ = std::fs::remove_dir_all(&path);
            let Some(record) = record else { continue };
            let mut info = record.info;
            info.status = SandboxStatus::Lost;
            info.reason = Some(match stopped {
                Some(pid) => format!(
                    "amberd stopped while the sandbox ran; its VM (QEMU pid {pid}) lost its root disk server and was stopped when amberd started again"
                ),
                None => "amberd stopped while the sandbox ran, and its VM with it".into(),
            });
            lost.push(info.clone());
            self.remember_ended(info);
        }
        lost
    }

    fn remember_ended(&self, info: SandboxInfo) {
        let mut inner = self.inner.lock().unwrap();
        inner.ended.push_back(info);
        while inner.ended.len() > ENDED_KEPT {
            inner.ended.pop_front();
        }
    }

    fn validate(&self, c: &CreateSandbox) -> Result<(), NodeError> {
        if c.image.trim().is_empty() {
            return Err(bad(
                "image is empty: give name:tag, name@sha256:… or blake3:…",
            ));
        }
        if c.cpus == 0 || c.cpus > 64 {
            return Err(bad(format!("cpus must be 1 to 64, not {}", c.cpus)));
        }
        if c.memory_mib < 128 || c.memory_mib > 1 << 20 {
            return Err(bad(format!(
                "memory_mib must be 128 to 1048576, not {}",
                c.memory_mib
            )));
        }
        if let Some(d) = c.disk_mib {
            if d != 0 && !(crate::disk::MIN_MIB..=crate::disk::MAX_MIB).contains(&d) {
                return Err(bad(format!(
                    "disk_mib must be {} to {} (or 0 for writes in guest memory), not {d}",
                    crate::disk::MIN_MIB,
                    crate::disk::MAX_MIB
                )));
            }
        }
        if c.lifetime_s == Some(0) || c.idle_timeout_s == Some(0) {
            return Err(bad("lifetime_s and idle_timeout_s must be positive"));
        }
        for (k, _) in c.env.iter().chain(c.labels.iter()) {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(bad(format!("{k:?} is not a valid env or label name")));
            }
        }
        if c.env.values().any(|v| v.contains('\0')) {
            return Err(bad("an env value holds a NUL byte"));
        }
        if let Some(a) = &c.accel {
            if a != "kvm" && a != "tcg" {
                return Err(bad(format!("accel must be kvm or tcg, not {a:?}")));
            }
        }
        if let Some(n) = &c.network {
            crate::network::Network::parse(n).map_err(|e| bad(format!("network: {e}")))?;
        }
        if let Some(h) = &c.hostname {
            if h.is_empty()
                || h.len() > 63
                || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            {
                return Err(bad(format!("{h:?} is not a valid hostname")));
            }
        }
        Ok(())
    }

    /// Reserves room for `c` or says which limit it would pass.
    fn reserve(&self, inner: &mut Inner, c: &CreateSandbox) -> Result<(), NodeError> {
        self.reserve_room(inner, 1, c.cpus, c.memory_mib)
    }

    /// Reserves `sandboxes`, `c` vCPUs and `m` MiB, or says which limit they would pass.
    fn reserve_room(
        &self,
        inner: &mut Inner,
        sandboxes: u32,
        c: u32,
        m: u32,
    ) -> Result<(), NodeError> {
        let (n, cpus, mem) = inner.used;
        let l = &self.limits;
        if n + sandboxes > l.sandboxes {
            return Err(NodeError::Capacity(format!(
                "this node runs at most {} sandboxes and all are in use",
                l.sandboxes
            )));
        }
        if cpus + c > l.cpus {
            return Err(NodeError::Capacity(format!(
                "this node has {} of {} vCPUs free, and the sandbox asks for {c}",
                l.cpus - cpus,
                l.cpus,
            )));
        }
        if mem + m as u64 > l.memory_mib {
            return Err(NodeError::Capacity(format!(
                "this node has {} of {} MiB of memory free, and the sandbox asks for {m}",
                l.memory_mib - mem,
                l.memory_mib,
            )));
        }
        inner.used = (n + sandboxes, cpus + c, mem + m as u64);
        Ok(())
    }

    /// Gives back what `info` holds: its vCPUs and memory, and its place (`sandbox`).
    fn release_room(&self, info: &SandboxInfo, sandbox: bool) {
        let mut inner = self.inner.lock().unwrap();
        let (n, cpus, mem) = inner.used;
        inner.used = (
            n.saturating_sub(u32::from(sandbox)),
            cpus.saturating_sub(info.cpus),
            mem.saturating_sub(info.memory_mib as u64),
        );
    }

    fn release(&self, info: &SandboxInfo) {
        self.release_room(info, true);
    }

    /// Creates a sandbox; returns it, and whether it is new (false: the idempotency key
    /// named an earlier one). With `wait`, returns once the guest agent answers.
    pub async fn create(
        self: &Arc<Self>,
        c: CreateSandbox,
    ) -> Result<(SandboxInfo, bool), NodeError> {
        self.validate(&c)?;
        let id = run::new_id().map_err(|e| NodeError::Internal(e.to_string()))?;
        {
            let mut inner = self.inner.lock().unwrap();
            if let Some(k) = &c.idempotency_key {
                if let Some(existing) = inner.keys.get(k).cloned() {
                    drop(inner);
                    let info = self.get(&existing)?;
                    return Ok((info, false));
                }
            }
            self.reserve(&mut inner, &c)?;
            if let Some(k) = &c.idempotency_key {
                inner.keys.insert(k.clone(), id.clone());
            }
        }
        let prepared = self.prepare(&id, &c).await;
        let entry = match prepared {
            Ok(e) => e,
            Err(e) => {
                let mut inner = self.inner.lock().unwrap();
                let (n, cpus, mem) = inner.used;
                inner.used = (n - 1, cpus - c.cpus, mem - c.memory_mib as u64);
                if let Some(k) = &c.idempotency_key {
                    inner.keys.remove(k);
                }
                return Err(e);
            }
        };
        let mut phase = entry.phase.subscribe();
        tokio::spawn(lifecycle(self.clone(), entry.clone()));
        if c.wait {
            let _ = phase.wait_for(Phase::settled).await;
        }
        let info = entry.info.lock().unwrap().clone();
        if c.wait && info.status == SandboxStatus::Failed {
            let reason = info.reason.unwrap_or_default();
            return Err(if reason.contains("integrity error") {
                NodeError::Integrity(reason)
            } else {
                NodeError::Unavailable(format!("sandbox {id} did not start: {reason}"))
            });
        }
        Ok((info, true))
    }

    /// Resolves what the sandbox boots and records it; the entry is live on return.
    async fn prepare(&self, id: &str, c: &CreateSandbox) -> Result<Arc<Entry>, NodeError> {
        let opts = VmOptions {
            reference: c.image.clone(),
            env: c.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            workdir: c.workdir.clone(),
            user: c.user.clone(),
            hostname: c.hostname.clone(),
            cpus: c.cpus,
            memory_mib: c.memory_mib,
            disk_mib: c.disk_mib.unwrap_or(crate::disk::DEFAULT_MIB),
            accel: "auto".into(),
            root_device: c.root_device,
        };
        let node_state = match (&c.kernel, &c.initramfs) {
            (Some(k), Some(i)) => {
                // This node's own state, if it was set up: the accelerator when none is
                // asked for, and its module tree (receipts do not pin it yet).
                let own = kernel::read_node(&self.home).ok();
                kernel::NodeState {
                    kernel_release: String::new(),
                    kernel: k.clone(),
                    initramfs: i.clone(),
                    accel: c
                        .accel
                        .clone()
                        .or_else(|| own.as_ref().map(|s| s.accel.clone()))
                        .unwrap_or_else(|| "tcg".into()),
                    modules_env: own.and_then(|s| s.modules_env),
                }
            }
            _ => {
                let mut s = kernel::read_node(&self.home).map_err(LaunchError::from)?;
                if let Some(k) = &c.kernel {
                    s.kernel = k.clone();
                }
                if let Some(i) = &c.initramfs {
                    s.initramfs = i.clone();
                }
                if let Some(a) = &c.accel {
                    s.accel = a.clone();
                }
                s
            }
        };
        let (resolved, state, mut launch) =
            run::launch(&self.registry, &self.home, &opts, Some(node_state)).await?;
        launch.prefetch = c.prefetch;
        if let Some(n) = &c.network {
            launch.network = Some(n.clone());
            launch.boot.network = Some(crate::network::guest());
        }
        let (kernel_digest, initramfs_digest) = (state.kernel, state.initramfs);
        let base = request(
            &resolved.config,
            Vec::new(),
            &opts.env,
            c.workdir.as_deref(),
            c.user.as_deref(),
            &launch.boot.hostname,
            false,
        );
        let now = now_unix();
        let info = SandboxInfo {
            id: id.to_string(),
            image: c.image.clone(),
            image_digest: resolved.image_digest.clone(),
            env_digest: resolved.env.to_string(),
            status: SandboxStatus::Creating,
            reason: None,
            cpus: c.cpus,
            memory_mib: c.memory_mib,
            disk_mib: launch.shape.disk_mib,
            labels: c.labels.clone(),
            hostname: launch.boot.hostname.clone(),
            created_at: now,
            expires_at: c.lifetime_s.map(|s| now + s),
            idle_timeout_s: c.idle_timeout_s,
            kernel: kernel_digest,
            initramfs: initramfs_digest,
            accel: launch.shape.accel.clone(),
            parents: resolved.parents.clone(),
            state_bytes: None,
            network: c.network.as_ref().map(|n| crate::network::info(n, &[])),
        };
        let record = Record {
            info: info.clone(),
            launch,
            env: base.env,
            cwd: base.cwd,
            user: base.user,
        };
        let dir = sandboxes_dir(&self.home).join(id);
        std::fs::create_dir_all(&dir)
            .and_then(|()| {
                std::fs::write(
                    dir.join("sandbox.json"),
                    serde_json::to_vec_pretty(&record).expect("json"),
                )
            })
            .map_err(|e| NodeError::Internal(format!("writing {}: {e}", dir.display())))?;
        let control = tokio::sync::mpsc::channel(4);
        let entry = Arc::new(Entry {
            id: id.to_string(),
            info: Mutex::new(info),
            record,
            phase: tokio::sync::watch::channel(Phase::Creating).0,
            stop: tokio::sync::watch::channel(None).0,
            deadline: tokio::sync::watch::channel(
                c.lifetime_s
                    .map(|s| Instant::now() + Duration::from_secs(s)),
            )
            .0,
            last_active: Mutex::new(Instant::now()),
            busy: AtomicUsize::new(0),
            processes: Mutex::new(BTreeMap::new()),
            next_process: AtomicU32::new(1),
            control: control.0,
            control_rx: Mutex::new(Some(control.1)),
            snapshotting: tokio::sync::Mutex::new(()),
        });
        self.inner
            .lock()
            .unwrap()
            .live
            .insert(id.to_string(), entry.clone());
        Ok(entry)
    }

    fn entry(&self, id: &str) -> Result<Arc<Entry>, NodeError> {
        if !valid_id(id) {
            return Err(NodeError::NotFound(format!("{id:?} is not a sandbox id")));
        }
        let inner = self.inner.lock().unwrap();
        if let Some(e) = inner.live.get(id) {
            return Ok(e.clone());
        }
        match inner.ended.iter().rev().find(|i| i.id == id) {
            Some(info) => Err(NodeError::NotRunning {
                id: id.to_string(),
                status: status_name(info.status),
                reason: info.reason.clone().unwrap_or_default(),
            }),
            None => Err(NodeError::NotFound(format!("no sandbox {id} on this node"))),
        }
    }

    pub fn get(&self, id: &str) -> Result<SandboxInfo, NodeError> {
        match self.entry(id) {
            Ok(e) => Ok(e.info.lock().unwrap().clone()),
            Err(NodeError::NotRunning { .. }) => {
                let inner = self.inner.lock().unwrap();
                Ok(inner
                    .ended
                    .iter()
                    .rev()
                    .find(|i| i.id == id)
                    .cloned()
                    .expect("an ended sandbox"))
            }
            Err(e) => Err(e),
        }
    }

    /// Waits until the sandbox is no longer creating, or with `until_ended` until it has
    /// ended (its VM stopped and its reason known), or until `timeout` passed; its state.
    pub async fn wait(
        &self,
        id: &str,
        timeout: Duration,
        until_ended: bool,
    ) -> Result<SandboxInfo, NodeError> {
        if let Ok(e) = self.entry(id) {
            let mut phase = e.phase.subscribe();
            let done = |p: &Phase| {
                if until_ended {
                    matches!(p, Phase::Ended)
                } else {
                    p.settled()
                }
            };
            let _ = tokio::time::timeout(timeout, phase.wait_for(done)).await;
        }
        self.get(id)
    }

    /// Every live sandbox and the ended ones kept, those with all of `labels`.
    pub fn list(&self, labels: &[(String, String)], include_ended: bool) -> Vec<SandboxInfo> {
        let inner = self.inner.lock().unwrap();
        let mut out: Vec<SandboxInfo> = inner
            .live
            .values()
            .map(|e| e.info.lock().unwrap().clone())
            .collect();
        if include_ended {
            out.extend(inner.ended.iter().cloned());
        }
        drop(inner);
        out.retain(|i| {
            labels
                .iter()
                .all(|(k, v)| i.labels.get(k).is_some_and(|x| x == v))
        });
        out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        out
    }

    /// Ends a sandbox and returns once its VM has stopped.
    pub async fn delete(&self, id: &str) -> Result<SandboxInfo, NodeError> {
        let e = match self.entry(id) {
            Ok(e) => e,
            Err(NodeError::NotRunning { .. }) => return self.get(id),
            Err(e) => return Err(e),
        };
        let mut phase = e.phase.subscribe();
        e.stop.send_if_modified(|r| {
            if r.is_none() {
                *r = Some("deleted".into());
                true
            } else {
                false
            }
        });
        let _ = phase.wait_for(|p| matches!(p, Phase::Ended)).await;
        let info = e.info.lock().unwrap().clone();
        Ok(info)
    }

    /// Ends every live sandbox with all of `labels`; their ids.
    pub async fn delete_by_labels(&self, labels: &[(String, String)]) -> Vec<String> {
        let ids: Vec<String> = self.list(labels, false).into_iter().map(|i| i.id).collect();
        let ends = ids.iter().map(|id| self.delete(id));
        futures_util::future::join_all(ends).await;
        ids
    }

    /// Ends every sandbox (amberd stopping).
    pub async fn stop_all(&self, reason: &str) {
        let entries: Vec<Arc<Entry>> = self.inner.lock().unwrap().live.values().cloned().collect();
        for e in &entries {
            e.stop.send_if_modified(|r| {
                if r.is_none() {
                    *r = Some(reason.to_string());
                    true
                } else {
                    false
                }
            });
        }
        for e in entries {
            let mut phase = e.phase.subscribe();
            let _ = phase.wait_for(|p| matches!(p, Phase::Ended)).await;
        }
    }

    /// A new hard lifetime for the sandbox, counted from now.
    pub fn set_timeout(&self, id: &str, lifetime_s: u64) -> Result<SandboxInfo, NodeError> {
        if lifetime_s == 0 {
            return Err(bad("lifetime_s must be positive"));
        }
        let e = self.entry(id)?;
        e.deadline
            .send_replace(Some(Instant::now() + Duration::from_secs(lifetime_s)));
        let mut info = e.info.lock().unwrap();
        info.expires_at = Some(now_unix() + lifetime_s);
        Ok(info.clone())
    }

    /// The running sandbox (waiting while it boots), held busy while the answer lives.
    pub async fn running(&self, id: &str) -> Result<(Running, Activity), NodeError> {
        let e = self.entry(id)?;
        e.busy.fetch_add(1, Ordering::SeqCst);
        let activity = Activity(e.clone());
        let mut phase = e.phase.subscribe();
        let p = phase.wait_for(Phase::settled).await.map(|p| p.clone());
        match p {
            Ok(Phase::Running(r)) => Ok((r, activity)),
            _ => {
                let info = e.info.lock().unwrap().clone();
                Err(NodeError::NotRunning {
                    id: id.to_string(),
                    status: status_name(info.status),
                    reason: info.reason.unwrap_or_else(|| "it ended".into()),
                })
            }
        }
    }

    /// The guest request for `r` under the sandbox's defaults (the image's config).
    fn request(&self, id: &str, r: &ExecRequest) -> Result<(Request, Option<Vec<u8>>), NodeError> {
        let e = self.entry(id)?;
        let argv = match (&r.argv, &r.command) {
            (Some(a), None) if !a.is_empty() => a.clone(),
            (None, Some(c)) => vec!["/bin/sh".into(), "-c".into(), c.clone()],
            (Some(_), Some(_)) => return Err(bad("give argv or command, not both")),
            _ => {
                return Err(bad(
                    "give argv (a non-empty list) or command (a shell string)",
                ))
            }
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(bad("an argument holds a NUL byte"));
        }
        if let Some(t) = r.timeout_s {
            if !(t.is_finite() && t > 0.0 && t < 1e9) {
                return Err(bad(format!("timeout_s must be a positive number, not {t}")));
            }
        }
        for (k, v) in &r.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(bad(format!("{k:?} is not a valid environment variable")));
            }
        }
        let o = Request {
            argv,
            env: r.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            cwd: r.cwd.clone().unwrap_or_default(),
            user: r.user.clone().unwrap_or_default(),
            stdin: r.stdin.is_some(),
        };
        let req = e.defaults().apply(&o);
        Ok((req, r.stdin.clone().map(String::into_bytes)))
    }

    /// Starts a command; `background` ones are kept for `process` and `output`.
    pub async fn exec(
        &self,
        id: &str,
        r: &ExecRequest,
        background: bool,
    ) -> Result<(Arc<Process>, Activity), NodeError> {
        let (req, stdin) = self.request(id, r)?;
        let (running, activity) = self.running(id).await?;
        let timeout = r.timeout_s.map(Duration::from_secs_f64);
        let e = self.entry(id)?;
        let pid = e.next_process.fetch_add(1, Ordering::Relaxed);
        let (bound, retain) = if background {
            (PROCESS_OUTPUT_BOUND, Retain::Tail)
        } else {
            (EXEC_OUTPUT_BOUND, Retain::Head)
        };
        let p = Process::spawn(
            pid,
            &running.mux,
            running.device.clone(),
            req,
            stdin,
            timeout,
            bound,
            retain,
            Box::pin(e.clone().end_reason()),
        );
        if background {
            let mut procs = e.processes.lock().unwrap();
            procs.insert(pid, p.clone());
            while procs.len() > PROCESSES_KEPT {
                let Some(old) = procs.iter().find(|(_, p)| p.ended()).map(|(k, _)| *k) else {
                    break;
                };
                procs.remove(&old);
            }
        }
        Ok((p, activity))
    }

    pub fn process(&self, id: &str, pid: u32) -> Result<Arc<Process>, NodeError> {
        let e = self.entry(id)?;
        let p = e.processes.lock().unwrap().get(&pid).cloned();
        *e.last_active.lock().unwrap() = Instant::now();
        p.ok_or_else(|| NodeError::NotFound(format!("no process {pid} in sandbox {id}")))
    }

    pub fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, NodeError> {
        let e = self.entry(id)?;
        let procs = e.processes.lock().unwrap();
        Ok(procs.values().map(|p| p.info()).collect())
    }

    /// Commits the sandbox's files as a new image (its image and one layer of what it
    /// changed, frozen at one instant); the sandbox keeps running. With `wait`, answers
    /// once the registry has converted it.
    pub async fn snapshot(&self, id: &str, r: &CreateSnapshot) -> Result<SnapshotInfo, NodeError> {
        let (running, _activity) = self.running(id).await?;
        let e = self.entry(id)?;
        let info = e.info.lock().unwrap().clone();
        if info.disk_mib == 0 {
            return Err(bad(format!(
                "sandbox {id} keeps its writes in guest memory (created with disk_mib 0): a snapshot needs its writable disk"
            )));
        }
        let (Some(image_digest), Ok(amber_oci::reference::ImageRef::Image(name))) = (
            info.image_digest.as_deref(),
            amber_oci::reference::ImageRef::parse(&info.image),
        ) else {
            return Err(bad(format!(
                "sandbox {id} was created from an env digest ({}): a snapshot is a layer on an image; create the sandbox from name:tag or name@sha256:…",
                info.image
            )));
        };
        if running.protocol < amber_guest::SNAPSHOT_PROTOCOL {
            return Err(bad(format!(
                "sandbox {id}'s guest agent speaks protocol {}, which has no snapshots (version {} and later do): it boots an older initramfs",
                running.protocol,
                amber_guest::SNAPSHOT_PROTOCOL
            )));
        }
        let image_digest: amber_oci::digest::Digest = image_digest
            .parse()
            .map_err(|e| NodeError::Internal(format!("sandbox {id}'s image digest: {e}")))?;
        let base_repo = name.repository.to_string();
        let target = snapshot::target(&self.registry, &base_repo, r.tag.as_deref())?;
        let started = Instant::now();
        let file = sandboxes_dir(&self.home).join(id).join(format!(
            "snapshot-{}.tar.gz",
            run::new_id().map_err(|e| NodeError::Internal(e.to_string()))?
        ));
        let layer = {
            // The guest freezes its disk for one snapshot at a time.
            let _one_at_a_time = e.snapshotting.lock().await;
            snapshot::take_layer(&running.mux, &file).await?
        };
        let frozen_ms = started.elapsed().as_millis() as u64;
        let base = snapshot::Base {
            repository: &base_repo,
            image_digest: &image_digest,
            env_digest: &info.env_digest,
            parents: &info.parents,
        };
        let committed = snapshot::commit(&self.registry, &base, &layer, &target, id).await;
        let _ = std::fs::remove_file(&file);
        let committed = committed?;
        let pushed_ms = started.elapsed().as_millis() as u64;
        let (env_digest, converted_ms) = if r.wait {
            let resolved = crate::image::resolve(
                &self.registry,
                &committed.reference,
                Duration::from_secs(600),
            )
            .await
            .map_err(|e| NodeError::from(LaunchError::from(e)))?;
            (
                Some(resolved.env.to_string()),
                Some(started.elapsed().as_millis() as u64),
            )
        } else {
            (None, None)
        };
        Ok(SnapshotInfo {
            sandbox: id.to_string(),
            image: committed.reference,
            tag: committed.tag,
            image_digest: committed.image_digest.to_string(),
            env_digest,
            layer_digest: layer.digest.to_string(),
            layer_bytes: layer.size,
            diff_bytes: layer.diff_bytes,
            frozen_ms,
            pushed_ms,
            converted_ms,
            parents: committed.parents,
        })
    }

    /// Saves the running sandbox to a file on this node and stops its VM (see
    /// `Sandbox::pause`); its vCPUs and memory are free until `resume`. Commands and
    /// copies in progress end with an error.
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, NodeError> {
        if self.get(id)?.status == SandboxStatus::Paused {
            return Err(bad(format!("sandbox {id} is already paused")));
        }
        let (running, activity) = self.running(id).await?;
        drop(activity);
        if running.protocol < amber_guest::SNAPSHOT_PROTOCOL {
            return Err(bad(format!(
                "sandbox {id}'s guest agent speaks protocol {}, which cannot pause (version {} and later can): it boots an older initramfs",
                running.protocol,
                amber_guest::SNAPSHOT_PROTOCOL
            )));
        }
        self.control(id, Control::Pause).await
    }

    /// Continues a paused sandbox where it was (429 when the node has no room for its
    /// vCPUs and memory now).
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, NodeError> {
        self.control(id, Control::Resume).await
    }

    async fn control(
        &self,
        id: &str,
        make: fn(tokio::sync::oneshot::Sender<Result<SandboxInfo, NodeError>>) -> Control,
    ) -> Result<SandboxInfo, NodeError> {
        let e = self.entry(id)?;
        let gone = || NodeError::NotRunning {
            id: id.to_string(),
            status: "stopped",
            reason: "it ended".into(),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        e.control.send(make(tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Starts fetching `image`'s env into the node's cache, ahead of any sandbox booting
    /// it; its progress arrives on the returned channel, ending with `done` or `error`.
    /// The image is resolved and the env's manifest read before this returns, so a
    /// reference that names nothing is an error here, not a frame. Dropping the receiver
    /// (the client went away) stops the fetching.
    pub async fn prefetch(
        &self,
        image: &str,
    ) -> Result<tokio::sync::mpsc::Receiver<PrefetchFrame>, NodeError> {
        let env = self.env_of(image).await?;
        let first = self.cached(&env).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let _ = tx.try_send(PrefetchFrame::Progress {
            cache: first,
            fetched_bytes: 0,
        });
        let exports = self.exports.clone();
        let running = self.work();
        tokio::spawn(async move {
            let _running = running;
            let mut last = Instant::now();
            let fetching = exports.prefetch(&env, |fetched_bytes| {
                // Progress is a sample: a frame the client has not read yet is not queued
                // behind (the next one says more), but a closed channel ends the fetch.
                if last.elapsed() >= PREFETCH_PROGRESS_EVERY {
                    last = Instant::now();
                    let cache = exports
                        .cached(&env)
                        .expect("an env being prefetched is known");
                    let _ = tx.try_send(PrefetchFrame::Progress {
                        cache,
                        fetched_bytes,
                    });
                }
            });
            let end = tokio::select! {
                r = fetching => match r {
                    Ok(fetched_bytes) => PrefetchFrame::Done {
                        cache: exports.cached(&env).expect("an env being prefetched is known"),
                        fetched_bytes,
                    },
                    Err(e) => PrefetchFrame::Error {
                        kind: match &e {
                            ExportError::Prefetch { source, .. }
                                if matches!(**source, CacheError::Integrity { .. }) =>
                            {
                                ErrorKind::Integrity
                            }
                            _ => ErrorKind::Unavailable,
                        },
                        message: e.to_string(),
                    },
                },
                () = tx.closed() => return,
            };
            let _ = tx.send(end).await;
        });
        Ok(rx)
    }

    /// The node's capacity, what is used, and what its cache holds (of `image` too).
    pub async fn info(&self, image: Option<&str>) -> Result<NodeInfo, NodeError> {
        // A node that was never set up still serves sandboxes whose boot files are pinned.
        let accel = kernel::read_node(&self.home).map_or_else(|_| "not set up".into(), |s| s.accel);
        let (n, cpus, mem) = self.inner.lock().unwrap().used;
        let l = &self.limits;
        let image = match image {
            Some(r) => Some(self.cached(&self.env_of(r).await?).await?),
            None => None,
        };
        let mut envs = Vec::new();
        for env in self.exports.known_envs() {
            if let Some(c) = self.exports.cached(&env) {
                envs.push(c);
            }
        }
        Ok(NodeInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            api: "v1".into(),
            registry: self.registry.base().to_string(),
            accel,
            capacity: Resources {
                sandboxes: l.sandboxes,
                cpus: l.cpus,
                memory_mib: l.memory_mib,
            },
            used: Resources {
                sandboxes: n,
                cpus,
                memory_mib: mem,
            },
            free: Resources {
                sandboxes: l.sandboxes - n,
                cpus: l.cpus - cpus,
                memory_mib: l.memory_mib - mem,
            },
            cache_bytes: self.exports.cache().bytes(),
            cache_limit_bytes: crate::exports::NODE_CACHE_BYTES,
            envs,
            image,
        })
    }

    /// The env `reference` names: resolved through the registry, once for a reference
    /// pinned by digest (an env digest is its own answer).
    async fn env_of(&self, reference: &str) -> Result<amber_oci::env::EnvDigest, NodeError> {
        use amber_oci::reference::ImageRef;
        let pinned = match ImageRef::parse(reference) {
            Ok(ImageRef::Image(n)) => n.digest.is_some(),
            _ => false,
        };
        if let Some(env) = self.pinned_envs.lock().unwrap().get(reference) {
            return Ok(*env);
        }
        let resolved = crate::image::resolve(&self.registry, reference, Duration::from_secs(0))
            .await
            .map_err(|e| NodeError::from(LaunchError::from(e)))?;
        if pinned {
            let mut known = self.pinned_envs.lock().unwrap();
            if known.len() >= PINNED_ENVS_KEPT {
                known.clear();
            }
            known.insert(reference.to_string(), resolved.env);
        }
        Ok(resolved.env)
    }

    async fn cached(&self, env: &amber_oci::env::EnvDigest) -> Result<CachedEnv, NodeError> {
        if let Some(c) = self.exports.cached(env) {
            return Ok(c);
        }
        // An env this node never served: nothing of it is cached, but say how big it is.
        self.exports.learn(env).await.map_err(|e| match e {
            ExportError::EnvNotFound { .. } => NodeError::ImageNotFound(e.to_string()),
            e => NodeError::Unavailable(e.to_string()),
        })?;
        self.exports
            .cached(env)
            .ok_or_else(|| NodeError::Internal(format!("env {env} was not learned")))
    }
}

/// A prefetch's progress frames come at most this often (its first and last always).
const PREFETCH_PROGRESS_EVERY: Duration = Duration::from_millis(200);

/// The one task that owns a sandbox's VM, from boot to stop.
async fn lifecycle(node: Arc<Node>, e: Arc<Entry>) {
    let dir = sandboxes_dir(&node.home).join(&e.id);
    let mut control = e
        .control_rx
        .lock()
        .unwrap()
        .take()
        .expect("one lifecycle per sandbox");
    let mut stop = e.stop.subscribe();
    let started = tokio::select! {
        s = Sandbox::start(&node.exports, dir.join("vm"), &e.record.launch) => Some(s),
        _ = stop.wait_for(Option::is_some) => None,
    };
    let (status, reason) = match started {
        None => (
            SandboxStatus::Stopped,
            e.stop.borrow().clone().unwrap_or_default(),
        ),
        Some(Err(err)) => (SandboxStatus::Failed, err.to_string()),
        Some(Ok(sandbox)) => run(&node, &e, &dir, sandbox, &mut control).await,
    };
    let _ = std::fs::remove_dir_all(&dir);
    let info = {
        let mut info = e.info.lock().unwrap();
        info.status = status;
        info.reason = Some(reason);
        info.state_bytes = None;
        info.clone()
    };
    node.release(&info);
    {
        let mut inner = node.inner.lock().unwrap();
        inner.live.remove(&e.id);
    }
    node.remember_ended(info);
    e.phase.send_replace(Phase::Ended);
    node.changed.notify_waiters();
}

/// Serves a started sandbox until it ends (its final status and reason), pausing and
/// resuming it when asked.
async fn run(
    node: &Node,
    e: &Entry,
    dir: &Path,
    mut sandbox: Sandbox,
    control: &mut tokio::sync::mpsc::Receiver<Control>,
) -> (SandboxStatus, String) {
    loop {
        if let Some(pid) = sandbox.vm.pid() {
            let _ = std::fs::write(dir.join("vm/qemu.pid"), pid.to_string());
        }
        {
            let mut info = e.info.lock().unwrap();
            info.status = SandboxStatus::Running;
            info.reason = None;
            info.state_bytes = None;
            if let Some(n) = &e.record.launch.network {
                info.network = Some(crate::network::info(n, sandbox.published()));
            }
        }
        e.phase.send_replace(Phase::Running(Running {
            mux: sandbox.vm.mux.clone(),
            device: sandbox.device().clone(),
            defaults: Arc::new(e.defaults()),
            protocol: sandbox.vm.protocol,
        }));
        let reply = match watch(e, &mut sandbox, control).await {
            Ended::Asked(reason) => {
                sandbox.shutdown().await;
                return (SandboxStatus::Stopped, reason);
            }
            Ended::VmExited(how) => {
                let console = sandbox.vm.console_tail();
                let integrity = sandbox.integrity_failure();
                sandbox.stop().await;
                let reason = match integrity {
                    Some(i) => format!("{i}"),
                    None => format!("the VM exited ({how}); console:\n{console}"),
                };
                return (SandboxStatus::Failed, reason);
            }
            Ended::Pause(reply) => reply,
        };
        e.phase.send_replace(Phase::Busy);
        let _ = std::fs::remove_file(dir.join("vm/qemu.pid"));
        let paused = match sandbox.pause().await {
            Ok(p) => p,
            Err(err) => {
                let reason = format!("pausing it failed, and the VM was stopped: {err}");
                let _ = reply.send(Err(NodeError::Internal(reason.clone())));
                return (SandboxStatus::Failed, reason);
            }
        };
        let info = {
            let mut info = e.info.lock().unwrap();
            info.status = SandboxStatus::Paused;
            info.reason = Some("resume it to run commands".into());
            info.state_bytes = Some(paused.state_bytes());
            info.clone()
        };
        // Its vCPUs and memory are free while no QEMU runs; its place stays taken.
        node.release_room(&info, false);
        e.phase.send_replace(Phase::Paused);
        let _ = reply.send(Ok(info.clone()));
        let reply = loop {
            match hold(e, control).await {
                Held::Asked(reason) => {
                    paused.discard();
                    // The end releases vCPUs and memory with the place: count them again
                    // (past the limits if need be: they are released at once).
                    let (cpus, mem) = (info.cpus, info.memory_mib as u64);
                    let mut inner = node.inner.lock().unwrap();
                    inner.used.1 += cpus;
                    inner.used.2 += mem;
                    return (SandboxStatus::Stopped, reason);
                }
                Held::Resume(reply) => {
                    let room = {
                        let mut inner = node.inner.lock().unwrap();
                        node.reserve_room(&mut inner, 0, info.cpus, info.memory_mib)
                    };
                    match room {
                        Ok(()) => break reply,
                        Err(err) => {
                            let _ = reply.send(Err(err));
                        }
                    }
                }
            }
        };
        e.phase.send_replace(Phase::Busy);
        sandbox = match paused.resume().await {
            Ok(s) => s,
            Err(err) => {
                let reason = format!("resuming it failed: {err}");
                let _ = reply.send(Err(NodeError::Unavailable(reason.clone())));
                return (SandboxStatus::Failed, reason);
            }
        };
        let mut info = e.info.lock().unwrap().clone();
        info.status = SandboxStatus::Running;
        info.reason = None;
        info.state_bytes = None;
        let _ = reply.send(Ok(info));
    }
}

enum Ended {
    Asked(String),
    VmExited(String),
    Pause(tokio::sync::oneshot::Sender<Result<SandboxInfo, NodeError>>),
}

enum Held {
    Asked(String),
    Resume(tokio::sync::oneshot::Sender<Result<SandboxInfo, NodeError>>),
}

fn lifetime_ended(e: &Entry) -> String {
    let secs = e
        .record
        .info
        .expires_at
        .unwrap_or(0)
        .saturating_sub(e.record.info.created_at);
    format!("its hard lifetime ended ({secs} s after it was created, or as last set)")
}

/// Waits for the sandbox's end: a stop, its lifetime, its idle timeout, or its VM dying;
/// or for a request to pause it.
async fn watch(
    e: &Entry,
    sandbox: &mut Sandbox,
    control: &mut tokio::sync::mpsc::Receiver<Control>,
) -> Ended {
    let mut stop = e.stop.subscribe();
    let mut deadline = e.deadline.subscribe();
    let idle = e.record.info.idle_timeout_s.map(Duration::from_secs);
    loop {
        let until = *deadline.borrow_and_update();
        let idle_at = idle.map(|d| *e.last_active.lock().unwrap() + d);
        tokio::select! {
            // A VM that died says so even when a stop was asked at the same moment (a
            // client whose command was cut short asks for the end and its reason).
            biased;
            status = sandbox.vm.wait() => {
                return Ended::VmExited(match status {
                    Ok(s) => s.to_string(),
                    Err(err) => err.to_string(),
                });
            }
            _ = stop.wait_for(Option::is_some) => {
                return Ended::Asked(e.stop.borrow().clone().unwrap_or_default());
            }
            _ = deadline.changed() => continue,
            _ = sleep_until(until) => return Ended::Asked(lifetime_ended(e)),
            _ = sleep_until(idle_at) => {
                let last = *e.last_active.lock().unwrap();
                if e.busy.load(Ordering::SeqCst) == 0 && last.elapsed() >= idle.unwrap_or_default() {
                    return Ended::Asked(format!(
                        "idle for {} s (its idle timeout)",
                        idle.unwrap_or_default().as_secs()
                    ));
                }
            }
            Some(c) = control.recv() => match c {
                Control::Pause(reply) => return Ended::Pause(reply),
                Control::Resume(reply) => {
                    let _ = reply.send(Err(bad(format!("sandbox {} is running, not paused", e.id))));
                }
            },
        }
    }
}

/// Waits, while the sandbox is paused, for a request to resume it or for its end (a
/// stop or its hard lifetime; a paused sandbox is not idle, it was put away).
async fn hold(e: &Entry, control: &mut tokio::sync::mpsc::Receiver<Control>) -> Held {
    let mut stop = e.stop.subscribe();
    let mut deadline = e.deadline.subscribe();
    loop {
        let until = *deadline.borrow_and_update();
        tokio::select! {
            _ = stop.wait_for(Option::is_some) => {
                return Held::Asked(e.stop.borrow().clone().unwrap_or_default());
            }
            _ = deadline.changed() => continue,
            _ = sleep_until(until) => return Held::Asked(lifetime_ended(e)),
            Some(c) = control.recv() => match c {
                Control::Resume(reply) => return Held::Resume(reply),
                Control::Pause(reply) => {
                    let _ = reply.send(Err(bad(format!("sandbox {} is already paused", e.id))));
                }
            },
        }
    }
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

/// Stops the QEMU a dead amberd left in `vm_dir`, if it still runs; its pid.
async fn stop_leftover_qemu(vm_dir: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(vm_dir.join("qemu.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    // Only a QEMU whose command line names this sandbox's directory is ours: a pid may
    // have been reused since.
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let needle = vm_dir.to_string_lossy();
    if !String::from_utf8_lossy(&cmdline).contains(needle.as_ref()) {
        return None;
    }
    // SAFETY: signalling a process we identified as this sandbox's QEMU.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // It is not our child: wait for /proc to lose it (bounded).
    for _ in 0..500 {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            break;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.contains(") Z ") {
            break; // a zombie of a parent that does not reap: it runs no more
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Some(pid)
}
