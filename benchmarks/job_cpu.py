"""CPU seconds of one smoke job, by process kind, for two checkouts interleaved (issue 43).

    python benchmarks/job_cpu.py --before /tmp/old-checkout --after . --repeat 3

Each run is ``python jobs/imagenet_inf.py --preset smoke --output <tmp>`` started from the
checkout (its own local Ray instance, the checkout's code on every worker's path), the two
checkouts alternating. Measured per run: the wall time, the CPU seconds of the whole machine
over the run (``/proc/stat``: every process, Ray's daemons included; run it on a quiet machine)
and, from ``/proc/<pid>/stat`` sampled every 0.2 s, the CPU seconds of each process started
during the run grouped by kind (Ray's process title ``ray::<Actor or task>``, else the command).
A process that lives shorter than one sample is missed by the per-kind table, not by the
machine total. The suite runs ~25 whole jobs on 2 cores, so a job's CPU seconds are the
suite's currency (its wall time is CPU-bound).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def machine_cpu() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK  # all but idle and iowait


def _kind(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    comm = st[st.index("(") + 1:st.rindex(")")]
    m = re.search(r"ray::([A-Za-z_]+(?:\([A-Za-z_]+\))?)", comm + " " + cmd)
    if m:
        return "ray::" + m.group(1)
    first = cmd.split(" ")[0].rsplit("/", 1)[-1] if cmd else comm
    return f"{first} {os.path.basename(cmd.split(' ')[1]) if len(cmd.split(' ')) > 1 else ''}".strip()


class Sampler(threading.Thread):
    """Cumulative CPU and the latest kind of every process that appears after it starts."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        self.every, self.stop = every, threading.Event()
        self.before = set(os.listdir("/proc"))
        self.cpu: dict[str, float] = {}
        self.kind: dict[str, str] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or pid in self.before:
                    continue
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        rest = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                self.cpu[pid] = (int(rest[11]) + int(rest[12])) / TICK
                k = _kind(pid)
                if k and not (k == "ray::IDLE" and pid in self.kind):
                    self.kind[pid] = k
            time.sleep(self.every)

    def table(self) -> dict[str, tuple[int, float]]:
        out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for pid, c in self.cpu.items():
            k = self.kind.get(pid, "?")
            out[k][0] += 1
            out[k][1] += c
        return {k: (n, c) for k, (n, c) in out.items()}


def one_run(checkout: Path, python: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="jobcpu-")) / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    s = Sampler()
    s.start()
    c0, t0 = machine_cpu(), time.time()
    res = subprocess.run([python, "jobs/imagenet_inf.py", "--preset", "smoke", "--output", str(out)], cwd=checkout,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall, cpu = time.time() - t0, machine_cpu() - c0
    s.stop.set()
    s.join()
    if res.returncode != 0:
        raise SystemExit(f"{checkout}: rc {res.returncode}\n{res.stdout[-3000:]}")
    return {"wall": wall, "cpu": cpu, "kinds": s.table()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    ap.add_argument("--after", type=Path, default=Path("."), help="checkout of the code after it")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(a.repeat):
        for name in ("before", "after"):
            r = one_run(getattr(a, name).resolve(), a.python)
            runs[name].append(r)
            print(f"run {i + 1} {name:6s}: wall {r['wall']:6.1f} s, machine CPU {r['cpu']:6.1f} s", flush=True)
    for name, rs in runs.items():
        wall = sorted(r["wall"] for r in rs)[len(rs) // 2]
        cpu = sorted(r["cpu"] for r in rs)[len(rs) // 2]
        print(f"\n{name}: median wall {wall:.1f} s, median machine CPU {cpu:.1f} s; by kind (mean of {len(rs)} runs):")
        kinds: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0])
        for r in rs:
            for k, (n, c) in r["kinds"].items():
                kinds[k][0] += n / len(rs)
                kinds[k][1] += c / len(rs)
        for k, (n, c) in sorted(kinds.items(), key=lambda x: -x[1][1]):
            if c >= 0.5:
                print(f"  {c:6.1f} s  {n:4.1f} x {k}")
    b = sorted(r["cpu"] for r in runs["before"])[a.repeat // 2]
    f = sorted(r["cpu"] for r in runs["after"])[a.repeat // 2]
    print(f"\nmachine CPU per smoke job: {b:.1f} s before, {f:.1f} s after ({f / b:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
