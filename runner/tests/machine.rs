//! A sandbox behaves like a machine (real VMs). Its network: without one a sandbox
//! reaches nothing (only its loopback is up); with an allow list it reaches an allowed
//! test server on the host's loopback and is refused at once by one that is not allowed;
//! DNS answers the gateway's name always and names of the world only when the world is
//! allowed; 16 sandboxes at once call an exposed host service that records which sandbox
//! each call came from; a service inside a sandbox answers the host through a published
//! port; kernel modules load on demand. Docker inside: an image with Docker Engine and
//! Compose from Debian's packages starts `dockerd` in a sandbox with no network (cgroup
//! v2 mounted as on a machine), `docker load` + `docker run` of an image from a file
//! prints its output, and `docker-compose up` of two services, one calling the other by
//! its service name over their own network, succeeds. The fidelity probes
//! (fixtures/fidelity/probes.sh) in `docker run` and in a sandbox of the same image agree
//! or differ with a reason, and docs/fidelity.md is their table. The three parts share
//! one registry and node and run side by side.
//!
//! Needs AMBER_TEST_DOCKER_ROOTFS (scripts/test builds it: Debian bookworm with
//! docker.io, docker-compose and iptables).

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use common::*;

/// A test HTTP server on the host's loopback: answers `hello from NAME` and records the
/// `X-Sandbox` header of every request.
struct HostServer {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

impl HostServer {
    fn start(name: &'static str) -> HostServer {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { continue };
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut req = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    }
                    let text = String::from_utf8_lossy(&req).to_string();
                    let who = text
                        .lines()
                        .find_map(|l| l.strip_prefix("X-Sandbox: "))
                        .unwrap_or("-")
                        .trim()
                        .to_string();
                    s.lock().unwrap().push(who);
                    let body = format!("hello from {name}\n");
                    let _ = write!(
                        c,
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        HostServer { port, seen }
    }
}

/// A shell line that sends an HTTP request from the sandbox (busybox's nc: its wget
/// crashes in Debian's static build) and prints the whole response.
fn get(host: &str, port: u16, who: &str) -> String {
    format!("printf 'GET / HTTP/1.0\\r\\nX-Sandbox: {who}\\r\\n\\r\\n' | nc -w 10 {host} {port}")
}

fn create(node: &Node, reg: &Registry, args: &[&str]) -> (String, String) {
    let mut a = vec!["create", "--disk", "0", "--memory", "256"];
    a.extend_from_slice(args);
    a.push("net/box:v1");
    let o = node.amber(reg, &a);
    assert!(o.status.success(), "create {args:?}: {}", stderr(&o));
    (stdout(&o).trim().to_string(), stderr(&o))
}

/// `sh -c script` in the sandbox: (exit status, stdout + stderr).
fn sh(node: &Node, reg: &Registry, id: &str, script: &str) -> (i32, String) {
    let o = node.amber(
        reg,
        &["exec", id, "--", "sh", "-c", &format!("{script} 2>&1")],
    );
    (o.status.code().unwrap_or(-1), stdout(&o) + &stderr(&o))
}

/// One registry and one node for the three parts, which run side by side.
#[test]
fn a_sandbox_behaves_like_a_machine() {
    let reg = Registry::start(&[]);
    let node = Node::setup(&reg);
    busybox_base();
    build_and_push(
        &format!("{}/net/box:v1", reg.addr),
        "FROM amber-test/busybox:1\nRUN mkdir -p /www && echo served-from-the-sandbox > /www/index.html\n",
        &[],
    );
    docker_ok(&[
        "import",
        &env("AMBER_TEST_DOCKER_ROOTFS"),
        "amber-test/debian-docker:bookworm",
    ]);
    let probes = repo_root().join("fixtures/fidelity/probes.sh");
    build_and_push(
        &format!("{}/machine/debian:v1", reg.addr),
        "FROM amber-test/debian-docker:bookworm\nCOPY probes.sh /probes.sh\nCMD [\"sh\"]\n",
        &[("probes.sh", &probes)],
    );
    let failures: Vec<String> = std::thread::scope(|s| {
        let parts = [
            ("network", s.spawn(|| network(&reg, &node))),
            ("docker inside", s.spawn(|| docker_inside(&reg, &node))),
            ("fidelity probes", s.spawn(|| fidelity(&reg, &node))),
        ];
        parts
            .into_iter()
            .filter_map(|(name, h)| {
                h.join().err().map(|e| {
                    let why = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    format!("{name}: {why}")
                })
            })
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Egress policy, DNS, host services, published ports, modules on demand.
fn network(reg: &Registry, node: &Node) {
    let allowed = HostServer::start("allowed");
    let denied = HostServer::start("denied");
    let wget = |port: u16| get("10.0.2.2", port, "-");

    // No network: only the loopback, and it is up.
    let (none, _) = create(node, reg, &[]);
    let (code, out) = sh(
        node,
        reg,
        &none,
        "ls /sys/class/net && cat /sys/class/net/lo/flags",
    );
    assert_eq!((code, out.as_str()), (0, "lo\n0x9\n"), "{out}");
    // Kernel modules load when the kernel asks for them, from the node's module disk:
    // a bridge needs bridge, stp and llc.
    let (code, out) = sh(
        node,
        reg,
        &none,
        "brctl addbr br0 && cut -d' ' -f1 /proc/modules",
    );
    assert_eq!(code, 0, "{out}");
    for m in ["bridge", "stp", "llc"] {
        assert!(out.lines().any(|l| l == m), "{m} not loaded: {out}");
    }
    let (code, out) = sh(node, reg, &none, &wget(allowed.port));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Network is unreachable"), "{out}");

    // An allow list: the allowed host port answers, another port of the host is refused
    // at once, and so is an address of the world that is not allowed.
    let rule = format!("127.0.0.1:{}", allowed.port);
    let (open, _) = create(
        node,
        reg,
        &["--allow", &rule, "--allow", "192.0.2.0/24:443"],
    );
    let (code, out) = sh(node, reg, &open, &wget(allowed.port));
    assert_eq!(code, 0, "{out}");
    assert!(out.ends_with("\r\n\r\nhello from allowed\n"), "{out}");
    let (code, out) = sh(node, reg, &open, &wget(denied.port));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Connection refused"), "{out}");
    let (code, out) = sh(node, reg, &open, &get("198.51.100.7", 80, "-"));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Connection refused"), "{out}");
    assert!(denied.seen.lock().unwrap().is_empty());
    // The resolver: the gateway by name, and names of the world through the host's
    // resolver (this machine resolves localhost, and nothing beyond it).
    let (code, out) = sh(
        node,
        reg,
        &open,
        "cat /etc/resolv.conf; nslookup host.amber.internal; nslookup localhost",
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("nameserver 10.0.2.3"), "{out}");
    assert!(out.contains("Address: 10.0.2.2"), "{out}");
    assert!(out.contains("Address: 127.0.0.1"), "{out}");
    let (code, out) = sh(
        node,
        reg,
        &open,
        &get("host.amber.internal", allowed.port, "-"),
    );
    assert!(out.ends_with("hello from allowed\n"), "{code} {out}");

    // Host services only: the service at the gateway, nothing else of the host or the
    // world, no names of the world. 16 sandboxes call it at once.
    let recorder = HostServer::start("recorder");
    let service = format!("80=127.0.0.1:{}", recorder.port);
    let o = node.amber(
        reg,
        &[
            "create",
            "--disk",
            "0",
            "--memory",
            "256",
            "--count",
            "16",
            "--host-service",
            &service,
            "net/box:v1",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let ids: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
    assert_eq!(ids.len(), 16, "{}", stdout(&o));
    let calls: Vec<_> = ids
        .iter()
        .map(|id| {
            let (id, cmd) = (id.clone(), node.command(reg));
            std::thread::spawn(move || {
                let mut cmd = cmd;
                let o = cmd
                    .args(["exec", &id, "--", "sh", "-c"])
                    .arg(get("host.amber.internal", 80, &id))
                    .output()
                    .unwrap();
                (id, o)
            })
        })
        .collect();
    for c in calls {
        let (id, o) = c.join().unwrap();
        assert!(
            stdout(&o).ends_with("\r\n\r\nhello from recorder\n"),
            "{id}: {}",
            stderr(&o)
        );
    }
    let seen: BTreeSet<String> = recorder.seen.lock().unwrap().iter().cloned().collect();
    assert_eq!(seen, ids.iter().cloned().collect::<BTreeSet<_>>());
    assert_eq!(recorder.seen.lock().unwrap().len(), 16, "one call each");
    let (code, out) = sh(
        node,
        reg,
        &ids[0],
        &format!("{}; nslookup localhost", wget(allowed.port)),
    );
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Connection refused"), "{out}");
    assert!(
        out.contains("NXDOMAIN") || out.contains("can't resolve"),
        "{out}"
    );
    for id in &ids {
        assert!(node.amber(reg, &["rm", id]).status.success());
    }

    // A published port: the host reaches a server in the sandbox; a published port with
    // nothing listening inside closes the host's connection without a byte.
    let (web, err) = create(node, reg, &["-p", "8080", "-p", "8081"]);
    let host_of = |port: u16| {
        err.lines()
            .find_map(|l| l.strip_prefix(&format!("amber: {web} port {port} is at ")))
            .unwrap_or_else(|| panic!("no published port {port} in {err}"))
            .to_string()
    };
    let (code, out) = sh(node, reg, &web, "httpd -p 8080 -h /www");
    assert_eq!(code, 0, "{out}");
    for _ in 0..2 {
        let mut c = TcpStream::connect(host_of(8080)).unwrap();
        c.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
        assert!(resp.ends_with("served-from-the-sandbox\n"), "{resp}");
    }
    let mut c = TcpStream::connect(host_of(8081)).unwrap();
    let mut resp = Vec::new();
    let _ = c.read_to_end(&mut resp);
    assert!(resp.is_empty());

    // Bad network specs are refused before anything starts, naming the bad entry.
    for (flag, bad, why) in [
        ("--allow", "example.com", "allow rule \"example.com\""),
        ("--host-service", "80", "host service \"80\""),
        ("-p", "http", "port \"http\""),
    ] {
        let o = node.amber(reg, &["create", flag, bad, "net/box:v1"]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(why), "{}", stderr(&o));
    }
    for id in [&none, &open, &web] {
        assert!(node.amber(reg, &["rm", id]).status.success());
    }
}

const COMPOSE: &str = "\
version: '2.4'
services:
  web:
    image: amber-test/busybox:1
    command: sh -c 'mkdir -p /www && echo hello-from-web > /www/index.html && httpd -f -p 80 -h /www'
  client:
    image: amber-test/busybox:1
    depends_on: [web]
    command: sh -c 'for i in $$(seq 100); do printf \"GET / HTTP/1.0\\r\\n\\r\\n\" | nc -w 5 web 80 && exit 0; sleep 0.1; done; exit 1'
";

/// dockerd, docker run and docker-compose inside a sandbox with no network.
fn docker_inside(reg: &Registry, node: &Node) {
    let work = tempfile::tempdir().unwrap();
    let image_tar = work.path().join("busybox.tar");
    docker_ok(&[
        "save",
        "-o",
        &image_tar.display().to_string(),
        "amber-test/busybox:1",
    ]);
    let compose = work.path().join("docker-compose.yml");
    std::fs::write(&compose, COMPOSE).unwrap();

    let o = node.amber(
        reg,
        &[
            "create",
            "--memory",
            "1024",
            "--cpus",
            "2",
            "--disk",
            "4096",
            "machine/debian:v1",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let id = stdout(&o).trim().to_string();
    let sh = |script: &str| {
        let o = node.amber(
            reg,
            &["exec", &id, "--", "sh", "-c", &format!("{script} 2>&1")],
        );
        (o.status.code().unwrap_or(-1), stdout(&o) + &stderr(&o))
    };
    for (src, dest) in [
        (&image_tar, "/root/busybox.tar"),
        (&compose, "/root/docker-compose.yml"),
    ] {
        let o = node.amber(
            reg,
            &["cp", &src.display().to_string(), &format!("{id}:{dest}")],
        );
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // containerd, then dockerd on it, as a distribution's service units start them (a
    // dockerd that starts its own containerd gives it a fixed startup time, which a
    // loaded machine can exceed); each in the background with its log in a file, each
    // waited for (bounded) until it answers.
    let (code, out) = sh(
        "setsid containerd >/var/log/containerd.log 2>&1 < /dev/null & \
         timeout 300 sh -c 'until ctr version >/dev/null 2>&1; do sleep 0.2; done' \
         || { tail -30 /var/log/containerd.log; exit 1; }",
    );
    assert_eq!(code, 0, "containerd did not start: {out}");
    let (code, out) = sh(
        "setsid dockerd --containerd=/run/containerd/containerd.sock \
         >/var/log/dockerd.log 2>&1 < /dev/null & \
         timeout 300 sh -c 'until docker info >/dev/null 2>&1; do sleep 0.2; done' \
         || { tail -30 /var/log/dockerd.log; exit 1; }",
    );
    assert_eq!(code, 0, "dockerd did not start: {out}");
    let (code, out) = sh("docker info --format '{{.CgroupVersion}} {{.Driver}}'");
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("2 "), "cgroup v2 expected: {out}");

    let (code, out) = sh("docker load -i /root/busybox.tar && docker run --rm amber-test/busybox:1 echo hello-from-a-container");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("hello-from-a-container\n"), "{out}");

    let (code, out) = sh("cd /root && COMPOSE_HTTP_TIMEOUT=600 docker-compose up --no-color --abort-on-container-exit --exit-code-from client");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("hello-from-web"), "{out}");
    assert!(node.amber(reg, &["rm", &id]).status.success());
}

/// Every probe of fixtures/fidelity/probes.sh: what it checks, and, where amber's answer
/// differs from `docker run`'s of the same image, whether by design and why. A probe
/// whose answers differ without an entry here fails the test, and so does an entry for a
/// probe whose answers are the same.
/// (verdict, why) of an explained difference.
type Why = Option<(&'static str, &'static str)>;

const PROBES: &[(&str, &str, Why)] = &[
    ("kernel.release", "`uname -r`", Some(("differs by design", "the sandbox boots amber's pinned guest kernel (recorded in receipts); a container runs on whatever kernel its host has"))),
    ("kernel.arch", "`uname -m`", None),
    ("cpus.nproc", "`nproc` (amber `--cpus 1`, docker `--cpuset-cpus 0`)", None),
    ("memory.total_gib", "MemTotal (amber `--memory 1024`, docker `--memory 1g`)", Some(("differs by design", "a VM has exactly its memory; a container's limit is a cgroup and /proc/meminfo shows the host's"))),
    ("proc.entries", "the /proc files tasks read", None),
    ("sys.entries", "the top of /sys", Some(("differs by design", "the sandbox is a VM: its kernel has /sys/hypervisor"))),
    ("cgroup.fs", "the file system at /sys/fs/cgroup", Some(("differs by design", "the sandbox's own kernel has cgroup v2, as current distributions do; a container sees its host's hierarchy (cgroup v1 on this machine's Docker)"))),
    ("cgroup.writable", "making a cgroup", Some(("differs by design", "the sandbox is a machine whose root may make cgroups (a container engine inside needs to); docker mounts the container's cgroup read-only"))),
    ("ns.unshare_user", "`unshare -U`", Some(("differs by design", "docker's seccomp profile refuses new user namespaces without CAP_SYS_ADMIN; in the sandbox root has every capability of its own kernel"))),
    ("ns.unshare_net_mount", "`unshare -nm`", Some(("differs by design", "needs CAP_SYS_ADMIN, which docker drops by default"))),
    ("ptrace.strace", "`strace -f true`", None),
    ("mount.tmpfs", "`mount -t tmpfs`", Some(("differs by design", "needs CAP_SYS_ADMIN, which docker drops by default"))),
    ("loop.device", "`losetup -f` on a file", Some(("differs by design", "the sandbox has loop devices and loads `loop` on demand; an unprivileged container has no /dev/loop*"))),
    ("user.uid", "`id -u`", None),
    ("pid1", "`/proc/1/comm`", Some(("differs by design", "PID 1 of the sandbox is amber's agent (`init`), which reaps orphans as a machine's init does; in `docker run` PID 1 is the command itself"))),
    ("hostname", "`hostname` (`--hostname probe`)", None),
    ("hosts.localhost", "`getent hosts localhost`", None),
    ("hosts.self", "`getent hosts $(hostname)`", None),
    ("net.interfaces", "/sys/class/net (no network asked for)", None),
    ("ulimit.nofile", "open files (soft/hard)", Some(("differs by design", "a sandbox has the kernel's defaults, as a machine's init leaves them; a container inherits its engine's limit (this machine's dockerd)"))),
    ("ulimit.nproc", "processes (soft/hard)", Some(("differs by design", "the kernel derives the default from the machine's memory: the VM's, not the host's"))),
    ("ulimit.stack", "stack size (soft/hard)", None),
    ("time.clock", "the clock against the host's", None),
    ("time.zone", "`date +%Z`", None),
    ("dev.entries", "the /dev nodes tasks use", None),
    ("tmp.writable", "writing /tmp", None),
];

fn probe_lines(text: &str) -> std::collections::BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn host_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A probe's clock reading against the host's before and after the run.
fn clock(lines: &mut std::collections::BTreeMap<String, String>, before: u64, after: u64) {
    let t: u64 = lines["time.clock"].parse().unwrap_or(0);
    // Whole seconds on both sides: a reading may round one way or the other.
    let v = if (before.saturating_sub(1)..=after + 1).contains(&t) {
        "the host's (within a second of the run)".to_string()
    } else {
        format!("{t}, outside the run's {before}..{after}")
    };
    lines.insert("time.clock".into(), v);
}

/// The fidelity probes in `docker run` and in a sandbox of the same image.
fn fidelity(reg: &Registry, node: &Node) {
    let image = format!("{}/machine/debian:v1", reg.addr);
    let t0 = host_now();
    let docker = docker_ok(&[
        "run",
        "--rm",
        "--hostname",
        "probe",
        "--cpuset-cpus",
        "0",
        "--memory",
        "1g",
        &image,
        "sh",
        "/probes.sh",
    ]);
    let (t1, t2) = (host_now(), host_now());
    let o = node.amber(
        reg,
        &[
            "run",
            "--cpus",
            "1",
            "--memory",
            "1024",
            "--hostname",
            "probe",
            "machine/debian:v1",
            "--",
            "sh",
            "/probes.sh",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let t3 = host_now();
    let (mut d, mut a) = (probe_lines(&docker), probe_lines(&stdout(&o)));
    clock(&mut d, t0, t1);
    clock(&mut a, t2, t3);
    let names: Vec<&str> = PROBES.iter().map(|p| p.0).collect();
    assert_eq!(
        a.keys().map(String::as_str).collect::<Vec<_>>(),
        {
            let mut n = names.clone();
            n.sort();
            n
        },
        "amber: {}",
        stdout(&o)
    );
    assert_eq!(
        d.keys().collect::<Vec<_>>(),
        a.keys().collect::<Vec<_>>(),
        "docker: {docker}"
    );

    let mut table = String::from(
        "# Fidelity: an amber sandbox against `docker run` of the same image\n\n\
         Generated by `runner/tests/machine.rs` (`a_sandbox_behaves_like_a_machine`)\n\
         from `fixtures/fidelity/probes.sh`, run in both on Debian bookworm (with Docker, strace,\n\
         util-linux) under the default `docker run` (no `--privileged`) and a default amber\n\
         sandbox. Every probe whose answers differ is explained; the test fails on a\n\
         difference nobody explained and on an explanation of a difference that is gone.\n\
         Regenerate with `AMBER_FIDELITY_WRITE=1`.\n\n\
         | probe | what | amber | docker run | verdict | why |\n|---|---|---|---|---|---|\n",
    );
    let mut problems = Vec::new();
    for (name, what, why) in PROBES {
        let (av, dv) = (&a[*name], &d[*name]);
        let same = av == dv;
        let (verdict, reason) = match (same, why) {
            (true, None) => ("same", ""),
            (false, Some((v, r))) => (*v, *r),
            (true, Some(_)) => {
                problems.push(format!(
                    "{name}: both say {av:?}, but PROBES explains a difference"
                ));
                ("same", "")
            }
            (false, None) => {
                problems.push(format!("{name}: amber {av:?}, docker {dv:?}, unexplained"));
                ("differs", "")
            }
        };
        // Values that name this machine (the host's kernel, its memory) stay out of the
        // table, which must not change from machine to machine.
        // The kernel's default process limit moves by a few with what the guest
        // loaded; the verdict is what matters.
        let amber_shown = if *name == "ulimit.nproc" {
            "(from the VM's memory)".to_string()
        } else {
            format!("`{av}`")
        };
        let docker_shown = if [
            "kernel.release",
            "memory.total_gib",
            "ulimit.nofile",
            "ulimit.nproc",
            "cgroup.fs",
        ]
        .contains(name)
        {
            "(this machine's)".to_string()
        } else {
            format!("`{dv}`")
        };
        table.push_str(&format!(
            "| {name} | {what} | {amber_shown} | {docker_shown} | {verdict} | {reason} |\n"
        ));
    }
    let out = target_dir().join("fidelity-probes.txt");
    std::fs::write(&out, format!("amber:\n{}\ndocker:\n{docker}\n", stdout(&o))).unwrap();
    assert!(
        problems.is_empty(),
        "{}\n(both outputs in {})",
        problems.join("\n"),
        out.display()
    );
    let doc = repo_root().join("docs/fidelity.md");
    if std::env::var_os("AMBER_FIDELITY_WRITE").is_some() {
        std::fs::write(&doc, &table).unwrap();
    }
    let committed = std::fs::read_to_string(&doc).unwrap_or_default();
    assert_eq!(
        committed, table,
        "docs/fidelity.md is not what the probes say: regenerate it with AMBER_FIDELITY_WRITE=1"
    );
}
