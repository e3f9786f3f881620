"""The async client of amber's node API, and the `Sandbox` handle a rollout uses.

A node is `unix:///path/to/amberd.sock` (the default socket is `$AMBER_HOME/amberd.sock`)
or `http://host:port` with a bearer token. Given several nodes, `AsyncAmber.create`
places each sandbox on the best of a few: the one with the most free capacity, preferring
nodes whose cache already holds the env's chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Sequence

import httpx

from .errors import BY_KIND, AmberError, CapacityError, CommandTimeout, NodeUnreachable
from .types import (
    ExecFrame,
    ExecResult,
    Network,
    NodeInfo,
    PrefetchProgress,
    ProcessInfo,
    SandboxInfo,
    SnapshotInfo,
)


def _raise_for(r: httpx.Response) -> None:
    if r.is_success:
        return
    try:
        err = r.json()["error"]
        kind, message = err["kind"], err["message"]
    except Exception:  # not the node's error body
        kind, message = "internal", f"HTTP {r.status_code}: {r.text[:500]}"
    raise BY_KIND.get(kind, AmberError)(message, r.status_code)


@dataclass(frozen=True)
class NodeAddress:
    url: str
    token: str | None = None

    @staticmethod
    def parse(s: "str | NodeAddress", token: str | None = None) -> "NodeAddress":
        if isinstance(s, NodeAddress):
            return s
        return NodeAddress(s, token)


class AsyncNode:
    """One amberd."""

    def __init__(self, address: "str | NodeAddress", token: str | None = None, timeout: float = 600.0):
        self.address = NodeAddress.parse(address, token)
        url = self.address.url
        headers = {}
        if self.address.token:
            headers["Authorization"] = f"Bearer {self.address.token}"
        if url.startswith("unix://"):
            transport = httpx.AsyncHTTPTransport(uds=url[len("unix://"):])
            base = "http://amberd"
        else:
            transport = httpx.AsyncHTTPTransport()
            base = url.rstrip("/")
        self._http = httpx.AsyncClient(
            transport=transport,
            base_url=base,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = await self._http.request(method, path, **kw)
        except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
            raise NodeUnreachable(f"amberd at {self.address.url} does not answer: {e}") from e
        _raise_for(r)
        return r

    async def info(self, image: str | None = None) -> NodeInfo:
        params = {"image": image} if image else None
        return NodeInfo.parse((await self._request("GET", "/v1/node", params=params)).json())

    async def prefetch(
        self, image: str, on_progress: Callable[[PrefetchProgress], None] | None = None
    ) -> PrefetchProgress:
        """Fetches every chunk of `image`'s env into this node's cache, calling
        `on_progress` with each frame (a few a second at most); returns the last one.
        Raises `ImageNotFound`, `IntegrityError`, … as `create` would."""
        async with contextlib.aclosing(self._lines("POST", "/v1/prefetch", json={"image": image})) as lines:
            async for d in lines:
                if d["type"] == "error":
                    raise BY_KIND.get(d["kind"], AmberError)(d["message"])
                frame = PrefetchProgress.parse(d)
                if on_progress:
                    on_progress(frame)
                if frame.done:
                    return frame
        raise NodeUnreachable(f"amberd at {self.address.url} ended a prefetch of {image} before it was done")

    async def health(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/health")).json()

    async def create(self, **spec: Any) -> SandboxInfo:
        body = {k: v for k, v in spec.items() if v is not None}
        return SandboxInfo.parse((await self._request("POST", "/v1/sandboxes", json=body)).json())

    async def create_batch(self, specs: Sequence[Mapping[str, Any]]) -> list[SandboxInfo | AmberError]:
        body = {"sandboxes": [{k: v for k, v in s.items() if v is not None} for s in specs]}
        r = await self._request("POST", "/v1/sandboxes/batch", json=body)
        out: list[SandboxInfo | AmberError] = []
        for item in r.json()["results"]:
            if item.get("sandbox"):
                out.append(SandboxInfo.parse(item["sandbox"]))
            else:
                e = item["error"]
                out.append(BY_KIND.get(e["kind"], AmberError)(e["message"]))
        return out

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.parse((await self._request("GET", f"/v1/sandboxes/{sandbox_id}")).json())

    async def wait(self, sandbox_id: str, timeout_s: int = 600, ended: bool = False) -> SandboxInfo:
        """Waits until the sandbox is no longer creating, or with `ended` until it has
        ended (its `reason` then says why), or until `timeout_s` passed."""
        params: dict[str, Any] = {"timeout_s": timeout_s}
        if ended:
            params["ended"] = "true"
        r = await self._request("GET", f"/v1/sandboxes/{sandbox_id}/wait", params=params)
        return SandboxInfo.parse(r.json())

    async def list(self, labels: Mapping[str, str] | None = None, all: bool = False) -> list[SandboxInfo]:
        params: dict[str, Any] = {}
        if labels:
            params["label"] = ",".join(f"{k}={v}" for k, v in labels.items())
        if all:
            params["all"] = "true"
        r = await self._request("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.parse(s) for s in r.json()["sandboxes"]]

    async def delete(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.parse((await self._request("DELETE", f"/v1/sandboxes/{sandbox_id}")).json())

    async def delete_by_labels(self, labels: Mapping[str, str]) -> list[str]:
        label = ",".join(f"{k}={v}" for k, v in labels.items())
        r = await self._request("DELETE", "/v1/sandboxes", params={"label": label})
        return r.json()["deleted"]

    async def set_timeout(self, sandbox_id: str, lifetime_s: int) -> SandboxInfo:
        r = await self._request("PUT", f"/v1/sandboxes/{sandbox_id}/timeout", json={"lifetime_s": lifetime_s})
        return SandboxInfo.parse(r.json())

    async def snapshot(self, sandbox_id: str, tag: str | None = None, wait: bool = True) -> SnapshotInfo:
        body: dict[str, Any] = {"wait": wait}
        if tag is not None:
            body["tag"] = tag
        r = await self._request("POST", f"/v1/sandboxes/{sandbox_id}/snapshot", json=body)
        return SnapshotInfo.parse(r.json())

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.parse((await self._request("POST", f"/v1/sandboxes/{sandbox_id}/pause")).json())

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.parse((await self._request("POST", f"/v1/sandboxes/{sandbox_id}/resume")).json())

    async def exec(self, sandbox_id: str, body: Mapping[str, Any]) -> ExecResult:
        r = await self._request("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body)
        return ExecResult.parse(r.json())

    async def _lines(self, method: str, path: str, **kw) -> AsyncIterator[dict[str, Any]]:
        """The JSON lines of a streamed (newline-delimited) answer, as they arrive."""
        try:
            async with self._http.stream(method, path, **kw) as r:
                if not r.is_success:
                    await r.aread()
                    _raise_for(r)
                async for line in r.aiter_lines():
                    if line:
                        yield json.loads(line)
        except httpx.ConnectError as e:
            raise NodeUnreachable(f"amberd at {self.address.url} does not answer: {e}") from e

    async def _frames(self, method: str, path: str, **kw) -> AsyncIterator[ExecFrame]:
        """A streamed command's frames, as they arrive."""
        async for d in self._lines(method, path, **kw):
            yield ExecFrame.parse(d)

    def exec_stream(self, sandbox_id: str, body: Mapping[str, Any]) -> AsyncIterator[ExecFrame]:
        return self._frames("POST", f"/v1/sandboxes/{sandbox_id}/exec/stream", json=body)

    async def start_process(self, sandbox_id: str, body: Mapping[str, Any]) -> ProcessInfo:
        r = await self._request("POST", f"/v1/sandboxes/{sandbox_id}/processes", json=body)
        return ProcessInfo.parse(r.json())

    async def process(self, sandbox_id: str, pid: int) -> ProcessInfo:
        r = await self._request("GET", f"/v1/sandboxes/{sandbox_id}/processes/{pid}")
        return ProcessInfo.parse(r.json())

    def output(self, sandbox_id: str, pid: int, from_seq: int = 0) -> AsyncIterator[ExecFrame]:
        path = f"/v1/sandboxes/{sandbox_id}/processes/{pid}/output"
        return self._frames("GET", path, params={"from": from_seq})

    async def signal(self, sandbox_id: str, pid: int, signal: str | int) -> ProcessInfo:
        r = await self._request(
            "POST", f"/v1/sandboxes/{sandbox_id}/processes/{pid}/signal", json={"signal": str(signal)}
        )
        return ProcessInfo.parse(r.json())

    async def upload(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._request(
            "PUT", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path, "mode": f"{mode:o}"}, content=data
        )

    async def download(self, sandbox_id: str, path: str) -> bytes:
        return (await self._request("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path})).content

    async def upload_archive(self, sandbox_id: str, path: str, tar: bytes) -> None:
        await self._request("PUT", f"/v1/sandboxes/{sandbox_id}/archive", params={"path": path}, content=tar)

    async def download_archive(self, sandbox_id: str, path: str) -> bytes:
        return (await self._request("GET", f"/v1/sandboxes/{sandbox_id}/archive", params={"path": path})).content


def _exec_body(
    command: "str | Sequence[str]",
    cwd: str | None,
    env: Mapping[str, str] | None,
    user: str | None,
    timeout: float | None,
    stdin: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if isinstance(command, str):
        body["command"] = command
    else:
        body["argv"] = list(command)
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if user is not None:
        body["user"] = user
    if timeout is not None:
        body["timeout_s"] = timeout
    if stdin is not None:
        body["stdin"] = stdin
    return body


class AsyncSandbox:
    """One sandbox; an async context manager that deletes it on exit."""

    def __init__(self, node: AsyncNode, info: SandboxInfo):
        self.node = node
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.delete()

    async def refresh(self) -> SandboxInfo:
        self.info = await self.node.get(self.id)
        return self.info

    async def exec(
        self,
        command: "str | Sequence[str]",
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        check_timeout: bool = True,
    ) -> ExecResult:
        """Runs a command (a shell string, or an argv list); raises CommandTimeout when it
        ran past `timeout` (unless `check_timeout` is False)."""
        r = await self.node.exec(self.id, _exec_body(command, cwd, env, user, timeout, stdin))
        if r.timed_out and check_timeout:
            raise CommandTimeout(f"the command ran past its timeout of {timeout} s and was killed", r)
        return r

    async def exec_stream(
        self,
        command: "str | Sequence[str]",
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
    ) -> AsyncIterator[ExecFrame]:
        """The command's frames as they come: stdout/stderr in order, then exit (or error)."""
        async for f in self.node.exec_stream(self.id, _exec_body(command, cwd, env, user, timeout, stdin)):
            yield f

    async def start(self, command: "str | Sequence[str]", **kw) -> ProcessInfo:
        """Starts a background process; read it with `output(pid, from_seq)`."""
        return await self.node.start_process(self.id, _exec_body(command, kw.get("cwd"), kw.get("env"), kw.get("user"), kw.get("timeout"), kw.get("stdin")))

    def output(self, pid: int, from_seq: int = 0) -> AsyncIterator[ExecFrame]:
        return self.node.output(self.id, pid, from_seq)

    async def signal(self, pid: int, signal: "str | int" = "TERM") -> ProcessInfo:
        return await self.node.signal(self.id, pid, signal)

    async def upload(self, path: str, data: "bytes | str", mode: int = 0o644) -> None:
        await self.node.upload(self.id, path, data.encode() if isinstance(data, str) else data, mode)

    async def download(self, path: str) -> bytes:
        return await self.node.download(self.id, path)

    async def upload_dir(self, local: "str | os.PathLike[str]", path: str) -> None:
        """Copies a local directory's contents into `path` (one tar stream)."""
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            t.add(str(local), arcname=".")
        await self.node.upload_archive(self.id, path, buf.getvalue())

    async def download_dir(self, path: str, local: "str | os.PathLike[str]") -> None:
        """Copies `path` (a directory tree) to the local directory `local`."""
        import io
        import tarfile

        data = await self.node.download_archive(self.id, path)
        Path(local).mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            t.extractall(str(local), filter="data")

    async def set_timeout(self, lifetime_s: int) -> SandboxInfo:
        """A new hard lifetime, counted from now."""
        self.info = await self.node.set_timeout(self.id, lifetime_s)
        return self.info

    async def snapshot(self, tag: str | None = None, wait: bool = True) -> SnapshotInfo:
        """Commit this sandbox's files as a new image (it keeps running). The answer's
        `image` is what `AsyncAmber.create` and `fork` take, and `docker pull`."""
        return await self.node.snapshot(self.id, tag=tag, wait=wait)

    async def pause(self) -> SandboxInfo:
        """Save this sandbox (memory, devices, disk) to a file on its node and stop its VM;
        its running processes continue where they were at `resume`."""
        self.info = await self.node.pause(self.id)
        return self.info

    async def resume(self) -> SandboxInfo:
        self.info = await self.node.resume(self.id)
        return self.info

    async def delete(self) -> SandboxInfo:
        self.info = await self.node.delete(self.id)
        return self.info


class AsyncAmber:
    """Sandboxes on one or many nodes. `nodes` are `unix://…` or `http://host:port`
    addresses (with `token` for TCP); by default the node of `$AMBER_HOME`."""

    def __init__(
        self,
        nodes: "Iterable[str | NodeAddress] | None" = None,
        token: str | None = None,
        candidates: int = 3,
    ):
        if nodes is None:
            home = os.environ.get("AMBER_HOME") or os.path.expanduser("~/.cache/amber")
            nodes = [f"unix://{home}/amberd.sock"]
        self.nodes = [AsyncNode(n, token) for n in nodes]
        if not self.nodes:
            raise ValueError("give at least one node")
        self.candidates = candidates

    async def close(self) -> None:
        await asyncio.gather(*(n.close() for n in self.nodes))

    async def __aenter__(self) -> "AsyncAmber":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def place(self, image: str, cpus: int, memory_mib: int) -> AsyncNode:
        """The node for a new sandbox: of a few candidates that have room, the one whose
        cache holds most of the image's env, then the one with the most free capacity."""
        if len(self.nodes) == 1:
            return self.nodes[0]
        picks = random.sample(self.nodes, min(self.candidates, len(self.nodes)))

        async def score(n: AsyncNode):
            try:
                i = await n.info(image=image)
            except AmberError:
                return None
            if i.free.sandboxes < 1 or i.free.cpus < cpus or i.free.memory_mib < memory_mib:
                return None
            cached = i.image.fraction if i.image else 0.0
            free = min(i.free.cpus / max(i.capacity.cpus, 1), i.free.memory_mib / max(i.capacity.memory_mib, 1))
            return (round(cached, 2), free, n)

        scored = [s for s in await asyncio.gather(*(score(n) for n in picks)) if s]
        if not scored:
            raise CapacityError(f"none of the {len(picks)} nodes asked has room for {cpus} vCPUs and {memory_mib} MiB")
        scored.sort(key=lambda s: (s[0], s[1]), reverse=True)
        return scored[0][2]

    async def create(
        self,
        image: str,
        *,
        cpus: int = 1,
        memory_mib: int = 512,
        disk_mib: int | None = None,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        lifetime_s: int | None = None,
        idle_timeout_s: int | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
        network: Network | None = None,
        node: AsyncNode | None = None,
    ) -> AsyncSandbox:
        """A new sandbox of `image` (name:tag, name@sha256:… or blake3:…), ready for
        commands unless `wait` is False."""
        target = node or await self.place(image, cpus, memory_mib)
        info = await target.create(
            image=image,
            cpus=cpus,
            memory_mib=memory_mib,
            disk_mib=disk_mib,
            env=dict(env) if env else None,
            labels=dict(labels) if labels else None,
            workdir=workdir,
            user=user,
            lifetime_s=lifetime_s,
            idle_timeout_s=idle_timeout_s,
            idempotency_key=idempotency_key,
            wait=wait,
            network=dataclasses.asdict(network) if network else None,
        )
        return AsyncSandbox(target, info)

    async def fork(self, image: str, n: int, **spec: Any) -> list[AsyncSandbox]:
        """`n` sandboxes of `image` (a snapshot's `image`, or any reference), placed over
        the nodes and created per node in one batch request. Raises the first error if
        any sandbox did not start, after deleting those that did."""
        if n < 1:
            raise ValueError("fork at least one sandbox")
        cpus, memory_mib = spec.get("cpus", 1), spec.get("memory_mib", 512)
        shares: dict[int, tuple[AsyncNode, int]] = {}
        for _ in range(n):
            node = await self.place(image, cpus, memory_mib)
            prev = shares.get(id(node), (node, 0))[1]
            shares[id(node)] = (node, prev + 1)
        body = {k: v for k, v in spec.items() if v is not None}
        results = await asyncio.gather(
            *(node.create_batch([dict(body, image=image)] * k) for node, k in shares.values())
        )
        made: list[AsyncSandbox] = []
        errors: list[AmberError] = []
        for (node, _), items in zip(shares.values(), results):
            for item in items:
                if isinstance(item, AmberError):
                    errors.append(item)
                else:
                    made.append(AsyncSandbox(node, item))
        if errors:
            await asyncio.gather(*(s.delete() for s in made), return_exceptions=True)
            raise errors[0]
        return made

    async def prefetch(
        self, image: str, on_progress: Callable[[AsyncNode, PrefetchProgress], None] | None = None
    ) -> list[PrefetchProgress]:
        """Fetches `image`'s env into the cache of every node at once (before a run that
        will create many sandboxes of it); one final frame per node, in `nodes` order."""

        def reporter(n: AsyncNode):
            return (lambda f: on_progress(n, f)) if on_progress else None

        return list(await asyncio.gather(*(n.prefetch(image, reporter(n)) for n in self.nodes)))

    async def list(self, labels: Mapping[str, str] | None = None) -> list[AsyncSandbox]:
        lists = await asyncio.gather(*(n.list(labels) for n in self.nodes))
        return [AsyncSandbox(n, i) for n, l in zip(self.nodes, lists) for i in l]

    async def delete_by_labels(self, labels: Mapping[str, str]) -> list[str]:
        lists = await asyncio.gather(*(n.delete_by_labels(labels) for n in self.nodes))
        return [i for l in lists for i in l]
