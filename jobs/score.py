"""Score new images with a finished run's posterior, as a Ray job::

    ray job submit --working-dir . -- python jobs/score.py --run s3://bucket/runs/r50 \
        --data s3://bucket/new-images --output s3://bucket/scores/r50-week42

The same command as ``infoform score`` (:mod:`pipelines.cli.score_cmd`): one Parquet row per image
with the predicted class, top-k, predictive entropy, expected entropy, mutual information and a flag.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # `python jobs/score.py` from a checkout or a Ray job's working dir
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipelines.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["score", *sys.argv[1:]]))
