//! `amber`: run pinned environments in microVMs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use amber_guest::{Boot, Request};
use amber_runner::image::{self, RunConfig};
use amber_runner::kernel::{self, NodeState};
use amber_runner::receipt;
use amber_runner::sandbox::{self, Launch, Record, Sandbox};
use amber_runner::session::{self, Outcome};

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
    #[command(hide = true)]
    SandboxDaemon { dir: PathBuf },
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
    let node = kernel::node_dir();
    match cli.command {
        Cmd::Setup { guest } => {
            let agent = match &guest {
                Some(p) => std::fs::read(p)
                    .with_context(|| format!("reading the guest agent {}", p.display()))?,
                None => kernel::GUEST_AGENT.to_vec(),
            };
            let s = kernel::setup(&node, &cli.registry, &agent).await?;
            println!("kernel {} {}", s.kernel_release, s.kernel);
            println!("initramfs {}", s.initramfs);
            println!("accel {}", s.accel);
            Ok(0)
        }
        Cmd::Run(a) => run_cmd(&cli.registry, &node, *a).await,
        Cmd::Create(a) => create(&cli.registry, &node, *a).await,
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
        Cmd::Reproduce { receipt } => reproduce(&node, &receipt).await,
        Cmd::SandboxDaemon { dir } => {
            sandbox::daemon(&node, &dir).await?;
            Ok(0)
        }
    }
}

/// The request for `argv` under the image's config and the user's flags, as docker does.
fn request(
    c: &RunConfig,
    argv: Vec<String>,
    extra_env: &[String],
    workdir: Option<&str>,
    user: Option<&str>,
    hostname: &str,
    stdin: bool,
) -> Request {
    let mut env = c.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.insert(
            0,
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        );
    }
    if !env.iter().any(|e| e.starts_with("HOSTNAME=")) {
        env.push(format!("HOSTNAME={hostname}"));
    }
    for e in extra_env {
        let key = e.split('=').next().unwrap_or("");
        env.retain(|x| x.split('=').next() != Some(key));
        env.push(e.clone());
    }
    Request {
        argv,
        env,
        cwd: workdir.map(str::to_string).unwrap_or_else(|| {
            if c.working_dir.is_empty() {
                "/".into()
            } else {
                c.working_dir.clone()
            }
        }),
        user: user.map(str::to_string).unwrap_or_else(|| c.user.clone()),
        stdin,
    }
}

/// Resolves the reference and the node's boot files into a launch.
async fn launch(
    registry: &str,
    node: &Path,
    a: &VmArgs,
) -> anyhow::Result<(image::Resolved, NodeState, Launch)> {
    let state = kernel::read_node(node)?;
    let http = amber_snapshotter::source::registry_client(Duration::from_secs(300));
    let resolved = image::resolve(&http, registry, &a.reference, Duration::from_secs(600)).await?;
    let hostname = a
        .hostname
        .clone()
        .unwrap_or_else(|| resolved.env.hex()[..12].to_string());
    let accel = if a.accel == "auto" {
        state.accel.clone()
    } else {
        a.accel.clone()
    };
    let l = Launch {
        registry: registry.to_string(),
        env: resolved.env,
        kernel: kernel::boot_file(node, registry, &state.kernel, "kernel").await?,
        initramfs: kernel::boot_file(node, registry, &state.initramfs, "initramfs").await?,
        shape: receipt::Vm {
            accel,
            cpus: a.cpus,
            memory_mib: a.memory,
        },
        boot: Boot {
            hostname,
            root_device: a.root_device,
        },
        prefetch: false,
        root_image: None,
    };
    Ok((resolved, state, l))
}

fn work_dir(node: &Path) -> anyhow::Result<PathBuf> {
    Ok(node.join("run").join(new_id()?))
}

fn new_id() -> anyhow::Result<String> {
    let mut b = [0u8; 6];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut b)?;
    Ok(hex::encode(b))
}

/// Boots `l`, runs `req` in it, and stops it; output passes through unchanged.
async fn boot_and_exec(
    node: &Path,
    l: &Launch,
    req: &Request,
    timeout: Option<Duration>,
) -> anyhow::Result<Outcome> {
    let sandbox = Sandbox::start(node, work_dir(node)?, l).await?;
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
    let integrity = sandbox.integrity_error();
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

async fn run_cmd(registry: &str, node: &Path, a: RunArgs) -> anyhow::Result<i32> {
    let (resolved, state, mut l) = launch(registry, node, &a.vm).await?;
    l.prefetch = a.prefetch;
    l.root_image = a.root_image.clone();
    let c = &resolved.config;
    let argv: Vec<String> = if a.command.is_empty() {
        c.entrypoint.iter().chain(c.cmd.iter()).cloned().collect()
    } else {
        c.entrypoint
            .iter()
            .chain(a.command.iter())
            .cloned()
            .collect()
    };
    anyhow::ensure!(
        !argv.is_empty(),
        "no command given and the image has no Entrypoint or Cmd"
    );
    let req = request(
        c,
        argv,
        &a.vm.env,
        a.vm.workdir.as_deref(),
        a.vm.user.as_deref(),
        &l.boot.hostname,
        a.interactive,
    );
    let out = boot_and_exec(node, &l, &req, a.timeout.map(Duration::from_secs)).await?;
    if let Some(path) = &a.receipt {
        let r = receipt::Receipt {
            version: receipt::RECEIPT_VERSION,
            registry: registry.to_string(),
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

async fn reproduce(node: &Path, path: &Path) -> anyhow::Result<i32> {
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
    let l = Launch {
        registry: r.registry.clone(),
        env: r.env_digest.parse()?,
        kernel: kernel::boot_file(node, &r.registry, &r.kernel, "kernel").await?,
        initramfs: kernel::boot_file(node, &r.registry, &r.initramfs, "initramfs").await?,
        shape: r.vm.clone(),
        boot: r.boot.clone(),
        prefetch: false,
        root_image: None,
    };
    let out = boot_and_exec(node, &l, &r.request, None).await?;
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

async fn create(registry: &str, node: &Path, a: CreateArgs) -> anyhow::Result<i32> {
    use std::os::unix::process::CommandExt;
    let (resolved, _, l) = launch(registry, node, &a.vm).await?;
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
    let log = std::fs::File::create(dir.join("daemon.log"))?;
    // The daemon outlives this command: its own session, stdin closed, output logged.
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("--registry")
        .arg(registry)
        .arg("sandbox-daemon")
        .arg(&dir)
        .env("AMBER_HOME", node)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting the sandbox daemon")?;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    tokio::task::spawn_blocking(move || {
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).map(|_| line)
    })
    .await??
    .trim()
    .eq("ready")
    .then_some(())
    .ok_or_else(|| {
        let _ = child.wait();
        let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        anyhow::anyhow!("the sandbox did not start: {}", log.trim())
    })?;
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
