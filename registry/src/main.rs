//! `amber-registry`: serve the registry, or check its storage.

use clap::{Parser, Subcommand};

use amber_registry::config::ConfigArgs;

#[derive(Parser)]
#[command(
    name = "amber-registry",
    version,
    about = "amber's OCI registry of execution environments"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OCI Distribution API and the amber API.
    Serve(ConfigArgs),
    /// Verify every stored object's hash and the index against the store; changes nothing.
    Fsck(ConfigArgs),
    /// Rebuild the index from the object store alone (new replica, lost index).
    Reindex(ConfigArgs),
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("AMBER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("AMBER_LOG_FORMAT").as_deref() == Ok("json") {
        fmt.json().init();
    } else {
        fmt.init();
    }
}

/// Keeps glibc's allocator from holding freed upload and download buffers: a fixed mmap
/// threshold returns large buffers to the kernel when freed (the default threshold grows
/// after the first free and then keeps them in per-thread arenas), and two arenas bound
/// how many heaps the blocking I/O threads spread over.
fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

fn main() -> std::process::ExitCode {
    tune_allocator();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("starting the tokio runtime")
        .block_on(async_main())
}

async fn async_main() -> std::process::ExitCode {
    init_logs();
    match run(Cli::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("amber-registry: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    match cli.command {
        Command::Serve(args) => {
            let config = args.resolve()?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .map_err(|e| anyhow::anyhow!("binding {}: {e}", config.listen))?;
            let reg = amber_registry::server::open(config).await?;
            amber_registry::server::serve(reg, listener).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Reindex(args) => {
            let s = amber_registry::reindex::reindex(args.resolve()?).await?;
            println!(
                "reindexed {} manifests, {} blobs, {} tags, {} conversions, {} chunks",
                s.manifests, s.blobs, s.tags, s.conversions, s.chunks
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Fsck(args) => {
            let reg = amber_registry::server::open(args.resolve()?).await?;
            let (checked, problems) = amber_registry::fsck::check(&reg).await?;
            for p in &problems {
                println!("problem: {p}");
            }
            println!("checked {checked} objects, {} problems", problems.len());
            Ok(if problems.is_empty() {
                std::process::ExitCode::SUCCESS
            } else {
                std::process::ExitCode::FAILURE
            })
        }
    }
}
