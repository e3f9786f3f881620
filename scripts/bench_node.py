"""The node benchmark (issue 14), side by side with the Docker engine on the same image:

  density   idle sandboxes of 512 MiB held at once: host memory (PSS of each QEMU, and
            amberd's share) and host CPU per idle sandbox over a quiet window; Docker:
            idle `sleep` containers (cgroup memory + containerd-shim PSS, cgroup CPU).
  exec      round trip of `true` in a running sandbox through the node API from the
            Python client, p50/p99; Docker: `docker exec` in a running container.
  rollout   16 rollouts at once (create, 20 commands, an upload, delete): rollouts per
            minute and ready-time p50/p99; Docker: docker run -d / exec / cp / rm -f.

Called by bench.py (`scripts/bench --only node`).
"""
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from amber_sandbox import AsyncNode  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def qemu_pids(home):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
        except OSError:
            continue
        if b"qemu-system" in cmd and home.encode() in cmd:
            out.append(int(d))
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def docker(*args):
    return subprocess.run(["docker", "-H", os.environ["DOCKER_SOCK"], *args], check=True,
                          capture_output=True, text=True).stdout


def container_cgroup(cid):
    """The container's cgroup: (cpu usage in microseconds, memory in bytes) readers, for
    cgroup v2 or v1 hosts (this one mounts v1 hierarchies)."""
    pid = docker("inspect", "-f", "{{.State.Pid}}", cid).strip()
    paths = {}
    for line in open(f"/proc/{pid}/cgroup"):
        _, controllers, path = line.strip().split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    if "cpuacct" in paths and os.path.exists(f"/sys/fs/cgroup/cpuacct{paths['cpuacct']}"):
        cpu_file = f"/sys/fs/cgroup/cpuacct{paths['cpuacct']}/cpuacct.usage"
        mem_file = f"/sys/fs/cgroup/memory{paths['memory']}/memory.usage_in_bytes"
        return (lambda: int(open(cpu_file).read()) // 1000, lambda: int(open(mem_file).read()))
    base = "/sys/fs/cgroup" + paths[""]

    def usage():
        for line in open(os.path.join(base, "cpu.stat")):
            if line.startswith("usage_usec"):
                return int(line.split()[1])
        return 0

    return (usage, lambda: int(open(os.path.join(base, "memory.current")).read()))


def shim_pids():
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if open(f"/proc/{d}/comm").read().strip() == "containerd-shim":
                    out.append(int(d))
            except OSError:
                pass
    return out


class Amberd:
    def __init__(self, amber, reg, home):
        self.home = home
        env = dict(os.environ, AMBER_HOME=home, AMBER_REGISTRY=reg)
        subprocess.run([amber, "setup"], check=True, env=env, stdout=subprocess.DEVNULL)
        self.proc = subprocess.Popen([amber, "daemon"], env=env, stdout=subprocess.PIPE,
                                     stderr=open(os.path.join(home, "amberd.log"), "ab"), text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.socket = f"unix://{home}/amberd.sock"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=600)


async def density(node, home, image, count, window):
    ids = []
    t0 = time.monotonic()
    gate = asyncio.Semaphore(8)

    async def one():
        async with gate:
            s = await node.create(image=image, memory_mib=512)
            ids.append(s.id)

    await asyncio.gather(*(one() for _ in range(count)))
    booted = time.monotonic() - t0
    alive = [s for s in await node.list() if s.status == "running"]
    # Let boot work settle, then measure a quiet window.
    await asyncio.sleep(10)
    pids = qemu_pids(home)
    r = {"asked": count, "alive": len(alive), "qemu": len(pids), "boot_s": booted}
    r.update(await window_of(pids, window, []))
    # The same sandboxes with the host's KSM merging identical pages across them (the
    # guest kernel, page cache of the shared env), when this host has KSM and we may
    # turn it on; ksmd's CPU is counted against the sandboxes.
    ksm = "/sys/kernel/mm/ksm"
    if os.access(os.path.join(ksm, "run"), os.W_OK):
        saved = {k: open(os.path.join(ksm, k)).read().strip() for k in ("run", "pages_to_scan", "sleep_millisecs")}
        try:
            for k, v in (("pages_to_scan", "4000"), ("sleep_millisecs", "20"), ("run", "1")):
                open(os.path.join(ksm, k), "w").write(v)
            start = int(open(os.path.join(ksm, "full_scans")).read())
            deadline = time.monotonic() + 600
            while int(open(os.path.join(ksm, "full_scans")).read()) < start + 2 and time.monotonic() < deadline:
                await asyncio.sleep(1)
            ksmd = [int(d) for d in os.listdir("/proc") if d.isdigit() and _comm(d) == "ksmd"]
            r["ksm"] = await window_of(pids, window, ksmd)
        finally:
            open(os.path.join(ksm, "run"), "w").write("2")  # unmerge everything
            for k in ("pages_to_scan", "sleep_millisecs"):
                open(os.path.join(ksm, k), "w").write(saved[k])
            open(os.path.join(ksm, "run"), "w").write(saved["run"])
    await asyncio.gather(*(node.delete(i) for i in ids))
    return r


def _comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


async def window_of(pids, window, extra):
    """Memory (PSS) and CPU per sandbox over a quiet window; `extra` processes' CPU
    (ksmd) is shared out among the sandboxes."""
    before = {p: cpu_ticks(p) for p in pids + extra}
    t = time.monotonic()
    await asyncio.sleep(window)
    elapsed = time.monotonic() - t
    cpu = sum(cpu_ticks(p) - before[p] for p in pids + extra) / HZ
    pss = [pss_kib(p) for p in pids]
    return {
        "pss_mib_per": statistics.mean(pss) / 1024 if pss else 0,
        "pss_mib_max": max(pss) / 1024 if pss else 0,
        "cpu_pct_per": 100 * cpu / elapsed / max(len(pids), 1),
        "host_used_mib": host_used_mib(),
    }


def host_used_mib():
    m = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":")
        m[k] = int(v.split()[0])
    return (m["MemTotal"] - m["MemAvailable"]) / 1024


