//! Fidelity: for each image of the test set (fixtures/images: Debian + apt, Python + pip,
//! Node + npm, and a multi-layer image of special files), built and pushed with the
//! Docker engine, the tree the Linux kernel's EROFS driver shows for amber's device
//! equals the tree `docker export` gives: paths, types, modes, owners, sizes, content
//! hashes, link targets, hard links and xattrs. `fsck.erofs` must find no error.

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use amber_converter::manifest::ManifestEnvelope;
use amber_testkit::browser::Browser;
use common::*;
use sha2::Digest as _;

/// What the comparison looks at for one path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    kind: String,
    mode: u32,
    uid: u64,
    gid: u64,
    size: u64,
    sha256: String,
    target: String,
    xattrs: BTreeMap<String, Vec<u8>>,
}

/// Paths Docker adds when it creates a container (its init layer); not image content.
const DOCKER_INIT: &[&str] = &[
    ".dockerenv",
    "etc/hostname",
    "etc/hosts",
    "etc/resolv.conf",
    "etc/mtab",
    "dev/console",
    "dev/pts",
    "dev/shm",
];

fn injected(path: &str) -> bool {
    DOCKER_INIT
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}/")))
}

/// The tree of a `docker export` tar; hard links as (path, target) pairs.
fn export_tree(tar_path: &Path) -> (BTreeMap<String, Node>, Vec<(String, String)>) {
    let mut a = tar::Archive::new(std::fs::File::open(tar_path).unwrap());
    let mut out = BTreeMap::new();
    let mut links = Vec::new();
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let path = String::from_utf8_lossy(&e.path_bytes())
            .trim_start_matches("./")
            .trim_end_matches('/')
            .to_string();
        if path.is_empty() || injected(&path) {
            continue;
        }
        let h = e.header().clone();
        let mut xattrs = BTreeMap::new();
        if let Ok(Some(pax)) = e.pax_extensions() {
            for x in pax {
                let x = x.unwrap();
                if let Some(name) = x.key().ok().and_then(|k| k.strip_prefix("SCHILY.xattr.")) {
                    xattrs.insert(name.to_string(), x.value_bytes().to_vec());
                }
            }
        }
        let t = h.entry_type();
        if t == tar::EntryType::Link {
            let target = String::from_utf8_lossy(&e.link_name_bytes().unwrap())
                .trim_start_matches("./")
                .to_string();
            links.push((path, target));
            continue;
        }
        let mut sha = String::new();
        let kind = match t {
            tar::EntryType::Regular => {
                let mut h2 = sha2::Sha256::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = e.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    h2.update(&buf[..n]);
                }
                sha = hex::encode(h2.finalize());
                "file".to_string()
            }
            tar::EntryType::Directory => "dir".into(),
            tar::EntryType::Symlink => "symlink".into(),
            tar::EntryType::Char => format!(
                "char {}:{}",
                h.device_major().unwrap().unwrap(),
                h.device_minor().unwrap().unwrap()
            ),
            tar::EntryType::Block => format!(
                "block {}:{}",
                h.device_major().unwrap().unwrap(),
                h.device_minor().unwrap().unwrap()
            ),
            tar::EntryType::Fifo => "fifo".into(),
            other => format!("{other:?}"),
        };
        let target = if t == tar::EntryType::Symlink {
            String::from_utf8_lossy(&e.link_name_bytes().unwrap()).to_string()
        } else {
            String::new()
        };
        let size = if kind == "file" { h.size().unwrap() } else { 0 };
        out.insert(
            path,
            Node {
                kind,
                mode: h.mode().unwrap() & 0o7777,
                uid: h.uid().unwrap(),
                gid: h.gid().unwrap(),
                size,
                sha256: sha,
                target,
                xattrs,
            },
        );
    }
    (out, links)
}

