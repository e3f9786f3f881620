"""amber's benchmark harness: runs each benchmark side by side with its peer in one run
and rewrites BENCHMARKS.md. Called by scripts/bench (which installs and builds first).

Benchmarks so far:
  registry  push and pull of one image set with skopeo, amber-registry vs CNCF
            distribution 2.8 (Debian's docker-registry); wall time and the server's
            peak resident memory (VmHWM), each run on a fresh data directory.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.environ.get("AMBER_RUN_DIR", os.path.join(ROOT, ".run"))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("VmHWM missing")


def wait_ready(addr, proc, log):
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; log: {log}")
        try:
            urllib.request.urlopen(f"http://{addr}/v2/", timeout=1)
            return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"server at {addr} did not answer; log: {log}")


class Server:
    """One registry process on a fresh data directory."""

    def __init__(self, kind, work):
        self.kind = kind
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.data = os.path.join(work, f"{kind}-data")
        shutil.rmtree(self.data, ignore_errors=True)
        os.makedirs(self.data)
        self.log = os.path.join(work, f"{kind}.log")
        logf = open(self.log, "w")
        if kind == "amber":
            cmd = [os.path.join(TARGET, "release", "amber-registry"), "serve",
                   "--listen", self.addr, "--data", self.data]
            env = dict(os.environ, AMBER_LOG="warn")
        else:
            cfg = os.path.join(work, "distribution.yml")
            with open(cfg, "w") as f:
                f.write(
                    "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
                    f"storage:\n  filesystem:\n    rootdirectory: {self.data}\n"
                    "  delete:\n    enabled: false\n"
                    f"http:\n  addr: {self.addr}\n"
                )
            cmd = ["docker-registry", "serve", cfg]
            env = dict(os.environ)
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, env=env)
        wait_ready(self.addr, self.proc, self.log)

    def cpu_seconds(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        hwm = vm_hwm_kib(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.data, ignore_errors=True)
        return hwm


def timed(cmd):
    t = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t


def bench_registry(work, image_set, runs):
    """Returns {kind: {"push": [s], "pull": [s], "rss": [KiB]}}."""
    res = {k: {"push": [], "pull": [], "rss": [], "push_cpu": [], "pull_cpu": []} for k in ("amber", "distribution")}
    for i in range(runs):
        # Alternate who goes first so neither always gets the warmer page cache.
        order = ("amber", "distribution") if i % 2 == 0 else ("distribution", "amber")
        for kind in order:
            s = Server(kind, work)
            try:
                ref = f"docker://{s.addr}/bench/set:v1"
                cpu0 = s.cpu_seconds()
                push = timed(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{image_set}:bench", ref])
                cpu1 = s.cpu_seconds()
                out = os.path.join(work, "pulled")
                shutil.rmtree(out, ignore_errors=True)
                pull = timed(["skopeo", "copy", "-q", "--src-tls-verify=false", ref, f"dir:{out}"])
                cpu2 = s.cpu_seconds()
                shutil.rmtree(out, ignore_errors=True)
            finally:
                rss = s.stop()
            res[kind]["push"].append(push)
            res[kind]["pull"].append(pull)
            res[kind]["rss"].append(rss)
            res[kind]["push_cpu"].append(cpu1 - cpu0)
            res[kind]["pull_cpu"].append(cpu2 - cpu1)
            print(f"  run {i + 1} {kind:12s} push {push:6.2f}s  pull {pull:6.2f}s  peak RSS {rss / 1024:7.1f} MiB", flush=True)
    return res


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def machine():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def tool_version(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def write_report(path, res, image_set_desc, runs, command):
    a, d = res["amber"], res["distribution"]
    rows = []
    for label, key, unit, scale in (
        ("push wall time (s)", "push", "s", 1),
        ("pull wall time (s)", "pull", "s", 1),
        ("peak RSS (MiB)", "rss", "MiB", 1 / 1024),
        ("server CPU during push (s)", "push_cpu", "s", 1),
        ("server CPU during pull (s)", "pull_cpu", "s", 1),
    ):
        am, amin, amax = stats(a[key])
        dm, dmin, dmax = stats(d[key])
        ratio = dm / am
        rows.append((label, am * scale, amin * scale, amax * scale, dm * scale, dmin * scale, dmax * scale, ratio))
    push_ratio, pull_ratio, rss_ratio = rows[0][7], rows[1][7], rows[2][7]
    size_gib = image_set_desc["bytes"] / 2**30

    def ok(b):
        return "met" if b else "NOT met"

    lines = [
        "# amber benchmarks",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}. Every figure below comes from",
        "one run of the harness, with amber and its peer measured side by side on the same",
        "machine; ratios compare medians.",
        "",
        f"Machine: {machine()}.",
        "",
        "## Registry push and pull (issue 2)",
        "",
        f"Image set: one OCI image of {image_set_desc['layers']} gzip layers, {size_gib:.2f} GiB in all",
        "(`fixtures/bench/make_image_set.py`, seeded, incompressible data). Client:",
        f"`{tool_version(['skopeo', '--version'])}`, copying `oci:` layout -> registry (push) and registry -> `dir:` (pull).",
        "Peer: CNCF distribution (`" + tool_version(["docker-registry", "--version"]) + "`), filesystem storage.",
        f"Method: {runs} runs per registry, alternating which goes first; each run starts the",
        "registry on an empty data directory, pushes, pulls, then reads the server's peak",
        "resident set (VmHWM from /proc) and its CPU time (utime + stime) before stopping it.",
        "amber is the release build on its default configuration (local disk + RocksDB); it",
        "fsyncs every blob before acknowledging it, distribution does not.",
        "",
        "| measure | amber median | amber min-max | distribution median | distribution min-max | distribution / amber |",
        "|---|---|---|---|---|---|",
    ]
    for label, am, amin, amax, dm, dmin, dmax, ratio in rows:
        lines.append(f"| {label} | {am:.2f} | {amin:.2f}-{amax:.2f} | {dm:.2f} | {dmin:.2f}-{dmax:.2f} | {ratio:.2f}x |")
    lines += [
        "",
        f"Throughput (median): amber push {size_gib / rows[0][1]:.2f} GiB/s, pull {size_gib / rows[1][1]:.2f} GiB/s;",
        f"distribution push {size_gib / rows[0][4]:.2f} GiB/s, pull {size_gib / rows[1][4]:.2f} GiB/s.",
        "",
        "Goals (issue 2): amber at least 1.3x faster in both directions, with at most half the peak resident memory.",
        f"- push: {push_ratio:.2f}x, goal {ok(push_ratio >= 1.3)}",
        f"- pull: {pull_ratio:.2f}x, goal {ok(pull_ratio >= 1.3)}",
        f"- peak RSS: amber uses {1 / rss_ratio:.2f} of distribution's, goal {ok(rss_ratio >= 2)}",
        "",
        "Raw runs (seconds, KiB):",
        "",
        "```",
        json.dumps(res, indent=None),
        "```",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small image set, 3 runs")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    layers, mib = (8, 16) if a.quick else (24, 86)
    work = os.path.join(RUN, "bench")
    os.makedirs(work, exist_ok=True)
    image_set = os.path.join(work, f"imageset-{layers}x{mib}")
    if not os.path.exists(os.path.join(image_set, "index.json")):
        print(f"generating image set {image_set}", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "fixtures/bench/make_image_set.py"), image_set,
                        "--layers", str(layers), "--layer-mib", str(mib)], check=True)
    idx = json.load(open(os.path.join(image_set, "index.json")))
    mdig = idx["manifests"][0]["digest"].split(":")[1]
    manifest = json.load(open(os.path.join(image_set, "blobs", "sha256", mdig)))
    desc = {"layers": len(manifest["layers"]), "bytes": sum(l["size"] for l in manifest["layers"])}
    print(f"registry push/pull: {desc['layers']} layers, {desc['bytes'] / 2**30:.2f} GiB, {a.runs} runs each", flush=True)
    res = bench_registry(work, image_set, a.runs)
    command = "scripts/bench" + (" --quick" if a.quick else "")
    out = os.path.join(ROOT, "BENCHMARKS.md") if not a.quick else os.path.join(work, "BENCHMARKS.quick.md")
    write_report(out, res, desc, a.runs, command)
    print(open(out).read())


if __name__ == "__main__":
    main()
