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

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "SandboxInfo":
        return _with_parents(cls, d)


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
