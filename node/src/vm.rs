//! One microVM: QEMU `-M microvm` booting the pinned kernel and the initramfs, with the
//! env's lazy NBD export as its root disk and a virtio-serial control port that carries
//! the guest protocol (amber_guest) as sessions (`mux`); a QMP socket (`qmp`) to pause
//! it into a file and restore it from one.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use amber_guest::{
    Boot, BOOT, ENV_DISK_SERIAL, ERROR, EXIT, MODULES_DISK_SERIAL, PAUSE, QUIESCED, READY, RESUME,
    SHUTDOWN, WRITABLE_DISK_SERIAL,
};
use serde_json::json;

use crate::mux::Mux;
use crate::qmp::{Qmp, QmpError};

/// Why a VM did not come up.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("the guest agent did not answer the pause within {0} s")]
    NotQuiesced(u64),
    #[error("starting {qemu} (run `amber setup`): {source}")]
    Spawn {
        qemu: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU exited with {status} before the VM started: {stderr}")]
    QemuExited {
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("QEMU did not listen on {} within {} s", .0.display(), SOCKET_WAIT.as_secs())]
    NoSocket(PathBuf),
    #[error("talking to the guest agent: {0}")]
    Io(#[from] std::io::Error),
    #[error("the guest could not start the sandbox: {0}")]
    Guest(String),
    /// The agent speaks a protocol version this host cannot drive.
    #[error("{0}")]
    Protocol(String),
    #[error("the VM stopped while booting; console:\n{0}")]
    Stopped(String),
}

#[derive(Clone)]
pub struct VmSpec {
    pub qemu: PathBuf,
    pub accel: String,
    pub cpus: u32,
    pub memory_mib: u32,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub root: Root,
    /// The sandbox's writable disk (`disk`), attached after the root so the root stays
    /// the guest's /dev/vda (what agents before the writable disk mount).
    pub disk: Option<PathBuf>,
    /// The netstack's link socket, when the sandbox has a network (`network`).
    pub net: Option<PathBuf>,
    /// The NBD socket of the kernel module tree's export (`kernel.rs`).
    pub modules: Option<PathBuf>,
    pub work: PathBuf,
}

/// Where the VM's root disk comes from.
#[derive(Clone)]
pub enum Root {
    /// The env's lazy, verified NBD export (the product path).
    Nbd(PathBuf),
    /// A local raw image file (for benchmarks against the lazy path).
    RawFile(PathBuf),
}

/// QEMU's `-accel` for `accel`. TCG's translated code goes into a buffer that grows up
/// to 1 GiB by default; an idle sandbox touched about 50 MiB of it just booting. A bound
/// keeps idle sandboxes small (hot code is translated again when it is evicted).
pub fn accel_arg(accel: &str) -> String {
    match accel {
        "tcg" => format!("tcg,tb-size={}", tcg_tb_mib()),
        other => other.to_string(),
    }
}

/// MiB of TCG translation buffer per VM: `AMBER_TCG_TB_MIB` (at least 4), default 16.
/// Measured with `exec true` in a busybox sandbox (p50 through the node API): 8 MiB
/// thrashes (235 ms, every exec translates the kernel's fork and exec paths again), 16
/// and 32 MiB both 10-12 ms; all of it stays resident, so 16 is 16 MiB less per sandbox.
fn tcg_tb_mib() -> u32 {
    std::env::var("AMBER_TCG_TB_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 4)
        .unwrap_or(16)
}

/// Whether guest memory is backed by small host pages: under TCG nothing gains from huge
/// pages, and the guest then hands back memory it frees in any size (see
/// [`page_reporting_order`]); under KVM huge pages back the guest's page tables and the
/// guest reports whole 2 MiB blocks only.
fn small_pages(accel: &str) -> bool {
    accel == "tcg"
}

/// The order of the smallest free block the guest reports to the host (`Boot`): 0 (4 KiB)
/// on small host pages, the kernel's default (2 MiB) otherwise. Measured on an idle
/// 512 MiB busybox sandbox under TCG: 107 MiB of guest memory resident on the host with
/// the default, 94 MiB with 0 (free memory the guest had touched while booting, in pieces
/// under 2 MiB).
pub fn page_reporting_order(accel: &str) -> Option<u32> {
    small_pages(accel).then_some(0)
}

/// QEMU's `-M`. Under TCG the emulated i8254 PIT keeps a QEMU timer firing about 37 times
/// a second in an idle VM (the guest uses its LAPIC timer; the PIT is only there for
/// calibration, which `tsc_early_khz` already gives): without it an idle sandbox costs
/// 0.4% of a host core instead of 0.9%. KVM keeps QEMU's default (an in-kernel PIT).
fn machine(accel: &str) -> &'static str {
    if accel == "tcg" {
        "microvm,pit=off"
    } else {
        "microvm"
    }
}

/// The guest kernel's command line. `tsc=reliable`: the guest trusts its TSC (under TCG
/// it follows the host's monotonic clock; under KVM the kernel prefers kvm-clock anyway).
/// Without it the kernel's clocksource watchdog compares the TSC against jiffies while
/// the guest boots, and on a busy host (VMs booting together, vCPUs descheduled) finds
/// "skew", marks the TSC unstable and falls back to jiffies, which needs the periodic
/// 250 Hz tick for ever after: 5% of a host core per idle sandbox instead of 0.9%.
const KERNEL_CMDLINE: &str = "console=ttyS0 panic=-1 quiet tsc=reliable rdinit=/init";

/// The guest kernel's command line: `KERNEL_CMDLINE` and the TSC's rate.
///
/// `tsc_early_khz`: microvm has no timer to calibrate the TSC against (no PIT), and the
/// guest's clock runs at the rate it is told. Under TCG the guest's TSC is the host's,
/// so the rate is the host's, measured once: with a fixed 2 GHz a guest on a 2.1 GHz
/// host ran 5% fast (2 s ahead of the host's clock a minute after boot).
fn kernel_cmdline() -> String {
    format!("{KERNEL_CMDLINE} tsc_early_khz={}", host_tsc_khz())
}

/// The host's TSC rate in kHz, measured against the monotonic clock over 20 ms.
fn host_tsc_khz() -> u64 {
    static KHZ: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KHZ.get_or_init(|| {
        // SAFETY: rdtsc has no preconditions on x86_64.
        let tsc = || unsafe { std::arch::x86_64::_rdtsc() };
        let (t0, c0) = (std::time::Instant::now(), tsc());
        while t0.elapsed() < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let (ns, ticks) = (t0.elapsed().as_nanos() as u64, tsc() - c0);
        match ticks.checked_mul(1_000_000).map(|t| t / ns.max(1)) {
            Some(khz) if khz > 100_000 => khz,
            _ => 2_000_000,
        }
    })
}

/// QEMU's `-m` for a VM of `mib` MiB.
///
/// Exactly 2048 MiB gets 2 MiB more. QEMU's microvm loads the initrd so that it ends
/// at the kernel's `initrd_addr_max` (2 GiB - 1) and keeps clear of the firmware's page
/// at the top of low memory only when that memory is smaller than 2 GiB; at exactly
/// 2 GiB the two share the last page and the initramfs's tail (the last kernel modules)
/// is damaged, so the guest cannot mount its overlay. With more memory the firmware's
/// page moves above 2 GiB. One page more was enough for that, but memory that is not a
/// whole number of 2 MiB blocks makes QEMU's migration setup take seconds (measured:
/// pausing an idle 2 GiB + 4 KiB guest took 5.1 s, 4.2 s of it in setup; + 2 MiB, 0.8 s).
pub fn qemu_memory(mib: u32) -> String {
    if mib == 2048 {
        format!("{}M", 2048 + 2)
    } else {
        mib.to_string()
    }
}

impl VmSpec {
    fn args(&self, ctl: &Path, console: &Path, qmp: &Path) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "-accel".into(),
            accel_arg(&self.accel),
            "-M".into(),
            machine(&self.accel).into(),
            "-m".into(),
            qemu_memory(self.memory_mib),
            "-smp".into(),
            self.cpus.to_string(),
            // ARAT (an always-running APIC timer) lets the guest kernel stop its tick when
            // idle; without it the LAPIC timer counts as stopping in deep C-states, there
            // is no broadcast timer on microvm, and an idle guest takes 250 ticks a second
            // (3-5% of a host core per idle sandbox under TCG, 0.9% with it).
            "-cpu".into(),
            "qemu64,+arat".into(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-chardev".into(),
            format!("file,id=con,path={},append=on", console.display()),
            "-serial".into(),
            "chardev:con".into(),
            "-kernel".into(),
            self.kernel.display().to_string(),
            "-initrd".into(),
            self.initramfs.display().to_string(),
            "-append".into(),
            kernel_cmdline(),
            "-blockdev".into(),
            match &self.root {
                Root::Nbd(socket) => format!(
                    "driver=nbd,node-name=root,server.type=unix,server.path={},export=amber,read-only=on",
                    socket.display()
                ),
                Root::RawFile(path) => format!(
                    "driver=raw,node-name=root,read-only=on,file.driver=file,file.filename={}",
                    path.display()
                ),
            },
            "-device".into(),
            format!("virtio-blk-device,drive=root,serial={ENV_DISK_SERIAL}"),
            // Memory the guest frees goes back to the host (an idle sandbox costs what
            // it holds, not what it once touched).
            "-device".into(),
            "virtio-balloon-device,free-page-reporting=on".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            format!("socket,id=ctl,path={},server=on,wait=off", ctl.display()),
            "-device".into(),
            format!("virtserialport,chardev=ctl,name={}", amber_guest::PORT_NAME),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ];
        if let Some(disk) = &self.disk {
            args.extend([
                "-blockdev".into(),
                format!(
                    "driver=raw,node-name=rw,discard=unmap,file.driver=file,file.filename={}",
                    disk.display()
                ),
                "-device".into(),
                format!("virtio-blk-device,drive=rw,serial={WRITABLE_DISK_SERIAL}"),
            ]);
        }
        if let Some(socket) = &self.modules {
            args.extend([
                "-blockdev".into(),
                format!(
                    "driver=nbd,node-name=modules,server.type=unix,server.path={},export=amber,read-only=on",
                    socket.display()
                ),
                "-device".into(),
                format!("virtio-blk-device,drive=modules,serial={MODULES_DISK_SERIAL}"),
            ]);
        }
        if let Some(link) = &self.net {
            args.extend(crate::network::qemu_args(link));
        }
        args
    }
}

