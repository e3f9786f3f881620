//! One microVM: QEMU `-M microvm` booting the pinned kernel and the initramfs, with the
//! env's lazy NBD export as its root disk and a virtio-serial control port. The host
//! sends the request, relays the guest's stdout and stderr unchanged, and returns the
//! command's exit status.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use amber_guest::{read_frame, Request, AGENT_ERROR, EXIT, STDERR, STDOUT};
use anyhow::{bail, Context};
use tokio::io::AsyncWriteExt;

pub struct VmSpec {
    pub qemu: PathBuf,
    pub accel: String,
    pub cpus: u32,
    pub memory_mib: u32,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub root: Root,
    pub work: PathBuf,
}

/// Where the VM's root disk comes from.
pub enum Root {
    /// The env's lazy, verified NBD export (the product path).
    Nbd(PathBuf),
    /// A local raw image file (for benchmarks against the lazy path).
    RawFile(PathBuf),
}

impl VmSpec {
    fn args(&self, ctl: &Path, console: &Path) -> Vec<String> {
        vec![
            "-accel".into(),
            self.accel.clone(),
            "-M".into(),
            "microvm".into(),
            "-m".into(),
            self.memory_mib.to_string(),
            "-smp".into(),
            self.cpus.to_string(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-chardev".into(),
            format!("file,id=con,path={}", console.display()),
            "-serial".into(),
            "chardev:con".into(),
            "-kernel".into(),
            self.kernel.display().to_string(),
            "-initrd".into(),
            self.initramfs.display().to_string(),
            "-append".into(),
            "console=ttyS0 panic=-1 quiet tsc_early_khz=2000000 rdinit=/init".into(),
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
            "virtio-blk-device,drive=root".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            format!("socket,id=ctl,path={},server=on,wait=off", ctl.display()),
            "-device".into(),
            format!("virtserialport,chardev=ctl,name={}", amber_guest::PORT_NAME),
        ]
    }
}

/// What a run produced: its status and the digests of what it wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Boots the VM, runs `req`, relays output unchanged; returns the outcome.
pub async fn run(
    spec: &VmSpec,
    req: &Request,
    timeout: Option<Duration>,
) -> anyhow::Result<Outcome> {
    let ctl = spec.work.join("ctl.sock");
    let console = spec.work.join("console.log");
    let mut qemu = tokio::process::Command::new(&spec.qemu)
        .args(spec.args(&ctl, &console))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {} (run `amber setup`)", spec.qemu.display()))?;
    // QEMU creates the control socket before the guest starts.
    let mut conn = None;
    for _ in 0..2000 {
        if let Ok(c) = std::os::unix::net::UnixStream::connect(&ctl) {
            conn = Some(c);
            break;
        }
        if let Some(st) = qemu.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = qemu.stderr.take() {
                use tokio::io::AsyncReadExt;
                let _ = e.read_to_string(&mut err).await;
            }
            bail!("QEMU exited with {st} before the VM started: {err}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut conn = conn.context("QEMU never opened the control socket")?;
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    std::io::Write::write_all(&mut conn, &line)?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(u8, Vec<u8>)>(64);
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        while let Some(f) = read_frame(&mut conn)? {
            let last = f.0 == EXIT;
            if tx.blocking_send(f).is_err() || last {
                break;
            }
        }
        Ok(())
    });
    let relay = async {
        use sha2::Digest as _;
        let mut out = tokio::io::stdout();
        let mut err = tokio::io::stderr();
        let (mut out_hash, mut err_hash) = (sha2::Sha256::new(), sha2::Sha256::new());
        let mut agent_error = None;
        while let Some((kind, data)) = rx.recv().await {
            match kind {
                STDOUT => {
                    out_hash.update(&data);
                    out.write_all(&data).await?;
                    out.flush().await?;
                }
                STDERR => {
                    err_hash.update(&data);
                    err.write_all(&data).await?;
                    err.flush().await?;
                }
                AGENT_ERROR => agent_error = Some(String::from_utf8_lossy(&data).into_owned()),
                EXIT => {
                    let code = i32::from_be_bytes(
                        data.get(..4)
                            .and_then(|b| b.try_into().ok())
                            .unwrap_or([0, 0, 0, 125]),
                    );
                    if let Some(e) = agent_error {
                        bail!("the guest could not run the command: {e}");
                    }
                    return Ok(Outcome {
                        status: code,
                        stdout: format!("sha256:{}", hex::encode(out_hash.finalize())),
                        stderr: format!("sha256:{}", hex::encode(err_hash.finalize())),
                    });
                }
                _ => {}
            }
        }
        let tail = std::fs::read_to_string(&console).unwrap_or_default();
        let tail: String = tail
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        bail!("the VM stopped before the command finished; console:\n{tail}")
    };
    let result = match timeout {
        Some(t) => match tokio::time::timeout(t, relay).await {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("timed out after {}s", t.as_secs())),
        },
        None => relay.await,
    };
    let _ = qemu.start_kill();
    let _ = qemu.wait().await;
    let _ = reader.join();
    result
}
