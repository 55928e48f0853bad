"""Per-image predictive and uncertainty columns of one batch (``infoform score`` and
``load_run(...).predict``), computed with the evaluation's predictors
(:func:`pipelines.evaluation.predictors.make_predictor`), so the probabilities are the audit's.

For a sampled predictive (``nn`` weight samples, ``glm`` MC-GLM or the last-layer closed form)
with per-sample probabilities ``p_t`` (``t < K``, drawn from ``(seed, t)``) and their mean ``p̄``:

* ``entropy``: the predictive entropy ``H[p̄] = -Σ_c p̄_c log p̄_c`` (nats);
* ``expected_entropy``: ``(1/K) Σ_t H[p_t]`` (the aleatoric part);
* ``mutual_information``: ``H[p̄] - (1/K) Σ_t H[p_t]`` (the epistemic part, >= 0);

For the MAP and temperature rows (one probability vector) the last two are NaN. Every row
also has the predicted class, the top-k classes and probabilities and the largest probability.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["UNCERTAINTY_COLUMNS", "entropy", "predict_columns"]

#: The per-image columns :func:`predict_columns` returns (``probs`` besides when asked).
UNCERTAINTY_COLUMNS = ("pred", "topk_classes", "topk_probs", "max_prob", "entropy", "expected_entropy",
                       "mutual_information")


def entropy(p: torch.Tensor) -> torch.Tensor:
    """``-Σ p log p`` over the last axis (``0 log 0 = 0``), in ``p``'s dtype."""
    return -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)


def _probs(model: torch.nn.Module, predictor: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(p̄ [B, C] in the model's dtype, expected entropy [B] float64 or None)``."""
    if predictor is None:  # MAP
        from laplace_core.predictive.monte_carlo import map_predict

        return map_predict(model, x), None
    if hasattr(predictor, "sample_probs"):
        sp = predictor.sample_probs(x)  # [K, B, C] float64
        return sp.mean(0).to(x.dtype), entropy(sp).mean(0)
    return predictor.predict_batches([x])[0], None  # e.g. the temperature row


def predict_columns(model: torch.nn.Module, predictor: Any, x: torch.Tensor, top_k: int = 5,
                    keep_probs: bool = False) -> dict[str, np.ndarray]:
    """The columns of :data:`UNCERTAINTY_COLUMNS` for a batch ``x`` ``[B, ...]`` (numpy, one
    row per image; ``topk_*`` as ``[B, k]``); ``probs`` ``[B, C]`` too when ``keep_probs``.
    ``predictor``: from ``make_predictor`` (``None`` for MAP) or a ``TemperaturePredictor``."""
    with torch.no_grad():
        p, exp_h = _probs(model, predictor, x)
        p = p.detach()
        p64 = p.to(torch.float64)
        h = entropy(p64)
        k = min(int(top_k), p.shape[-1])
        top_p, top_c = torch.topk(p, k, dim=-1)
    nan = torch.full_like(h, float("nan"))
    out = {
        "pred": top_c[:, 0].cpu().numpy().astype(np.int64),
        "topk_classes": top_c.cpu().numpy().astype(np.int64),
        "topk_probs": top_p.cpu().numpy().astype(np.float32),
        "max_prob": top_p[:, 0].cpu().numpy().astype(np.float32),
        "entropy": h.cpu().numpy(),
        "expected_entropy": (nan if exp_h is None else exp_h).cpu().numpy(),
        "mutual_information": (nan if exp_h is None else (h - exp_h).clamp_min(0.0)).cpu().numpy(),
    }
    if keep_probs:
        out["probs"] = p.cpu().numpy()
    return out
