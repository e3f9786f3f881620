//! amber's node: everything that runs environments on one machine. The `amber` command
//! line is a thin layer over it, and the node service (`amberd`) grows from `daemon`.
//!
//! Modules:
//! - `kernel`: the guest's boot files on the node and in the registry (the pinned Debian
//!   kernel, the initramfs around the agent built into this binary), the accelerator
//!   probe; `initramfs`: its deterministic cpio;
//! - `image`: reference resolution through the registry, with every manifest and config
//!   byte verified against its digest;
//! - `command`: `docker run`/`docker exec` semantics (argv, environment, cwd, user);
//! - `exports`: the per-process chunk cache and one shared NBD export per env;
//! - `vm`: QEMU microvm and the agent's protocol version check; `mux` and `session`:
//!   the guest protocol's sessions (exec, copies) over a stream;
//! - `sandbox`: a VM on its env's export and the socket that serves exec/cp/rm;
//! - `daemon`: the one process per node that owns every `amber create` sandbox;
//! - `run`: one-shot runs (`amber run`, `amber reproduce`); `receipt`: what a run
//!   depended on.

pub mod command;
pub mod daemon;
pub mod exports;
pub mod image;
pub mod initramfs;
pub mod kernel;
pub mod mux;
pub mod receipt;
pub mod run;
pub mod sandbox;
pub mod session;
pub mod vm;
