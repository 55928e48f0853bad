"""Temperature scaling (Guo et al. 2017): the ``temperature`` row, a calibration baseline without a posterior.

The predictive is ``softmax(f(x; θ*) / T)`` with one scalar ``T > 0`` fitted by NLL on the
search split (the held-out split the ``(N, τ)`` search scores on). With ``β = 1/T`` and the
MAP logits ``z_i`` of the ``n`` search examples, the objective

    ``L(β) = (1/n) Σ_i [ logsumexp(β z_i) − β z_{i, y_i} ]``

is convex in ``β``: ``L'(β) = (1/n) Σ_i (E_{p_β}[z_i] − z_{i, y_i})`` and
``L''(β) = (1/n) Σ_i Var_{p_β}[z_i] >= 0`` (the mean and variance of the logits under
``p_β = softmax(β z_i)``). :func:`fit_temperature` finds the root of ``L'`` by Newton steps
safeguarded by bisection inside a bracket ``β ∈ [1/T_max, 1/T_min]``, in float64, to
``|L'| <= 1e-13 · (1 + scale)`` (deterministic: no random start, the rows are put in a
canonical order first so the sums do not depend on the actors' sharding). When the
minimum lies outside the bracket (e.g. every search example already correct with a
margin, where ``L`` keeps decreasing as ``T → 0``) the bound is returned and ``at_bound``
says so.

:func:`fit_temperature_run` is the stage's part: the MAP logits of the search split are
computed from the search's own chunks (:func:`pipelines.evaluation.tune.chunk_refs`: the split
read and decoded once, in the same fixed-size batches as the search and the evaluation) by up to
``cfg.num_actors`` Ray tasks (:func:`chunk_logits`), gathered on the driver (``n x C`` numbers:
80 MB in float64 for a 10,000-image ImageNet search split) and fitted there
(:func:`with_fallback`: ``T = 1`` on a separable split); with ``output`` the fit is written to
``<output>/eval/temperature/temperature.json``.
:class:`TemperaturePredictor` is what the evaluation actors predict with.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from laplace_core.posteriors.methods import TEMPERATURE, method_info
from pipelines.evaluation.actors import ActorProgress, await_round
from pipelines.evaluation.chunks import load_chunk
from pipelines.evaluation.predictors import model_ref
from pipelines.evaluation.runtime import RuntimeFields, eval_uri
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["T_BOUNDS", "FEW_ERRORS", "temperature_nll", "fit_temperature", "with_fallback", "TemperaturePredictor", "chunk_logits",
           "fit_temperature_run", "temperature_file", "load_temperature"]

#: The bracket of ``T`` (``β = 1/T`` is searched in ``[1/T_max, 1/T_min]``).
T_BOUNDS = (1e-3, 1e3)


def _moments(z: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[float, float, float]:
    """``(L(β), L'(β), L''(β))`` of the module docstring, float64."""
    s = beta * z
    lse = torch.logsumexp(s, dim=1)
    p = torch.exp(s - lse[:, None])
    zy = z.gather(1, y[:, None]).squeeze(1)
    mean = (p * z).sum(1)
    var = (p * (z - mean[:, None]) ** 2).sum(1)
    n = z.shape[0]
    return float((lse - beta * zy).sum() / n), float((mean - zy).sum() / n), float(var.sum() / n)


def temperature_nll(logits: Any, labels: Any, temperature: float) -> float:
    """Mean NLL of ``softmax(logits / T)`` (float64)."""
    z = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    return _moments(z, y, 1.0 / float(temperature))[0]


def _canonical(z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows in an order that does not depend on how the actors split them."""
    order = np.lexsort((z[:, 0], z.sum(axis=1), z.max(axis=1), y))
    return z[order], y[order]


#: Fewer misclassified fitting examples than this: the fit's note says T rests on few mistakes (the
#: demo's converged CNN gets 1 of 269 wrong; its T = 0.27 takes the test NLL from 0.080 to 0.237)
FEW_ERRORS = 10


def fit_temperature(logits: Any, labels: Any, bounds: tuple[float, float] = T_BOUNDS,
                    max_iter: int = 200) -> dict[str, Any]:
    """The NLL-optimal temperature of ``logits`` ``[n, C]`` with integer ``labels`` ``[n]``.

    Returns ``{"temperature", "log_temperature", "nll_before"`` (at ``T = 1``),
    ``"nll_after", "count", "iterations", "at_bound"}``. Safeguarded Newton on the convex
    ``L(β)`` (module docstring); ``ValueError`` for empty, non-finite or mismatched input.
    """
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if z.ndim != 2 or y.shape != (z.shape[0],) or z.shape[0] == 0:
        raise ValueError(f"temperature fit needs logits [n, C] and labels [n] with n >= 1, got "
                         f"{z.shape} and {y.shape}")
    if not np.isfinite(z).all():
        raise ValueError("temperature fit: the MAP logits are not all finite")
    if y.min() < 0 or y.max() >= z.shape[1]:
        raise ValueError(f"temperature fit: labels outside [0, {z.shape[1]})")
    t_lo, t_hi = (float(b) for b in bounds)
    if not 0 < t_lo < 1 < t_hi:
        raise ValueError(f"temperature bounds must satisfy 0 < T_min < 1 < T_max, got {bounds!r}")
    z, y = _canonical(z, y)
    zt, yt = torch.from_numpy(z), torch.from_numpy(y)
    lo, hi = 1.0 / t_hi, 1.0 / t_lo  # bracket of β
    scale = float(np.abs(z).max()) + 1.0
    tol = 1e-13 * scale
    at_bound, it = False, 0
    g_lo, g_hi = _moments(zt, yt, lo)[1], _moments(zt, yt, hi)[1]
    if g_lo >= 0:  # L increasing over the whole bracket: the largest T
        beta, at_bound = lo, True
    elif g_hi <= 0:  # L decreasing over the whole bracket: the smallest T
        beta, at_bound = hi, True
    else:
        beta = 1.0
        for it in range(1, max_iter + 1):
            _, g, h = _moments(zt, yt, beta)
            if abs(g) <= tol:
                break
            if g < 0:
                lo = beta
            else:
                hi = beta
            step = beta - g / h if h > 0 else math.nan
            beta = step if lo < step < hi else math.sqrt(lo * hi)  # bisection in log β when Newton leaves
            if hi - lo <= 1e-15 * hi:
                break
    T = 1.0 / beta
    errors = int((zt.argmax(1) != yt).sum())
    out = {"temperature": T, "log_temperature": math.log(T), "nll_before": _moments(zt, yt, 1.0)[0],
           "nll_after": _moments(zt, yt, beta)[0], "count": int(z.shape[0]), "errors": errors, "iterations": it,
           "at_bound": at_bound, "note": ""}
    if at_bound and beta == hi:
        out["note"] = (f"the NLL keeps falling as T -> 0 (the MAP network classifies the {z.shape[0]} fitting "
                       f"examples correctly with a margin), so T stops at its bound {t_lo:g}: fit it on more examples")
    elif at_bound:
        out["note"] = f"the NLL keeps falling as T grows, so T stops at its bound {t_hi:g}"
    elif errors < FEW_ERRORS:
        out["note"] = (f"only {errors} of the {z.shape[0]} fitting examples {'is' if errors == 1 else 'are'} "
                       f"misclassified, so T is set by few "
                       f"mistakes and may not carry over to the test split (its row says whether it does)")
    return out


def with_fallback(fit: Mapping[str, Any]) -> dict[str, Any]:
    """The ``T`` the evaluation uses (``docs/design.md``, "Temperature scaling on a separable split").

    When the search split's NLL has no minimiser inside the bracket because it keeps falling as
    ``T -> 0`` (every search image right with a margin: a *separable* split), the fit's
    ``T = T_min`` would turn the row into hard 0/1 predictions whose test NLL is huge on the
    first mistake. The row then falls back to ``T = 1`` (the MAP probabilities unchanged);
    a held-out part of the split would not help: every part of a separable split is separable.
    Returns the fit with ``temperature`` (used), ``temperature_fit`` (the fit's ``T``) and
    ``fallback`` (one line saying why, ``""`` when none)."""
    out = dict(fit)
    out["temperature_fit"] = fit["temperature"]
    out["fallback"] = ""
    if fit.get("at_bound") and fit["temperature"] < 1.0:
        out["temperature"], out["log_temperature"] = 1.0, 0.0
        out["nll_after"] = out["nll_before"]
        out["fallback"] = (f"temperature scaling: the search split is separable (its NLL keeps falling as T -> 0, "
                           f"the fit stops at T = {fit['temperature']:g}), so the temperature row uses T = 1 "
                           f"(MAP's probabilities) instead of hard 0/1 predictions")
    return out


class TemperaturePredictor:
    """``softmax(f(x; θ*) / T)`` per batch (the evaluation's ``temperature`` row)."""

    def __init__(self, model: nn.Module, temperature: float):
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
        self.model, self.temperature = model, float(temperature)

    def predict_batches(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [torch.softmax(self.model(x) / self.temperature, dim=-1) for x in xs]

    def predict_batches_stats(self, xs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, None]]:
        """``(log_softmax(f(x; θ*) / T)`` float64, no draws) per batch: the exact log-probabilities."""
        with torch.no_grad():
            return [(torch.log_softmax(self.model(x).to(torch.float64) / self.temperature, dim=-1), None)
                    for x in xs]


def chunk_logits(model_spec: Any, chunks: Sequence[Any], cfg: RuntimeFields,
                 store: RunStore = RunStore()) -> tuple[np.ndarray, np.ndarray]:
    """The MAP logits ``[n, C]`` and labels ``[n]`` of the search's chunks (object refs of
    :func:`pipelines.evaluation.tune.chunk_refs`), each of up to ``cfg.num_actors`` Ray tasks
    taking a contiguous share of them (no actor, no second read of the split)."""
    import ray

    k = max(1, min(int(cfg.num_actors), len(chunks)))
    shares = [list(chunks[i * len(chunks) // k:(i + 1) * len(chunks) // k]) for i in range(k)]
    task_cfg = dataclasses.replace(cfg, num_actors=k)  # the progress estimate counts the tasks that run

    @ray.remote(num_cpus=cfg.cpus_per_actor, num_gpus=cfg.gpus_per_actor)
    def logits(model, refs, cfg, store, index):
        from pipelines.evaluation.predictors import load_eval_model

        torch.set_num_threads(cfg.threads)
        net = load_eval_model(model, dtype=cfg.torch_dtype, device=cfg.resolved_device, store=store,
                              precision=cfg.precision)
        prog = ActorProgress("temperature", index, cfg, splits=("search",))
        zs, ys = [], []
        with torch.no_grad():
            for ref in refs:
                c = load_chunk(ray.get(ref), cfg.resolved_device)
                for x, y, n in zip(c.xs, c.ys, c.sizes):
                    zs.append(net(x)[:n].detach().cpu().numpy())
                    ys.append(y.numpy())
                prog(0, c.count)
        return (np.concatenate(zs), np.concatenate(ys)) if zs else (np.zeros((0, 0)), np.zeros(0, dtype=np.int64))

    refs = [logits.remote(dict(model_ref(model_spec)), share, task_cfg, store, i) for i, share in enumerate(shares)]
    parts = [p for p in await_round(refs, (), cfg, "temperature logits") if len(p[1])]
    if not parts:
        return np.zeros((0, 0)), np.zeros(0, dtype=np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def temperature_file(output: str) -> str:
    """``<output>/eval/temperature/temperature.json``."""
    return storage.join(eval_uri(output, TEMPERATURE), "temperature.json")


def fit_temperature_run(model_spec: Any, chunks: Sequence[Any], cfg: RuntimeFields, *, skipped: int = 0,
                        store: RunStore = RunStore()) -> dict[str, Any]:
    """Fit ``T`` on the search split's ``chunks`` (:func:`pipelines.evaluation.tune.chunk_refs`,
    ``skipped`` images left out of them): MAP logits by :func:`chunk_logits`,
    :func:`fit_temperature` on the driver. Returns the fit plus ``num_stored`` (1),
    ``skipped``, ``wall_s``; with the store's output also writes :func:`temperature_file`."""
    t0 = time.perf_counter()
    z, y = chunk_logits(model_spec, chunks, cfg, store)
    if not len(y):
        raise ValueError("temperature scaling: the search split has no valid image to fit T on")
    fit = with_fallback(fit_temperature(z.astype(np.float64), y))
    fit.update(method=TEMPERATURE, split="search", num_stored=method_info(TEMPERATURE).num_stored,
               skipped=int(skipped), wall_s=time.perf_counter() - t0)
    if store.output is not None:
        store.write_json_atomic(temperature_file(store.output), fit)
    return fit


def load_temperature(store: RunStore) -> float:
    """The fitted ``T`` of a run (:func:`temperature_file`)."""
    return float(store.read_json(temperature_file(store.output))["temperature"])
