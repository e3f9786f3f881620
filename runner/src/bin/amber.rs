//! `amber`: run pinned environments in microVMs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use amber_runner::{image, kernel, receipt, vm};
use amber_snapshotter::cache::ChunkCache;
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::RegistrySource;

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
    /// Prepare this node: the pinned guest kernel and the initramfs.
    Setup {
        /// The static guest agent binary.
        #[arg(long, env = "AMBER_GUEST")]
        guest: PathBuf,
    },
    /// Run a command in a fresh microVM of REF, as `docker run REF CMD` would.
    Run(Box<RunArgs>),
    /// Boot exactly what a receipt pinned and run its command again.
    Reproduce { receipt: PathBuf },
}

#[derive(clap::Args)]
struct RunArgs {
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
    /// Seconds before the VM is stopped.
    #[arg(long)]
    timeout: Option<u64>,
    /// QEMU accelerator: tcg or kvm.
    #[arg(long, env = "AMBER_ACCEL", default_value = "tcg")]
    accel: String,
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
    let dir = kernel::node_dir();
    match cli.command {
        Cmd::Setup { guest } => {
            let k = kernel::setup(&dir, &guest)?;
            println!(
                "kernel {} {}",
                kernel::KERNEL_RELEASE,
                kernel::sha256_file(&k.vmlinuz)?
            );
            println!("initramfs {}", kernel::sha256_file(&k.initramfs)?);
            Ok(0)
        }
        Cmd::Run(a) => run_cmd(&cli.registry, &dir, *a).await,
        Cmd::Reproduce { receipt } => reproduce(&dir, &receipt).await,
    }
}

fn node_files(dir: &std::path::Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let vmlinuz = dir
        .join("kernel")
        .join(kernel::KERNEL_RELEASE)
        .join("vmlinuz");
    let initramfs = dir.join("initramfs.cpio");
    anyhow::ensure!(
        vmlinuz.exists() && initramfs.exists(),
        "this node is not set up: run `amber setup`"
    );
    Ok((vmlinuz, initramfs))
}

/// How to attach the root disk.
#[derive(Default)]
struct BootOptions {
    prefetch: bool,
    root_image: Option<PathBuf>,
}

/// Boots `env` and runs `req` on it.
async fn boot(
    registry: &str,
    dir: &std::path::Path,
    env: &amber_converter::manifest::EnvDigest,
    req: &amber_guest::Request,
    shape: &receipt::Vm,
    timeout: Option<Duration>,
    opts: BootOptions,
) -> anyhow::Result<vm::Outcome> {
    let (vmlinuz, initramfs) = node_files(dir)?;
    let work = tempfile_dir(dir)?;
    let source = Arc::new(RegistrySource::new(registry));
    let envelope = match source.manifest(env).await {
        Err(amber_snapshotter::source::SourceError::NotFound(_)) => {
            anyhow::bail!("env {env} is not in the registry at {registry}")
        }
        r => r?,
    };
    let cache = Arc::new(ChunkCache::open(dir.join("chunks"), 20 << 30, source)?);
    if opts.prefetch {
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
    let device = Arc::new(LazyDevice::new(envelope.manifest, cache));
    let nbd_socket = work.join("root.sock");
    let listener = tokio::net::UnixListener::bind(&nbd_socket)?;
    let server = tokio::spawn(amber_snapshotter::nbd::serve(
        listener,
        "amber".into(),
        device,
    ));
    let root = match opts.root_image {
        Some(p) => vm::Root::RawFile(p),
        None => vm::Root::Nbd(nbd_socket),
    };
    let spec = vm::VmSpec {
        qemu: PathBuf::from("qemu-system-x86_64"),
        accel: shape.accel.clone(),
        cpus: shape.cpus,
        memory_mib: shape.memory_mib,
        kernel: vmlinuz,
        initramfs,
        root,
        work: work.clone(),
    };
    let result = vm::run(&spec, req, timeout).await;
    server.abort();
    let _ = std::fs::remove_dir_all(&work);
    result
}

async fn reproduce(dir: &std::path::Path, path: &std::path::Path) -> anyhow::Result<i32> {
    let text =
        std::fs::read(path).with_context(|| format!("reading receipt {}", path.display()))?;
    let r: receipt::Receipt =
        serde_json::from_slice(&text).with_context(|| format!("receipt {}", path.display()))?;
    anyhow::ensure!(
        r.version == receipt::RECEIPT_VERSION,
        "receipt version {} is not supported",
        r.version
    );
    anyhow::ensure!(
        r.kernel_release == kernel::KERNEL_RELEASE,
        "the receipt pinned kernel {} but this node has {}: run a matching amber",
        r.kernel_release,
        kernel::KERNEL_RELEASE
    );
    let (vmlinuz, initramfs) = node_files(dir)?;
    let k = kernel::sha256_file(&vmlinuz)?;
    anyhow::ensure!(
        k == r.kernel,
        "the pinned kernel {} is not on this node (it has {k})",
        r.kernel
    );
    let i = kernel::sha256_file(&initramfs)?;
    anyhow::ensure!(i == r.initramfs, "the pinned initramfs {} is not on this node (it has {i}): run `amber setup` with the same guest agent", r.initramfs);
    let env: amber_converter::manifest::EnvDigest = r.env_digest.parse()?;
    let out = boot(
        &r.registry,
        dir,
        &env,
        &r.request,
        &r.vm,
        None,
        BootOptions::default(),
    )
    .await?;
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

async fn run_cmd(registry: &str, dir: &std::path::Path, a: RunArgs) -> anyhow::Result<i32> {
    node_files(dir)?;
    let resolved = image::resolve(registry, &a.reference, Duration::from_secs(600)).await?;
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
    let hostname = a
        .hostname
        .clone()
        .unwrap_or_else(|| resolved.env.hex()[..12].to_string());
    let mut env = c.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.insert(
            0,
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        );
    }
    env.push(format!("HOSTNAME={hostname}"));
    for e in &a.env {
        let key = e.split('=').next().unwrap_or("");
        env.retain(|x| x.split('=').next() != Some(key));
        env.push(e.clone());
    }
    let req = amber_guest::Request {
        argv,
        env,
        cwd: a.workdir.clone().unwrap_or_else(|| {
            if c.working_dir.is_empty() {
                "/".into()
            } else {
                c.working_dir.clone()
            }
        }),
        user: a.user.clone().unwrap_or_else(|| c.user.clone()),
        hostname,
    };
    let shape = receipt::Vm {
        accel: a.accel.clone(),
        cpus: a.cpus,
        memory_mib: a.memory,
    };
    let opts = BootOptions {
        prefetch: a.prefetch,
        root_image: a.root_image.clone(),
    };
    let out = boot(
        registry,
        dir,
        &resolved.env,
        &req,
        &shape,
        a.timeout.map(Duration::from_secs),
        opts,
    )
    .await?;
    if let Some(path) = &a.receipt {
        let (vmlinuz, initramfs) = node_files(dir)?;
        let r = receipt::Receipt {
            version: receipt::RECEIPT_VERSION,
            registry: registry.to_string(),
            reference: a.reference.clone(),
            image_digest: resolved.image_digest.clone(),
            env_digest: resolved.env.to_string(),
            kernel_release: kernel::KERNEL_RELEASE.to_string(),
            kernel: kernel::sha256_file(&vmlinuz)?,
            initramfs: kernel::sha256_file(&initramfs)?,
            qemu: receipt::qemu_version(),
            vm: shape,
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

fn tempfile_dir(dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let base = dir.join("run");
    std::fs::create_dir_all(&base)?;
    let p = base.join(format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    ));
    std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    Ok(p)
}