fn xattrs_of(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut names = vec![0u8; 65536];
    // SAFETY: buffers are valid for their lengths; the path is NUL-terminated.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "llistxattr {}", path.display());
    let mut out = BTreeMap::new();
    for name in names[..n as usize]
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
    {
        let cn = CString::new(name).unwrap();
        let mut value = vec![0u8; 65536];
        // SAFETY: as above.
        let m = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cn.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        assert!(m >= 0);
        value.truncate(m as usize);
        out.insert(String::from_utf8_lossy(name).into_owned(), value);
    }
    out
}

/// The tree the kernel shows under `root`, and each path's inode number.
fn mounted_tree(root: &Path) -> (BTreeMap<String, Node>, BTreeMap<String, u64>) {
    let mut out = BTreeMap::new();
    let mut inos = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for e in std::fs::read_dir(root.join(&rel)).unwrap() {
            let e = e.unwrap();
            let rel_path = rel.join(e.file_name());
            let full = root.join(&rel_path);
            let m = std::fs::symlink_metadata(&full).unwrap();
            let ft = m.file_type();
            let path = rel_path.to_string_lossy().into_owned();
            let (kind, sha, target) = if ft.is_dir() {
                stack.push(rel_path.clone());
                ("dir".to_string(), String::new(), String::new())
            } else if ft.is_file() {
                let mut f = std::fs::File::open(&full).unwrap();
                let mut h = sha2::Sha256::new();
                std::io::copy(&mut f, &mut h).unwrap();
                ("file".into(), hex::encode(h.finalize()), String::new())
            } else if ft.is_symlink() {
                (
                    "symlink".into(),
                    String::new(),
                    std::fs::read_link(&full)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                )
            } else if ft.is_char_device() {
                (
                    format!("char {}:{}", libc::major(m.rdev()), libc::minor(m.rdev())),
                    String::new(),
                    String::new(),
                )
            } else if ft.is_block_device() {
                (
                    format!("block {}:{}", libc::major(m.rdev()), libc::minor(m.rdev())),
                    String::new(),
                    String::new(),
                )
            } else if ft.is_fifo() {
                ("fifo".into(), String::new(), String::new())
            } else {
                ("other".into(), String::new(), String::new())
            };
            let size = if kind == "file" { m.len() } else { 0 };
            inos.insert(path.clone(), m.ino());
            if injected(&path) {
                continue;
            }
            out.insert(
                path,
                Node {
                    kind,
                    mode: m.mode() & 0o7777,
                    uid: m.uid() as u64,
                    gid: m.gid() as u64,
                    size,
                    sha256: sha,
                    target,
                    xattrs: xattrs_of(&full),
                },
            );
        }
    }
    (out, inos)
}

struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

async fn fetch_device(s: &Server, env: &str, out: &Path) {
    let envelope: ManifestEnvelope = get_json(s, &format!("/amber/v1/envs/{env}")).await;
    let f = std::fs::File::create(out).unwrap();
    f.set_len(envelope.manifest.device_size).unwrap();
    for e in &envelope.manifest.extents {
        let data = chunk(s, &e.chunk.to_string(), e.length).await;
        std::os::unix::fs::FileExt::write_all_at(&f, &data, e.offset).unwrap();
    }
}

async fn env_of(s: &Server, repo: &str) -> String {
    let v = settled(s, repo, "v1").await;
    assert_eq!(
        v["state"], "done",
        "conversion of {repo} failed: {}",
        v["error"]
    );
    v["env_digest"].as_str().unwrap().to_string()
}

/// Builds (or loads, see `build_cached`) and pushes image `name` of the test set; returns
/// its build key. `salt`: the key of the test-set image it is built on, if any.
fn build(s: &Server, name: &str, salt: &str) -> String {
    let image = format!("{}/fidelity/{name}:v1", s.addr);
    let dockerfile = std::fs::read_to_string(
        repo_root()
            .join("fixtures/images")
            .join(name)
            .join("Dockerfile"),
    )
    .unwrap();
    // The build context: the fixture plus this machine's CA bundle (see the Dockerfiles).
    let ca = std::env::var("SSL_CERT_FILE")
        .unwrap_or_else(|_| "/etc/ssl/certs/ca-certificates.crt".into());
    let key = build_cached(
        &image,
        &dockerfile,
        &[("build-ca.crt", Path::new(&ca))],
        salt,
    );
    push(&image);
    key
}

