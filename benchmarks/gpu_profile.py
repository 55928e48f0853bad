"""Where pass 1's time goes on one GPU (issue 42's follow-up): torch.profiler over pass 1 of
resnet50 (``--model``) at 224x224, batch 64, per precision config, the top CUDA kernels and Python-level ops.

    python benchmarks/gpu_profile.py --out $OUT/profile.txt      # on the device machine (CUDA)
    python benchmarks/gpu_profile.py --device cpu --model tiny_cnn --classes 10 --size 16 --batch 4 \
        --batches 1 --configs fp32_default --out /tmp/p.txt          # CPU, seconds (tests/benchmarks)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check_parts as parts  # noqa: E402
from laplace_core.curvature.keyed_rng import KeyedSampler  # noqa: E402
from laplace_core.curvature.collect import collect_statistics  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="profile.txt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--configs", default="fp32_tf32,bf16_tf32")
    a = p.parse_args(argv)
    from pipelines.ingest.models import load_model
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = load_model(a.model, None, a.classes).to(dev).eval()
    x, y = parts.make_data(a.classes, a.size, a.batch, dev)
    sync = parts.syncer(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    lines = []
    for config in a.configs.split(","):
        _, mm, cudnn = parts.CONFIGS[config]
        opts = parts.pass_options(config, model)
        with parts.tf32(mm, cudnn):
            collect_statistics(model, parts.TimedBatches(x, y, 1, sync), generator=KeyedSampler(0), **opts)  # warm-up
            with profile(activities=acts) as prof:
                collect_statistics(model, parts.TimedBatches(x, y, a.batches, sync), generator=KeyedSampler(0), **opts)
                sync()
        lines.append(f"==== {config} {opts} {a.batches} batches of {a.batch}")
        lines.append(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
        lines.append(prof.key_averages(group_by_stack_n=0).table(sort_by="cpu_time_total", row_limit=15,
                                                                 max_name_column_width=70))
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
