//! Builds the guest agent (the `amber-guest` crate) as a static binary and hands its path
//! to the runner as `AMBER_GUEST_AGENT`, so `amber` carries the agent it speaks to and
//! `amber setup` needs nothing else on a node.
//!
//! The agent is PID 1 of every microVM, so it must not depend on the guest's libc: it is
//! linked with `-C target-feature=+crt-static` on the host's gnu target (the only
//! toolchain target here), in release mode, into `<target dir>/guest`, the same place
//! scripts/ used to build it, shared by every profile of the outer build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest_dir
        .parent()
        .expect("the runner is in the workspace")
        .to_path_buf();
    for p in ["guest/src", "guest/Cargo.toml", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    let target = guest_target_dir(&out);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args([
            "rustc",
            "--release",
            "--locked",
            "--offline",
            "-p",
            "amber-guest",
        ])
        .args(["--bin", "amber-guest", "--target-dir"])
        .arg(&target)
        // The agent lives in every guest's memory (the initramfs is never freed): no
        // debug info (7.7 MiB with it, 2 MiB without; symbols stay for backtraces).
        .args([
            "--",
            "-C",
            "target-feature=+crt-static",
            "-C",
            "strip=debuginfo",
        ]);
    // The outer build's settings are not the agent's: its own target dir, no wrappers
    // (clippy), no flags meant for the outer crates.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("CARGO_BUILD_")
            || k.starts_with("CARGO_PROFILE_")
            || k.starts_with("CARGO_CFG_")
            || k.starts_with("CARGO_FEATURE_")
            || matches!(
                k.as_str(),
                "CARGO_TARGET_DIR"
                    | "RUSTFLAGS"
                    | "CARGO_ENCODED_RUSTFLAGS"
                    | "RUSTC_WRAPPER"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "CARGO_MAKEFLAGS"
                    | "MAKEFLAGS"
                    | "MFLAGS"
            )
        {
            cmd.env_remove(&k);
        }
    }
    let status = cmd
        .status()
        .expect("running cargo to build the guest agent");
    assert!(
        status.success(),
        "building the static guest agent failed: {status}"
    );
    let agent = target.join("release/amber-guest");
    assert!(agent.is_file(), "{} was not built", agent.display());
    println!("cargo:rustc-env=AMBER_GUEST_AGENT={}", agent.display());
}

/// `<target dir>/guest`: OUT_DIR is `<target dir>[/<triple>]/<profile>/build/<pkg>/out`.
fn guest_target_dir(out: &Path) -> PathBuf {
    let build = out
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "build"))
        .expect("OUT_DIR lies under a build directory");
    build
        .parent()
        .and_then(Path::parent)
        .expect("the target dir is above the profile dir")
        .join("guest")
}