/// Compares one pushed image; returns the differences found.
async fn compare(s: &Server, name: &str, work: &Path) -> Vec<String> {
    let image = format!("{}/fidelity/{name}:v1", s.addr);
    let env = env_of(s, &format!("fidelity/{name}")).await;
    let dev = work.join(format!("{name}.erofs"));
    fetch_device(s, &env, &dev).await;
    let fsck = Command::new(require_tool("fsck.erofs"))
        .arg(&dev)
        .output()
        .unwrap();
    assert!(
        fsck.status.success() && fsck.stderr.is_empty() && fsck.stdout.is_empty(),
        "fsck.erofs {name}: {fsck:?}"
    );

    let cid = docker_ok(&["create", &image, "true"]).trim().to_string();
    let export = work.join(format!("{name}.export.tar"));
    docker_ok(&["export", "-o", export.to_str().unwrap(), &cid]);
    docker_ok(&["rm", &cid]);
    let (want, links) = export_tree(&export);

    let mnt = work.join(format!("{name}.mnt"));
    std::fs::create_dir_all(&mnt).unwrap();
    run(Command::new("mount")
        .args(["-t", "erofs", "-o", "loop,ro"])
        .arg(&dev)
        .arg(&mnt));
    let _m = Mount(mnt.clone());
    let (got, inos) = mounted_tree(&mnt);

    let mut diffs = Vec::new();
    for (path, w) in &want {
        match got.get(path) {
            None => diffs.push(format!("{name}: {path} missing from the EROFS tree")),
            Some(g) if g != w => diffs.push(format!("{name}: {path}: docker {w:?} != amber {g:?}")),
            _ => {}
        }
    }
    let linked: std::collections::HashSet<&str> = links.iter().map(|(p, _)| p.as_str()).collect();
    for path in got.keys() {
        if !want.contains_key(path) && !linked.contains(path.as_str()) {
            diffs.push(format!(
                "{name}: {path} is in the EROFS tree but not in docker export"
            ));
        }
    }
    for (path, target) in &links {
        if inos.get(path) != inos.get(target) || !inos.contains_key(path) {
            diffs.push(format!("{name}: {path} should be a hard link of {target}"));
        }
    }
    eprintln!(
        "{name}: {} entries ({} hard links) compared, env {env}, {} differences",
        want.len(),
        links.len(),
        diffs.len()
    );
    diffs
}

/// Adds an account to the users file `users`, with `secret` as its password.
fn add_user(users: &Path, name: &str, secret: &str, rights: &[&str]) {
    let mut child = Command::new(workspace_bin("amber-registry"))
        .args(["user", "add", name, "--users"])
        .arg(users)
        .args(rights)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        &mut child.stdin.take().unwrap(),
        format!("{secret}\n").as_bytes(),
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "adding {name}: {out:?}");
}

/// The repositories the page lists.
async fn listed(b: &Browser) -> Vec<String> {
    let mut v = Vec::new();
    for a in b.find_all("#repositories a").await {
        v.push(a.text().await.unwrap());
    }
    v
}

/// Signs in through the form; the browser lands on `next` (or the login page again).
async fn sign_in(b: &Browser, s: &Server, user: &str, secret: &str) {
    b.goto(&s.url("/ui/")).await;
    assert!(
        b.url().await.contains("/ui/login"),
        "a viewer who has not signed in is sent to the sign-in page, not {}",
        b.url().await
    );
    b.fill("input[name=user]", user).await;
    b.fill("input[name=password]", secret).await;
    b.follow("#sign-in").await;
}

