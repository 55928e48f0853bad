"""The ImageNet-shaped rehearsal of the control plane (issue 29): a tree of tiny JPEGs with
ImageNet's layout, listed, planned and run through the curvature stage with a tiny model.

    python benchmarks/rehearsal.py /tmp/reh --classes 100 --per-class 100            # 10k local
    python benchmarks/rehearsal.py s3://reh/data --moto --classes 100 --per-class 200  # 20k on moto

``<root>/train/<wnid>/<wnid>_<i>.JPEG``, 16x16 JPEGs (64 distinct images, so writing costs
little; decoding and the model cost nothing next to the control plane). ``--moto`` starts the
counting S3 server (benchmarks/s3server.py) and writes the tree there; ``--endpoint`` uses
another S3-compatible store. Then, in this process (the driver):

1. listing: the split listed into ``<output>/index/train.parquet`` (:mod:`pipelines.ingest.index_store`);
   a second :class:`IndexedListing` then shows the reuse check (its seconds are printed too);
2. planning: the scan of the listing and the partitions (``--partition-size``);
3. the curvature stage (``tiny_cnn``, KFAC, 2 CPU workers of 0.5 CPU, a checkpoint after every
   partition) on a local Ray instance.

Printed (one JSON line at the end, after a readable table): listing and planning seconds,
seconds per partition (pass 1's wall time / partitions), the driver's peak RSS (``VmHWM``), the
highest ``VmHWM`` of a Ray Train worker (polled from ``/proc`` while the stage runs), the bytes
handed to the workers (their pickled index shares) and the bytes written (checkpoints and the
index), and with ``--moto`` the requests the server counted.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_REPO, os.path.join(_REPO, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def tiny_jpegs(n: int = 64, size: int = 16) -> list[bytes]:
    import numpy as np
    from PIL import Image

    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def write_local(root: str, classes: int, per_class: int) -> int:
    jpegs = tiny_jpegs()

    def one_class(c: int) -> int:
        wnid = f"n{c:08d}"
        d = os.path.join(root, "train", wnid)
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            with open(os.path.join(d, f"{wnid}_{i}.JPEG"), "wb") as f:
                f.write(jpegs[(c * 7 + i) % len(jpegs)])
        return per_class

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one_class, range(classes)))


def write_s3(uri: str, endpoint: str, classes: int, per_class: int) -> int:
    import listing_bench as lb

    bucket, _, prefix = uri.split("://", 1)[1].partition("/")
    jpegs = tiny_jpegs()
    return lb.put_tree(endpoint, bucket, (prefix.strip("/") + "/train").lstrip("/"), classes, per_class,
                       body=jpegs[0], threads=16)


def vm_status(pid: int | str = "self", keys=("VmHWM",)) -> dict[str, int]:
    """Bytes of the ``/proc/<pid>/status`` fields ``keys`` (those found; none if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def vm_hwm(pid: int | str = "self") -> int:
    """Peak resident bytes of a process (``VmHWM``), 0 if it is gone."""
    return vm_status(pid).get("VmHWM", 0)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


_RSS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssShmem")


class WorkerWatch(threading.Thread):
    """Polls ``/proc`` for this driver's Ray Train worker processes (descendants of this process,
    whose local Ray instance started them) and keeps the highest ``VmHWM`` seen, and a timeline
    of the largest worker's resident bytes: all (``VmRSS``), private (``RssAnon``) and the
    object store's shared pages it has touched (``RssShmem``)."""

    def __init__(self, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.every_s, self.peak, self.pids, self._halt = every_s, 0, set(), threading.Event()
        self.samples: list[tuple[float, int, int, int]] = []  # (time, VmRSS, RssAnon, RssShmem)
        self.driver: list[tuple[float, int, int, int]] = []  # the same of this process (the driver)

    def curve(self, points: int = 10, driver: bool = False) -> list[list[int]]:
        """``[VmRSS, RssAnon, RssShmem]`` in MiB of the largest worker (``driver``: of this process)
        at ``points`` even steps of the stage's time (the last sample before each step): growth per
        partition shows here."""
        samples = self.driver if driver else self.samples
        if not samples:
            return []
        t0, t1 = samples[0][0], samples[-1][0]
        out, i = [], 0
        for k in range(1, points + 1):
            step = t0 + (t1 - t0) * k / points
            while i + 1 < len(samples) and samples[i + 1][0] <= step:
                i += 1
            out.append([v >> 20 for v in samples[i][1:]])
        return out

    def run(self) -> None:
        while not self._halt.is_set():
            sample = (0.0, 0, 0, 0)
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"RayTrainWorker" not in f.read(200):
                            continue
                except OSError:
                    continue
                if not _descends_from(int(pid), os.getpid()):
                    continue
                self.pids.add(int(pid))
                st = vm_status(pid, _RSS_KEYS)
                self.peak = max(self.peak, st.get("VmHWM", 0))
                if st.get("VmRSS", 0) > sample[1]:
                    sample = (time.time(), st["VmRSS"], st.get("RssAnon", 0), st.get("RssShmem", 0))
            if sample[1]:
                self.samples.append(sample)
            me = vm_status("self", _RSS_KEYS)
            self.driver.append((time.time(), me.get("VmRSS", 0), me.get("RssAnon", 0), me.get("RssShmem", 0)))
            self._halt.wait(self.every_s)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def _curvature(parts, dc, output: str, store, classes: int) -> dict:
    import logging

    import ray

    from pipelines.config.schema import ModelSpec
    from pipelines.passes.curvature import CurvatureConfig, run_curvature
    from pipelines.storage.store import RunStore
    from pipelines.storage.uris import StorageOptions

    tmp = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level=logging.WARNING,
             object_store_memory=1 << 30)
    watch = WorkerWatch()
    watch.start()
    try:
        cfg = CurvatureConfig(num_workers=2, cpus_per_worker=0.5, fisher="mc", batch_size=256, methods=("kfac",),
                              checkpoint_every_s=0, log_every_s=60.0)
        t0 = time.perf_counter()
        res = run_curvature(ModelSpec(name="tiny_cnn", weights=None, num_classes=classes), parts, cfg,
                            RunStore.open(output, StorageOptions(store)), data_config=dc, run_name="rehearsal")
        stage_s = time.perf_counter() - t0
    finally:
        worker_peak = watch.stop()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    ranks = res.passes["pass1"]["ranks"]
    report_ranks = res.timings["worker"].get("ranks", [])
    return {"stage_s": round(stage_s, 1), "per_partition_s": round(max(r["wall_s"] for r in ranks) / len(parts), 2),
            "worker_peak_rss": worker_peak, "workers_seen": len(watch.pids),
            "worker_rss_curve_mib": watch.curve(), "driver_rss_curve_mib": watch.curve(driver=True),
            "bytes_to_workers": int(sum(r.get("pass1", {}).get("source_bytes", 0) for r in report_ranks)),
            "bytes_written": int(sum(r["bytes_written"] for r in ranks)), "count": res.stats.count}


def rehearse(args) -> dict:
    from pipelines.ingest.index import DataConfig, partition
    from pipelines.ingest.index_store import IndexedListing, index_uris
    from pipelines.ingest.scan import scan
    from pipelines.ingest.table_scan import release_unused
    from pipelines.storage import uris as storage

    import pyarrow.compute  # noqa: F401  (imports are not part of the listing's seconds)
    import pyarrow.parquet  # noqa: F401

    store = args.endpoint
    split_uri = storage.join(args.root, "train")
    out: dict = {"root": args.root, "classes": args.classes, "per_class": args.per_class,
                 "files": args.classes * args.per_class}
    if not args.skip_write:
        t0 = time.perf_counter()
        if storage.is_remote(args.root):
            write_s3(args.root, store, args.classes, args.per_class)
        else:
            write_local(args.root, args.classes, args.per_class)
        out["write_s"] = round(time.perf_counter() - t0, 1)
    output = args.output or storage.join(args.root, "_rehearsal_out")
    if storage.exists(output, store):  # a fresh run: an earlier run's checkpoints would be resumed from
        storage.remove(output, recursive=True, options=store)
    if args.moto:
        import listing_bench as lb

        lb.counts(store, reset=True)
    t0 = time.perf_counter()
    listing = IndexedListing(output, store)
    table = listing.records("train", split_uri)
    out["listing_s"] = round(time.perf_counter() - t0, 2)
    if args.moto:
        out["listing_requests"] = lb.counts(store, reset=True)
    del table  # the job holds one listing at a time: the reused one is scanned below
    t0 = time.perf_counter()
    table = IndexedListing(output, store).records("train", split_uri)
    out["reuse_check_s"] = round(time.perf_counter() - t0, 2)
    if args.moto:
        out["reuse_requests"] = lb.counts(store, reset=True)
    fs, index_path = storage.get_fs(index_uris(output, "train")[0], store)
    out["index_bytes"] = int(fs.size(index_path))
    if storage.is_remote(args.root):  # the listing's heap, in a fresh process (tracemalloc + Arrow's pool)
        import subprocess

        res = subprocess.run([sys.executable, os.path.join(_REPO, "benchmarks", "listing_bench.py"), "measure",
                              split_uri, "--endpoint", store], capture_output=True, text=True, check=True)
        m = json.loads(res.stdout.strip().splitlines()[-1])
        out["listing_heap"] = {k: m[k] for k in ("keys", "unique_keys", "python_heap_peak", "arrow_peak",
                                                  "heap_per_key", "seconds")}
        out["listing_heap"]["max_in_flight"] = m["server"]["max_in_flight"]
    t0 = time.perf_counter()
    dc = DataConfig(root=args.root, split="train", image_size=16, resize_size=16,
                    storage_options=storage.StorageOptions(store).resolved())
    held = [table]  # handed over, not kept here (the job's lister returns it the same way)
    del table
    index = scan(dc, lambda _uri: held.pop())
    parts = partition(index, partition_size=args.partition_size)
    release_unused()  # as the job does (pipelines.ingest.plan.scan_splits)
    out["planning_s"] = round(time.perf_counter() - t0, 2)
    out["partitions"] = len(parts)
    out["driver_rss_before_stage"] = vm_hwm()
    if not args.no_stage:
        out.update(_curvature(parts, dc, output, store, args.classes))
        out["bytes_written"] += out["index_bytes"]
    out["driver_peak_rss"] = vm_hwm()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="local folder or s3://bucket/prefix (the tree goes under <root>/train)")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--partition-size", type=int, default=2000)
    ap.add_argument("--output", help="the run's output, removed first (default <root>/_rehearsal_out)")
    ap.add_argument("--endpoint", help="S3-compatible endpoint URL")
    ap.add_argument("--moto", action="store_true", help="start the counting moto server and use it")
    ap.add_argument("--skip-write", action="store_true", help="the tree is there already")
    ap.add_argument("--no-stage", action="store_true", help="listing and planning only")
    args = ap.parse_args(argv)
    server = None
    if args.moto:
        import listing_bench as lb

        lb.fake_aws_env()
        server, args.endpoint = lb.start_server()
    try:
        res = rehearse(args)
    finally:
        if server is not None:
            server.terminate()
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    for k, v in res.items():
        shown = mib(v) if ("rss" in k or "bytes" in k) and isinstance(v, int) else v
        print(f"{k:>24}: {shown}")
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
