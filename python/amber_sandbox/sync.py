"""A synchronous client over the async one: one event loop on a background thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

from .client import AsyncAmber, AsyncSandbox
from .types import ExecFrame, ExecResult, PrefetchProgress, SandboxInfo, SnapshotInfo


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="amber-sandbox")
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen) -> Iterator[Any]:
        while True:
            try:
                yield self.run(agen.__anext__())
            except StopAsyncIteration:
                return


class Sandbox:
    """The sync handle of a sandbox; a context manager that deletes it on exit."""

    def __init__(self, loop: _Loop, inner: AsyncSandbox):
        self._loop = loop
        self._inner = inner

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def info(self) -> SandboxInfo:
        return self._inner.info

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    def exec(self, command, **kw) -> ExecResult:
        return self._loop.run(self._inner.exec(command, **kw))

    def exec_stream(self, command, **kw) -> Iterator[ExecFrame]:
        return self._loop.iterate(self._inner.exec_stream(command, **kw))

    def upload(self, path: str, data, mode: int = 0o644) -> None:
        self._loop.run(self._inner.upload(path, data, mode))

    def download(self, path: str) -> bytes:
        return self._loop.run(self._inner.download(path))

    def upload_dir(self, local, path: str) -> None:
        self._loop.run(self._inner.upload_dir(local, path))

    def download_dir(self, path: str, local) -> None:
        self._loop.run(self._inner.download_dir(path, local))

    def set_timeout(self, lifetime_s: int) -> SandboxInfo:
        return self._loop.run(self._inner.set_timeout(lifetime_s))

    def refresh(self) -> SandboxInfo:
        return self._loop.run(self._inner.refresh())

    def snapshot(self, tag: str | None = None, wait: bool = True) -> SnapshotInfo:
        return self._loop.run(self._inner.snapshot(tag=tag, wait=wait))

    def pause(self) -> SandboxInfo:
        return self._loop.run(self._inner.pause())

    def resume(self) -> SandboxInfo:
        return self._loop.run(self._inner.resume())

    def delete(self) -> SandboxInfo:
        return self._loop.run(self._inner.delete())


class Amber:
    """The sync client: the same calls as `AsyncAmber`."""

    def __init__(self, *args, **kw):
        self._loop = _Loop()
        self._inner = self._loop.run(self._make(*args, **kw))

    @staticmethod
    async def _make(*args, **kw) -> AsyncAmber:
        return AsyncAmber(*args, **kw)

    def create(self, image: str, **kw) -> Sandbox:
        return Sandbox(self._loop, self._loop.run(self._inner.create(image, **kw)))

    def fork(self, image: str, n: int, **kw) -> list[Sandbox]:
        return [Sandbox(self._loop, s) for s in self._loop.run(self._inner.fork(image, n, **kw))]

    def prefetch(self, image: str, on_progress=None) -> list[PrefetchProgress]:
        return self._loop.run(self._inner.prefetch(image, on_progress))

    def list(self, labels=None) -> list[Sandbox]:
        return [Sandbox(self._loop, s) for s in self._loop.run(self._inner.list(labels))]

    def delete_by_labels(self, labels) -> list[str]:
        return self._loop.run(self._inner.delete_by_labels(labels))

    def close(self) -> None:
        self._loop.run(self._inner.close())
        self._loop.loop.call_soon_threadsafe(self._loop.loop.stop)

    def __enter__(self) -> "Amber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
