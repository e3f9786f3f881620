//! `amber-nbd`: serves one env (a block manifest in the registry) as a read-only NBD
//! export on a Unix socket, fetching and verifying chunks lazily into a node cache.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

use amber_converter::manifest::EnvDigest;
use amber_snapshotter::cache::ChunkCache;
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::{RegistryClient, RegistrySource, CREDENTIALS_ENV};

#[derive(Parser)]
#[command(
    name = "amber-nbd",
    version,
    about = "Serve an amber env as a lazy NBD export"
)]
struct Cli {
    /// Registry base URL.
    #[arg(long, env = "AMBER_REGISTRY", default_value = "http://127.0.0.1:5000")]
    registry: String,
    /// The env digest (blake3:…) to serve.
    #[arg(long)]
    env: EnvDigest,
    /// Unix socket to listen on.
    #[arg(long)]
    socket: PathBuf,
    /// Node chunk cache directory.
    #[arg(long, env = "AMBER_CACHE", default_value = "/var/cache/amber/chunks")]
    cache: PathBuf,
    /// Cache size limit in bytes.
    #[arg(long, default_value_t = 10 << 30)]
    cache_bytes: u64,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("amber-nbd: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let credentials = std::env::var(CREDENTIALS_ENV).ok();
    let client = RegistryClient::new(
        &cli.registry,
        credentials.as_deref(),
        std::time::Duration::from_secs(300),
    );
    let source = Arc::new(RegistrySource::new(&client));
    let envelope = source.manifest(&cli.env).await?;
    let cache = Arc::new(ChunkCache::open(&cli.cache, cli.cache_bytes, source)?);
    let device = Arc::new(LazyDevice::new(envelope.manifest, cache));
    let _ = std::fs::remove_file(&cli.socket);
    let listener = tokio::net::UnixListener::bind(&cli.socket)
        .with_context(|| format!("binding {}", cli.socket.display()))?;
    println!("serving {} on {}", cli.env, cli.socket.display());
    amber_snapshotter::nbd::serve(listener, "amber".into(), device).await?;
    Ok(())
}
