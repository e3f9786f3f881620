//! `amber`: run pinned environments in microVMs. Parses the command line, reads the
//! environment, and calls amber-node: `run`, `create`, `exec`, `cp`, `ps`, `rm` and
//! `reproduce` are clients of the node's `amberd` (started on demand), `daemon` is
//! amberd itself. Errors become one line on stderr and exit 125.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use amber_api::node::{CreateSandbox, SandboxInfo};
use amber_guest::Request;
use amber_node::client::{with_causes, ClientError, NodeClient};
use amber_node::command::{request, run_argv};
use amber_node::daemon::{self, DaemonArgs};
use amber_node::run::{boot_and_exec, launch, VmOptions};
use amber_node::{image, kernel, receipt, session};
use amber_snapshotter::source::{RegistryClient, CREDENTIALS_ENV};

/// The longest one registry request may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(300);

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
    /// Fetch every chunk of REF's env into this node's cache (with progress), so sandboxes
    /// of it boot without waiting for the registry.
    Prefetch { reference: String },
    /// Run a command in a running sandbox, as `docker exec` would.
    Exec(ExecArgs),
    /// Copy files: `amber cp PATH ID:PATH` or `amber cp ID:PATH PATH`.
    Cp { src: String, dest: String },
    /// Stop and remove sandboxes.
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Commit a sandbox's files as a new image (its image plus one layer of its changes)
    /// and print the image's pinned reference; the sandbox keeps running.
    Snapshot {
        id: String,
        /// Push the image under name or name:tag (by default: the sandbox's repository,
        /// by digest only).
        #[arg(long)]
        tag: Option<String>,
        /// Do not wait for the registry to convert it.
        #[arg(long)]
        no_wait: bool,
        /// Print the whole answer (digests, sizes, times, lineage) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Save sandboxes to files on this node (memory, devices, disk) and stop their VMs.
    Pause {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Continue paused sandboxes where they were.
    Resume {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// List the sandboxes running on this node.
    Ps,
    /// Boot exactly what a receipt pinned and run its command again.
    Reproduce { receipt: PathBuf },
    /// Run amberd, the node daemon (the CLI starts one on demand, which exits when idle).
    Daemon(DaemonArgs),
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
    /// The sandbox's writable disk in MiB (sparse on this node; a full disk is ENOSPC in
    /// the guest); 0 keeps writes in guest memory.
    #[arg(long, default_value_t = amber_node::disk::DEFAULT_MIB)]
    disk: u32,
    /// QEMU accelerator: auto (what `amber setup`'s probe found), kvm or tcg.
    #[arg(long, env = "AMBER_ACCEL", default_value = "auto")]
    accel: String,
    /// Also expose the read-only root device as /dev/vda in the sandbox.
    #[arg(long)]
    root_device: bool,
    /// Give the sandbox a network interface (implied by the three below); without one
    /// it has only its loopback.
    #[arg(long)]
    network: bool,
    /// A destination the sandbox may connect to: ADDR, CIDR, ADDR:PORT or CIDR:PORT
    /// (IPv4; 127.0.0.1:PORT is the host's loopback port, at 10.0.2.2 inside).
    #[arg(long = "allow", value_name = "RULE")]
    allow: Vec<String>,
    /// A host service the sandbox reaches at 10.0.2.2 (host.amber.internal):
    /// PORT=ADDR:PORT, or ADDR:PORT for the same port.
    #[arg(long = "host-service", value_name = "SPEC")]
    host_services: Vec<String>,
    /// A port of the sandbox the host reaches: PORT (a free port on 127.0.0.1) or
    /// PORT=ADDR:PORT; `amber create --json` shows where.
    #[arg(long = "publish", short = 'p', value_name = "SPEC")]
    publish: Vec<String>,
}

impl VmArgs {
    /// The network these flags ask for, if any.
    fn network(&self) -> Option<amber_api::node::NetworkSpec> {
        let any = self.network
            || !self.allow.is_empty()
            || !self.host_services.is_empty()
            || !self.publish.is_empty();
        any.then(|| amber_api::node::NetworkSpec {
            allow: self.allow.clone(),
            host_services: self.host_services.clone(),
            ports: self.publish.clone(),
        })
    }

    fn options(&self) -> VmOptions {
        VmOptions {
            reference: self.reference.clone(),
            env: self.env.clone(),
            workdir: self.workdir.clone(),
            user: self.user.clone(),
            hostname: self.hostname.clone(),
            cpus: self.cpus,
            memory_mib: self.memory,
            disk_mib: self.disk,
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
    /// Fetch every chunk of the env into the node cache before booting (with progress).
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
    /// Seconds after which the node ends the sandbox.
    #[arg(long)]
    lifetime: Option<u64>,
    /// Seconds without use after which the node ends the sandbox.
    #[arg(long)]
    idle_timeout: Option<u64>,
    /// label key=value (repeatable).
    #[arg(long = "label", short = 'l')]
    labels: Vec<String>,
    /// Create this many sandboxes of REF in one request (a fork of a snapshot); prints
    /// one id per line.
    #[arg(long, default_value_t = 1)]
    count: u32,
    /// Fetch every chunk of the env into the node cache first (with progress).
    #[arg(long)]
    prefetch: bool,
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
    amber_node::init_logging();
    match run(Cli::parse()).await {
        Ok(code) => std::process::ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("amber: {}", with_causes(e.as_ref()));
            std::process::ExitCode::from(125)
        }
    }
}

/// `-e K=V` as given; `-e K` takes K's value from this process's environment (dropped
/// when unset), as `docker run -e K` does.
fn env_pairs(env: &[String]) -> Vec<String> {
    env.iter()
        .filter_map(|e| match e.split_once('=') {
            Some(_) => Some(e.clone()),
            None => std::env::var(e).ok().map(|v| format!("{e}={v}")),
        })
        .collect()
}

/// The node's amberd, started when none runs; refuses one that serves another registry.
async fn node_client(registry: &RegistryClient, home: &Path) -> anyhow::Result<NodeClient> {
    let exe = std::env::current_exe()?;
    let start_daemon = || {
        let mut c = std::process::Command::new(&exe);
        c.arg("--registry")
            .arg(registry.base())
            .arg("daemon")
            .arg("--exit-when-idle")
            .env("AMBER_HOME", home);
        c
    };
    let client = NodeClient::unix(&daemon::socket_path(home));
    // A daemon that answered may be exiting, idle, just before this request reaches it
    // (its linger restarts with each request, but this process may have stalled): then
    // the request does not connect, and a new daemon is started.
    let mut attempts = 0;
    let info = loop {
        daemon::ensure_running(home, &start_daemon).await?;
        match client.node().await {
            Err(ClientError::Unreachable { .. }) if attempts < 2 => attempts += 1,
            answer => break answer?,
        }
    };
    anyhow::ensure!(
        info.registry == registry.base(),
        "this node's amberd serves registry {}, not {}; remove its sandboxes first (it exits once idle)",
        info.registry,
        registry.base()
    );
    Ok(client)
}

/// A client of the running amberd (commands on existing sandboxes start none).
fn running_client(home: &Path) -> NodeClient {
    NodeClient::unix(&daemon::socket_path(home))
}

async fn run(cli: Cli) -> anyhow::Result<i32> {
    let node = amber_node::default_home();
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
        Cmd::Prefetch { reference } => {
            let client = node_client(&registry, &node).await?;
            prefetch(&client, &reference).await?;
            Ok(0)
        }
        Cmd::Exec(a) => exec(&node, a).await,
        Cmd::Cp { src, dest } => cp(&node, &src, &dest).await,
        Cmd::Rm { ids } => {
            let client = running_client(&node);
            for id in ids {
                client.delete(&id).await?;
                println!("{id}");
            }
            Ok(0)
        }
        Cmd::Snapshot {
            id,
            tag,
            no_wait,
            json,
        } => {
            let client = running_client(&node);
            let req = amber_api::node::CreateSnapshot {
                tag,
                wait: !no_wait,
            };
            let s = client.snapshot(&id, &req).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                println!("{}", s.image);
            }
            Ok(0)
        }
        Cmd::Pause { ids } => {
            let client = running_client(&node);
            for id in ids {
                client.pause(&id).await?;
                println!("{id}");
            }
            Ok(0)
        }
        Cmd::Resume { ids } => {
            let client = running_client(&node);
            for id in ids {
                client.resume(&id).await?;
                println!("{id}");
            }
            Ok(0)
        }
        Cmd::Ps => {
            let client = running_client(&node);
            if client.health().await.is_err() {
                return Ok(0); // no amberd: no sandboxes
            }
            for s in client.list().await? {
                println!("{}\t{}\t{}", s.id, s.image, s.env_digest);
            }
            Ok(0)
        }
        Cmd::Reproduce { receipt } => reproduce(&node, &receipt, credentials.as_deref()).await,
        Cmd::Daemon(args) => Ok(daemon::run_daemon(&args, &node, registry).await),
    }
}

/// The sandbox create for these flags.
fn create_request(v: &VmArgs, image: String, hostname: Option<String>) -> CreateSandbox {
    CreateSandbox {
        image,
        cpus: v.cpus,
        memory_mib: v.memory,
        disk_mib: Some(v.disk),
        env: Default::default(),
        labels: Default::default(),
        workdir: v.workdir.clone(),
        user: v.user.clone(),
        hostname,
        lifetime_s: None,
        idle_timeout_s: None,
        idempotency_key: None,
        wait: true,
        kernel: None,
        initramfs: None,
        accel: None,
        root_device: v.root_device,
        prefetch: false,
        network: v.network(),
    }
}

/// Runs `req` in the sandbox through amberd, output passed through; its outcome.
async fn exec_in(
    client: &NodeClient,
    id: &str,
    req: &Request,
    timeout: Option<Duration>,
) -> anyhow::Result<session::Outcome> {
    let mux = client.attach(id).await?;
    let stdin: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>> = if req.stdin {
        Some(Box::new(tokio::io::stdin()))
    } else {
        None
    };
    let exec = session::exec(
        mux.open(),
        req,
        stdin,
        tokio::io::stdout(),
        tokio::io::stderr(),
    );
    let out = match timeout {
        Some(t) => match tokio::time::timeout(t, exec).await {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("timed out after {}s", t.as_secs())),
        },
        None => exec.await,
    };
    match out {
        Err(e) if e.is::<session::Stopped>() => {
            // Say why the sandbox went: the node knows (an integrity error, a dead VM and
            // its console) once it has ended it.
            let why = client
                .wait_ended(id, 30)
                .await
                .ok()
                .and_then(|s: SandboxInfo| s.reason)
                .unwrap_or_default();
            Err(anyhow::anyhow!("{why}").context(e))
        }
        r => r,
    }
}

