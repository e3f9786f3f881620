//! One-shot work on this node: resolving a reference and the node's boot files into a
//! `Launch`, and booting it to run one command (`amber run`, `amber reproduce`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use amber_guest::{Boot, Request};
use amber_snapshotter::source::RegistryClient;

use crate::exports::Exports;
use crate::image;
use crate::kernel::{self, BootFileError, NodeState};
use crate::receipt;
use crate::sandbox::{Launch, Sandbox};
use crate::session::{self, Outcome};

/// How the VM is shaped and how its command runs (`amber run` and `amber create`).
#[derive(Clone, Debug)]
pub struct VmOptions {
    /// name:tag, name@sha256:…, or an env digest blake3:…
    pub reference: String,
    pub env: Vec<String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub hostname: Option<String>,
    pub cpus: u32,
    pub memory_mib: u32,
    /// The writable disk in MiB (`disk`); 0 keeps writes in guest memory.
    pub disk_mib: u32,
    /// `auto` (what `amber setup`'s probe found), `kvm` or `tcg`.
    pub accel: String,
    pub root_device: bool,
}

/// Why a reference and this node's boot files did not make a launch.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    BootFile(#[from] BootFileError),
    #[error(transparent)]
    Image(#[from] image::ImageError),
}

/// Resolves the reference and the node's boot files into a launch: those `amber setup`
/// chose, or exactly `pins` (a receipt's), which need no set-up node.
pub async fn launch(
    registry: &RegistryClient,
    node: &Path,
    a: &VmOptions,
    pins: Option<NodeState>,
) -> Result<(image::Resolved, NodeState, Launch), LaunchError> {
    let state = match pins {
        Some(p) => p,
        None => kernel::read_node(node)?,
    };
    let resolved = image::resolve(registry, &a.reference, Duration::from_secs(600)).await?;
    let hostname = a
        .hostname
        .clone()
        .unwrap_or_else(|| resolved.env.hex()[..12].to_string());
    let accel = if a.accel == "auto" {
        state.accel.clone()
    } else {
        a.accel.clone()
    };
    let page_reporting_order = crate::vm::page_reporting_order(&accel);
    let l = Launch {
        registry: registry.base().to_string(),
        env: resolved.env,
        kernel: kernel::boot_file(node, registry, &state.kernel, "kernel").await?,
        initramfs: kernel::boot_file(node, registry, &state.initramfs, "initramfs").await?,
        shape: receipt::Vm {
            accel,
            cpus: a.cpus,
            memory_mib: a.memory_mib,
            disk_mib: a.disk_mib,
        },
        boot: Boot {
            hostname,
            root_device: a.root_device,
            page_reporting_order,
            writable_disk: a.disk_mib > 0,
            network: None,
        },
        prefetch: false,
        root_image: None,
        network: None,
        modules: state.modules_env.as_deref().and_then(|m| m.parse().ok()),
    };
    Ok((resolved, state, l))
}

pub fn work_dir(node: &Path) -> anyhow::Result<PathBuf> {
    Ok(node.join("run").join(new_id()?))
}

pub fn new_id() -> anyhow::Result<String> {
    let mut b = [0u8; 6];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut b)?;
    Ok(hex::encode(b))
}

/// Boots `l`, runs `req` in it, and stops it; output passes through unchanged.
pub async fn boot_and_exec(
    node: &Path,
    registry: &RegistryClient,
    l: &Launch,
    req: &Request,
    timeout: Option<Duration>,
) -> anyhow::Result<Outcome> {
    let exports = Exports::open(node, registry).await?;
    let sandbox = Sandbox::start(&exports, work_dir(node)?, l).await?;
    let s = sandbox.vm.mux.open();
    let stdin: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>> = if req.stdin {
        Some(Box::new(tokio::io::stdin()))
    } else {
        None
    };
    let exec = session::exec(s, req, stdin, tokio::io::stdout(), tokio::io::stderr());
    let result = match timeout {
        Some(t) => tokio::time::timeout(t, exec)
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("timed out after {}s", t.as_secs()))),
        None => exec.await,
    };
    let integrity = sandbox.integrity_failure();
    let console = sandbox.vm.console_tail();
    sandbox.stop().await;
    if let Some(e) = integrity {
        anyhow::bail!("{e}");
    }
    result.map_err(|e| {
        if e.is::<session::Stopped>() {
            e.context(format!("console:\n{console}"))
        } else {
            e
        }
    })
}
