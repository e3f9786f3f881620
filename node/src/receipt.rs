//! Receipts: every digest a run depended on (image, env, kernel, initramfs, and a
//! snapshot's lineage), the VM shape,
//! the exact request, and the exit status and output digests. `amber reproduce` boots
//! exactly those bytes and compares the outcome.

use serde::{Deserialize, Serialize};

pub const RECEIPT_VERSION: u32 = 2;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Vm {
    pub accel: String,
    pub cpus: u32,
    pub memory_mib: u32,
    /// The writable disk in MiB; 0 (and receipts from before it) keeps writes in guest
    /// memory.
    #[serde(default)]
    pub disk_mib: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Receipt {
    pub version: u32,
    pub registry: String,
    pub reference: String,
    pub image_digest: Option<String>,
    pub env_digest: String,
    pub kernel_release: String,
    /// sha256 of the vmlinuz the VM booted.
    pub kernel: String,
    /// sha256 of the initramfs (guest agent + modules).
    pub initramfs: String,
    pub qemu: String,
    pub vm: Vm,
    pub boot: amber_guest::Boot,
    pub request: amber_guest::Request,
    pub exit_status: i32,
    pub stdout: String,
    pub stderr: String,
    /// When the image is a snapshot: the images it was made from, nearest first, each
    /// with its env digest (receipts from before snapshots have none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<amber_api::node::Parent>,
}

/// `qemu-system-x86_64 --version`, first line.
pub fn qemu_version() -> String {
    std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}