/// A booted microVM whose guest agent is ready for sessions.
pub struct Vm {
    qemu: tokio::process::Child,
    pub mux: Mux,
    console: PathBuf,
    qmp: PathBuf,
    /// The guest protocol version the agent said it speaks in `READY`.
    pub protocol: u32,
}

impl Vm {
    /// Starts QEMU for `spec` with `extra` arguments and connects to its control port.
    async fn spawn(spec: &VmSpec, extra: &[&str]) -> Result<Vm, VmError> {
        let ctl = spec.work.join("ctl.sock");
        let console = spec.work.join("console.log");
        let _ = std::fs::remove_file(&ctl);
        let _ = std::fs::remove_file(spec.work.join("qmp.sock"));
        let mut cmd = tokio::process::Command::new(&spec.qemu);
        cmd.args(spec.args(&ctl, &console, &spec.work.join("qmp.sock")));
        cmd.args(extra);
        // QEMU dies with the process that started it: a VM whose root disk server (this
        // process) is gone can do nothing useful. The signal is tied to the thread that
        // forks; VMs are started from the runtime's worker threads, which live as long as
        // the process (never from a blocking-pool thread, which may exit while idle).
        let parent = std::process::id() as libc::pid_t;
        // Small pages (TCG): no transparent huge pages in QEMU (the setting survives
        // exec), so the 4 KiB pieces the guest reports free are given back whole instead
        // of splitting the huge pages around them.
        let no_thp = small_pages(&spec.accel);
        // SAFETY: prctl and getppid are async-signal-safe; nothing else runs in the child.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if no_thp && libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    // The parent died before the prctl took effect.
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut qemu = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| VmError::Spawn {
                qemu: spec.qemu.clone(),
                source,
            })?;
        // QEMU creates the control socket (server=on) before the guest starts.
        let stream = listening(&ctl, &mut qemu).await?;
        let (mux, _) = Mux::new(stream);
        Ok(Vm {
            qemu,
            mux,
            console,
            qmp: spec.work.join("qmp.sock"),
            protocol: 0,
        })
    }

    /// Boots QEMU and sends `boot`; returns once the guest has mounted its root (or
    /// with the console's last lines when it could not).
    pub async fn boot(spec: &VmSpec, boot: &Boot) -> Result<Vm, VmError> {
        let mut vm = Self::spawn(spec, &[]).await?;
        let mut control = vm.mux.session(0);
        control
            .tx
            .send(BOOT, &serde_json::to_vec(boot).expect("Boot serializes"))
            .await?;
        let mut agent_error = None;
        loop {
            match control.recv().await {
                Some(f) if f.kind == READY => {
                    let ready = amber_guest::Ready::parse(&f.payload).map_err(VmError::Protocol)?;
                    ready.check().map_err(VmError::Protocol)?;
                    vm.protocol = ready.protocol;
                    return Ok(vm);
                }
                Some(f) if f.kind == ERROR => {
                    agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned())
                }
                Some(f) if f.kind == EXIT => {
                    return Err(VmError::Guest(agent_error.unwrap_or_default()));
                }
                Some(_) => {}
                None => return Err(VmError::Stopped(vm.console_tail())),
            }
        }
    }

    /// Saves the VM to `state` and stops QEMU: the agent quiesces its port (`PAUSE`),
    /// QEMU stops the vCPUs (which flushes the disks: the writable disk's file is then
    /// the disk at this instant) and migrates memory and devices to the file. On an error
    /// the VM is gone (it may have been stopped half-way); the caller ends the sandbox.
    pub async fn pause(mut self, state: &Path) -> Result<(), VmError> {
        let result = self.save(state).await;
        if result.is_err() {
            self.kill().await;
            let _ = std::fs::remove_file(state);
        }
        result
    }

    async fn save(&mut self, state: &Path) -> Result<(), VmError> {
        const QUIESCE_S: u64 = 30;
        let started = std::time::Instant::now();
        let mut control = self.mux.session(0);
        self.mux.seal_with(PAUSE, 0, &[]).await?;
        let quiesced = tokio::time::timeout(Duration::from_secs(QUIESCE_S), async {
            loop {
                match control.recv().await {
                    Some(f) if f.kind == QUIESCED => return true,
                    Some(_) => {}
                    None => return false,
                }
            }
        })
        .await;
        if quiesced != Ok(true) {
            return Err(VmError::NotQuiesced(QUIESCE_S));
        }
        let quiesced_ms = started.elapsed().as_millis();
        let mut qmp = self.qmp().await?;
        qmp.execute("stop", json!({})).await?;
        // One pass over a stopped VM: no bandwidth limit (QEMU's default is 128 MiB/s).
        qmp.execute(
            "migrate-set-parameters",
            json!({"max-bandwidth": 1u64 << 40}),
        )
        .await?;
        qmp.execute(
            "migrate",
            json!({"uri": format!("file:{}", state.display())}),
        )
        .await?;
        let m = qmp.wait_migration(Duration::from_secs(3600)).await?;
        let saved_ms = started.elapsed().as_millis();
        // QEMU may close the socket before it answers `quit`.
        let _ = qmp.execute("quit", json!({})).await;
        if tokio::time::timeout(Duration::from_secs(10), self.qemu.wait())
            .await
            .is_err()
        {
            self.kill().await;
        }
        tracing::debug!(
            quiesced_ms,
            saved_ms,
            qemu_total_ms = m["total-time"].as_u64(),
            qemu_setup_ms = m["setup-time"].as_u64(),
            exited_ms = started.elapsed().as_millis(),
            "paused {}",
            state.display()
        );
        Ok(())
    }

    /// Starts QEMU for `spec` from the VM saved in `state` by `pause`, connects its
    /// control port before the vCPUs run (so no frame of the guest is lost), tells the
    /// agent the time, and continues it. `protocol` is the agent's, from its boot.
    pub async fn restore(spec: &VmSpec, state: &Path, protocol: u32) -> Result<Vm, VmError> {
        let mut vm = Self::spawn(spec, &["-incoming", "defer", "-S"]).await?;
        vm.protocol = protocol;
        let restored = async {
            let mut qmp = vm.qmp().await?;
            qmp.execute(
                "migrate-incoming",
                json!({"uri": format!("file:{}", state.display())}),
            )
            .await?;
            qmp.wait_migration(Duration::from_secs(3600)).await?;
            let unix_ns = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let resume = amber_guest::Resume { unix_ns };
            vm.mux
                .send(RESUME, 0, &serde_json::to_vec(&resume).expect("json"))
                .await?;
            qmp.execute("cont", json!({})).await?;
            Ok::<(), VmError>(())
        }
        .await;
        match restored {
            Ok(()) => Ok(vm),
            Err(e) => {
                vm.kill().await;
                Err(e)
            }
        }
    }

    /// A QMP connection. QEMU opens its sockets one after another, so the QMP socket
    /// may not listen yet when the control socket already does (a restore's first step).
    async fn qmp(&mut self) -> Result<Qmp, VmError> {
        let stream = listening(&self.qmp, &mut self.qemu).await?;
        Ok(Qmp::over(stream).await?)
    }

    /// The last lines the guest kernel wrote on its console.
    pub fn console_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.console).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Asks the guest to sync and power off; stops QEMU if it has not within `grace`.
    pub async fn shutdown(mut self, grace: Duration) {
        let _ = self.mux.send(SHUTDOWN, 0, &[]).await;
        if tokio::time::timeout(grace, self.qemu.wait()).await.is_err() {
            self.kill().await;
        }
    }

    /// Stops QEMU at once (the root is read-only and the upper layer is memory: nothing
    /// is lost that a finished command did not already report).
    pub async fn kill(&mut self) {
        let _ = self.qemu.start_kill();
        let _ = self.qemu.wait().await;
    }

    /// QEMU's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.qemu.id()
    }

    /// Waits for QEMU to exit on its own.
    pub async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.qemu.wait().await
    }
}

/// How long QEMU may take to listen on one of its sockets after it started.
const SOCKET_WAIT: Duration = Duration::from_secs(10);

/// Connects to the socket QEMU serves at `path` (`server=on`), waiting (bounded by
/// `SOCKET_WAIT`) while it does not exist or listen yet; QEMU exiting first is its own
/// error, with what QEMU printed.
async fn listening(
    path: &Path,
    qemu: &mut tokio::process::Child,
) -> Result<tokio::net::UnixStream, VmError> {
    let deadline = tokio::time::Instant::now() + SOCKET_WAIT;
    loop {
        match tokio::net::UnixStream::connect(path).await {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) => {}
            Err(e) => return Err(VmError::Io(e)),
        }
        if let Some(status) = qemu.try_wait()? {
            let mut stderr = String::new();
            if let Some(mut e) = qemu.stderr.take() {
                use tokio::io::AsyncReadExt;
                let _ = e.read_to_string(&mut stderr).await;
            }
            return Err(VmError::QemuExited { status, stderr });
        }
        if tokio::time::Instant::now() > deadline {
            return Err(VmError::NoSocket(path.to_path_buf()));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
