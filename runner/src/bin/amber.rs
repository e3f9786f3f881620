//! `amber`: run pinned environments in microVMs. Parses the command line, reads the
//! environment, and calls amber-node; errors become one line on stderr and exit 125.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use amber_node::command::{request, run_argv};
use amber_node::image::RunConfig;
use amber_node::kernel;
use amber_node::receipt;
use amber_node::run::{boot_and_exec, launch, new_id, VmOptions};
use amber_node::sandbox::{self, Launch, Record};
use amber_node::{daemon, session};
use amber_snapshotter::source::{RegistryClient, CREDENTIALS_ENV};

/// The longest one registry request may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(300);

/// The node's directory: `AMBER_HOME`, else `~/.cache/amber`.
fn node_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("AMBER_HOME") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".cache/amber")
}

#[derive(Parser)]
#[command(name = "amber", version, about = "Run pinned environments in microVMs")]
struct Cli {
    /// The registry to resolve references and fetch chunks from.
    #[arg(
        long,
        global = true,
        env = "AMBER_REGISTRY",
        default_value = "http://127.0.0.1:5000"
    )]
    registry: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Prepare this node: the pinned guest kernel (from the registry, or Debian once, then
    /// pushed), the initramfs, and which accelerator works.
    Setup {
        /// A static guest agent binary to use instead of the one built into `amber`.
        #[arg(long, env = "AMBER_GUEST")]
        guest: Option<PathBuf>,
    },
    /// Run a command in a fresh microVM of REF, as `docker run REF CMD` would.
    Run(Box<RunArgs>),
    /// Start a sandbox of REF that stays up for `exec` and `cp`; prints its id.
    Create(Box<CreateArgs>),
    /// Run a command in a running sandbox, as `docker exec` would.
    Exec(ExecArgs),
    /// Copy files: `amber cp PATH ID:PATH` or `amber cp ID:PATH PATH`.
    Cp { src: String, dest: String },
    /// Stop and remove sandboxes.
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// List the sandboxes running on this node.
    Ps,
    /// Boot exactly what a receipt pinned and run its command again.
    Reproduce { receipt: PathBuf },
    /// The node daemon `amber create` starts (one per node; it exits when idle).
    #[command(hide = true)]
    NodeDaemon,
}

/// How the VM is shaped and how its command runs (shared by `run` and `create`).
#[derive(clap::Args)]
struct VmArgs {
    /// name:tag, name@sha256:…, or an env digest blake3:…
    reference: String,
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    #[arg(long, short = 'w')]
    workdir: Option<String>,
    #[arg(long, short = 'u')]
    user: Option<String>,
    #[arg(long)]
    hostname: Option<String>,
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    memory: u32,
    /// QEMU accelerator: auto (what `amber setup`'s probe found), kvm or tcg.
    #[arg(long, env = "AMBER_ACCEL", default_value = "auto")]
    accel: String,
    /// Also expose the read-only root device as /dev/vda in the sandbox.
    #[arg(long)]
    root_device: bool,
}

impl VmArgs {
    fn options(&self) -> VmOptions {
        VmOptions {
            reference: self.reference.clone(),
            env: self.env.clone(),
            workdir: self.workdir.clone(),
            user: self.user.clone(),
            hostname: self.hostname.clone(),
            cpus: self.cpus,
            memory_mib: self.memory,
            accel: self.accel.clone(),
            root_device: self.root_device,
        }
    }
}

#[derive(clap::Args)]
struct RunArgs {
    #[command(flatten)]
    vm: VmArgs,
    /// Pass stdin to the command (otherwise it reads /dev/null, as `docker run`).
    #[arg(long, short = 'i')]
    interactive: bool,
    /// Seconds before the VM is stopped.
    #[arg(long)]
    timeout: Option<u64>,
    /// Write a receipt of the run (every digest it depended on) to this file.
    #[arg(long)]
    receipt: Option<PathBuf>,
    /// Fetch every chunk of the env into the node cache before booting (benchmarks).
    #[arg(long)]
    prefetch: bool,
    /// Boot from this local raw image of the env instead of its NBD export (benchmarks).
    #[arg(long)]
    root_image: Option<PathBuf>,
    /// The command; without it the image's Cmd runs.
    #[arg(last = true)]
    command: Vec<String>,
}

#[derive(clap::Args)]
struct CreateArgs {
    #[command(flatten)]
    vm: VmArgs,
}

