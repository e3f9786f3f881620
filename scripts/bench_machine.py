"""The real-machine benchmark (issue 16), an amber sandbox against a Docker container of
the same image (Debian bookworm with Docker Engine, the root fs of the Docker-inside
test) on this machine:

  tcp       throughput of one TCP stream from the guest to a server on the host's
            loopback (amber: an allow rule, through the sandbox's user-mode network;
            Docker: `--network host`, the kernel's loopback): 256 MiB written by bash's
            /dev/tcp and dd, timed by the host server from the first byte to EOF.
  service   request latency of a host service (a small HTTP server on the host; amber:
            `--host-service 80=127.0.0.1:P` at host.amber.internal; Docker: the same
            server at 127.0.0.1:P): connect, send a request, read the status line, timed
            inside with bash's $EPOCHREALTIME (no process started per request), p50/p99.
  docker    Docker inside a sandbox: `dockerd` started until `docker info` answers, and
            `docker run --rm` of a small loaded image (busybox) until it exits.

Called by bench.py (`scripts/bench --only machine`).
"""
import os
import socket
import statistics
import subprocess
import threading
import time

from bench_node import pct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
STREAM_MIB = 256


class Sink:
    """Counts the bytes of each connection; records (bytes, seconds from first byte to EOF)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.results = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            c, _ = self.sock.accept()
            n, t0 = 0, None
            while True:
                b = c.recv(1 << 20)
                if not b:
                    break
                if t0 is None:
                    t0 = time.monotonic()
                n += len(b)
            self.results.append((n, time.monotonic() - (t0 or time.monotonic())))
            c.close()


class Service:
    """A minimal HTTP server answering every request with a short body."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            c, _ = self.sock.accept()
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    @staticmethod
    def _one(c):
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                b = c.recv(4096)
                if not b:
                    break
                data += b
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
        finally:
            c.close()


def stream_script(host, port):
    return f"exec 3<>/dev/tcp/{host}/{port} && dd if=/dev/zero bs=1M count={STREAM_MIB} status=none >&3 && exec 3>&-"


def latency_script(host, port, n):
    # Microseconds per request, one per line; only bash builtins inside the loop.
    return (f"for i in $(seq {n}); do t0=$EPOCHREALTIME; exec 3<>/dev/tcp/{host}/{port} || exit 1; "
            f"printf 'GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n' >&3; read -r line <&3; exec 3>&-; t1=$EPOCHREALTIME; "
            f"echo $(( (${{t1/./}} - ${{t0/./}}) )); done")


def bench_machine(work, h, quick=False):
    """`h` is bench.py (Server, docker helpers, wait_converted, TARGET)."""
    n = 50 if quick else 300
    amber = os.path.join(h.TARGET, "release", "amber")
    rootfs = os.path.expanduser(os.environ.get("AMBER_TEST_DOCKER_ROOTFS",
                                               "~/.cache/amber-test/debian-bookworm-docker-v2.tar"))
    if not os.path.exists(rootfs):
        subprocess.run([os.path.join(ROOT, "fixtures/debian-rootfs.sh"), rootfs,
                        "docker.io,docker-compose,iptables,strace,mount,procps"], check=True)
    busybox = os.path.join(work, "busybox-rootfs.tar")
    subprocess.run([os.path.join(ROOT, "fixtures/busybox-rootfs.sh"), busybox], check=True)
    h.docker("import", busybox, "amber-bench/busybox:1")
    saved = os.path.join(work, "busybox-image.tar")
    h.docker("save", "-o", saved, "amber-bench/busybox:1")
    s = h.Server("amber+convert", work)
    res = {"stream_mib": STREAM_MIB, "requests": n}
    sink, service = Sink(), Service()
    try:
        image = f"{s.addr}/bench/machine:1"
        h.docker("import", rootfs, image)
        h.docker("push", image)
        h.wait_converted(s.addr, "bench/machine", "1")
        home = os.path.join(work, "machine-home")
        subprocess.run(["rm", "-rf", home])
        os.makedirs(home)
        env = dict(os.environ, AMBER_HOME=home, AMBER_REGISTRY=f"http://{s.addr}")

        def amber_cmd(*args, check=True):
            r = subprocess.run([amber, *args], env=env, capture_output=True, text=True)
            if check and r.returncode != 0:
                raise RuntimeError(f"amber {' '.join(args[:2])}: {r.stderr}")
            return r.stdout

        amber_cmd("setup")
        sid = amber_cmd("create", "--memory", "1024", "--cpus", "2", "--disk", "4096",
                        "--allow", f"127.0.0.1:{sink.port}",
                        "--host-service", f"80=127.0.0.1:{service.port}", "bench/machine:1").strip()
        try:
            def sh(script):
                return amber_cmd("exec", sid, "--", "bash", "-c", script)

            sh(stream_script("10.0.2.2", sink.port))
            b, secs = sink.results[-1]
            assert b == STREAM_MIB * MIB, b
            res["amber_tcp_mib_s"] = STREAM_MIB / secs
            lat = [int(x) / 1000 for x in sh(latency_script("10.0.2.2", 80, n)).split()]
            res["amber_service_ms"] = lat
            # Docker inside.
            amber_cmd("cp", saved, f"{sid}:/root/busybox.tar")
            out = sh("t0=$EPOCHREALTIME; setsid dockerd >/var/log/dockerd.log 2>&1 </dev/null & "
                     "until docker info >/dev/null 2>&1; do sleep 0.05; done; t1=$EPOCHREALTIME; "
                     "docker load -q -i /root/busybox.tar >/dev/null; t2=$EPOCHREALTIME; "
                     "docker run --rm amber-bench/busybox:1 true; t3=$EPOCHREALTIME; "
                     "echo $t0 $t1 $t2 $t3").split()
            t = [float(x) for x in out]
            res["amber_dockerd_ready_s"] = t[1] - t[0]
            res["amber_docker_run_s"] = t[3] - t[2]
            runs = []
            for _ in range(5):
                o = sh("t0=$EPOCHREALTIME; docker run --rm amber-bench/busybox:1 true; t1=$EPOCHREALTIME; echo $t0 $t1").split()
                runs.append(float(o[1]) - float(o[0]))
            res["amber_docker_run_again_s"] = statistics.median(runs)
        finally:
            amber_cmd("rm", sid, check=False)

        # Docker: the same image, host network.
        def dsh(script):
            return h.docker("run", "--rm", "--network", "host", image, "bash", "-c", script)

        dsh(stream_script("127.0.0.1", sink.port))
        b, secs = sink.results[-1]
        assert b == STREAM_MIB * MIB, b
        res["docker_tcp_mib_s"] = STREAM_MIB / secs
        res["docker_service_ms"] = [int(x) / 1000 for x in dsh(latency_script("127.0.0.1", service.port, n)).split()]
        t0 = time.monotonic()
        h.docker("run", "--rm", "amber-bench/busybox:1", "true")
        res["host_docker_run_s"] = time.monotonic() - t0
    finally:
        s.stop()
    return res


