//! `amberd`: the node daemon. Owns every sandbox on this machine and serves the node API
//! on `$AMBER_HOME/amberd.sock` (and on TCP with `--listen` and a bearer token).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use amber_node::daemon::{run_daemon, DaemonArgs};
use amber_snapshotter::source::{RegistryClient, CREDENTIALS_ENV};

#[derive(Parser)]
#[command(name = "amberd", version, about = "amber's node daemon")]
struct Cli {
    /// The registry sandboxes' images and chunks come from.
    #[arg(long, env = "AMBER_REGISTRY", default_value = "http://127.0.0.1:5000")]
    registry: String,
    /// The node's directory (its cache, boot files and sandboxes).
    #[arg(long, env = "AMBER_HOME")]
    home: Option<PathBuf>,
    #[command(flatten)]
    daemon: DaemonArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    amber_node::init_logging();
    let cli = Cli::parse();
    let home = cli.home.unwrap_or_else(amber_node::default_home);
    let credentials = std::env::var(CREDENTIALS_ENV).ok();
    let registry = RegistryClient::new(
        &cli.registry,
        credentials.as_deref(),
        Duration::from_secs(300),
    );
    let code = run_daemon(&cli.daemon, &home, registry).await;
    std::process::ExitCode::from(code as u8)
}
