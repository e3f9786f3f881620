"""The node API's answers as dataclasses (amber_api::node in the Rust tree)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _from(cls, d: dict[str, Any]):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def _with_parents(cls, d: dict[str, Any]):
    """`cls` from `d`, its `parents` (a snapshot's lineage) as `Parent`s."""
    info = _from(cls, d)
    info.parents = [_from(Parent, p) for p in d.get("parents", [])]
    return info


@dataclass
class Parent:
    """One image of a snapshot's lineage."""

    image: str
    env_digest: str


@dataclass
class Network:
    """A sandbox's network (`network=` of `create`). Inside, the sandbox is 10.0.2.15;
    the host is 10.0.2.2 (`host.amber.internal`), the DNS server 10.0.2.3.

    allow: destinations it may reach, `ADDR`, `CIDR`, `ADDR:PORT` or `CIDR:PORT`
        (`127.0.0.1:PORT` is the host's loopback port, at 10.0.2.2:PORT inside);
    host_services: `PORT=ADDR:PORT` services of the host at 10.0.2.2:PORT;
    ports: `PORT` or `PORT=ADDR:PORT` ports of the sandbox the host reaches.
    """

    allow: list[str] = field(default_factory=list)
    host_services: list[str] = field(default_factory=list)
    ports: list[str] = field(default_factory=list)


@dataclass
class PublishedPort:
    guest_port: int
    host: str


@dataclass
class NetworkInfo:
    """A running sandbox's network: its address, and where its published ports are."""

    address: str
    gateway: str
    dns: str
    allow: list[str] = field(default_factory=list)
    host_services: list[str] = field(default_factory=list)
    ports: list[PublishedPort] = field(default_factory=list)

    def port(self, guest_port: int) -> str:
        """`ADDR:PORT` where the host reaches `guest_port`."""
        for p in self.ports:
            if p.guest_port == guest_port:
                return p.host
        raise KeyError(f"port {guest_port} of this sandbox is not published")


@dataclass
class SandboxInfo:
    id: str
    image: str
    env_digest: str
    status: str
    cpus: int
    memory_mib: int
    hostname: str
    created_at: int
    kernel: str
    initramfs: str
    accel: str
    image_digest: str | None = None
    reason: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    expires_at: int | None = None
    idle_timeout_s: int | None = None
    disk_mib: int = 0
    parents: list[Parent] = field(default_factory=list)
    state_bytes: int | None = None
    network: NetworkInfo | None = None

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "SandboxInfo":
        info = _with_parents(cls, d)
        if d.get("network"):
            n = _from(NetworkInfo, d["network"])
            n.ports = [_from(PublishedPort, p) for p in d["network"].get("ports", [])]
            info.network = n
        return info


@dataclass
class SnapshotInfo:
    """A snapshot: an ordinary image in the registry (`image` is `repo@sha256:…`)."""

    sandbox: str
    image: str
    image_digest: str
    layer_digest: str
    layer_bytes: int
    diff_bytes: int
    frozen_ms: int
    pushed_ms: int
    tag: str | None = None
    env_digest: str | None = None
    converted_ms: int | None = None
    parents: list[Parent] = field(default_factory=list)

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "SnapshotInfo":
        return _with_parents(cls, d)


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "ExecResult":
        return _from(cls, d)


@dataclass
class ExecFrame:
    """One line of a streamed command: `stdout`/`stderr` with `data`, then `exit` or `error`."""

    type: str
    seq: int
    data: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    kind: str | None = None
    message: str | None = None

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "ExecFrame":
        return _from(cls, d)

    @property
    def is_end(self) -> bool:
        return self.type in ("exit", "error")


@dataclass
class PrefetchProgress:
    """One line of a prefetch: how much of the env the node's cache holds (`cache`) and
    the chunk bytes this prefetch fetched so far; `type` is `progress`, then `done`."""

    type: str
    cache: "CachedEnv"
    fetched_bytes: int

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "PrefetchProgress":
        return cls(type=d["type"], cache=_from(CachedEnv, d["cache"]), fetched_bytes=d["fetched_bytes"])

    @property
    def done(self) -> bool:
        return self.type == "done"


@dataclass
class ProcessInfo:
    id: int
    argv: list[str]
    status: str
    next_seq: int
    first_seq: int
    exit_code: int | None = None
    timed_out: bool = False

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "ProcessInfo":
        return _from(cls, d)


@dataclass
class CachedEnv:
    env_digest: str
    chunks: int
    cached_chunks: int
    bytes: int
    cached_bytes: int

    @property
    def fraction(self) -> float:
        return self.cached_bytes / self.bytes if self.bytes else 0.0


@dataclass
class Resources:
    sandboxes: int
    cpus: int
    memory_mib: int


@dataclass
class NodeInfo:
    version: str
    registry: str
    accel: str
    capacity: Resources
    used: Resources
    free: Resources
    cache_bytes: int
    envs: list[CachedEnv]
    image: CachedEnv | None = None

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "NodeInfo":
        return cls(
            version=d["version"],
            registry=d["registry"],
            accel=d["accel"],
            capacity=_from(Resources, d["capacity"]),
            used=_from(Resources, d["used"]),
            free=_from(Resources, d["free"]),
            cache_bytes=d["cache_bytes"],
            envs=[_from(CachedEnv, e) for e in d.get("envs", [])],
            image=_from(CachedEnv, d["image"]) if d.get("image") else None,
        )