/// The catalog pages in headless Chromium over the registry holding the fidelity
/// images, restarted with accounts: alice may pull every `fidelity/` repository, carol
/// only `fidelity/python-pip`. Screenshots of each page go to the test's output directory.
async fn browse_the_catalog_pages(s: Server, envs: &BTreeMap<&str, String>) {
    let users = s.data.join("users.toml");
    add_user(&users, "alice", "alice-pw", &["--pull", "fidelity"]);
    add_user(
        &users,
        "carol",
        "carol-pw",
        &["--pull", "fidelity/python-pip"],
    );
    let s = s.restart_with(&["--auth", "token", "--users", users.to_str().unwrap()]);
    let shots = test_output("catalog-pages");
    let b = Browser::start().await;

    sign_in(&b, &s, "alice", "wrong").await;
    assert!(
        b.page_text().await.contains("Wrong user name or password"),
        "a wrong password is told as such: {}",
        b.page_text().await
    );
    b.screenshot(&shots.join("0-sign-in-refused.png")).await;
    sign_in(&b, &s, "alice", "alice-pw").await;
    assert!(
        b.url().await.ends_with("/ui/"),
        "signed in: {}",
        b.url().await
    );
    assert_eq!(b.text("#total-images").await, "4", "four images converted");
    assert_eq!(b.text("#total-envs").await, "4", "four envs");
    let home = b.text("#repositories").await;
    for name in envs.keys() {
        assert!(
            home.contains(&format!("fidelity/{name}")),
            "{name} listed: {home}"
        );
    }
    b.find("#history").await;
    b.screenshot(&shots.join("1-home.png")).await;

    // Search finds an image by name; its page shows the env resolve gives.
    b.fill("input[name=q]", "node").await;
    b.follow("header button[type=submit]").await;
    assert_eq!(
        listed(&b).await,
        ["fidelity/node-npm"],
        "searching \"node\""
    );
    b.screenshot(&shots.join("2-search.png")).await;
    b.follow("#repositories a").await;
    assert_eq!(b.text("h1").await, "fidelity/node-npm");
    b.screenshot(&shots.join("3-repository.png")).await;
    b.follow("#tags a").await;
    assert_eq!(
        b.text("#env-digest").await,
        envs["node-npm"],
        "the page's env is resolve's"
    );
    assert_eq!(b.text("#platform").await, "linux/amd64");
    assert!(
        b.text("#conversion").await.starts_with("converted"),
        "{}",
        b.text("#conversion").await
    );
    assert!(b.text("#env-chunks").await.contains("chunks"));
    assert!(b.text("#env-shared").await.contains(" of "));
    assert!(
        b.find_all("#layers tr").await.len() > 2,
        "the layers are listed"
    );
    assert!(
        b.text("#run-cli")
            .await
            .contains(&format!("{}/fidelity/node-npm@sha256:", s.addr)),
        "the command to copy pins the image by digest: {}",
        b.text("#run-cli").await
    );
    assert!(b
        .text("#referrers")
        .await
        .contains("application/vnd.amber.block-manifest"));
    b.screenshot(&shots.join("4-image.png")).await;
    b.follow("header form[action='/ui/logout'] button").await;
    assert!(
        b.url().await.contains("/ui/login"),
        "signed out: {}",
        b.url().await
    );

    // carol sees only what she may pull, wherever she looks.
    sign_in(&b, &s, "carol", "carol-pw").await;
    assert_eq!(listed(&b).await, ["fidelity/python-pip"], "carol's catalog");
    b.goto(&s.url("/ui/search?q=fidelity")).await;
    assert_eq!(listed(&b).await, ["fidelity/python-pip"], "carol's search");
    b.goto(&s.url("/ui/r/fidelity/node-npm")).await;
    assert!(b
        .page_text()
        .await
        .contains("no repository fidelity/node-npm that you may pull"));
    b.goto(&s.url("/ui/i/fidelity/node-npm/v1")).await;
    assert!(b
        .page_text()
        .await
        .contains("no repository fidelity/node-npm that you may pull"));
    b.screenshot(&shots.join("5-not-visible.png")).await;
    b.close().await;
    // The same over plain HTTP: 404 for what carol may not pull (as for what does not
    // exist), the sign-in page for a request without credentials.
    let carol = format!(
        "Basic {}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "carol:carol-pw")
    );
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    for (path, auth, status) in [
        ("/ui/r/fidelity/node-npm", Some(&carol), 404),
        ("/ui/r/fidelity/no-such-thing", Some(&carol), 404),
        ("/ui/r/fidelity/python-pip", Some(&carol), 200),
        ("/ui/r/fidelity/python-pip", None, 303),
    ] {
        let mut r = http.get(s.url(path));
        if let Some(a) = auth {
            r = r.header("Authorization", a.as_str());
        }
        let r = r.send().await.unwrap();
        assert_eq!(
            r.status().as_u16(),
            status,
            "{path} with credentials {}",
            auth.is_some()
        );
        assert!(
            r.headers().contains_key("server-timing"),
            "{path}: render time given"
        );
    }
    eprintln!("catalog page screenshots in {}", shots.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_export_equals_the_tree_in_amber_s_erofs_device() {
    let rootfs = std::env::var("AMBER_TEST_DEBIAN_ROOTFS")
        .expect("AMBER_TEST_DEBIAN_ROOTFS is not set: scripts/test builds the Debian base (fixtures/debian-rootfs.sh) and sets it");
    require_tool("mount");
    let s = Server::start(&[]);
    let work = tempfile::tempdir().unwrap();
    docker_ok(&["import", &rootfs, "amber-test/debian:bookworm"]);
    let mut diffs = Vec::new();
    let mut apt_key = String::new();
    for name in ["debian-apt", "python-pip", "node-npm"] {
        let key = build(&s, name, "");
        if name == "debian-apt" {
            apt_key = key;
        }
        diffs.extend(compare(&s, name, work.path()).await);
    }
    docker_ok(&[
        "tag",
        &format!("{}/fidelity/debian-apt:v1", s.addr),
        "amber-test/debian-apt",
    ]);
    build(&s, "special", &apt_key);
    diffs.extend(compare(&s, "special", work.path()).await);
    // The first images on the Debian base kept its state (debian-apt at once, the base
    // layer being big beside it, or python-pip, the second image on it), and the later
    // ones were converted from it (special, built on debian-apt, keeps debian-apt's state
    // for the next image on it): a conversion of every layer in another process gives
    // the same env digests.
    let metrics = metrics_text(&s).await;
    assert!(
        metric(&metrics, "amber_conversion_layers_reused_total") >= 2,
        "conversions reused the base's work: {metrics}"
    );
    for name in ["debian-apt", "python-pip", "node-npm", "special"] {
        let image = format!("{}/fidelity/{name}:v1", s.addr);
        let archive = work.path().join(format!("{name}.docker.tar"));
        docker_ok(&["save", "-o", archive.to_str().unwrap(), &image]);
        let out = Command::new(workspace_bin("amber-convert"))
            .arg(&archive)
            .arg("--out")
            .arg(work.path().join(format!("{name}.full")))
            .output()
            .unwrap();
        assert!(out.status.success(), "amber-convert {name}: {out:?}");
        // Not on a terminal: its progress as plain lines, one per step.
        let progress = String::from_utf8_lossy(&out.stderr);
        assert!(
            progress.contains("amber-convert: [1/") && progress.contains("] chunking"),
            "amber-convert {name} reports its steps: {progress}"
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            env_of(&s, &format!("fidelity/{name}")).await,
            "{name}: the registry's env digest is that of a conversion of every layer"
        );
        std::fs::remove_dir_all(work.path().join(format!("{name}.full"))).unwrap();
        std::fs::remove_file(&archive).unwrap();
    }
    let mut envs = BTreeMap::new();
    for name in ["debian-apt", "python-pip", "node-npm", "special"] {
        envs.insert(name, env_of(&s, &format!("fidelity/{name}")).await);
    }
    browse_the_catalog_pages(s, &envs).await;
    assert!(
        diffs.is_empty(),
        "{} differences:\n{}",
        diffs.len(),
        diffs
            .iter()
            .take(50)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
