"""amber_sandbox: drive amber sandboxes (microVMs of pinned environments) from Python.

    async with AsyncAmber(["unix:///var/lib/amber/amberd.sock"]) as amber:
        async with await amber.create("swe/task-123@sha256:…") as sb:
            r = await sb.exec("pytest -q", timeout=600)

`Amber` and `Sandbox` are the same calls, synchronous. `amber_sandbox.prime` has the
method names of hosted sandbox SDKs.
"""

from .client import AsyncAmber, AsyncNode, AsyncSandbox, NodeAddress
from .errors import (
    AmberError,
    BadRequest,
    CapacityError,
    CommandTimeout,
    ImageNotFound,
    IntegrityError,
    NodeUnreachable,
    NotFound,
    SandboxNotRunning,
    Unauthorized,
    Unavailable,
)
from .sync import Amber, Sandbox
from .types import (
    ExecFrame,
    ExecResult,
    Network,
    NetworkInfo,
    NodeInfo,
    Parent,
    PrefetchProgress,
    ProcessInfo,
    PublishedPort,
    SandboxInfo,
    SnapshotInfo,
)

__all__ = [
    "Amber", "AsyncAmber", "AsyncNode", "AsyncSandbox", "NodeAddress", "Sandbox",
    "AmberError", "BadRequest", "CapacityError", "CommandTimeout", "ImageNotFound",
    "IntegrityError", "NodeUnreachable", "NotFound", "SandboxNotRunning", "Unauthorized",
    "Unavailable", "ExecFrame", "ExecResult", "NodeInfo", "ProcessInfo", "SandboxInfo",
    "Parent", "PrefetchProgress", "SnapshotInfo", "Network", "NetworkInfo", "PublishedPort",
]
