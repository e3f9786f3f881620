"""The sandbox state benchmark (issue 15), every figure on this machine's accelerator:

  snapshot  a sandbox of a 1.1 GiB env (fixtures/images/big) that wrote 10 MiB and one
            that wrote 500 MiB (incompressible bytes, uploaded through the node API so the
            harness knows exactly what was written): snapshot time (frozen, pushed,
            converted), and the bytes the registry's store grew by (new chunks, the layer
            as a recipe over them, manifests) against the compressed size of what was
            written (zstd -9, as chunks are stored).
  fork      time from one batch request of 8 sandboxes of the snapshot to 8 ready,
            against the same batch of the snapshot's base image.
  resume    time from `resume` to a command's output, against a cold boot of the same
            env (create, wait until ready, the same command); the node cache is warm for
            both, so the difference is the boot.
  pause     pause time and state file size of an idle 2 GiB sandbox and of the same after
            it touched 1 GiB of memory (incompressible data in a tmpfs).

Called by bench.py (`scripts/bench --only state`).
"""
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from amber_sandbox import AsyncNode  # noqa: E402

from bench_node import Amberd, docker  # noqa: E402

MIB = 1 << 20
KIB = 1 << 10


def tree_bytes(d):
    total = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def store_bytes(data):
    """Bytes under each top-level directory of the registry's store, and in all."""
    store = os.path.join(data, "store")
    out = {name: tree_bytes(os.path.join(store, name)) for name in os.listdir(store)
           if os.path.isdir(os.path.join(store, name))}
    for name in ("chunks", "blobs", "recipes", "chains", "envs"):
        out.setdefault(name, 0)
    out["all"] = tree_bytes(store)
    return out


def compressed(path, cmd):
    out = subprocess.run(cmd + [path, "-c"], check=True, stdout=subprocess.PIPE).stdout
    return len(out)


async def snapshot_case(node, ref, data_dir, work, mib):
    sb = await node.create(image=ref, memory_mib=1024, disk_mib=4096)
    try:
        local = os.path.join(work, f"written-{mib}")
        with open(local, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(MIB))
        with open(local, "rb") as f:
            await node.upload(sb.id, "/opt/written", f.read())
        before = store_bytes(data_dir)
        started = time.monotonic()
        snap = await node.snapshot(sb.id)
        total_s = time.monotonic() - started
        after = store_bytes(data_dir)
        r = {
            "mib": mib,
            "frozen_s": snap.frozen_ms / 1000,
            "pushed_s": snap.pushed_ms / 1000,
            "converted_s": (snap.converted_ms or 0) / 1000,
            "total_s": total_s,
            "layer_bytes": snap.layer_bytes,
            "new": {k: after[k] - before.get(k, 0) for k in after},
            "zstd9": compressed(local, ["zstd", "-9", "-q"]),
            "image": snap.image,
        }
        os.remove(local)
        return r
    finally:
        await node.delete(sb.id)


async def batch_ready(node, image, n):
    started = time.monotonic()
    results = await node.create_batch([{"image": image, "memory_mib": 512}] * n)
    elapsed = time.monotonic() - started
    ids = [r.id for r in results if not isinstance(r, Exception)]
    errors = [str(r) for r in results if isinstance(r, Exception)]
    await asyncio.gather(*(node.delete(i) for i in ids))
    assert not errors, errors
    return elapsed


async def resume_vs_boot(node, ref, runs):
    boot, resume = [], []
    for _ in range(runs):
        started = time.monotonic()
        sb = await node.create(image=ref, memory_mib=512)
        r = await node.exec(sb.id, {"argv": ["echo", "hi"]})
        boot.append(time.monotonic() - started)
        assert r.stdout == "hi\n", r
        await node.pause(sb.id)
        started = time.monotonic()
        await node.resume(sb.id)
        r = await node.exec(sb.id, {"argv": ["echo", "hi"]})
        resume.append(time.monotonic() - started)
        assert r.stdout == "hi\n", r
        await node.delete(sb.id)
    return boot, resume


