"""Listing an S3 prefix the way the job does (:func:`pipelines.ingest.listing.list_records`) and
measuring it: seconds, the driver's heap (tracemalloc's peak plus Arrow's memory pool peak,
after a warm-up so imports and the client are not counted), and the requests the counting
server (benchmarks/s3server.py) saw.

    python benchmarks/listing_bench.py measure s3://bucket/train --endpoint http://127.0.0.1:PORT

prints one JSON line. Run each measurement in a fresh process (Arrow's pool peak is per process).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from concurrent.futures import ThreadPoolExecutor

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def fake_aws_env() -> None:
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    os.environ.pop("AWS_PROFILE", None)


def start_server() -> tuple[subprocess.Popen, str]:
    """benchmarks/s3server.py in a child process: ``(process, endpoint URL)``."""
    proc = subprocess.Popen([sys.executable, os.path.join(_REPO, "benchmarks", "s3server.py")],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "PORT":
        proc.kill()
        raise RuntimeError("the counting S3 server did not start")
    return proc, f"http://127.0.0.1:{int(line[1])}"


def counts(endpoint: str, reset: bool = False) -> dict:
    req = urllib.request.Request(endpoint + "/__counts", method="POST" if reset else "GET")
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def put_tree(endpoint: str, bucket: str, prefix: str, classes: int, per_class: int, body: bytes = b"x" * 16,
             threads: int = 16) -> int:
    """``classes`` class prefixes of ``per_class`` objects each under ``s3://bucket/prefix/``
    (ImageNet-like names); returns the number of keys."""
    from pipelines.ingest.listing import s3_client

    client = s3_client(endpoint, threads)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.ClientError as e:
        if "BucketAlready" not in str(e):
            raise

    def put(k: int) -> None:
        c, i = divmod(k, per_class)
        wnid = f"n{c:08d}"
        client.put_object(Bucket=bucket, Key=f"{prefix.strip('/')}/{wnid}/{wnid}_{i}.JPEG", Body=body)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(classes * per_class)))
    return classes * per_class


def measure(uri: str, endpoint: str) -> dict:
    """List ``uri`` once to warm up (a class prefix only), then list it all under tracemalloc."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401  (imported before the measurement)

    from pipelines.ingest.listing import list_records, top_level

    tops, _ = top_level(uri, endpoint)
    list_records(uri.rstrip("/") + "/" + tops[0], endpoint)  # warm-up: client, paginator model, Arrow kernels
    gc.collect()
    pool = pa.default_memory_pool()
    arrow_before = pool.bytes_allocated()
    counts(endpoint, reset=True)
    tracemalloc.start()
    t0 = time.perf_counter()
    table = list_records(uri, endpoint)
    seconds = time.perf_counter() - t0
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    arrow_peak = pool.max_memory() - arrow_before
    n = table.num_rows
    return {"keys": n, "unique_keys": len(set(table.column("path").to_pylist())), "seconds": round(seconds, 3),
            "python_heap_peak": py_peak, "arrow_peak": arrow_peak, "table_bytes": table.nbytes,
            "heap_per_key": round((py_peak + arrow_peak) / max(n, 1), 1), "server": counts(endpoint)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["measure"])
    p.add_argument("uri")
    p.add_argument("--endpoint", required=True)
    a = p.parse_args()
    fake_aws_env()
    print(json.dumps(measure(a.uri, a.endpoint)), flush=True)


if __name__ == "__main__":
    main()
