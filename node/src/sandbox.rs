//! A sandbox: one microVM booted on its env's shared, lazy, verified NBD export
//! (`exports`), and the relay that carries an attached client's guest-protocol sessions
//! (`amber exec` with stdin and signals, `amber cp`) to it. `service` owns the sandboxes
//! of a node; `run` boots one in-process for benchmarks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use amber_converter::manifest::EnvDigest;
use amber_guest::{Boot, ERROR, EXEC, EXIT, GET, PUT};
use amber_snapshotter::cache::CacheError;
use amber_snapshotter::device::LazyDevice;
use serde::{Deserialize, Serialize};

use crate::command::ExecDefaults;
use crate::disk::{self, DiskError};
use crate::exports::{Export, ExportError, Exports};
use crate::mux::{Mux, SessionTx};
use crate::network::{Network, NetworkError};
use crate::receipt;
use crate::vm::{Root, Vm, VmError, VmSpec};
use amber_netstack::Netstack;

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
    /// The env of the kernel's module tree, attached as a read-only disk the agent loads
    /// modules from (`kernel.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modules: Option<EnvDigest>,
    /// The sandbox's network (`boot.network` says how the guest sets it up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<amber_api::node::NetworkSpec>,
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
    /// A chunk of the env failed verification while the guest booted.
    #[error("{0}")]
    Integrity(Arc<CacheError>),
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    Network(#[from] NetworkError),
    #[error("the sandbox's network: {0}")]
    Net(#[from] amber_netstack::NetError),
    #[error("the VM failed to start: {0}")]
    Vm(VmError),
}

impl From<VmError> for StartError {
    fn from(e: VmError) -> StartError {
        StartError::Vm(e)
    }
}

/// A running sandbox: its VM, the env export feeding it (and the module tree's), its
/// network and its work directory.
pub struct Sandbox {
    pub vm: Vm,
    export: Arc<Export>,
    modules: Option<Arc<Export>>,
    net: Option<Netstack>,
    work: PathBuf,
    spec: VmSpec,
}

/// A sandbox saved by `Sandbox::pause`: no QEMU runs; its memory and devices are in
/// `state`, its writable disk where it was (`work`), and its env's export stays open.
pub struct Paused {
    export: Arc<Export>,
    modules: Option<Arc<Export>>,
    /// Runs on while paused: the guest's connections are there when it resumes.
    net: Option<Netstack>,
    work: PathBuf,
    spec: VmSpec,
    protocol: u32,
    pub state: PathBuf,
}

impl Paused {
    /// Bytes of the saved VM state.
    pub fn state_bytes(&self) -> u64 {
        std::fs::metadata(&self.state).map_or(0, |m| m.len())
    }

    /// Starts the VM again where it was paused; the state file is removed once it runs.
    /// On an error nothing is left of the sandbox.
    pub async fn resume(self) -> Result<Sandbox, StartError> {
        match Vm::restore(&self.spec, &self.state, self.protocol).await {
            Ok(vm) => {
                let _ = std::fs::remove_file(&self.state);
                Ok(Sandbox {
                    vm,
                    export: self.export,
                    modules: self.modules,
                    net: self.net,
                    work: self.work,
                    spec: self.spec,
                })
            }
            Err(e) => {
                self.discard();
                Err(StartError::Vm(e))
            }
        }
    }

    /// Removes what is left of the sandbox (its state, its disk).
    pub fn discard(self) {
        let _ = std::fs::remove_dir_all(&self.work);
    }
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
        match Self::boot(exports, &work, l).await {
            Ok((export, modules, vm, spec, net)) => Ok(Sandbox {
                vm,
                export,
                modules,
                net,
                work,
                spec,
            }),
            Err(e) => {
                // Whatever failed, nothing of the sandbox stays on the node.
                let _ = std::fs::remove_dir_all(&work);
                Err(e)
            }
        }
    }

    /// Everything `start` does inside the work directory: the export, the optional
    /// prefetch, the writable disk and the VM.
    async fn boot(
        exports: &Exports,
        work: &std::path::Path,
        l: &Launch,
    ) -> Result<
        (
            Arc<Export>,
            Option<Arc<Export>>,
            Vm,
            VmSpec,
            Option<Netstack>,
        ),
        StartError,
    > {
        // The network first: QEMU connects to its link as it starts.
        let net = match &l.network {
            Some(spec) => {
                let n = Network::parse(spec)?;
                let link = work.join("net.sock");
                Some(Netstack::start(&link, n.policy, &n.publish).await?)
            }
            None => None,
        };
        let export = exports.export(&l.env).await?;
        let modules = match &l.modules {
            Some(m) => Some(exports.export(m).await?),
            None => None,
        };
        if l.prefetch {
            exports.prefetch(&l.env, |_| {}).await?;
        }
        let disk = if l.shape.disk_mib > 0 {
            let p = work.join("disk.img");
            // mkfs is a process and file I/O: off the runtime's worker threads.
            let (path, mib) = (p.clone(), l.shape.disk_mib);
            tokio::task::spawn_blocking(move || disk::create(&path, mib))
                .await
                .expect("making a disk does not panic")?;
            Some(p)
        } else {
            None
        };
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
            disk,
            net: net.as_ref().map(|_| work.join("net.sock")),
            modules: modules.as_ref().map(|m| m.socket.clone()),
            work: work.to_path_buf(),
        };
        match Vm::boot(&spec, &l.boot).await {
            Ok(vm) => Ok((export, modules, vm, spec, net)),
            Err(e) => Err(match export.device.integrity_failure() {
                Some(i) => StartError::Integrity(i),
                None => StartError::Vm(e),
            }),
        }
    }

    /// The first chunk of this sandbox's env that failed verification, if any did: the
    /// guest got an I/O error instead of its bytes.
    pub fn integrity_failure(&self) -> Option<Arc<CacheError>> {
        self.export.device.integrity_failure()
    }

    /// Where the host reaches the sandbox's published ports.
    pub fn published(&self) -> &[amber_netstack::Published] {
        self.net.as_ref().map_or(&[], |n| n.published.as_slice())
    }

    /// The lazy device the VM's root reads.
    pub fn device(&self) -> &Arc<LazyDevice> {
        &self.export.device
    }

    /// Saves the VM into its work directory and stops QEMU (see `Vm::pause`). On an
    /// error the VM is gone and nothing is left of the sandbox.
    pub async fn pause(self) -> Result<Paused, VmError> {
        let Sandbox {
            vm,
            export,
            modules,
            net,
            work,
            spec,
        } = self;
        let protocol = vm.protocol;
        let state = work.join("vm.state");
        match vm.pause(&state).await {
            Ok(()) => Ok(Paused {
                export,
                modules,
                net,
                work,
                spec,
                protocol,
                state,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&work);
                Err(e)
            }
        }
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

/// Relays one client's sessions (an attached `amber exec` or `amber cp`) to fresh VM
/// sessions and back, until the client or the VM closes its stream.
///
/// An `EXEC` from the client names overrides (`ExecDefaults::apply`): the sandbox's own
/// environment, directory and user fill in the rest.
pub async fn relay<S>(conn: S, vm: Mux, device: Arc<LazyDevice>, defaults: Arc<ExecDefaults>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (client, mut incoming) = Mux::new(conn);
    let mut vm_gone = vm.closed();
    let mut open: HashMap<u32, SessionTx> = HashMap::new();
    // The session forwarders end with this relay (dropping the set aborts them).
    let mut forwarders = tokio::task::JoinSet::new();
    loop {
        let f = tokio::select! {
            f = incoming.recv() => match f {
                Some(f) => f,
                None => break,
            },
            _ = &mut vm_gone => break,
        };
        if f.session == 0 {
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
            let payload = match f.kind {
                EXEC => match serde_json::from_slice::<amber_guest::Request>(&f.payload) {
                    Ok(o) => serde_json::to_vec(&defaults.apply(&o)).expect("json"),
                    Err(_) => f.payload,
                },
                _ => f.payload,
            };
            let _ = tx.send(f.kind, &payload).await;
        }
    }
    drop(forwarders);
    client.shutdown().await;
}