async fn run_cmd(registry: &RegistryClient, node: &Path, a: RunArgs) -> anyhow::Result<i32> {
    let env = env_pairs(&a.vm.env);
    let mut opts = a.vm.options();
    opts.env = env.clone();
    // Resolve here, so the command line, the receipt and the sandbox name one image.
    let (resolved, state, mut l) = launch(registry, node, &opts, None).await?;
    let c = &resolved.config;
    let argv = run_argv(c, &a.command)
        .context("no command given and the image has no Entrypoint or Cmd")?;
    let req = request(
        c,
        argv,
        &env,
        a.vm.workdir.as_deref(),
        a.vm.user.as_deref(),
        &l.boot.hostname,
        a.interactive,
    );
    let timeout = a.timeout.map(Duration::from_secs);
    let out = if a.root_image.is_some() {
        // Benchmarks: boot a local raw image in this process, beside no daemon.
        l.root_image = a.root_image.clone();
        l.prefetch = a.prefetch;
        boot_and_exec(node, registry, &l, &req, timeout).await?
    } else {
        let client = node_client(registry, node).await?;
        // Boot the image just resolved, whatever its tag names by now.
        let pinned = match &resolved.image_digest {
            Some(d) => image::pinned(&a.vm.reference, d),
            None => resolved.env.to_string(),
        };
        if a.prefetch {
            prefetch(&client, &pinned).await?;
        }
        let mut c = create_request(&a.vm, pinned, a.vm.hostname.clone());
        c.prefetch = a.prefetch;
        // A run whose client died leaves nothing for long: once no client is attached,
        // the node ends it after this.
        c.idle_timeout_s = Some(60);
        c.kernel = Some(state.kernel.clone());
        c.initramfs = Some(state.initramfs.clone());
        let s = client.create(&c).await?;
        let out = exec_in(&client, &s.id, &req, timeout).await;
        let _ = client.delete(&s.id).await;
        out?
    };
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
            parents: resolved.parents.clone(),
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
    let client = node_client(&registry, node).await?;
    let c = CreateSandbox {
        image: r.env_digest.clone(),
        cpus: r.vm.cpus,
        memory_mib: r.vm.memory_mib,
        disk_mib: Some(r.vm.disk_mib),
        hostname: Some(r.boot.hostname.clone()),
        root_device: r.boot.root_device,
        kernel: Some(r.kernel.clone()),
        initramfs: Some(r.initramfs.clone()),
        accel: Some(r.vm.accel.clone()),
        idle_timeout_s: Some(60),
        wait: true,
        ..CreateSandbox::default()
    };
    let s = client.create(&c).await?;
    let out = exec_in(&client, &s.id, &r.request, None).await;
    let _ = client.delete(&s.id).await;
    let out = out?;
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
    let client = node_client(registry, node).await?;
    let mut c = create_request(&a.vm, a.vm.reference.clone(), a.vm.hostname.clone());
    for e in env_pairs(&a.vm.env) {
        let (k, v) = e.split_once('=').expect("K=V");
        c.env.insert(k.to_string(), v.to_string());
    }
    for l in &a.labels {
        let (k, v) = l
            .split_once('=')
            .with_context(|| format!("label {l:?} is not key=value"))?;
        c.labels.insert(k.to_string(), v.to_string());
    }
    c.lifetime_s = a.lifetime;
    c.idle_timeout_s = a.idle_timeout;
    if a.prefetch {
        prefetch(&client, &c.image).await?;
        // The node fetches what was evicted meanwhile before it boots.
        c.prefetch = true;
    }
    if a.count == 1 {
        created(&client.create(&c).await?);
        return Ok(0);
    }
    anyhow::ensure!(a.count > 0, "--count must be at least 1");
    let batch = amber_api::node::CreateBatch {
        sandboxes: vec![c; a.count as usize],
    };
    let mut failed = 0;
    for item in client.create_batch(&batch).await?.results {
        match (item.sandbox, item.error) {
            (Some(s), _) => created(&s),
            (None, Some(e)) => {
                eprintln!("amber: {}", e.message);
                failed += 1;
            }
            (None, None) => failed += 1,
        }
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

/// Fetches `reference`'s env into the node's cache, showing progress on stderr: a bar on
/// a terminal, otherwise a line at the start, at every tenth of the env's bytes cached,
/// and at the end.
async fn prefetch(client: &NodeClient, reference: &str) -> anyhow::Result<()> {
    use amber_api::node::PrefetchFrame;
    use std::io::IsTerminal;
    let bar = if std::io::stderr().is_terminal() {
        indicatif::ProgressBar::new(0).with_style(
            indicatif::ProgressStyle::with_template(
                "amber: prefetch {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        )
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut tenth_shown = None;
    let done = client
        .prefetch(reference, |f| {
            let (PrefetchFrame::Progress {
                cache,
                fetched_bytes,
            }
            | PrefetchFrame::Done {
                cache,
                fetched_bytes,
            }) = f
            else {
                return;
            };
            bar.set_message(short_env(&cache.env_digest));
            bar.set_length(cache.bytes);
            bar.set_position(cache.cached_bytes);
            let tenth = (cache.cached_bytes * 10)
                .checked_div(cache.bytes)
                .unwrap_or(10);
            let last = matches!(f, PrefetchFrame::Done { .. });
            if bar.is_hidden() && (last || tenth_shown != Some(tenth)) {
                tenth_shown = Some(tenth);
                eprintln!(
                    "amber: prefetch {}: {} of {} bytes cached, {} fetched{}",
                    cache.env_digest,
                    cache.cached_bytes,
                    cache.bytes,
                    fetched_bytes,
                    if last { ", done" } else { "" }
                );
            }
        })
        .await;
    bar.finish_and_clear();
    if let PrefetchFrame::Done {
        cache,
        fetched_bytes,
    } = done?
    {
        if !bar.is_hidden() {
            eprintln!(
                "amber: prefetched {}: {} chunks, {} ({} fetched)",
                cache.env_digest,
                cache.chunks,
                indicatif::HumanBytes(cache.bytes),
                indicatif::HumanBytes(fetched_bytes)
            );
        }
    }
    Ok(())
}

/// The start of an env digest, for a progress bar's label.
fn short_env(env: &str) -> String {
    env.chars().take("blake3:".len() + 12).collect()
}

/// Prints a new sandbox's id, and on stderr where the host reaches its published ports.
fn created(s: &amber_api::node::SandboxInfo) {
    println!("{}", s.id);
    for p in s.network.iter().flat_map(|n| &n.ports) {
        eprintln!("amber: {} port {} is at {}", s.id, p.guest_port, p.host);
    }
}

async fn exec(node: &Path, a: ExecArgs) -> anyhow::Result<i32> {
    let client = running_client(node);
    // Overrides only: the node fills in the sandbox's environment, directory and user.
    let req = Request {
        argv: a.command.clone(),
        env: env_pairs(&a.env),
        cwd: a.workdir.clone().unwrap_or_default(),
        user: a.user.clone().unwrap_or_default(),
        stdin: a.interactive,
    };
    let out = exec_in(&client, &a.id, &req, None).await?;
    Ok(out.status)
}

/// `ID:PATH` -> (id, path) when the id names a sandbox on this node.
async fn sandbox_path<'a>(client: &NodeClient, s: &'a str) -> Option<(&'a str, &'a str)> {
    let (id, path) = s.split_once(':')?;
    client.get(id).await.ok()?;
    Some((id, path))
}

async fn cp(node: &Path, src: &str, dest: &str) -> anyhow::Result<i32> {
    let client = running_client(node);
    match (
        sandbox_path(&client, src).await,
        sandbox_path(&client, dest).await,
    ) {
        (None, Some((id, path))) => {
            let mux = client.attach(id).await?;
            session::put(mux.open(), Path::new(src), path).await?;
        }
        (Some((id, path)), None) => {
            let mux = client.attach(id).await?;
            session::get(mux.open(), path, Path::new(dest)).await?;
        }
        (Some(_), Some(_)) => anyhow::bail!("copying between two sandboxes is not supported"),
        (None, None) => {
            anyhow::bail!("one of {src:?} and {dest:?} must be ID:PATH of a sandbox on this node")
        }
    }
    Ok(0)
}
