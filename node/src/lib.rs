//! amber's node: everything that runs environments on one machine. The `amber` command
//! line is a thin client of `amberd` (`daemon`), which serves the node API.
//!
//! Modules:
//! - `kernel`: the guest's boot files on the node and in the registry (the pinned Debian
//!   kernel, the initramfs around the agent built into this binary), the accelerator
//!   probe; `initramfs`: its deterministic, gzip-compressed cpio;
//! - `image`: reference resolution through the registry, with every manifest and config
//!   byte verified against its digest;
//! - `command`: `docker run`/`docker exec` semantics (argv, environment, cwd, user);
//! - `exports`: the per-process chunk cache and one shared NBD export per env;
//! - `vm`: QEMU microvm, the agent's protocol version check, pause and restore through
//!   `qmp`; `mux` and `session`:
//!   the guest protocol's sessions (exec, copies) over a stream;
//! - `sandbox`: a VM on its env's export, and the relay of an attached client's sessions;
//! - `service`: every sandbox of the node, limits, lifetimes, commands (`process`) and
//!   files (`files`); `http`: the node API over it (OpenAPI); `daemon`: `amberd`, the one
//!   process per node serving it; `client`: the Rust client of that API;
//! - `snapshot`: a sandbox's files committed as a new image (one more layer);
//! - `network`: a sandbox's network spec read into the netstack's policy (amber-netstack
//!   runs it), the guest's interface settings;
//! - `run`: one-shot runs (`amber run`, `amber reproduce`); `receipt`: what a run
//!   depended on.

pub mod client;
pub mod command;
pub mod daemon;
pub mod disk;
pub mod exports;
pub mod files;
pub mod http;
pub mod image;
pub mod initramfs;
pub mod kernel;
pub mod mux;
pub mod network;
pub mod process;
pub mod qmp;
pub mod receipt;
pub mod run;
pub mod sandbox;
pub mod service;
pub mod session;
pub mod snapshot;
pub mod vm;

/// The node's directory when `AMBER_HOME` is not set: `~/.cache/amber`.
pub fn default_home() -> std::path::PathBuf {
    if let Some(d) = std::env::var_os("AMBER_HOME") {
        return std::path::PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/tmp"));
    home.join(".cache/amber")
}

/// Logs to stderr at the level `AMBER_LOG` sets (default `warn`), for amber's binaries;
/// colours only on a terminal (a daemon the CLI starts logs to `amberd.log`).
pub fn init_logging() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AMBER_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
}