def docker_density(image, count, window):
    ids = [docker("run", "-d", "--network", "none", "-m", "512m", image, "sleep", "100000").strip()
           for _ in range(count)]
    time.sleep(10)
    cgs = [container_cgroup(c) for c in ids]
    shims = shim_pids()
    before = [cpu() for cpu, _ in cgs]
    shim_before = {p: cpu_ticks(p) for p in shims}
    t = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - t
    cpu = sum(c() - b for (c, _), b in zip(cgs, before)) / 1e6
    cpu += sum(cpu_ticks(p) - shim_before[p] for p in shims) / HZ
    mem = [m() / 2**20 for _, m in cgs]
    shim_mib = sum(pss_kib(p) for p in shims) / 1024
    r = {"asked": count, "alive": len(ids),
         "mem_mib_per": statistics.mean(mem) + shim_mib / count,
         "cpu_pct_per": 100 * cpu / elapsed / count}
    docker("rm", "-f", *ids)
    return r


async def exec_latency(node, image, n):
    s = await node.create(image=image, memory_mib=512)
    for _ in range(10):
        await node.exec(s.id, {"argv": ["true"]})
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        r = await node.exec(s.id, {"argv": ["true"]})
        lat.append((time.perf_counter() - t) * 1000)
        assert r.exit_code == 0
    await node.delete(s.id)
    return lat


def docker_exec_latency(image, n):
    cid = docker("run", "-d", "--network", "none", image, "sleep", "100000").strip()
    for _ in range(3):
        docker("exec", cid, "true")
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        docker("exec", cid, "true")
        lat.append((time.perf_counter() - t) * 1000)
    docker("rm", "-f", cid)
    return lat