async def pause_cost(node, ref):
    sb = await node.create(image=ref, memory_mib=2048)
    try:
        out = {}
        for case, script in (
            ("idle", None),
            ("1 GiB touched", "mkdir -p /mnt/t && mount -t tmpfs -o size=1100m tmpfs /mnt/t && head -c 1073741824 /dev/urandom > /mnt/t/fill"),
        ):
            if script:
                r = await node.exec(sb.id, {"command": script, "user": "root"})
                assert r.exit_code == 0, r
            started = time.monotonic()
            info = await node.pause(sb.id)
            pause_s = time.monotonic() - started
            started = time.monotonic()
            await node.resume(sb.id)
            r = await node.exec(sb.id, {"argv": ["true"]})
            resume_s = time.monotonic() - started
            assert r.exit_code == 0, r
            out[case] = {"pause_s": pause_s, "state_bytes": info.state_bytes, "resume_s": resume_s}
            print(f"  pause {case}: {out[case]}", flush=True)
        return out
    finally:
        await node.delete(sb.id)


def bench_state(work, server_cls, wait_converted, quick=False):
    amber = os.path.join(sys.modules["__main__"].TARGET, "release", "amber")  # bench.py's
    rootfs = os.path.join(ROOT, ".run", "cache", "debian-bookworm-v2.tar")
    if not os.path.exists(rootfs):
        os.makedirs(os.path.dirname(rootfs), exist_ok=True)
        subprocess.run([os.path.join(ROOT, "fixtures/debian-rootfs.sh"), rootfs], check=True)
    docker("import", rootfs, "amber-test/debian:bookworm")
    s = server_cls("amber+convert", work)
    res = {}
    try:
        tag = f"{s.addr}/bench/big:v1"
        docker("build", "-q", "-t", tag, os.path.join(ROOT, "fixtures/images/big"))
        push = docker("push", tag)
        digest = push.split("digest: ")[1].split()[0]
        ref = f"bench/big@{digest}"
        reg = f"http://{s.addr}"
        wait_converted(s.addr, "bench/big", digest)
        home = os.path.join(work, "state-home")
        subprocess.run(["rm", "-rf", home])
        os.makedirs(home)
        d = Amberd(amber, reg, home)
        try:
            node = AsyncNode(d.socket, timeout=3600)

            async def run():
                r = {"snapshots": []}
                for mib in (10, 50) if quick else (10, 500):
                    c = await snapshot_case(node, ref, s.data, work, mib)
                    print(f"  snapshot {mib} MiB: {c}", flush=True)
                    r["snapshots"].append(c)
                snap = r["snapshots"][0]["image"]
                r["fork"] = {
                    "image": await batch_ready(node, ref, 8),
                    "snapshot": await batch_ready(node, snap, 8),
                }
                print(f"  fork 8: {r['fork']}", flush=True)
                r["boot"], r["resume"] = await resume_vs_boot(node, ref, 3)
                print(f"  boot {r['boot']} resume {r['resume']}", flush=True)
                r["pause"] = await pause_cost(node, ref)
                await node.close()
                return r

            res = asyncio.run(run())
        finally:
            d.stop()
        res["accel"] = json.load(open(os.path.join(home, "node.json")))["accel"]
    finally:
        s.stop()
    return res