#[derive(clap::Args)]
struct ExecArgs {
    id: String,
    #[arg(long, short = 'i')]
    interactive: bool,
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    #[arg(long, short = 'w')]
    workdir: Option<String>,
    #[arg(long, short = 'u')]
    user: Option<String>,
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AMBER_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match run(Cli::parse()).await {
        Ok(code) => std::process::ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("amber: {e:#}");
            std::process::ExitCode::from(125)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<i32> {
    let node = node_dir();
    let credentials = std::env::var(CREDENTIALS_ENV).ok();
    let registry = RegistryClient::new(&cli.registry, credentials.as_deref(), HTTP_TIMEOUT);
    match cli.command {
        Cmd::Setup { guest } => {
            let agent = match &guest {
                Some(p) => std::fs::read(p)
                    .with_context(|| format!("reading the guest agent {}", p.display()))?,
                None => kernel::GUEST_AGENT.to_vec(),
            };
            let s = kernel::setup(&node, &registry, &agent).await?;
            println!("kernel {} {}", s.kernel_release, s.kernel);
            println!("initramfs {}", s.initramfs);
            println!("accel {}", s.accel);
            Ok(0)
        }
        Cmd::Run(a) => run_cmd(&registry, &node, *a).await,
        Cmd::Create(a) => create(&registry, &node, *a).await,
        Cmd::Exec(a) => exec(&node, a).await,
        Cmd::Cp { src, dest } => cp(&node, &src, &dest).await,
        Cmd::Rm { ids } => {
            for id in ids {
                rm(&node, &id).await?;
                println!("{id}");
            }
            Ok(0)
        }
        Cmd::Ps => {
            let dir = sandbox::sandboxes_dir(&node);
            let mut ids: Vec<String> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect();
            ids.sort();
            for id in ids {
                if let Ok(r) = sandbox::read_record(&node, &id) {
                    println!("{id}\t{}\t{}", r.reference, r.launch.env);
                }
            }
            Ok(0)
        }
        Cmd::Reproduce { receipt } => reproduce(&node, &receipt, credentials.as_deref()).await,
        Cmd::NodeDaemon => {
            let served = daemon::serve(&node, &registry, || {
                use std::io::Write;
                let mut out = std::io::stdout();
                let _ = out.write_all(b"ready\n").and_then(|()| out.flush());
            })
            .await;
            match served {
                Err(daemon::DaemonError::AlreadyRunning(_)) => {
                    println!("running");
                    Ok(0)
                }
                r => r.map(|()| 0).map_err(Into::into),
            }
        }
    }
}

async fn run_cmd(registry: &RegistryClient, node: &Path, a: RunArgs) -> anyhow::Result<i32> {
    let (resolved, state, mut l) = launch(registry, node, &a.vm.options()).await?;
    l.prefetch = a.prefetch;
    l.root_image = a.root_image.clone();
    let c = &resolved.config;
    let argv = run_argv(c, &a.command)
        .context("no command given and the image has no Entrypoint or Cmd")?;
    let req = request(
        c,
        argv,
        &a.vm.env,
        a.vm.workdir.as_deref(),
        a.vm.user.as_deref(),
        &l.boot.hostname,
        a.interactive,
    );
    let out = boot_and_exec(node, registry, &l, &req, a.timeout.map(Duration::from_secs)).await?;
    if let Some(path) = &a.receipt {
        let r = receipt::Receipt {
            version: receipt::RECEIPT_VERSION,
            registry: registry.base().to_string(),
            reference: a.vm.reference.clone(),
            image_digest: resolved.image_digest.clone(),
            env_digest: resolved.env.to_string(),
            kernel_release: state.kernel_release.clone(),
            kernel: state.kernel.clone(),
            initramfs: state.initramfs.clone(),
            qemu: receipt::qemu_version(),
            vm: l.shape.clone(),
            boot: l.boot.clone(),
            request: req,
            exit_status: out.status,
            stdout: out.stdout.clone(),
            stderr: out.stderr.clone(),
        };
        std::fs::write(path, serde_json::to_vec_pretty(&r)?)
            .with_context(|| format!("writing receipt {}", path.display()))?;
    }
    Ok(out.status)
}

async fn reproduce(node: &Path, path: &Path, credentials: Option<&str>) -> anyhow::Result<i32> {
    let text =
        std::fs::read(path).with_context(|| format!("reading receipt {}", path.display()))?;
    let r: receipt::Receipt =
        serde_json::from_slice(&text).with_context(|| format!("receipt {}", path.display()))?;
    anyhow::ensure!(
        r.version == receipt::RECEIPT_VERSION,
        "receipt version {} is not supported (this amber reads version {})",
        r.version,
        receipt::RECEIPT_VERSION
    );
    anyhow::ensure!(
        !r.request.stdin,
        "the receipt's command read stdin, which a receipt does not record"
    );
    let registry = RegistryClient::new(&r.registry, credentials, HTTP_TIMEOUT);
    let l = Launch {
        registry: r.registry.clone(),
        env: r.env_digest.parse()?,
        kernel: kernel::boot_file(node, &registry, &r.kernel, "kernel").await?,
        initramfs: kernel::boot_file(node, &registry, &r.initramfs, "initramfs").await?,
        shape: r.vm.clone(),
        boot: r.boot.clone(),
        prefetch: false,
        root_image: None,
    };
    let out = boot_and_exec(node, &registry, &l, &r.request, None).await?;
    let same = out.status == r.exit_status && out.stdout == r.stdout && out.stderr == r.stderr;
    if same {
        eprintln!(
            "amber: reproduced {}: exit {}, stdout {}, stderr {} (identical)",
            r.env_digest, out.status, out.stdout, out.stderr
        );
        Ok(out.status)
    } else {
        eprintln!(
            "amber: NOT reproduced: receipt exit {} stdout {} stderr {}; now exit {} stdout {} stderr {}",
            r.exit_status, r.stdout, r.stderr, out.status, out.stdout, out.stderr
        );
        Ok(if out.status == 0 { 1 } else { out.status })
    }
}

async fn create(registry: &RegistryClient, node: &Path, a: CreateArgs) -> anyhow::Result<i32> {
    let (resolved, _, l) = launch(registry, node, &a.vm.options()).await?;
    let id = new_id()?;
    let dir = sandbox::sandbox_dir(node, &id)?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let base = request(
        &resolved.config,
        Vec::new(),
        &a.vm.env,
        a.vm.workdir.as_deref(),
        a.vm.user.as_deref(),
        &l.boot.hostname,
        false,
    );
    let record = Record {
        id: id.clone(),
        reference: a.vm.reference.clone(),
        image_digest: resolved.image_digest.clone(),
        env: base.env,
        cwd: base.cwd,
        user: base.user,
        launch: l,
    };
    std::fs::write(
        dir.join("sandbox.json"),
        serde_json::to_vec_pretty(&record)?,
    )?;
    let exe = std::env::current_exe()?;
    let started = daemon::create(node, &record, || {
        let mut c = std::process::Command::new(&exe);
        c.arg("--registry")
            .arg(registry.base())
            .arg("node-daemon")
            .env("AMBER_HOME", node);
        c
    })
    .await;
    if let Err(e) = started {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(e.into());
    }
    println!("{id}");
    Ok(0)
}

async fn exec(node: &Path, a: ExecArgs) -> anyhow::Result<i32> {
    let r = sandbox::read_record(node, &a.id)?;
    let base = RunConfig {
        env: r.env.clone(),
        working_dir: r.cwd.clone(),
        user: r.user.clone(),
        ..RunConfig::default()
    };
    let req = request(
        &base,
        a.command.clone(),
        &a.env,
        a.workdir.as_deref(),
        a.user.as_deref(),
        &r.launch.boot.hostname,
        a.interactive,
    );
    let mux = sandbox::connect(node, &a.id).await?;
    let stdin: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>> = if a.interactive {
        Some(Box::new(tokio::io::stdin()))
    } else {
        None
    };
    let out = session::exec(
        mux.open(),
        &req,
        stdin,
        tokio::io::stdout(),
        tokio::io::stderr(),
    )
    .await?;
    Ok(out.status)
}

/// `ID:PATH` -> (id, path) when the id names a sandbox on this node.
fn sandbox_path<'a>(node: &Path, s: &'a str) -> Option<(&'a str, &'a str)> {
    let (id, path) = s.split_once(':')?;
    sandbox::sandbox_dir(node, id)
        .ok()?
        .exists()
        .then_some((id, path))
}

async fn cp(node: &Path, src: &str, dest: &str) -> anyhow::Result<i32> {
    match (sandbox_path(node, src), sandbox_path(node, dest)) {
        (None, Some((id, path))) => {
            let mux = sandbox::connect(node, id).await?;
            session::put(mux.open(), Path::new(src), path).await?;
        }
        (Some((id, path)), None) => {
            let mux = sandbox::connect(node, id).await?;
            session::get(mux.open(), path, Path::new(dest)).await?;
        }
        (Some(_), Some(_)) => anyhow::bail!("copying between two sandboxes is not supported"),
        (None, None) => {
            anyhow::bail!("one of {src:?} and {dest:?} must be ID:PATH of a sandbox on this node")
        }
    }
    Ok(0)
}

async fn rm(node: &Path, id: &str) -> anyhow::Result<()> {
    let dir = sandbox::sandbox_dir(node, id)?;
    anyhow::ensure!(dir.exists(), "no sandbox {id} on this node");
    match sandbox::connect(node, id).await {
        Ok(mux) => {
            let mut control = mux.session(0);
            mux.send(amber_guest::SHUTDOWN, 0, &[]).await?;
            // The daemon closes the socket when it exits, after removing the directory.
            while control.recv().await.is_some() {}
        }
        Err(_) => {
            // The daemon is gone (killed, or the node restarted): only the record is left.
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    Ok(())
}