async def rollouts(node, image, total, parallel):
    ready = []
    payload = os.urandom(64 << 10)
    gate = asyncio.Semaphore(parallel)

    async def one(i):
        async with gate:
            t = time.monotonic()
            s = await node.create(image=image, memory_mib=512)
            ready.append(time.monotonic() - t)
            for k in range(20):
                r = await node.exec(s.id, {"command": f"echo {k} > /tmp/step; cat /tmp/step"})
                assert r.stdout == f"{k}\n", r
            await node.upload(s.id, "/tmp/payload", payload)
            await node.delete(s.id)

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(total)))
    return total / ((time.monotonic() - t0) / 60), ready


def docker_rollouts(image, total, parallel, work):
    import concurrent.futures
    payload = os.path.join(work, "payload")
    with open(payload, "wb") as f:
        f.write(os.urandom(64 << 10))
    ready = []

    def one(i):
        t = time.monotonic()
        cid = docker("run", "-d", "--network", "none", image, "sleep", "100000").strip()
        ready.append(time.monotonic() - t)
        for k in range(20):
            out = docker("exec", cid, "sh", "-c", f"echo {k} > /tmp/step; cat /tmp/step")
            assert out == f"{k}\n", out
        docker("cp", payload, f"{cid}:/tmp/payload")
        docker("rm", "-f", cid)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(parallel) as ex:
        list(ex.map(one, range(total)))
    return total / ((time.monotonic() - t0) / 60), ready


def bench_node(work, server_cls, quick=False):
    """Runs the three node benchmarks; returns the figures."""
    amber = os.path.join(sys.modules["__main__"].TARGET, "release", "amber")  # bench.py's
    s = server_cls("amber+convert", work)
    res = {}
    try:
        rootfs = os.path.join(work, "busybox.tar")
        subprocess.run([os.path.join(ROOT, "fixtures/busybox-rootfs.sh"), rootfs], check=True,
                       stdout=subprocess.DEVNULL)
        tag = f"{s.addr}/bench/busybox:1"
        docker("import", rootfs, tag)
        docker("push", tag)
        reg = f"http://{s.addr}"
        for _ in range(6000):
            v = json.load(urllib.request.urlopen(f"{reg}/amber/v1/resolve/bench/busybox/1"))
            if v["state"] in ("done", "failed"):
                break
            time.sleep(0.1)
        assert v["state"] == "done", v
        home = os.path.join(work, "node-home")
        subprocess.run(["rm", "-rf", home])
        os.makedirs(home)
        d = Amberd(amber, reg, home)
        count = 8 if quick else int(os.environ.get("AMBER_BENCH_DENSITY", "64"))
        window = 20
        try:
            node = AsyncNode(d.socket)

            async def amber_side():
                r = {"density": await density(node, home, "bench/busybox:1", count, window)}
                print(f"  density: {r['density']}", flush=True)
                r["exec"] = await exec_latency(node, "bench/busybox:1", 50 if quick else 300)
                print(f"  exec p50 {statistics.median(r['exec']):.2f} ms", flush=True)
                r["rollout"] = await rollouts(node, "bench/busybox:1", 16 if quick else 48, 16)
                print(f"  rollouts/min {r['rollout'][0]:.1f}", flush=True)
                await node.close()
                return r

            res["amber"] = asyncio.run(amber_side())
        finally:
            d.stop()
        res["docker"] = {
            "density": docker_density(tag, count, window),
            "exec": docker_exec_latency(tag, 30 if quick else 100),
            "rollout": docker_rollouts(tag, 16 if quick else 48, 16, work),
        }
        print(f"  docker: {res['docker']['density']}", flush=True)
    finally:
        s.stop()
    return res