def state_section(res):
    accel = res["accel"].upper()
    lines = [
        "## Sandbox state: snapshots, forks, pause and resume (issue 15)",
        "",
        f"One run of `scripts/bench --only state`, every figure under {accel} on this machine. The env",
        "is `fixtures/images/big` (Debian plus 1.1 GiB of incompressible files), converted by a",
        "registry on local disk; one amberd; sandboxes through the node API from the Python client.",
        "",
        "Snapshots of a sandbox that wrote N MiB of incompressible bytes (an upload through the",
        "node API, so the harness holds exactly what was written). Frozen: the guest's disk is",
        "frozen while it sends its changes; pushed: the layer and manifest are in the registry;",
        "converted: the registry has the snapshot's env (the base image kept its layer-chain",
        "state when it converted, so only the snapshot's layer is read). Stored new bytes: what",
        "the registry's store grew by. The snapshot's layer is an uncompressed tar; once converted,",
        "the registry keeps it as a recipe over the chunks that hold its files (tar headers and",
        "anything no chunk holds stay literal), and `docker pull` gets it rebuilt byte for byte.",
        "The rest: blobs (the snapshot's manifest and config, and the block manifest's referrer),",
        "the block manifest (envs), and layer-chain states kept for later conversions (chains).",
        "",
        "| written | frozen (s) | pushed (s) | converted (s) | stored new bytes | chunks | layer recipe | blobs | envs | chains | written, zstd -9 | stored new / zstd -9 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["snapshots"]:
        n = c["new"]
        lines.append(
            f"| {c['mib']} MiB | {c['frozen_s']:.1f} | {c['pushed_s']:.1f} | {c['converted_s']:.1f} | "
            f"{n['all'] / MIB:.2f} MiB | {n['chunks'] / MIB:.2f} MiB | {n['recipes'] / KIB:.1f} KiB | "
            f"{n['blobs'] / KIB:.0f} KiB | {n['envs'] / KIB:.0f} KiB | {n['chains'] / KIB:.0f} KiB | "
            f"{c['zstd9'] / MIB:.2f} MiB | {n['all'] / c['zstd9']:.3f} |"
        )
    worst = max(c["new"]["chunks"] / c["zstd9"] for c in res["snapshots"])
    worst_all = max(c["new"]["all"] / c["zstd9"] for c in res["snapshots"])
    lines += [
        "",
        f"Goal: stored new bytes within 10% of the compressed size of what was written:",
        f"{'met' if worst_all <= 1.10 else 'NOT met'} (everything the store grew by: at most {worst_all:.3f}x;",
        f"the new chunks alone: at most {worst:.3f}x).",
        "",
    ]
    f = res["fork"]
    lines += [
        "Fork: one batch request of 8 sandboxes (512 MiB each) until all 8 are ready:",
        "",
        "| | 8 ready (s) |",
        "|---|---|",
        f"| from the base image | {f['image']:.1f} |",
        f"| from the 10 MiB snapshot (fork 8) | {f['snapshot']:.1f} |",
        f"| ratio (image / snapshot) | {f['image'] / f['snapshot']:.2f}x |",
        "",
    ]
    b, r = statistics.median(res["boot"]), statistics.median(res["resume"])
    lines += [
        f"Resume against a cold boot of the same env (a command's output, median of {len(res['boot'])}):",
        "",
        "| | to `echo hi`'s output (s) |",
        "|---|---|",
        f"| cold boot (create, wait, exec) | {b:.2f} |",
        f"| resume of a paused sandbox (resume, exec) | {r:.2f} |",
        f"| ratio (boot / resume) | {b / r:.1f}x |",
        "",
        f"Goal: resume at least 5x faster than a cold boot: {'met' if b / r >= 5 else 'NOT met'}.",
        "",
        "Pause of a 2 GiB sandbox, idle and after it touched 1 GiB of memory (pause: the agent",
        "quiesced, vCPUs stopped, memory and devices written to the file; QEMU's stream skips",
        "pages that read as zeros, so an idle guest's file is what it holds):",
        "",
        "| | pause (s) | state file (MiB) | resume to `true` (s) |",
        "|---|---|---|---|",
    ]
    for case, p in res["pause"].items():
        lines.append(f"| {case} | {p['pause_s']:.2f} | {p['state_bytes'] / MIB:.0f} | {p['resume_s']:.2f} |")
    idle, touched = res["pause"]["idle"], res["pause"]["1 GiB touched"]
    lines += [
        "",
        f"Per GiB of guest memory touched: {(touched['pause_s'] - idle['pause_s']):.2f} s of pause and "
        f"{(touched['state_bytes'] - idle['state_bytes']) / MIB:.0f} MiB of state file.",
        "",
    ]
    return lines
