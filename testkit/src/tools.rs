//! The environment scripts/test prepares: variables it sets, tools it installs, the
//! Docker engine it starts, the workspace's built binaries and fixtures.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::Digest as _;

/// A variable scripts/test sets; panics naming it when it is not set.
pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: scripts/test sets it"))
}

/// The target profile directory holding the workspace's binaries (`target/debug`): the
/// test executable lives in its `deps/`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test executable is in <target>/<profile>/deps")
        .to_path_buf()
}

/// A binary of the workspace, built by `cargo build --workspace` (scripts/test does).
pub fn workspace_bin(name: &str) -> PathBuf {
    let bin = target_dir().join(name);
    assert!(
        bin.exists(),
        "{} is missing: build the workspace first (scripts/test does)",
        bin.display()
    );
    bin
}

/// A directory for what a test leaves to be looked at (screenshots): under
/// `$AMBER_TEST_OUTPUT` (scripts/test sets it), else `<target>/test-output`; emptied first.
pub fn test_output(name: &str) -> PathBuf {
    let root = std::env::var_os("AMBER_TEST_OUTPUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("test-output"));
    let dir = root.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// The repository root (for fixtures/).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit is in the workspace")
        .to_path_buf()
}

/// A tool the test needs; fails loudly when it is missing.
pub fn require_tool(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
        .unwrap_or_else(|| panic!("`{name}` is required by this test but is not on PATH; run scripts/test, which installs it"))
}

/// Runs a command, panicking with its output if it fails; returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd:?} failed with {}:\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `n` bytes that no compressor can shrink (splitmix64 from `seed`), so converting them
/// takes a while.
pub fn incompressible(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}

pub fn sha512(data: &[u8]) -> String {
    format!("sha512:{}", hex::encode(sha2::Sha512::digest(data)))
}

/// The docker CLI against the engine scripts/test started (AMBER_TEST_DOCKER_HOST).
pub fn docker() -> Command {
    require_tool("docker");
    let mut c = Command::new("docker");
    c.arg("-H").arg(env("AMBER_TEST_DOCKER_HOST"));
    c
}

/// Runs the docker CLI with `args`; returns stdout.
pub fn docker_ok(args: &[&str]) -> String {
    run(docker().args(args))
}

/// The Debian base imported into the engine as `amber-test/debian:bookworm` (the same
/// bytes every time: scripts/test builds it once with debootstrap).
pub fn debian_base() {
    docker_ok(&[
        "import",
        &env("AMBER_TEST_DEBIAN_ROOTFS"),
        "amber-test/debian:bookworm",
    ]);
}

/// Imports the busybox test root fs (`fixtures/busybox-rootfs.sh`) as
/// `amber-test/busybox:1`: a small image with wget, nc, httpd and nslookup.
pub fn busybox_base() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tar = dir.path().join("busybox.tar");
    run(Command::new(repo_root().join("fixtures/busybox-rootfs.sh")).arg(&tar));
    docker_ok(&["import", &tar.display().to_string(), "amber-test/busybox:1"]);
}

/// Builds `dockerfile` (with `files` beside it) as `image` and pushes it with the Docker
/// engine; returns the pushed manifest digest.
pub fn build_and_push(image: &str, dockerfile: &str, files: &[(&str, &Path)]) -> String {
    let ctx = build_context(dockerfile, files);
    run(docker()
        .args(["build", "-q", "--network", "host", "-t", image])
        .arg(ctx.path()));
    push(image)
}

/// Pushes `image` with the Docker engine; returns the pushed manifest digest.
pub fn push(image: &str) -> String {
    let out = run(docker().args(["push", image]));
    out.split("digest: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("pushed digest")
        .to_string()
}

fn build_context(dockerfile: &str, files: &[(&str, &Path)]) -> tempfile::TempDir {
    let ctx = tempfile::tempdir().expect("temp dir");
    std::fs::write(ctx.path().join("Dockerfile"), dockerfile).expect("writing the Dockerfile");
    for (name, src) in files {
        std::fs::copy(src, ctx.path().join(name))
            .unwrap_or_else(|e| panic!("copying {}: {e}", src.display()));
    }
    ctx
}

/// Builds `dockerfile` (with `files` beside it) as `image`, or, when an earlier run on this
/// machine built the same inputs, loads that build from the test cache (AMBER_TEST_CACHE,
/// where scripts/test also keeps the debootstrapped root file systems). For images whose
/// build downloads packages (apt, pip, npm): a test run then neither waits for nor
/// depends on the package mirrors, and the image it pushes is the same every time.
/// `salt` names inputs outside the context (a base image built by this helper: its key).
/// Returns this build's key.
pub fn build_cached(image: &str, dockerfile: &str, files: &[(&str, &Path)], salt: &str) -> String {
    let mut h = sha2::Sha256::new();
    for part in [salt, &env("AMBER_TEST_DEBIAN_ROOTFS"), dockerfile] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    for (name, src) in files {
        let bytes = std::fs::read(src).unwrap_or_else(|e| panic!("reading {}: {e}", src.display()));
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    let key = hex::encode(h.finalize())[..16].to_string();
    let cached_tag = format!("amber-test/cached:{key}");
    let dir = PathBuf::from(env("AMBER_TEST_CACHE")).join("images");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    let tar = dir.join(format!("{key}.tar"));
    if tar.exists() {
        run(docker().arg("load").arg("-q").arg("-i").arg(&tar));
    } else {
        let ctx = build_context(dockerfile, files);
        run(docker()
            .args(["build", "-q", "--network", "host", "-t", &cached_tag])
            .arg(ctx.path()));
        let partial = dir.join(format!("{key}.tar.partial"));
        run(docker()
            .arg("save")
            .arg("-o")
            .arg(&partial)
            .arg(&cached_tag));
        std::fs::rename(&partial, &tar)
            .unwrap_or_else(|e| panic!("renaming {}: {e}", partial.display()));
    }
    docker_ok(&["tag", &cached_tag, image]);
    key
}

/// Peak or current memory of a process from /proc/PID/status (`VmHWM:`, `VmRSS:`), KiB.
pub fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} missing from /proc/{pid}/status"))
}

/// Every file below `dir` (not directories), depth first.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}
