//! The guest kernel on this node: a pinned Debian cloud kernel package, unpacked into the
//! node directory by `amber setup` (vmlinuz and the modules the guest loads), and the
//! initramfs built from it and the guest agent.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use sha2::Digest as _;

/// The pinned kernel package (Debian bookworm, cloud flavour).
pub const KERNEL_PACKAGE: &str = "linux-image-6.1.0-57-cloud-amd64";
pub const KERNEL_RELEASE: &str = "6.1.0-57-cloud-amd64";

/// Modules the guest needs, in load order (paths under lib/modules/<release>/kernel/).
pub const MODULES: &[&str] = &[
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/block/virtio_blk.ko",
    "drivers/char/virtio_console.ko",
    "lib/libcrc32c.ko",
    "fs/erofs/erofs.ko",
    "fs/overlayfs/overlay.ko",
];

/// What a node needs to boot envs.
pub struct NodeKernel {
    pub vmlinuz: PathBuf,
    pub initramfs: PathBuf,
}

pub fn node_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("AMBER_HOME") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".cache/amber")
}

pub fn sha256_file(p: &Path) -> anyhow::Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// Unpacks the pinned kernel (downloading the package with apt if needed) and builds the
/// initramfs around `guest` (the static guest agent). Idempotent.
pub fn setup(dir: &Path, guest: &Path) -> anyhow::Result<NodeKernel> {
    let kdir = dir.join("kernel").join(KERNEL_RELEASE);
    let vmlinuz = kdir.join("vmlinuz");
    if !vmlinuz.exists()
        || !MODULES
            .iter()
            .all(|m| kdir.join(Path::new(m).file_name().unwrap()).exists())
    {
        let work = dir.join("kernel").join("download");
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work)?;
        let st = Command::new("apt-get")
            .args(["download", KERNEL_PACKAGE])
            .current_dir(&work)
            .status()
            .context(
                "running apt-get download (Debian's apt is required to fetch the guest kernel)",
            )?;
        if !st.success() {
            bail!("apt-get download {KERNEL_PACKAGE} failed");
        }
        let deb = std::fs::read_dir(&work)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .context("no .deb downloaded")?;
        let x = work.join("x");
        let st = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&x)
            .status()
            .context("running dpkg-deb")?;
        if !st.success() {
            bail!("dpkg-deb -x {} failed", deb.display());
        }
        std::fs::create_dir_all(&kdir)?;
        std::fs::copy(x.join(format!("boot/vmlinuz-{KERNEL_RELEASE}")), &vmlinuz)?;
        for m in MODULES {
            let src = x.join(format!("lib/modules/{KERNEL_RELEASE}/kernel/{m}"));
            std::fs::copy(&src, kdir.join(Path::new(m).file_name().unwrap()))
                .with_context(|| format!("copying {}", src.display()))?;
        }
        std::fs::remove_dir_all(&work)?;
    }
    let init = std::fs::read(guest)
        .with_context(|| format!("reading the guest agent {}", guest.display()))?;
    let mut modules = Vec::new();
    for m in MODULES {
        let name = Path::new(m)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        modules.push((name.clone(), std::fs::read(kdir.join(&name))?));
    }
    let mut cpio = Vec::new();
    crate::initramfs::write(&mut cpio, &init, &modules)?;
    let initramfs = dir.join("initramfs.cpio");
    let tmp = dir.join("initramfs.cpio.tmp");
    std::fs::write(&tmp, &cpio)?;
    std::fs::rename(&tmp, &initramfs)?;
    Ok(NodeKernel { vmlinuz, initramfs })
}