def node_section(res):
    a, d = res["amber"], res["docker"]
    ad, dd = a["density"], d["density"]
    ae, de = a["exec"], d["exec"]
    ar, dr = a["rollout"], d["rollout"]
    lines = [
        "## Node: density, exec round trip, rollouts (issue 14)",
        "",
        "Image: a 2 MiB busybox image (`fixtures/busybox-rootfs.sh`), pushed with `docker push`.",
        "amber: sandboxes of 512 MiB and 1 vCPU through amberd's node API from the Python client",
        "(`amber_sandbox.AsyncNode` over the Unix socket); QEMU microvm under TCG (this machine's",
        "nested KVM cannot run the guest kernel). Docker: the Docker engine of scripts/lib.sh",
        f"({os.environ.get('DOCKER_STORAGE_DRIVER', 'vfs')} storage, `--network none`), containers of the same image.",
        "",
        f"Density: {ad['asked']} idle sandboxes created (8 at a time), then 10 s to settle and a {20} s",
        "window. Host memory per sandbox is each QEMU's PSS (amberd's own, shared by all, is left out);",
        "per container it is the container's cgroup memory (v1 `memory.usage_in_bytes` on this host) plus the shims' PSS shared out.",
        "CPU is each QEMU's (or container cgroup's plus the shims') CPU time over the window.",
        "",
        "| measure | amber (TCG) | Docker | goal (amber) |",
        "|---|---|---|---|",
        f"| idle sandboxes alive at once | {ad['alive']} of {ad['asked']} | {dd['alive']} of {dd['asked']} | at least 64 |",
        f"| host memory per idle sandbox (MiB) | {ad['pss_mib_per']:.0f} (max {ad['pss_mib_max']:.0f}) | {dd['mem_mib_per']:.1f} | under 128 |",
        f"| host CPU per idle sandbox (% of a core) | {ad['cpu_pct_per']:.2f} | {dd['cpu_pct_per']:.3f} | under 1 |",
        f"| time to create all (s) | {ad['boot_s']:.0f} | - | |",
        "",
    ]
    if "ksm" in ad:
        k = ad["ksm"]
        lines += [
            "The same idle sandboxes after the host's KSM merged identical pages across them (two full",
            "scans, `pages_to_scan` 4000 every 20 ms; ksmd's CPU shared out among the sandboxes). KSM is a",
            "host setting amberd does not change; the harness turned it on for this window and off after:",
            "",
            "| measure | amber with KSM |",
            "|---|---|",
            f"| host memory per idle sandbox (MiB) | {k['pss_mib_per']:.0f} (max {k['pss_mib_max']:.0f}) |",
            f"| host CPU per idle sandbox (% of a core, ksmd included) | {k['cpu_pct_per']:.2f} |",
            "",
        ]
    lines += [
        f"Exec round trip of `true` in a running sandbox ({len(ae)} amber, {len(de)} Docker, one after another):",
        "",
        "| | p50 (ms) | p99 (ms) |",
        "|---|---|---|",
        f"| amber: node API from Python (`exec`, one JSON answer) | {statistics.median(ae):.2f} | {pct(ae, 99):.2f} |",
        f"| Docker: `docker exec` | {statistics.median(de):.2f} | {pct(de, 99):.2f} |",
        f"| ratio (Docker / amber) | {statistics.median(de) / statistics.median(ae):.1f}x | {pct(de, 99) / pct(ae, 99):.1f}x |",
        "",
        f"Goal: p50 at most 5 ms through the node API: {'met' if statistics.median(ae) <= 5 else 'NOT met'}.",
        "",
        f"Rollout loop, 16 at once ({len(ar[1])} rollouts: create and wait until ready, 20 commands,",
        "a 64 KiB upload, delete):",
        "",
        "| | rollouts per minute | ready p50 (s) | ready p99 (s) |",
        "|---|---|---|---|",
        f"| amber (TCG) | {ar[0]:.1f} | {statistics.median(ar[1]):.2f} | {pct(ar[1], 99):.2f} |",
        f"| Docker (`docker run -d` / `exec` / `cp` / `rm -f`) | {dr[0]:.1f} | {statistics.median(dr[1]):.2f} | {pct(dr[1], 99):.2f} |",
        "",
    ]
    return lines
