//! `amber`, the user's command: resolve a reference, boot a microVM on the env's lazy
//! block device, run a command as `docker run` would, and pass its output and status
//! through.
//!
//! Modules: `initramfs` (deterministic cpio of the guest agent and kernel modules),
//! `kernel` (the guest's boot files on the node and in the registry, the accelerator
//! probe), `image` (reference resolution and the image config), `vm` (QEMU microvm),
//! `mux` (the guest protocol's sessions over a stream), `session` (exec and copies over
//! a session), `sandbox` (a VM on its lazy export; the daemon behind `amber create`),
//! `receipt` (what a run depended on).

pub mod image;
pub mod initramfs;
pub mod kernel;
pub mod mux;
pub mod receipt;
pub mod sandbox;
pub mod session;
pub mod vm;