def machine_section(res):
    a, d = res["amber_service_ms"], res["docker_service_ms"]
    lines = [
        "## Real-machine fidelity: network and Docker inside (issue 16)",
        "",
        "One run of `scripts/bench --only machine` (`scripts/bench_machine.py`), the sandbox under TCG on this",
        "machine (no usable KVM), against a Docker container of the same image (Debian bookworm with Docker",
        "Engine) on the host's engine. TCP: one stream of "
        f"{res['stream_mib']} MiB from bash's /dev/tcp to a server on the host's loopback, timed by the server",
        "(amber: an allow rule, through the sandbox's user-mode network stack; Docker: `--network host`, the",
        f"kernel's loopback). Host service: {res['requests']} requests one after another (connect, request, status",
        "line), timed inside with bash's `$EPOCHREALTIME` (amber: `--host-service 80=127.0.0.1:P` at the",
        "gateway, 10.0.2.2:80; Docker: the server itself at 127.0.0.1:P).",
        "",
        "| measure | amber sandbox | Docker container | amber / Docker |",
        "|---|---|---|---|",
        f"| TCP guest to host (MiB/s) | {res['amber_tcp_mib_s']:.0f} | {res['docker_tcp_mib_s']:.0f} | "
        f"{res['amber_tcp_mib_s'] / res['docker_tcp_mib_s']:.3f}x |",
        f"| host service request p50 (ms) | {statistics.median(a):.2f} | {statistics.median(d):.2f} | "
        f"{statistics.median(a) / statistics.median(d):.1f}x |",
        f"| host service request p99 (ms) | {pct(a, 99):.2f} | {pct(d, 99):.2f} | {pct(a, 99) / pct(d, 99):.1f}x |",
        "",
        "Docker inside a sandbox (2 vCPUs, 1 GiB, a 4 GiB disk; vfs storage driver):",
        "",
        "| measure | seconds |",
        "|---|---|",
        f"| `dockerd` started until `docker info` answers | {res['amber_dockerd_ready_s']:.1f} |",
        f"| first `docker run --rm` of a loaded busybox image | {res['amber_docker_run_s']:.1f} |",
        f"| later `docker run --rm` (median of 5) | {res['amber_docker_run_again_s']:.1f} |",
        f"| the same `docker run --rm` on the host's engine, for reference | {res['host_docker_run_s']:.1f} |",
        "",
        "Every figure in the sandbox is CPU emulated by TCG (no KVM here); the ratios measure that as much as",
        "the network path.",
        "",
    ]
    return lines
