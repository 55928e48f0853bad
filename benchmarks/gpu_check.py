"""One GPU check in one command (issue 42): bf16 against fp32 where the time goes, in under 8 minutes.

    python benchmarks/gpu_check.py --out gpu_check.json      # on one GPU (docs/benchmarks.md: the device run)
    python benchmarks/gpu_check.py --tiny --out tiny.json    # CPU, seconds: tests/benchmarks/test_gpu_check.py

Phases, in this order, each recorded in the JSON as ``status`` ``ok`` / ``failed`` / ``error``
/ ``skipped`` (with the reason: no CUDA, a package missing, the time budget), the JSON rewritten
after every phase so that a run cut off still leaves what it measured:

* ``check`` (e): bf16's ``A``, ``G``, diagonal and EFB sums against fp32 (TF32 off) on the same
  images, per layer, worst layer against ``BF16_CHECK_RTOL`` (docs/design.md §1, "Precision");
* ``passes`` (b): pass 1 and the EFB pass, resnet50 at 224x224 on a synthetic batch, img/s and
  peak memory, in fp32 (torch's default flags, and TF32 on) and bf16;
* ``kronfluence`` (c): kronfluence 1.0.1's bf16 covariance and lambda passes, same model and batch;
* ``mc_forward`` (d): the evaluation actors' MC predictive (INF, K = 30) in fp32 and bf16;
* ``cuda_tests`` (a): the tests that skip without CUDA (found by their ``skipif``), in a
  subprocess with what is left of the budget; the ones that need Ray are skipped, with the
  reason, where Ray is not importable.

``--tiny``: a tiny CNN on 16x16 images on the CPU (seconds), every phase but the CUDA tests.
The versions of Python, torch, torchvision, CUDA, kronfluence and Ray are in ``env``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check_parts as parts  # noqa: E402

SCHEMA = 1
PHASES = ("check", "passes", "kronfluence", "mc_forward", "cuda_tests")
#: Seconds a phase is expected to need on an H100 at the default sizes (skipped when less is left).
NEED_S = {"check": 30, "passes": 40, "kronfluence": 60, "mc_forward": 30, "cuda_tests": 30}
TINY = dict(model="tiny_cnn", size=16, classes=10, batch=8, batches=5, warmup=1, check_images=16,
            eval_images=16, eval_batch=8, mc=4, repeats=1, configs="fp32_default,fp32_tf32,bf16")
CUDA_SKIP = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON written (after every phase)")
    p.add_argument("--tiny", action="store_true", help="tiny CNN, 16x16, CPU: seconds (the suite runs it)")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the whole run")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--weights", default=None,
                   help="a state-dict file (safetensors) for --model; default random init (see docs/benchmarks.md: the "
                        "check (e) on random init is not representative of a trained network)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64, help="images per batch of the passes (the ImageNet preset's)")
    p.add_argument("--batches", type=int, default=12, help="batches per timed pass, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-images", type=int, default=64, help="images of the precision check (e)")
    p.add_argument("--configs", default="fp32_default,fp32_tf32,bf16,bf16_tf32",
                   help=f"timed configurations, of {', '.join(parts.CONFIGS)}")
    p.add_argument("--eval-images", type=int, default=256)
    p.add_argument("--eval-batch", type=int, default=128, help="the ImageNet preset's evaluate.batch_size")
    p.add_argument("--mc", type=int, default=30, help="K, MC samples of the predictive")
    p.add_argument("--repeats", type=int, default=2, help="MC forward: best of this many after a warm-up")
    p.add_argument("--skip", default="", help=f"phases to skip, comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available; cpu with --tiny)")
    return p


def parse(argv=None) -> argparse.Namespace:
    p = get_args_parser()
    a = p.parse_args(argv)
    if a.tiny:
        given = {k for k in vars(a) if any(t.split("=")[0] == "--" + k.replace("_", "-") for t in (argv or []))}
        for k, v in TINY.items():
            if k not in given:
                setattr(a, k, v)
        a.device = a.device or "cpu"
        a.skip = ",".join(filter(None, [a.skip, "cuda_tests"]))
    bad = [c for c in a.configs.split(",") if c not in parts.CONFIGS] + \
          [s for s in a.skip.split(",") if s and s not in PHASES]
    if bad or a.batches < a.warmup + 2:
        p.error(f"unknown config/phase {bad}" if bad else "--batches must be at least --warmup + 2")
    return a


def versions() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
           "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
           "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    for mod in ("torchvision", "kronfluence", "ray", "pytest"):
        env[mod] = _version(mod)
    return env


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None
    return getattr(m, "__version__", "unknown")


# --------------------------------------------------------------------------- (a) CUDA-only tests
def cuda_tests() -> list[str]:
    """pytest node ids (files where the whole module is marked) of the tests that skip without CUDA."""
    ids = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        src = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(ROOT))
        if re.search(r"^pytestmark\s*=.*" + CUDA_SKIP.pattern, src, flags=re.M):
            ids.append(rel)
            continue
        for m in re.finditer(CUDA_SKIP.pattern + r".*\n(?:@.*\n)*def (test_\w+)", src):
            ids.append(f"{rel}::{m.group(1)}")
    return ids


def needs_ray(node: str) -> bool:
    """A test under tests/pipelines or tests/jobs (their conftest files start Ray) or importing it."""
    path = ROOT / node.split("::")[0]
    return node.startswith(("tests/pipelines/", "tests/jobs/")) or "import ray" in path.read_text(encoding="utf-8")


def run_cuda_tests(env: dict, timeout: float) -> dict:
    ids = cuda_tests()
    skipped = {i: "ray is not importable here" for i in ids if env["ray"] is None and needs_ray(i)}
    run = [i for i in ids if i not in skipped]
    rec = {"found": ids, "skipped": skipped, "ran": run}
    if not torch.cuda.is_available():
        return {**rec, "status": "skipped", "reason": "no CUDA device"}
    if not run:
        return {**rec, "status": "skipped", "reason": "every CUDA test needs a package missing here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *run]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {**rec, "status": "error", "reason": f"pytest ran past {timeout:.0f} s",
                "tail": (e.stdout or b"")[-3000:].decode() if isinstance(e.stdout, bytes) else (e.stdout or "")[-3000:]}
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    return {**rec, "status": "ok" if proc.returncode == 0 else "failed", "returncode": proc.returncode,
            "summary": summary, "tail": proc.stdout[-3000:] + proc.stderr[-1000:]}


# --------------------------------------------------------------------------- orchestration
class Run:
    """The JSON being written and the budget."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.deadline = self.t0 + args.budget_s
        self.doc = {"schema": SCHEMA, "args": vars(args), "env": versions(), "phases": {}}
        self.skip = set(filter(None, args.skip.split(",")))

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def write(self) -> None:
        self.doc["wall_s"] = round(time.perf_counter() - self.t0, 2)
        Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.out).write_text(json.dumps(self.doc, indent=1, default=str))

    def phase(self, name: str, fn, *, need_pkg: str | None = None):
        """Run ``fn()`` (returns the phase record, or ``(record, value)``) unless skipped; record it."""
        rec, value = None, None
        if name in self.skip:
            rec = {"status": "skipped", "reason": "--skip"}
        elif need_pkg and self.doc["env"].get(need_pkg) is None:
            rec = {"status": "skipped", "reason": f"{need_pkg} is not importable here (docs/benchmarks.md: carry its wheel)"}
        elif not self.args.tiny and self.left() < NEED_S[name]:
            rec = {"status": "skipped", "reason": f"budget: {self.left():.0f} s left, the phase needs ~{NEED_S[name]} s"}
        if rec is None:
            t0 = time.perf_counter()
            print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
            try:
                out = fn()
                rec, value = out if isinstance(out, tuple) else (out, None)
                rec.setdefault("status", "ok")
            except Exception as e:  # noqa: BLE001 - one phase's failure must not lose the others
                rec = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500],
                       "traceback": traceback.format_exc()[-3000:]}
            rec["seconds"] = round(time.perf_counter() - t0, 2)
        self.doc["phases"][name] = rec
        print(f"[gpu_check] {name}: {rec['status']} {rec.get('reason', '')}", file=sys.stderr, flush=True)
        self.write()
        return value


