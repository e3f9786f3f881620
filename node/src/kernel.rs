//! The guest's boot files on this node and in the registry: the pinned Debian cloud
//! kernel (vmlinuz and the modules the guest loads) and the initramfs built from them and
//! the guest agent.
//!
//! `amber setup` takes the kernel from the registry's `amber/guest` repository (tag
//! `kernel-<release>`) or, the first time anywhere, from the Debian archive, and pushes
//! it there as an OCI artifact; it pushes the initramfs too (tag `boot-<digest>`), so a
//! receipt's boot files can always be fetched by digest, whatever the archive keeps.
//! Boot files live on the node under `boot/<sha256 hex>`; `node.json` says which ones
//! this node runs and which accelerator its probe boot chose.
//!
//! The kernel's whole module tree (with depmod's indexes) is an ordinary image too,
//! `amber/guest:modules-<release>-m<set>`, which the registry converts into an env like
//! any push: every VM gets it as a second lazy, verified, read-only disk, and the agent
//! loads a module from it when the kernel asks for one (a bridge, netfilter, loop, fuse:
//! what Docker and tasks inside a sandbox need), so only the modules used are fetched.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use amber_distribution::{DistributionClient, DistributionError, Pusher};
use amber_oci::digest::Digest;
use amber_oci::names::Reference;
use amber_snapshotter::source::RegistryClient;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

/// The static guest agent this `amber` was built with (runner/build.rs), the init of the
/// initramfs unless `amber setup --guest PATH` names another.
pub static GUEST_AGENT: &[u8] = include_bytes!(env!("AMBER_GUEST_AGENT"));

/// The pinned kernel package (Debian bookworm, cloud flavour).
pub const KERNEL_PACKAGE: &str = "linux-image-6.1.0-57-cloud-amd64";
pub const KERNEL_RELEASE: &str = "6.1.0-57-cloud-amd64";

/// The registry repository holding boot files.
pub const GUEST_REPO: &str = "amber/guest";
use amber_oci::media::{
    GUEST_ARTIFACT as ARTIFACT_TYPE, GUEST_INITRAMFS as INITRAMFS_TYPE,
    GUEST_MODULES as MODULES_TYPE, GUEST_VMLINUZ as VMLINUZ_TYPE, OCI_EMPTY as EMPTY_TYPE,
    OCI_MANIFEST as MANIFEST_TYPE,
};

/// The version of `MODULES`: part of the registry's kernel artifact tag, so a registry
/// holding an older module set is given a new artifact instead of failing a setup (set 1,
/// tagged `kernel-<release>`, had no virtio_balloon; set 2 had no virtio_net).
pub const MODULE_SET: u32 = 3;

/// Modules the guest needs, in load order (paths under lib/modules/<release>/kernel/).
pub const MODULES: &[&str] = &[
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/block/virtio_blk.ko",
    "drivers/char/virtio_console.ko",
    // Free page reporting: the guest hands memory it freed back to the host.
    "drivers/virtio/virtio_balloon.ko",
    // The network interface of sandboxes created with a network.
    "net/core/failover.ko",
    "drivers/net/net_failover.ko",
    "drivers/net/virtio_net.ko",
    "lib/libcrc32c.ko",
    "fs/erofs/erofs.ko",
    "fs/overlayfs/overlay.ko",
];

/// What this node boots, written by `amber setup`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeState {
    pub kernel_release: String,
    /// sha256 of vmlinuz.
    pub kernel: String,
    /// sha256 of the initramfs.
    pub initramfs: String,
    /// `kvm` when a probe boot with KVM succeeded, else `tcg`.
    pub accel: String,
    /// The env of the kernel's module tree (`MODULES_IMAGE`), when setup made one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modules_env: Option<String>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(bytes))
}

pub fn sha256_file(p: &Path) -> anyhow::Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// Where the boot file with this digest lives on the node.
pub fn boot_path(dir: &Path, digest: &str) -> PathBuf {
    dir.join("boot")
        .join(digest.strip_prefix("sha256:").unwrap_or(digest))
}

