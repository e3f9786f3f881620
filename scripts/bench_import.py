"""The import benchmark (issue 17): the task-image corpus (fixtures/corpus) served by a
CNCF distribution registry, copied whole into amber with `amber-registry import`, against
`skopeo sync` of the same repositories into a second distribution registry.

Both copy every tag of every corpus repository from the same source on loopback. The
bytes transferred are what the source registry wrote to its sockets during the copy
(`wchar` of its /proc/PID/io: bodies and headers); the bytes stored are each
destination's blob directory. amber runs twice: with conversion deferred
(`--convert-workers 0`, the copy alone, as skopeo does), and with conversion on, where
the import answers once every image is stored and its conversion queued (the time until
every env is ready is reported beside it).

Called by bench.py (`scripts/bench --only import`).
"""
import os
import re
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wchar(pid):
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError(f"no wchar in /proc/{pid}/io")


def bench_import(work, h, count):
    """`h` is bench.py (its Server, corpus_layout, skopeo helpers, dir_bytes...)."""
    layout, corpus = h.corpus_layout(work, count)
    tasks = corpus["tasks"]
    repos = sorted({t["repository"] for t in tasks})
    skopeo = h.current_skopeo()
    src = h.Server("distribution-src", work)
    res = {"images": len(tasks), "repositories": len(repos), "skopeo": h.tool_version(skopeo + ["--version"])}
    try:
        print(f"  seeding the source with {len(tasks)} images", flush=True)
        for t in tasks:
            subprocess.run(skopeo + ["copy", "-q", "--dest-tls-verify=false", f"oci:{layout}:{t['ref']}",
                                     f"docker://{src.addr}/corpus/{t['repository']}:{t['version']}"],
                           check=True, stdout=subprocess.DEVNULL)
        res["source_stored"] = h.dir_bytes(os.path.join(src.data, "docker/registry/v2/blobs"))

        # The peer: skopeo sync of every repository into another distribution.
        dst = h.Server("distribution-dst", work)
        try:
            spec = os.path.join(work, "sync.yml")
            with open(spec, "w") as f:
                f.write(f"{src.addr}:\n  tls-verify: false\n  images:\n")
                f.writelines(f"    corpus/{r}: []\n" for r in repos)
            w0 = wchar(src.proc.pid)
            t0 = time.monotonic()
            subprocess.run(skopeo + ["sync", "--src", "yaml", "--dest", "docker", "--dest-tls-verify=false",
                                     spec, f"{dst.addr}/mirror"], check=True, stdout=subprocess.DEVNULL)
            res["skopeo_sync"] = {"seconds": time.monotonic() - t0, "transferred": wchar(src.proc.pid) - w0,
                                  "stored": h.dir_bytes(os.path.join(dst.data, "docker/registry/v2/blobs"))}
        finally:
            dst.stop()

        listing = os.path.join(work, "import.txt")
        with open(listing, "w") as f:
            f.writelines(f"{src.addr}/corpus/{r}\n" for r in repos)
        amber = os.path.join(h.TARGET, "release", "amber-registry")
        for key, extra in (("amber_deferred", ["--convert-workers", "0"]), ("amber_converting", [])):
            s = h.Server("amber-import", work, extra=extra)
            try:
                w0 = wchar(src.proc.pid)
                t0 = time.monotonic()
                out = subprocess.run([amber, "import", "--registry", f"http://{s.addr}", "--from-file", listing],
                                     check=True, capture_output=True, text=True).stdout
                seconds = time.monotonic() - t0
                entry = {"seconds": seconds, "transferred": wchar(src.proc.pid) - w0,
                         "stored": h.dir_bytes(os.path.join(s.data, "store", "blobs")),
                         "summary": out.strip().splitlines()[-1]}
                m = re.search(r"(\d+) images imported, (\d+) failed; (\d+) blobs fetched \((\d+) bytes\)", entry["summary"])
                assert m and int(m.group(1)) == len(tasks) and m.group(2) == "0", entry["summary"]
                entry["blob_bytes_fetched"] = int(m.group(4))
                if not extra:
                    mirror = src.addr.replace(":", "-")
                    for t in tasks:
                        h.wait_converted(s.addr, f"{mirror}/corpus/{t['repository']}", t["version"])
                    entry["until_converted"] = time.monotonic() - t0
                res[key] = entry
            finally:
                s.stop()
    finally:
        src.stop()
    return res


def import_section(res):
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    sk, ad, ac = res["skopeo_sync"], res["amber_deferred"], res["amber_converting"]
    ratio = sk["seconds"] / ad["seconds"]
    lines = [
        "## Import from another registry (issue 17)",
        "",
        f"The task-image corpus ({res['images']} images in {res['repositories']} repositories, `fixtures/corpus/generate.py",
        f"--count {res['images']} --seed 1`) pushed to a CNCF distribution 2.8 registry (the source, {gib(res['source_stored'])}",
        "of blobs), then copied whole, every tag of every repository, over loopback: by `skopeo sync` (skopeo",
        f"{res['skopeo'].split()[-1]}, its defaults) into a second distribution registry, and by `amber-registry import`",
        "(defaults: 4 images at once, 4 blobs per image) into amber. Transferred: what the source wrote to its",
        "sockets during the copy (`wchar`, /proc/PID/io); stored: the destination's blob directory. One run each.",
        "",
        "| copy | wall time | transferred | stored | vs skopeo sync |",
        "|---|---|---|---|---|",
        f"| skopeo sync, distribution to distribution | {sk['seconds']:.1f} s | {gib(sk['transferred'])} | {gib(sk['stored'])} | 1.00x |",
        f"| amber import, conversion deferred | {ad['seconds']:.1f} s | {gib(ad['transferred'])} | {gib(ad['stored'])} | {ratio:.2f}x faster |",
        f"| amber import, conversion on (import answered) | {ac['seconds']:.1f} s | {gib(ac['transferred'])} | {gib(ac['stored'])} | {sk['seconds'] / ac['seconds']:.2f}x faster |",
        "",
        f"With conversion on, every image's env was ready {ac['until_converted']:.1f} s after the import started.",
        f"amber's own count of blob bytes fetched: {gib(ad['blob_bytes_fetched'])} (each blob once, whatever the number",
        "of repositories and images naming it).",
        "",
        f"Goal (issue 17): amber's import at least 1.5x faster than skopeo sync: {ratio:.2f}x, "
        f"{'met' if ratio >= 1.5 else 'NOT met'}.",
        "",
    ]
    return lines