def main(argv=None) -> int:
    a = parse(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    from pipelines.ingest.models import load_model

    run = Run(a)
    run.doc["device"] = str(dev)
    torch.manual_seed(0)
    model = load_model(a.model, a.weights, a.classes).to(dev).eval()
    configs = a.configs.split(",")
    xc, yc = parts.make_data(a.classes, a.size, a.check_images, dev, seed=1)
    check_batches = [(xc[i:i + a.batch], yc[i:i + a.batch]) for i in range(0, a.check_images, a.batch)]
    got = run.phase("check", lambda: _check(model, check_batches, configs))
    stats, basis = got if got is not None else (None, None)
    x, y = parts.make_data(a.classes, a.size, a.batch, dev)
    if basis is not None:
        run.phase("passes", lambda: {"configs": parts.time_passes(model, x, y, basis, configs, a.batches, a.warmup,
                                                                  run.deadline - 200)})
    else:  # the passes and the MC forward start from the check's statistics and basis: say so, not vanish
        for name in ("passes", "mc_forward"):
            run.doc["phases"][name] = {"status": "skipped", "reason": "needs the check's statistics and basis (the check was skipped or ended in an error)"}
    run.phase("kronfluence", lambda: parts.time_kronfluence(model, x, y, a.batches, a.warmup, run.deadline - 120),
              need_pkg="kronfluence")
    if stats is not None:
        xe, _ = parts.make_data(a.classes, a.size, a.eval_images, dev, seed=2)
        run.phase("mc_forward", lambda: parts.time_mc_forward(model, stats, basis, xe, a.mc, a.eval_batch, a.repeats))
    run.phase("cuda_tests", lambda: run_cuda_tests(run.doc["env"], max(30.0, run.left())))
    run.doc["summary"] = summary(run.doc)
    run.write()
    print(json.dumps(run.doc["summary"], indent=1))
    return 0


def _check(model, batches, configs):
    rec, stats, basis = parts.precision_check(model, batches, list(dict.fromkeys(["fp32_default", *configs])))
    rec["status"] = "ok" if rec["ok"] else "failed"
    return rec, (stats, basis)


def summary(doc: dict) -> dict:
    """The figures RESULTS.md records: img/s per pass and config, kronfluence's, the check."""
    ph = doc["phases"]
    out = {"device": doc.get("device"), "check_ok": ph.get("check", {}).get("ok"),
           "phases": {k: v["status"] for k, v in ph.items()}}
    for cfg, rec in ph.get("passes", {}).get("configs", {}).items():
        out[f"pass1_{cfg}_img_s"] = rec["pass1"]["img_per_s"]
        out[f"efb_{cfg}_img_s"] = rec["efb"]["img_per_s"]
    kron = ph.get("kronfluence", {})
    if kron.get("status") == "ok":
        out["kron_bf16_covariance_img_s"] = kron["covariance"]["img_per_s"]
        out["kron_bf16_lambda_img_s"] = kron["lambda"]["img_per_s"]
    mc = ph.get("mc_forward", {})
    for prec in ("plain_fp32", "fp32", "bf16"):
        if prec in mc:
            out[f"mc_{prec}_img_s"] = mc[prec]["img_per_s"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
