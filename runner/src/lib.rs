//! `amber`, the user's command: resolve a reference, boot a microVM on the env's lazy
//! block device, run a command as `docker run` would, and pass its output and status
//! through.
//!
//! Modules: `initramfs` (deterministic cpio of the guest agent and kernel modules),
//! `kernel` (the pinned guest kernel on this node), `image` (reference resolution and
//! the image config), `vm` (QEMU microvm and the control channel), `receipt` (what a run
//! depended on, and reproducing it).

pub mod image;
pub mod initramfs;
pub mod kernel;
pub mod receipt;
pub mod vm;