/// Stores `bytes` as a boot file; returns its digest.
fn store_boot_file(dir: &Path, bytes: &[u8]) -> anyhow::Result<String> {
    let digest = format!("sha256:{}", sha256_hex(bytes));
    let p = boot_path(dir, &digest);
    if !p.exists() {
        std::fs::create_dir_all(p.parent().expect("parent"))?;
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &p)?;
    }
    Ok(digest)
}

/// Why a boot file or the node's state is not at hand.
#[derive(Debug, thiserror::Error)]
pub enum BootFileError {
    #[error("this node is not set up ({path}): run `amber setup`")]
    NotSetUp { path: PathBuf },
    #[error("{path} is unreadable: {why}; run `amber setup` again")]
    NodeState { path: PathBuf, why: String },
    #[error("the pinned {what} {digest} is neither on this node nor in {registry}/{GUEST_REPO}")]
    Missing {
        what: String,
        digest: String,
        registry: String,
    },
    #[error("fetching the pinned {what} {digest}: {why}")]
    Fetch {
        what: String,
        digest: String,
        why: String,
    },
    #[error("storing the pinned {what} {digest} on this node: {why}")]
    Store {
        what: String,
        digest: String,
        why: String,
    },
}

pub fn read_node(dir: &Path) -> Result<NodeState, BootFileError> {
    let p = dir.join("node.json");
    let text = std::fs::read(&p).map_err(|_| BootFileError::NotSetUp { path: p.clone() })?;
    serde_json::from_slice(&text).map_err(|e| BootFileError::NodeState {
        path: p,
        why: e.to_string(),
    })
}

/// The most a boot file (vmlinuz, the module set, an initramfs) may take.
const MAX_BOOT_FILE: usize = 256 << 20;
/// The most the artifact manifest of boot files may take.
const MAX_ARTIFACT_MANIFEST: usize = 1 << 20;

/// The registry's `amber/guest` repository, through the registry's one verified client.
struct GuestRepo<'a> {
    oci: &'a DistributionClient,
}

