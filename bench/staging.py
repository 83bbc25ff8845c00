"""Benchmark: `kuberl stage` against a plain single-stream copy from the same loopback S3 server.

Workloads: one big file, and many small files. References measured in the same run:
- single stream: boto3 get_object, one object after another, streamed to disk in 1 MiB blocks;
- s3fs.get (big file only): fsspec's own download of the object.
The last line is the headline ratio. ``--json`` prints the results as JSON instead.

Servers (started here, on loopback): ``moto`` (Python, the server the tests use; it reads the whole
object for every ranged GET, so it penalises parallel ranges) or ``gofakes3`` (Go, in-memory;
``--gofakes3-bin``, default ``~/.cache/kuberl/bin/gofakes3-v1.2.0``; build it with
``GOBIN=/tmp/g go install github.com/johannesboyne/gofakes3/cmd/gofakes3@v1.2.0`` and move it
there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
BUCKET = "kuberl-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(kind: str, gofakes3_bin: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "moto":
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    else:
        if not gofakes3_bin or not Path(gofakes3_bin).exists():
            raise SystemExit(f"gofakes3 binary {gofakes3_bin!r} not found; see --help")
        cmd = [gofakes3_bin, "-backend", "memory", "-host", f"127.0.0.1:{port}", "-quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{kind} server did not start")
            time.sleep(0.1)
    return proc, endpoint


def single_stream(client, prefix: str, dst: Path) -> int:
    """The plain reference: list, then GET each object in turn, streamed to disk."""
    total = 0
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            target = dst / obj["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            body = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"]
            with open(target, "wb") as out:
                for block in body.iter_chunks(1 << 20):
                    out.write(block)
                    total += len(block)
    return total


def timed(fn, dst_root: Path, repeat: int) -> tuple[float, int]:
    """Best wall time of ``repeat`` runs of fn(fresh_dst) -> bytes."""
    best, nbytes = float("inf"), 0
    for _ in range(repeat):
        dst = Path(tempfile.mkdtemp(dir=dst_root))
        start = time.perf_counter()
        nbytes = fn(dst)
        best = min(best, time.perf_counter() - start)
        shutil.rmtree(dst)
    return best, nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("moto", "gofakes3"), default="moto")
    parser.add_argument("--gofakes3-bin",
                        default=str(Path.home() / ".cache/kuberl/bin/gofakes3-v1.2.0"))
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("--small-count", type=int, default=1000)
    parser.add_argument("--small-kib", type=int, default=64)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--part-size-mib", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    os.environ.update(ENV)
    proc, endpoint = start_server(args.server, args.gofakes3_bin)
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    import boto3
    import s3fs

    from kuberl.storage import stage

    work = Path(tempfile.mkdtemp(prefix="kuberl-bench-"))
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        big = work / "big.bin"
        with open(big, "wb") as f:  # incompressible content: no store can shortcut it
            for _ in range(args.big_mib):
                f.write(os.urandom(1 << 20))
        fs.put_file(str(big), f"{BUCKET}/big/model.safetensors")
        big.unlink()
        fs.pipe({f"{BUCKET}/small/d{i % 20}/f{i:05d}.bin": os.urandom(args.small_kib << 10)
                 for i in range(args.small_count)})

        def kuberl(prefix):
            return lambda dst: stage(f"s3://{BUCKET}/{prefix}", dst, workers=args.workers,
                                     part_size=args.part_size_mib << 20,
                                     log_interval_s=3600).downloaded_bytes

        def s3fs_get(dst):
            fs.get(f"{BUCKET}/big/model.safetensors", str(dst / "model.safetensors"))
            return (dst / "model.safetensors").stat().st_size

        rows = []
        for workload, prefix, methods in (
                ("big", "big", [("single-stream", lambda d: single_stream(client, "big", d)),
                                ("s3fs.get", s3fs_get), ("kuberl stage", kuberl("big"))]),
                ("small", "small", [("single-stream", lambda d: single_stream(client, "small", d)),
                                    ("kuberl stage", kuberl("small"))])):
            for method, fn in methods:
                seconds, nbytes = timed(fn, work, args.repeat)
                rows.append({"workload": workload, "method": method, "seconds": seconds,
                             "bytes": nbytes, "gbps": nbytes / seconds / 1e9})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    def gbps(workload, method):
        return next(r["gbps"] for r in rows if r["workload"] == workload and r["method"] == method)

    small_ratio = gbps("small", "kuberl stage") / gbps("small", "single-stream")
    big_ratio = gbps("big", "kuberl stage") / max(gbps("big", "single-stream"),
                                                  gbps("big", "s3fs.get"))
    result = {"server": args.server, "machine": f"{platform.node()} {os.cpu_count()} CPUs",
              "big_mib": args.big_mib, "small_count": args.small_count,
              "small_kib": args.small_kib, "workers": args.workers, "rows": rows,
              "small_vs_single_stream": small_ratio, "big_vs_best_reference": big_ratio}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"server: {args.server} on loopback; {os.cpu_count()} CPUs; best of {args.repeat}")
    print(f"{'workload':<34} {'method':<14} {'seconds':>8} {'GB/s':>7}")
    for r in rows:
        label = (f"big: 1 x {args.big_mib} MiB" if r["workload"] == "big"
                 else f"small: {args.small_count} x {args.small_kib} KiB")
        print(f"{label:<34} {r['method']:<14} {r['seconds']:>8.2f} {r['gbps']:>7.3f}")
    print(f"big file: kuberl stage = {big_ratio:.2f}x best(single-stream, s3fs.get) (goal >= 0.8)")
    print(f"headline: kuberl stage = {small_ratio:.2f}x single-stream on many small files "
          f"(goal >= 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
