"""The Python client against real amberd nodes booting real microVMs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from amber_sandbox import (
    Amber,
    AsyncAmber,
    AsyncNode,
    CommandTimeout,
    ImageNotFound,
    Network,
    NotFound,
    SandboxNotRunning,
    BadRequest,
    Unauthorized,
)
from amber_sandbox.prime import AsyncSandboxClient, CreateSandboxRequest

from conftest import setup_home, start_amberd


async def test_sixteen_sandboxes_of_four_images_run_their_rollouts(nodes, images):
    # One client over every node's socket; placement spreads the sandboxes.
    async with AsyncAmber([n.socket for n in nodes]) as amber:

        async def rollout(i: int) -> None:
            image = images[i % 4]
            async with await amber.create(image, memory_mib=256, labels={"test": "rollout"}) as sb:
                assert sb.info.status == "running"
                for k in range(20):
                    r = await sb.exec(f"echo {k} $IMAGE; cat /id; pwd")
                    assert (r.exit_code, r.stderr) == (0, ""), r
                    assert r.stdout == f"{k} {i % 4}\nimage-{i % 4}\n/work\n"
                payload = os.urandom(100_000) + f"sandbox {i}".encode()
                await sb.upload("/work/in/data.bin", payload)
                r = await sb.exec(["sh", "-c", "sha256sum /work/in/data.bin | cut -d' ' -f1; cp /work/in/data.bin /tmp/out"])
                import hashlib

                assert r.stdout.strip() == hashlib.sha256(payload).hexdigest()
                assert await sb.download("/tmp/out") == payload
            assert sb.info.status == "stopped" and sb.info.reason == "deleted"

        await asyncio.gather(*(rollout(i) for i in range(16)))
        assert await amber.list(labels={"test": "rollout"}) == []


async def test_streams_timeouts_processes_and_errors(nodes, images, tmp_path):
    node = AsyncNode(nodes[0].socket)
    async with AsyncAmber([nodes[0].socket]) as amber:
        sb = await amber.create(images[0], memory_mib=256)
        try:
            frames = [f async for f in sb.exec_stream("for i in 1 2 3; do echo out$i; echo err$i >&2; done; exit 4")]
            assert [f.seq for f in frames] == list(range(len(frames)))
            assert frames[-1].type == "exit" and frames[-1].exit_code == 4
            out = "".join(f.data for f in frames if f.type == "stdout")
            err = "".join(f.data for f in frames if f.type == "stderr")
            assert (out, err) == ("out1\nout2\nout3\n", "err1\nerr2\nerr3\n")

            # Past its timeout the command (and what its shell started) is killed.
            started = time.monotonic()
            with pytest.raises(CommandTimeout) as e:
                await sb.exec("sleep 100; echo never", timeout=1.5)
            assert e.value.result.timed_out and e.value.result.exit_code == 137
            assert "never" not in e.value.result.stdout
            assert time.monotonic() - started < 60
            r = await sb.exec("ps | grep -c '[s]leep 100' || true")
            assert r.stdout.strip() == "0", "the shell's child outlived the timeout"

            # A background process's output is read again from any sequence number.
            p = await sb.start("for i in $(seq 1 5); do echo line$i; done; sleep 0.2; echo done")
            frames = [f async for f in sb.output(p.id)]
            assert frames[-1].type == "exit" and frames[-1].exit_code == 0
            again = [f async for f in sb.output(p.id, from_seq=2)]
            assert again == frames[2:]
            # Signals reach the process group.
            p = await sb.start("trap 'echo got-term; exit 9' TERM; echo up; while :; do sleep 0.1; done")
            async for f in sb.output(p.id):
                if f.type == "stdout" and "up" in f.data:
                    break
            await sb.signal(p.id, "TERM")
            frames = [f async for f in sb.output(p.id)]
            assert frames[-1].exit_code == 9 and any("got-term" in f.data for f in frames)

            # Stdin, env, cwd and user.
            r = await sb.exec(["cat"], stdin="piped in")
            assert r.stdout == "piped in"
            r = await sb.exec("echo $A; pwd; id -un", env={"A": "b"}, cwd="/tmp", user="root")
            assert r.stdout == "b\n/tmp\nroot\n"
            # A directory up and down as one tar stream.
            src = tmp_path / "tree"
            (src / "sub").mkdir(parents=True, exist_ok=True)
            (src / "sub" / "f.txt").write_text("tree")
            await sb.upload_dir(src, "/work/tree")
            assert (await sb.exec("cat /work/tree/sub/f.txt")).stdout == "tree"
            await sb.download_dir("/work/tree", src / "back")
            assert (src / "back" / "sub" / "f.txt").read_text() == "tree"

            # Bad input: a clear error of its kind.
            with pytest.raises(BadRequest):
                await node.exec(sb.id, {"argv": []})
            with pytest.raises(NotFound):
                await sb.download("/no/such/file")
            with pytest.raises(BadRequest, match="not a regular file"):
                await sb.download("/work")
            with pytest.raises(NotFound):
                await node.get("doesnotexist")
        finally:
            await sb.delete()
        with pytest.raises(SandboxNotRunning, match="deleted"):
            await sb.exec("true")
        with pytest.raises(ImageNotFound):
            await amber.create("py/nothing:here")
        with pytest.raises(BadRequest, match="disk_mib must be 64 to"):
            await amber.create(images[0], disk_mib=10)
    # TCP needs the token.
    with pytest.raises(Unauthorized):
        await AsyncNode(nodes[0].tcp).info()
    info = await AsyncNode(nodes[0].tcp, token=nodes[0].token).info()
    assert info.registry == nodes[0].registry.url
    await node.close()


async def test_a_snapshot_forks_over_nodes_and_a_sandbox_pauses_and_resumes(nodes, images):
    async with AsyncAmber([n.socket for n in nodes]) as amber:
        sb = await amber.create(images[1], memory_mib=256, node=amber.nodes[0])
        forks = []
        try:
            await sb.exec("echo saved > /work/state && rm /id")
            snap = await sb.snapshot(tag="py/snap:v1")
            assert snap.image.startswith("py/snap@sha256:") and snap.tag == "py/snap:v1"
            assert snap.env_digest and snap.env_digest.startswith("blake3:")
            assert [p.image.split("@")[0] for p in snap.parents] == ["py/img1"]
            assert snap.parents[0].env_digest == sb.info.env_digest
            # The sandbox keeps running.
            assert (await sb.exec("cat /work/state")).stdout == "saved\n"

            forks = await amber.fork(snap.image, 3, memory_mib=256)
            assert len(forks) == 3
            for f in forks:
                r = await f.exec("cat /work/state; test -e /id || echo no-id")
                assert r.stdout == "saved\nno-id\n", r
                assert f.info.env_digest == snap.env_digest
                assert f.info.parents == snap.parents

            p = await forks[0].pause()
            assert p.status == "paused" and p.state_bytes and p.state_bytes > 0
            with pytest.raises(SandboxNotRunning, match="paused"):
                await forks[0].exec("true")
            with pytest.raises(BadRequest, match="already paused"):
                await forks[0].pause()
            r = await forks[0].resume()
            assert r.status == "running" and r.state_bytes is None
            assert (await forks[0].exec("cat /work/state")).stdout == "saved\n"
            with pytest.raises(BadRequest, match="not paused"):
                await forks[0].resume()
            with pytest.raises(BadRequest, match="tag"):
                await sb.snapshot(tag="Not A Tag")
        finally:
            for s in [sb, *forks]:
                await s.delete()


async def test_a_network_reaches_a_host_service_and_publishes_a_port_across_a_pause(nodes, images):
    async def pong(reader, writer):
        await reader.readline()
        writer.write(b"pong\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(pong, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def get(host: str) -> str:
        addr, p = host.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(addr, int(p))
        writer.write(b"GET /index.html HTTP/1.0\r\n\r\n")
        body = await reader.read()
        writer.close()
        return body.decode()

    async with AsyncAmber([nodes[0].socket]) as amber:
        net = Network(host_services=[f"9000=127.0.0.1:{port}"], ports=["8080"])
        sb = await amber.create(images[0], memory_mib=256, network=net)
        try:
            assert sb.info.network and sb.info.network.address == "10.0.2.15"
            host = sb.info.network.port(8080)
            assert host.startswith("127.0.0.1:")
            call = "echo ping | nc -w 10 host.amber.internal 9000"
            assert (await sb.exec(call)).stdout == "pong\n"
            await sb.exec("mkdir -p /www && echo inside > /www/index.html && httpd -p 8080 -h /www")
            assert (await get(host)).endswith("\r\n\r\ninside\n")
            # The network lives on the node while the VM is saved, and the restored VM
            # reconnects to it: both directions work after the resume.
            await sb.pause()
            await sb.resume()
            assert (await sb.exec(call)).stdout == "pong\n"
            assert (await get(host)).endswith("\r\n\r\ninside\n")
            with pytest.raises(BadRequest, match="allow rule \"nowhere\""):
                await amber.create(images[0], network=Network(allow=["nowhere"]))
        finally:
            await sb.delete()
            server.close()


async def test_placement_prefers_the_node_that_caches_the_env(nodes, images, registry, workdir):
    # A fifth image, booted once on node 2 only: its chunks are in node 2's cache alone.
    ctx = workdir / "img-placement"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM amber-test/busybox:1\nRUN head -c 3000000 /dev/urandom > /blob\n")
    from conftest import docker

    tag = f"{registry.addr}/py/placed:v1"
    docker("build", "-q", "-t", tag, str(ctx))
    docker("push", tag)
    assert registry.settled("py/placed", "v1")["state"] == "done"
    async with AsyncAmber([n.socket for n in nodes]) as amber:
        warm = amber.nodes[2]
        sb = await amber.create("py/placed:v1", node=warm, memory_mib=256)
        assert (await sb.exec("wc -c < /blob")).stdout.strip() == "3000000"
        await sb.delete()
        for _ in range(3):
            sb = await amber.create("py/placed:v1", memory_mib=256)
            assert sb.node is warm, "placed on a node without the env's chunks"
            await sb.delete()

        # Prefetch on every node: the cold ones fetch the whole env, the warm one nothing;
        # each reports its progress from its first frame to `done`.
        seen: dict[int, list] = {}
        finals = await amber.prefetch("py/placed:v1", lambda n, f: seen.setdefault(id(n), []).append(f))
        for node, final in zip(amber.nodes, finals):
            assert final.done and final.cache.cached_bytes == final.cache.bytes > 3000000
            assert final.cache.cached_chunks == final.cache.chunks
            # A cold node has this image's own 3 MB to fetch (its base may be cached
            # from other tests' sandboxes); the warm node has nothing to fetch.
            if node is warm:
                assert final.fetched_bytes == 0
            else:
                assert 3000000 <= final.fetched_bytes <= final.cache.bytes
            frames = seen[id(node)]
            assert frames[0].type == "progress" and frames[-1] is final
        with pytest.raises(ImageNotFound):
            await amber.nodes[0].prefetch("py/placed:missing")


def test_the_sync_client_and_the_hosted_sdk_names(nodes, images, tmp_path):
    with Amber([nodes[1].socket]) as amber:
        with amber.create(images[1], memory_mib=256) as sb:
            assert sb.exec("cat /id").stdout == "image-1\n"
            frames = list(sb.exec_stream("echo a; echo b"))
            assert frames[-1].type == "exit"
            info = sb.set_timeout(600)
            assert info.expires_at is not None

    async def prime():
        c = AsyncSandboxClient([nodes[1].socket])
        s = await c.create(CreateSandboxRequest(docker_image=images[2], memory_gb=0.25, labels=["prime"]))
        await c.wait_for_creation(s.id)
        r = await c.execute_command(s.id, "cat /id; echo $X", env={"X": "y"})
        assert (r.stdout, r.exit_code) == ("image-2\ny\n", 0)
        (tmp_path / "up").write_text("uploaded")
        await c.upload_file(s.id, "/tmp/up", str(tmp_path / "up"))
        await c.download_file(s.id, "/tmp/up", str(tmp_path / "down"))
        assert (tmp_path / "down").read_text() == "uploaded"
        with pytest.raises(CommandTimeout):
            await c.execute_command(s.id, "sleep 30", timeout=1)
        done = await c.bulk_delete(sandbox_ids=[s.id])
        assert done["succeeded"] == [s.id]
        await c.aclose()

    asyncio.run(prime())


async def test_a_lifetime_ends_the_sandbox_after_its_creator_was_killed(nodes, images):
    code = textwrap.dedent(
        f"""
        import asyncio, os, signal
        from amber_sandbox import AsyncAmber
        async def main():
            amber = AsyncAmber([{nodes[0].socket!r}])
            sb = await amber.create({images[3]!r}, memory_mib=256, lifetime_s=3, labels={{"life": "short"}})
            print(sb.id, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    sid = p.stdout.strip()
    node = AsyncNode(nodes[0].socket)
    info = await node.wait(sid, timeout_s=120, ended=True)
    assert info.status == "stopped" and "lifetime" in info.reason, info
    assert not (nodes[0].home / "sandboxes" / sid).exists()
    await node.close()


def qemu_pids_under(home: Path) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd and str(home).encode() in cmd:
                pids.append(int(d.name))
    return pids


async def test_a_killed_amberd_leaves_no_qemu_and_reports_its_sandboxes_lost(registry, images, workdir):
    home = workdir / "node-restart"
    home.mkdir()
    setup_home(registry, home)
    d = start_amberd(registry, home)
    node = AsyncNode(d.socket)
    sb = await node.create(image=images[0], memory_mib=256)
    assert len(qemu_pids_under(home)) == 1
    await node.close()
    d.stop(signal.SIGKILL)
    d2 = start_amberd(registry, home)
    assert qemu_pids_under(home) == [], "an orphan QEMU outlived amberd's restart"
    node = AsyncNode(d2.socket)
    info = await node.get(sb.id)
    assert info.status == "lost" and "amberd stopped" in info.reason, info
    with pytest.raises(SandboxNotRunning):
        await node.exec(sb.id, {"command": "true"})
    await node.close()
    d2.stop()


async def a_dead_vm_says_why(node: AsyncNode, sid: str, sandbox_dir: Path) -> None:
    """A command cut short by the death of its VM, and the sandbox, say why: the VM
    exited, with the guest console's last lines."""
    p = await node.start_process(sid, {"command": "echo up; sleep 600"})
    frames = node.output(sid, p.id)
    async for f in frames:
        if f.type == "stdout" and "up" in f.data:
            break
    [qemu] = qemu_pids_under(sandbox_dir)
    os.kill(qemu, signal.SIGKILL)
    rest = [f async for f in frames]
    assert rest[-1].type == "error" and rest[-1].kind == "not_running", rest
    assert "the sandbox stopped before the command finished: the VM exited" in rest[-1].message, rest
    assert "SIGKILL" in rest[-1].message and "console:" in rest[-1].message, rest[-1].message
    info = await node.wait(sid, timeout_s=60, ended=True)
    assert info.status == "failed" and info.reason.startswith("the VM exited"), info
    with pytest.raises(SandboxNotRunning, match="the VM exited"):
        await node.exec(sid, {"command": "true"})


async def test_every_vm_shape_boots(nodes, images):
    """256 MiB to 16 GiB in 256 MiB steps (2048 included), 1 to 4 vCPUs."""
    node = AsyncNode(nodes[1].socket)
    gate = asyncio.Semaphore(2)

    async def boot(i: int, mib: int) -> None:
        cpus = i % 4 + 1
        async with gate:
            s = await node.create(image=images[0], memory_mib=mib, cpus=cpus)
            try:
                r = await node.exec(s.id, {"command": "nproc; grep MemTotal /proc/meminfo"})
                if i == 0:
                    await a_dead_vm_says_why(node, s.id, nodes[1].home / "sandboxes" / s.id)
            finally:
                await node.delete(s.id)
        lines = r.stdout.split("\n")
        assert r.exit_code == 0 and lines[0] == str(cpus), (mib, cpus, r)
        total_kib = int(lines[1].split()[1])
        assert mib * 1024 * 0.85 < total_kib <= mib * 1024 + 4, (mib, total_kib)

    await asyncio.gather(*(boot(i, mib) for i, mib in enumerate(range(256, 16384 + 1, 256))))
    await node.close()
