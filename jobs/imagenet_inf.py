"""Laplace posteriors in the sparse information form + calibration/OOD audit, on Ray.

    ray job submit --working-dir . -- python jobs/imagenet_inf.py --preset imagenet-resnet50 \
        --data s3://bucket/imagenet --weights s3://bucket/resnet50.pt --output s3://bucket/runs/r50

With no data arguments it runs the embedded ``demo`` preset on a local Ray instance.
Thin on purpose: parse -> frozen config -> ``ray.init()`` -> ``pipelines.cli.run`` -> print
where the report is. ``infoform run`` is the same entry point (``pipelines.cli.main``).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # `python jobs/imagenet_inf.py` from a checkout or a Ray job's working dir
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipelines.cli.main import config_from_args, get_args_parser, run_job  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(run_job())