impl GuestRepo<'_> {
    fn new(registry: &RegistryClient) -> GuestRepo<'_> {
        GuestRepo {
            oci: registry.distribution(),
        }
    }

    /// A blob, verified against its digest; `None` when the registry does not have it.
    async fn blob(&self, digest: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let d: Digest = digest
            .parse()
            .with_context(|| format!("boot file digest {digest:?}"))?;
        match self.oci.blob(GUEST_REPO, &d, MAX_BOOT_FILE).await {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(DistributionError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Pushes `bytes` unless the repository has them; their descriptor (digest, size).
    async fn push_blob(pusher: &Pusher<'_>, bytes: &[u8]) -> anyhow::Result<serde_json::Value> {
        let digest = pusher
            .push_bytes(bytes::Bytes::copy_from_slice(bytes))
            .await
            .context("pushing a boot file")?;
        Ok(serde_json::json!({"digest": digest.to_string(), "size": bytes.len()}))
    }

    /// Pushes an image of one uncompressed layer `tar` under `tag` (the registry
    /// converts it as any push).
    async fn push_image(&self, tag: &str, tar: &[u8]) -> anyhow::Result<()> {
        let pusher = self.oci.pusher(GUEST_REPO).await?;
        let mut l = Self::push_blob(&pusher, tar).await?;
        l["mediaType"] = amber_oci::media::OCI_LAYER_TAR.into();
        // An uncompressed layer's diff id is its digest.
        let config = serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [l["digest"]]},
        });
        let mut c = Self::push_blob(&pusher, &serde_json::to_vec(&config)?).await?;
        c["mediaType"] = amber_oci::media::OCI_CONFIG.into();
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": c,
            "layers": [l],
        });
        pusher
            .put_manifest(tag, serde_json::to_vec(&manifest)?, MANIFEST_TYPE)
            .await?;
        Ok(())
    }

    /// Pushes an artifact of `layers` (media type, bytes, title) under `tag`.
    async fn push(&self, tag: &str, layers: &[(&str, &[u8], &str)]) -> anyhow::Result<()> {
        let pusher = self.oci.pusher(GUEST_REPO).await?;
        let mut config = Self::push_blob(&pusher, b"{}").await?;
        config["mediaType"] = EMPTY_TYPE.into();
        let mut descs = Vec::new();
        for (media_type, bytes, title) in layers {
            let mut d = Self::push_blob(&pusher, bytes).await?;
            d["mediaType"] = (*media_type).into();
            d["annotations"] = serde_json::json!({"org.opencontainers.image.title": title});
            descs.push(d);
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "config": config,
            "layers": descs,
        });
        pusher
            .put_manifest(tag, serde_json::to_vec(&manifest)?, MANIFEST_TYPE)
            .await?;
        Ok(())
    }

    /// The layers of the artifact tagged `tag` (title -> digest); `None` if there is none.
    async fn artifact(&self, tag: &str) -> anyhow::Result<Option<Vec<(String, String)>>> {
        let r = Reference::parse(tag).with_context(|| format!("boot file tag {tag:?}"))?;
        let bytes = match self
            .oci
            .manifest(GUEST_REPO, &r, &[MANIFEST_TYPE], MAX_ARTIFACT_MANIFEST)
            .await
        {
            Ok((b, _)) => b,
            Err(DistributionError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let m: serde_json::Value = serde_json::from_slice(&bytes)
            .with_context(|| format!("the manifest of {GUEST_REPO}:{tag}"))?;
        Ok(Some(
            m["layers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|l| {
                    Some((
                        l["annotations"]["org.opencontainers.image.title"]
                            .as_str()?
                            .to_string(),
                        l["digest"].as_str()?.to_string(),
                    ))
                })
                .collect(),
        ))
    }
}

/// Appends a regular file with a fixed owner, mode and time (deterministic tars).
fn append_file(b: &mut tar::Builder<Vec<u8>>, path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut h = tar::Header::new_ustar();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, path, data)
}

/// The modules as a deterministic tar (sorted, fixed owner, mode and time).
fn modules_tar(modules: &[(String, Vec<u8>)]) -> anyhow::Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    let mut sorted: Vec<_> = modules.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, data) in sorted {
        append_file(&mut b, Path::new(name), data)?;
    }
    Ok(b.into_inner()?)
}

fn module_name(m: &str) -> String {
    Path::new(m)
        .file_name()
        .expect("module path")
        .to_string_lossy()
        .into_owned()
}

/// vmlinuz and the modules (file name, bytes).
type KernelFiles = (Vec<u8>, Vec<(String, Vec<u8>)>);

/// The tag of the module tree's image in `GUEST_REPO`.
pub fn modules_tag() -> String {
    format!("modules-{KERNEL_RELEASE}-m{MODULE_SET}")
}

/// The kernel package's module tree as a tar of `lib/modules/<release>/` (its root is
/// that directory), with the indexes `depmod` writes, deterministic (sorted, fixed
/// owners and times).
fn module_tree_tar(unpacked: &Path) -> anyhow::Result<Vec<u8>> {
    let st = Command::new("depmod")
        .arg("-b")
        .arg(unpacked)
        .arg(KERNEL_RELEASE)
        .status()
        .context("running depmod (Debian package kmod) for the guest kernel's module indexes")?;
    if !st.success() {
        bail!("depmod -b {} {KERNEL_RELEASE} failed", unpacked.display());
    }
    let root = unpacked.join(format!("lib/modules/{KERNEL_RELEASE}"));
    let mut files = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.is_file() {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut b = tar::Builder::new(Vec::new());
    for p in files {
        let rel = p.strip_prefix(&root).expect("under the root");
        append_file(&mut b, rel, &std::fs::read(&p)?)?;
    }
    Ok(b.into_inner()?)
}

/// Downloads and unpacks the kernel package into `work/x`.
fn unpack_debian(work: &Path) -> anyhow::Result<PathBuf> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let st = Command::new("apt-get")
        .args(["download", KERNEL_PACKAGE])
        .current_dir(work)
        .status()
        .context("running apt-get download (Debian's apt fetches the guest kernel once)")?;
    if !st.success() {
        bail!("apt-get download {KERNEL_PACKAGE} failed");
    }
    let deb = std::fs::read_dir(work)?
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
    Ok(x)
}

