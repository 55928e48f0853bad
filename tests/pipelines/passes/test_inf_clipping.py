"""INF's clipped ``D`` entries at the search's chosen ``(N, τ)``, as the run summary reports them."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from laplace_core.posteriors.build import build_posterior
from pipelines.passes.posterior import inf_clipping_at

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "core"))
from test_structures import synthetic_stats  # noqa: E402


def test_inf_clipping_at_chosen_hyper_matches_a_direct_build(tmp_path):
    stats = synthetic_stats()
    built = build_posterior(stats, "inf", n_data=1e-3, prior_precision=1.0)
    assert built.info["clipped_D"] == 0 and built.info["diag_rel_error"] == 0.0
    uri = str(tmp_path / "inf")
    built.save(uri)
    got = inf_clipping_at(uri, 1e4, 0.5)
    direct = build_posterior(stats, "inf", n_data=1e4, prior_precision=0.5).info
    assert got["clipped_D"] == direct["clipped_D"] > 0
    total = sum(m * n for m, n in (stats.infos[k].shape for k in stats.infos))
    assert got["clipped_D_fraction"] == pytest.approx(direct["clipped_D"] / total)
    assert got["diag_rel_error"] == pytest.approx(direct["diag_rel_error"], rel=1e-9) and got["diag_rel_error"] > 0
    assert (got["n_data"], got["prior_precision"]) == (1e4, 0.5)
    assert torch.isfinite(torch.tensor(got["diag_rel_error"]))
