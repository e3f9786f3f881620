"""Real parts for the client's tests: an amber registry, images pushed with the Docker
engine, and amberd nodes booting real QEMU microVMs. Started here, on loopback, and
stopped by PID. Needs AMBER_TEST_BIN_DIR (the built amber binaries) and
AMBER_TEST_DOCKER_HOST (a Docker engine), as scripts/test sets them."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def need(var: str) -> str:
    v = os.environ.get(var)
    if not v:
        raise RuntimeError(f"{var} is not set: run the tests with scripts/test")
    return v


def bin_path(name: str) -> str:
    p = Path(need("AMBER_TEST_BIN_DIR")) / name
    if not p.exists():
        raise RuntimeError(f"{p} is missing: build the workspace first")
    return str(p)


def docker(*args: str) -> str:
    """Runs the docker CLI against the test engine; a failure says what the CLI said and
    whether the engine's socket was there."""
    if not shutil.which("docker"):
        raise RuntimeError("the docker CLI is not installed")
    host = need("AMBER_TEST_DOCKER_HOST")
    r = subprocess.run(["docker", "-H", host, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sock = Path(host.removeprefix("unix://"))
        raise RuntimeError(
            f"docker {' '.join(args)} exited {r.returncode}: {r.stderr.strip()} "
            f"(engine socket {sock} {'exists' if sock.exists() else 'is missing'})"
        )
    return r.stdout


def wait_for_docker_engine(deadline_s: float = 60.0) -> None:
    """Waits until the test engine answers `docker version` (it is started by scripts/test
    and shared with the Rust tests before this session), failing with its last answer."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            docker("version", "--format", "{{.Server.Version}}")
            return
        except RuntimeError as e:
            if time.monotonic() > end:
                raise RuntimeError(f"the Docker engine did not answer within {deadline_s:.0f} s: {e}") from e
        time.sleep(0.5)


@dataclass
class Registry:
    addr: str
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def resolve(self, repo: str, ref: str) -> dict:
        with urllib.request.urlopen(f"{self.url}/amber/v1/resolve/{repo}/{ref}") as r:
            return json.load(r)

    def settled(self, repo: str, ref: str) -> dict:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            v = self.resolve(repo, ref)
            if v["state"] in ("done", "failed"):
                return v
            time.sleep(0.05)
        raise AssertionError(f"the conversion of {repo}:{ref} never settled")


@dataclass
class Amberd:
    home: Path
    proc: subprocess.Popen
    tcp: str
    token: str
    registry: Registry

    @property
    def socket(self) -> str:
        return f"unix://{self.home}/amberd.sock"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=120)


def setup_home(reg: Registry, home: Path) -> None:
    env = {**os.environ, "AMBER_HOME": str(home), "AMBER_REGISTRY": reg.url}
    subprocess.run([bin_path("amber"), "setup"], env=env, check=True, capture_output=True)


def start_amberd(reg: Registry, home: Path, *extra: str) -> Amberd:
    token = secrets.token_hex(16)
    (home / "token").write_text(token)
    env = {**os.environ, "AMBER_HOME": str(home), "AMBER_REGISTRY": reg.url}
    p = subprocess.Popen(
        [bin_path("amberd"), "--listen", "127.0.0.1:0", "--token-file", str(home / "token"), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(home / "amberd.log", "ab"),
        text=True,
    )
    first = p.stdout.readline().strip()
    if first != "ready":
        p.kill()
        raise RuntimeError(f"amberd said {first!r}; log: {(home / 'amberd.log').read_text()[-2000:]}")
    addr = p.stdout.readline().strip().removeprefix("listening on ")
    return Amberd(home, p, f"http://{addr}", token, reg)


@pytest.fixture(scope="session")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="amber-py-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def registry(workdir):
    p = subprocess.Popen(
        [bin_path("amber-registry"), "serve", "--listen", "127.0.0.1:0", "--data", str(workdir / "data")],
        stdout=subprocess.PIPE,
        stderr=open(workdir / "registry.log", "ab"),
        text=True,
    )
    line = p.stdout.readline().strip()
    assert line.startswith("listening on "), line
    reg = Registry(line.removeprefix("listening on "), p)
    yield reg
    p.terminate()
    p.wait(timeout=60)


@pytest.fixture(scope="session")
def images(registry, workdir):
    """Four small images (busybox plus one file each), converted; their references."""
    rootfs = workdir / "busybox.tar"
    subprocess.run([str(ROOT / "fixtures/busybox-rootfs.sh"), str(rootfs)], check=True, capture_output=True)
    wait_for_docker_engine()
    docker("import", str(rootfs), "amber-test/busybox:1")
    refs = []
    for i in range(4):
        ctx = workdir / f"img{i}"
        ctx.mkdir()
        (ctx / "Dockerfile").write_text(
            f"FROM amber-test/busybox:1\nRUN echo image-{i} > /id && mkdir -p /work\nWORKDIR /work\nENV IMAGE={i}\n"
        )
        tag = f"{registry.addr}/py/img{i}:v1"
        docker("build", "-q", "-t", tag, str(ctx))
        docker("push", tag)
        v = registry.settled(f"py/img{i}", "v1")
        assert v["state"] == "done", v
        refs.append(f"py/img{i}:v1")
    return refs


@pytest.fixture(scope="session")
def nodes(registry, images, workdir):
    """Three amberd on this machine, each with its own home and TCP port."""
    started = []
    for i in range(3):
        home = workdir / f"node{i}"
        home.mkdir()
        setup_home(registry, home)
        started.append(start_amberd(registry, home))
    yield started
    for n in started:
        n.stop()
