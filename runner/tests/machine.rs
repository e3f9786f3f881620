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
//! its service name over their own network, succeeds. The two tests run side by side.
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

#[test]
fn sandboxes_reach_what_their_policy_allows_and_nothing_else() {
    let reg = Registry::start(&[]);
    let node = Node::setup(&reg);
    busybox_base();
    build_and_push(
        &format!("{}/net/box:v1", reg.addr),
        "FROM amber-test/busybox:1\nRUN mkdir -p /www && echo served-from-the-sandbox > /www/index.html\n",
        &[],
    );
    let allowed = HostServer::start("allowed");
    let denied = HostServer::start("denied");
    let wget = |port: u16| get("10.0.2.2", port, "-");

    // No network: only the loopback, and it is up.
    let (none, _) = create(&node, &reg, &[]);
    let (code, out) = sh(
        &node,
        &reg,
        &none,
        "ls /sys/class/net && cat /sys/class/net/lo/flags",
    );
    assert_eq!((code, out.as_str()), (0, "lo\n0x9\n"), "{out}");
    // Kernel modules load when the kernel asks for them, from the node's module disk:
    // a bridge needs bridge, stp and llc.
    let (code, out) = sh(
        &node,
        &reg,
        &none,
        "brctl addbr br0 && cut -d' ' -f1 /proc/modules",
    );
    assert_eq!(code, 0, "{out}");
    for m in ["bridge", "stp", "llc"] {
        assert!(out.lines().any(|l| l == m), "{m} not loaded: {out}");
    }
    let (code, out) = sh(&node, &reg, &none, &wget(allowed.port));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Network is unreachable"), "{out}");

    // An allow list: the allowed host port answers, another port of the host is refused
    // at once, and so is an address of the world that is not allowed.
    let rule = format!("127.0.0.1:{}", allowed.port);
    let (open, _) = create(
        &node,
        &reg,
        &["--allow", &rule, "--allow", "192.0.2.0/24:443"],
    );
    let (code, out) = sh(&node, &reg, &open, &wget(allowed.port));
    assert_eq!(code, 0, "{out}");
    assert!(out.ends_with("\r\n\r\nhello from allowed\n"), "{out}");
    let (code, out) = sh(&node, &reg, &open, &wget(denied.port));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Connection refused"), "{out}");
    let (code, out) = sh(&node, &reg, &open, &get("198.51.100.7", 80, "-"));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Connection refused"), "{out}");
    assert!(denied.seen.lock().unwrap().is_empty());
    // The resolver: the gateway by name, and names of the world through the host's
    // resolver (this machine resolves localhost, and nothing beyond it).
    let (code, out) = sh(
        &node,
        &reg,
        &open,
        "cat /etc/resolv.conf; nslookup host.amber.internal; nslookup localhost",
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("nameserver 10.0.2.3"), "{out}");
    assert!(out.contains("Address: 10.0.2.2"), "{out}");
    assert!(out.contains("Address: 127.0.0.1"), "{out}");
    let (code, out) = sh(
        &node,
        &reg,
        &open,
        &get("host.amber.internal", allowed.port, "-"),
    );
    assert!(out.ends_with("hello from allowed\n"), "{code} {out}");

    // Host services only: the service at the gateway, nothing else of the host or the
    // world, no names of the world. 16 sandboxes call it at once.
    let recorder = HostServer::start("recorder");
    let service = format!("80=127.0.0.1:{}", recorder.port);
    let o = node.amber(
        &reg,
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
            let (id, cmd) = (id.clone(), node.command(&reg));
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
        &node,
        &reg,
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
        assert!(node.amber(&reg, &["rm", id]).status.success());
    }

    // A published port: the host reaches a server in the sandbox; a published port with
    // nothing listening inside closes the host's connection without a byte.
    let (web, err) = create(&node, &reg, &["-p", "8080", "-p", "8081"]);
    let host_of = |port: u16| {
        err.lines()
            .find_map(|l| l.strip_prefix(&format!("amber: {web} port {port} is at ")))
            .unwrap_or_else(|| panic!("no published port {port} in {err}"))
            .to_string()
    };
    let (code, out) = sh(&node, &reg, &web, "httpd -p 8080 -h /www");
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
        let o = node.amber(&reg, &["create", flag, bad, "net/box:v1"]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(why), "{}", stderr(&o));
    }
    for id in [&none, &open, &web] {
        assert!(node.amber(&reg, &["rm", id]).status.success());
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

#[test]
fn docker_and_compose_run_inside_a_sandbox() {
    let reg = Registry::start(&[]);
    let node = Node::setup(&reg);
    docker_ok(&[
        "import",
        &env("AMBER_TEST_DOCKER_ROOTFS"),
        "amber-test/debian-docker:bookworm",
    ]);
    build_and_push(
        &format!("{}/dind/engine:v1", reg.addr),
        "FROM amber-test/debian-docker:bookworm\nCMD [\"sh\"]\n",
        &[],
    );
    busybox_base();
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
        &reg,
        &[
            "create",
            "--memory",
            "1024",
            "--cpus",
            "2",
            "--disk",
            "4096",
            "dind/engine:v1",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let id = stdout(&o).trim().to_string();
    let sh = |script: &str| {
        let o = node.amber(
            &reg,
            &["exec", &id, "--", "sh", "-c", &format!("{script} 2>&1")],
        );
        (o.status.code().unwrap_or(-1), stdout(&o) + &stderr(&o))
    };
    for (src, dest) in [
        (&image_tar, "/root/busybox.tar"),
        (&compose, "/root/docker-compose.yml"),
    ] {
        let o = node.amber(
            &reg,
            &["cp", &src.display().to_string(), &format!("{id}:{dest}")],
        );
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // dockerd in the background, its log in a file; then wait (bounded) until it answers.
    let (code, out) = sh("setsid dockerd >/var/log/dockerd.log 2>&1 < /dev/null & \
         timeout 120 sh -c 'until docker info >/dev/null 2>&1; do sleep 0.2; done' \
         || { tail -30 /var/log/dockerd.log; exit 1; }");
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
    assert!(node.amber(&reg, &["rm", &id]).status.success());
}