/// The kernel from the Debian archive, and its module tree (`module_tree_tar`).
fn kernel_from_debian(work: &Path) -> anyhow::Result<(KernelFiles, Vec<u8>)> {
    let x = unpack_debian(work)?;
    let tree = module_tree_tar(&x)?;
    let vmlinuz = std::fs::read(x.join(format!("boot/vmlinuz-{KERNEL_RELEASE}")))?;
    let mut modules = Vec::new();
    for m in MODULES {
        let src = x.join(format!("lib/modules/{KERNEL_RELEASE}/kernel/{m}"));
        let data = std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
        modules.push((module_name(m), data));
    }
    std::fs::remove_dir_all(work)?;
    Ok(((vmlinuz, modules), tree))
}

/// Prepares this node: kernel from the registry (or Debian, then pushed), the initramfs
/// around `guest`, both pushed and stored by digest, and the accelerator probe. Idempotent.
pub async fn setup(
    dir: &Path,
    registry: &RegistryClient,
    guest: &[u8],
) -> anyhow::Result<NodeState> {
    let repo = GuestRepo::new(registry);
    let kernel_tag = format!("kernel-{KERNEL_RELEASE}-m{MODULE_SET}");
    let from_registry = match repo.artifact(&kernel_tag).await? {
        Some(layers) => {
            let find = |title: &str| {
                layers
                    .iter()
                    .find(|(t, _)| t == title)
                    .map(|(_, d)| d.clone())
                    .with_context(|| format!("{GUEST_REPO}:{kernel_tag} has no {title}"))
            };
            let vmlinuz = repo.blob(&find("vmlinuz")?).await?;
            let mods = repo.blob(&find("modules.tar")?).await?;
            match (vmlinuz, mods) {
                (Some(v), Some(m)) => {
                    let mut modules = Vec::new();
                    for e in tar::Archive::new(&m[..]).entries()? {
                        let mut e = e?;
                        let name = e.path()?.to_string_lossy().into_owned();
                        let mut data = Vec::new();
                        std::io::Read::read_to_end(&mut e, &mut data)?;
                        modules.push((name, data));
                    }
                    Some((v, modules))
                }
                _ => None,
            }
        }
        None => None,
    };
    let mut tree = None;
    let (vmlinuz, modules) = match from_registry {
        Some(k) => k,
        None => {
            let (k, t) = kernel_from_debian(&dir.join("kernel-download"))?;
            tree = Some(t);
            repo.push(
                &kernel_tag,
                &[
                    (VMLINUZ_TYPE, &k.0, "vmlinuz"),
                    (MODULES_TYPE, &modules_tar(&k.1)?, "modules.tar"),
                ],
            )
            .await?;
            k
        }
    };
    let mut ordered = Vec::new();
    for m in MODULES {
        let name = module_name(m);
        let data = modules
            .iter()
            .find(|(n, _)| *n == name)
            .with_context(|| format!("the kernel artifact lacks {name}"))?;
        ordered.push(data.clone());
    }
    let mut cpio = Vec::new();
    crate::initramfs::write(&mut cpio, guest, &ordered)?;
    let kernel = store_boot_file(dir, &vmlinuz)?;
    let initramfs = store_boot_file(dir, &cpio)?;
    repo.push(
        &format!("boot-{}", &initramfs["sha256:".len()..][..16]),
        &[
            (VMLINUZ_TYPE, &vmlinuz, "vmlinuz"),
            (INITRAMFS_TYPE, &cpio, "initramfs.cpio.gz"),
        ],
    )
    .await?;
    // The probe costs a boot (up to 15 s where KVM hangs): reuse it for the same kernel.
    let accel = match read_node(dir) {
        Ok(old) if old.kernel == kernel => old.accel,
        _ => probe_accel(&boot_path(dir, &kernel)).await,
    };
    let modules_env = modules_env(dir, registry, &repo, tree).await?;
    let state = NodeState {
        kernel_release: KERNEL_RELEASE.into(),
        kernel,
        initramfs,
        accel,
        modules_env: Some(modules_env),
    };
    let p = dir.join("node.json");
    let tmp = dir.join("node.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&state)?)?;
    std::fs::rename(&tmp, &p)?;
    Ok(state)
}

/// The env of the module tree's image: the registry's, or pushed from `tree` (or from
/// the kernel package, downloaded again) and converted first.
async fn modules_env(
    dir: &Path,
    registry: &RegistryClient,
    repo: &GuestRepo<'_>,
    tree: Option<Vec<u8>>,
) -> anyhow::Result<String> {
    let reference = format!("{GUEST_REPO}:{}", modules_tag());
    let wait = Duration::from_secs(600);
    if let Ok(r) = crate::image::resolve(registry, &reference, wait).await {
        return Ok(r.env.to_string());
    }
    let tree = match tree {
        Some(t) => t,
        None => {
            let work = dir.join("kernel-download");
            let x = unpack_debian(&work)?;
            let t = module_tree_tar(&x)?;
            std::fs::remove_dir_all(&work)?;
            t
        }
    };
    repo.push_image(&modules_tag(), &tree).await?;
    let r = crate::image::resolve(registry, &reference, wait)
        .await
        .with_context(|| format!("the registry's conversion of {reference}"))?;
    Ok(r.env.to_string())
}

/// A boot file by digest: from the node (stored under its digest only after it was
/// hashed, so the name is trusted, as the chunk cache trusts its names), or fetched from
/// the registry and verified.
pub async fn boot_file(
    dir: &Path,
    registry: &RegistryClient,
    digest: &str,
    what: &str,
) -> Result<PathBuf, BootFileError> {
    let p = boot_path(dir, digest);
    if p.exists() {
        return Ok(p);
    }
    let fetched =
        GuestRepo::new(registry)
            .blob(digest)
            .await
            .map_err(|e| BootFileError::Fetch {
                what: what.into(),
                digest: digest.into(),
                why: format!("{e:#}"),
            })?;
    match fetched {
        Some(bytes) => {
            store_boot_file(dir, &bytes).map_err(|e| BootFileError::Store {
                what: what.into(),
                digest: digest.into(),
                why: format!("{e:#}"),
            })?;
            Ok(p)
        }
        None => Err(BootFileError::Missing {
            what: what.into(),
            digest: digest.into(),
            registry: registry.base().into(),
        }),
    }
}

/// `kvm` when /dev/kvm exists and a probe boot with it reaches the kernel's panic (no
/// root given) within 15 s; `tcg` otherwise. Some hosts expose /dev/kvm without the CPU
/// support a guest needs, and there a KVM boot hangs: only a boot proves it works.
async fn probe_accel(vmlinuz: &Path) -> String {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return "tcg".into();
    }
    let child = tokio::process::Command::new("qemu-system-x86_64")
        .args(["-accel", "kvm", "-M", "microvm", "-m", "128", "-nodefaults"])
        .args([
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "none",
        ])
        .arg("-kernel")
        .arg(vmlinuz)
        .args(["-append", "panic=-1 quiet"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .status();
    match tokio::time::timeout(Duration::from_secs(15), child).await {
        Ok(Ok(st)) if st.success() => "kvm".into(),
        _ => "tcg".into(),
    }
}
