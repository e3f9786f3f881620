"""A thin layer with the method names RL environment libraries call on hosted sandbox
SDKs (create, wait_for_creation, execute_command, upload_file, download_file, delete,
bulk_delete), so an environment written for one switches to amber by changing an import:

    from amber_sandbox.prime import AsyncSandboxClient, CreateSandboxRequest
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .client import AsyncAmber, AsyncSandbox
from .errors import CommandTimeout
from .types import SandboxInfo


@dataclass
class CreateSandboxRequest:
    docker_image: str
    name: str | None = None
    cpu_cores: int = 1
    memory_gb: float = 0.5
    disk_size_gb: int | None = None
    timeout_minutes: int = 60
    environment_vars: dict[str, str] | None = None
    labels: list[str] | dict[str, str] = field(default_factory=dict)
    start_command: str | None = None


@dataclass
class CommandResponse:
    stdout: str
    stderr: str
    exit_code: int


class AsyncSandboxClient:
    def __init__(self, nodes=None, token: str | None = None):
        self._amber = AsyncAmber(nodes, token)
        self._sandboxes: dict[str, AsyncSandbox] = {}

    async def create(self, request: CreateSandboxRequest) -> SandboxInfo:
        labels = request.labels if isinstance(request.labels, dict) else {l: "1" for l in request.labels}
        if request.name:
            labels = {**labels, "name": request.name}
        s = await self._amber.create(
            request.docker_image,
            cpus=request.cpu_cores,
            memory_mib=int(request.memory_gb * 1024),
            disk_mib=None if request.disk_size_gb is None else request.disk_size_gb * 1024,
            env=request.environment_vars,
            labels=labels,
            lifetime_s=request.timeout_minutes * 60,
            wait=False,
        )
        self._sandboxes[s.id] = s
        if request.start_command:
            await s.node.wait(s.id)
            await s.start(request.start_command)
        return s.info

    def _sandbox(self, sandbox_id: str) -> AsyncSandbox:
        return self._sandboxes[sandbox_id]

    async def wait_for_creation(self, sandbox_id: str, max_attempts: int = 60) -> None:
        s = self._sandbox(sandbox_id)
        s.info = await s.node.wait(sandbox_id, timeout_s=max(10, max_attempts * 10))
        if s.info.status != "running":
            from .errors import SandboxNotRunning

            raise SandboxNotRunning(f"sandbox {sandbox_id} is {s.info.status}: {s.info.reason}")

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._sandbox(sandbox_id).refresh()

    async def execute_command(
        self,
        sandbox_id: str,
        command: str,
        working_dir: str | None = None,
        env: dict[str, str] | None = None,
        timeout: int | None = None,
    ) -> CommandResponse:
        r = await self._sandbox(sandbox_id).exec(command, cwd=working_dir, env=env, timeout=timeout, check_timeout=False)
        if r.timed_out:
            raise CommandTimeout(f"command timed out after {timeout} s", r)
        return CommandResponse(r.stdout, r.stderr, r.exit_code)

    async def upload_file(self, sandbox_id: str, file_path: str, local_file_path: str) -> None:
        await self._sandbox(sandbox_id).upload(file_path, Path(local_file_path).read_bytes())

    async def download_file(self, sandbox_id: str, file_path: str, local_file_path: str) -> None:
        Path(local_file_path).write_bytes(await self._sandbox(sandbox_id).download(file_path))

    async def delete(self, sandbox_id: str) -> dict[str, Any]:
        info = await self._sandboxes.pop(sandbox_id).delete()
        return {"id": info.id, "status": info.status}

    async def bulk_delete(self, sandbox_ids: list[str] | None = None, labels: list[str] | None = None) -> dict[str, Any]:
        deleted: list[str] = []
        for i in sandbox_ids or []:
            await self.delete(i)
            deleted.append(i)
        if labels:
            deleted += await self._amber.delete_by_labels({l: "1" for l in labels})
        return {"succeeded": deleted}

    async def aclose(self) -> None:
        await self._amber.close()
