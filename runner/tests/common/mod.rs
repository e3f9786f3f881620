//! What the runner's end-to-end tests share: the real registry binary, the Docker engine
//! scripts/test started, a node directory per test, and `amber` itself.
//!
//! Needs (scripts/test provides them): AMBER_TEST_DOCKER_HOST (a Docker engine),
//! AMBER_TEST_DEBIAN_ROOTFS (the Debian base root fs), AMBER_GUEST (the static guest
//! agent), qemu-system-x86_64.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use sha2::Digest as _;

pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: scripts/test sets it"))
}

pub fn target_dir() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn ok(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn docker() -> Command {
    let mut c = Command::new("docker");
    c.arg("-H").arg(env("AMBER_TEST_DOCKER_HOST"));
    c
}

/// The real `amber-registry serve` on a data directory.
pub struct Registry {
    child: Child,
    pub addr: String,
    pub data: PathBuf,
    /// Further `serve` arguments it was started with (kept across restarts).
    extra: Vec<String>,
}

impl Registry {
    /// The registry on `data`, listening on `listen` (port 0: any free port).
    pub fn start(data: &Path, listen: &str) -> Registry {
        Registry::start_with(data, listen, &[])
    }

    /// The registry with further `serve` arguments (`--auth token --users FILE`).
    pub fn start_with(data: &Path, listen: &str, extra: &[&str]) -> Registry {
        let bin = target_dir().join("amber-registry");
        assert!(
            bin.exists(),
            "{} is missing: build the workspace first",
            bin.display()
        );
        let mut child = Command::new(bin)
            .args(["serve", "--listen", listen, "--data"])
            .arg(data)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .expect("registry started")
            .to_string();
        Registry {
            child,
            addr,
            data: data.to_path_buf(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Stops the process and starts it again on the same address, data and arguments.
    pub fn restart(self) -> Registry {
        let (data, addr, extra) = (self.data.clone(), self.addr.clone(), self.extra.clone());
        drop(self);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        Registry::start_with(&data, &addr, &extra)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn get(&self, path: &str) -> Vec<u8> {
        let url = format!("{}{path}", self.url());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let r = reqwest::get(&url).await.unwrap();
            assert!(r.status().is_success(), "GET {url}: {}", r.status());
            r.bytes().await.unwrap().to_vec()
        })
    }

    pub fn json(&self, path: &str) -> serde_json::Value {
        serde_json::from_slice(&self.get(path)).unwrap()
    }

    /// A sample from /metrics, summed over every label set whose labels contain `labels`.
    pub fn metric(&self, name: &str, labels: &str) -> f64 {
        String::from_utf8(self.get("/metrics"))
            .unwrap()
            .lines()
            .filter(|l| {
                l.starts_with(name)
                    && (l[name.len()..].starts_with(' ') || l[name.len()..].starts_with('{'))
                    && l.contains(labels)
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    }

    /// The env digest an image was converted to; the caller has already run it (amber
    /// waits for the conversion), so the registry must say `done`.
    pub fn env_of(&self, name: &str, reference: &str) -> String {
        let v = self.json(&format!("/amber/v1/resolve/{name}/{reference}"));
        assert_eq!(v["state"], "done", "{v}");
        v["env_digest"].as_str().unwrap().to_string()
    }

    /// sha256 of the device the env's manifest describes, assembled here from the
    /// registry's chunks (zstd, checked against their blake3 ids) and zero gaps.
    pub fn device_sha256(&self, env: &str) -> String {
        let envelope = self.json(&format!("/amber/v1/envs/{env}"));
        let m = &envelope["manifest"];
        let size = m["device_size"].as_u64().unwrap();
        let mut h = sha2::Sha256::new();
        let mut at = 0u64;
        let zeros = |h: &mut sha2::Sha256, n: u64| {
            let z = vec![0u8; 1 << 20];
            let mut left = n;
            while left > 0 {
                let k = left.min(z.len() as u64) as usize;
                h.update(&z[..k]);
                left -= k as u64;
            }
        };
        for e in m["extents"].as_array().unwrap() {
            let (off, len) = (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap());
            let chunk = e["chunk"].as_str().unwrap();
            assert!(off >= at, "extents overlap");
            zeros(&mut h, off - at);
            let data =
                zstd::decode_all(&self.get(&format!("/amber/v1/chunks/{chunk}"))[..]).unwrap();
            assert_eq!(format!("blake3:{}", blake3::hash(&data).to_hex()), chunk);
            assert_eq!(data.len() as u64, len);
            h.update(&data);
            at = off + len;
        }
        zeros(&mut h, size - at);
        hex::encode(h.finalize())
    }

    /// The store file of a chunk (the fs backend's layout, shared/DESIGN.md).
    pub fn chunk_file(&self, chunk: &str) -> PathBuf {
        let hex = chunk.strip_prefix("blake3:").unwrap();
        self.data
            .join("store/chunks/blake3")
            .join(&hex[..2])
            .join(hex)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One node: its own AMBER_HOME (boot files, chunk cache, sandboxes).
pub struct Node {
    pub home: tempfile::TempDir,
}

impl Node {
    /// A fresh node, set up against `reg` with `amber setup`.
    pub fn setup(reg: &Registry) -> Node {
        let n = Node::bare();
        let out = n.amber(reg, &["setup", "--guest", &env("AMBER_GUEST")]);
        assert!(out.status.success(), "amber setup: {out:?}");
        n
    }

    /// A node directory on which `amber setup` never ran.
    pub fn bare() -> Node {
        Node {
            home: tempfile::tempdir().unwrap(),
        }
    }

    pub fn command(&self, reg: &Registry) -> Command {
        let mut c = Command::new(target_dir().join("amber"));
        c.arg("--registry")
            .arg(reg.url())
            .env("AMBER_HOME", self.home.path());
        c
    }

    pub fn amber(&self, reg: &Registry, args: &[&str]) -> Output {
        self.command(reg).args(args).output().unwrap()
    }

    /// `amber` with `input` on its stdin.
    pub fn amber_with_stdin(&self, reg: &Registry, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .command(reg)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap().unwrap();
        out
    }

    pub fn chunks(&self) -> PathBuf {
        self.home.path().join("chunks")
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The Debian base imported into the engine (the same bytes every time).
pub fn debian_base() {
    ok(docker().args([
        "import",
        &env("AMBER_TEST_DEBIAN_ROOTFS"),
        "amber-test/debian:bookworm",
    ]));
}

/// Builds `dockerfile` (with `files` beside it) as `image` and pushes it; returns the
/// pushed manifest digest.
pub fn build_and_push(image: &str, dockerfile: &str, files: &[(&str, &Path)]) -> String {
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(ctx.path().join("Dockerfile"), dockerfile).unwrap();
    for (name, src) in files {
        std::fs::copy(src, ctx.path().join(name)).unwrap();
    }
    ok(docker()
        .args(["build", "-q", "--network", "host", "-t", image])
        .arg(ctx.path()));
    let push = ok(docker().args(["push", image]));
    push.split("digest: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("pushed digest")
        .to_string()
}
