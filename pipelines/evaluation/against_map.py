"""Does a method's chosen ``(N, τ)`` beat MAP on the validation split it was chosen on? (issue #38)

The search picks, per method, the configuration with the smallest validation objective; that
configuration can still be worse than the MAP model itself (a posterior so broad that its
sampled weights hurt). :func:`judge_shard` scores MAP and each method's chosen configuration on
the **same validation images** with the **same draws** as the search (the predictor of
:func:`pipelines.evaluation.predictors.make_predictor`, seeded ``(cfg.seed, t)``), keeps the
per-image terms (:class:`laplace_core.metrics.perimage.PerImage`) and runs the paired bootstrap
of the test verdict (:func:`laplace_core.metrics.bootstrap.bootstrap`, ``cfg.seed``) on them.
A method *improved* over MAP when its paired NLL interval lies below ``-MIN_GAIN`` (a gain of
less than 10^-4 nats per image is the MAP limit within MC noise: at τ = 10^8 the draws move the
weights by ~10^-4 and can lower a confident model's NLL by ~10^-8, "significantly" so over 400
images); otherwise it is marked
with :func:`not_better_line`: ``"no configuration of <method> improved validation NLL over MAP
(best Δ = +x [a, b])"``, which run.json, the log, the report and its verdict show.

:func:`judge` is the same on the search's chunks in one Ray task (the model and the chosen
methods' posteriors loaded once).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from laplace_core.metrics.bootstrap import bootstrap
from laplace_core.metrics.perimage import PerImage, per_image_terms

from pipelines.errors import StageError
from pipelines.evaluation.chunks import iter_chunks
from pipelines.evaluation.predictors import MAP, make_predictor, predict_chunk
from pipelines.evaluation.runtime import SearchConfig
from pipelines.storage.store import RunStore

__all__ = ["RESAMPLES", "MIN_GAIN", "judge_terms", "not_better_line", "judge_shard", "judge"]

#: Paired bootstrap resamples over the validation images (as the test verdict's default).
RESAMPLES = 1000
#: Nats per image: the paired interval's upper end must lie below ``-MIN_GAIN`` to be an improvement.
MIN_GAIN = 1e-4


def not_better_line(method: str, verdict: Mapping[str, Any] | None) -> str:
    """The mark of a method whose chosen configuration did not beat MAP on validation ("" if it did)."""
    if verdict is None:
        return f"no configuration of {method} improved validation NLL over MAP (no configuration could be scored)"
    if verdict.get("improved"):
        return ""
    d, lo, hi = (float(verdict[k]) for k in ("diff", "lo", "hi"))
    # 4 decimals, or up to 6 so that the interval's larger end shows two significant figures: a
    # converged model's validation NLL of 0.0083 read "-0.0000 [-0.0001, +0.0000]" at 4
    top = max(abs(d), abs(lo), abs(hi))
    k = 4 if top == 0 or not math.isfinite(top) else min(6, max(4, 1 - math.floor(math.log10(top))))
    # an interval wholly below 0 but above -MIN_GAIN reads like a gain: say why it is not one
    limit = f"; a gain under {MIN_GAIN:g} nats per image is the MAP limit" if -MIN_GAIN <= hi < 0 else ""
    return (f"no configuration of {method} improved validation NLL over MAP "
            f"(best Δ = {d:+.{k}f} [{lo:+.{k}f}, {hi:+.{k}f}]{limit})")


def judge_terms(map_per: PerImage, per: PerImage, method: str, resamples: int = RESAMPLES,
                seed: int = 0) -> dict[str, Any]:
    """``{"diff", "lo", "hi", "n", "resamples", "map_nll", "nll", "improved", "mark"}``: the paired
    bootstrap of the NLL difference ``method − MAP`` over the same images (negative: the method
    is better; ``improved``: ``hi < -MIN_GAIN``)."""
    got = bootstrap({MAP: map_per, method: per}, resamples, seed, (MAP,))
    p = got[method]["paired"][MAP]["nll"]
    out = {"diff": float(p["diff"]), "lo": float(p["lo"]), "hi": float(p["hi"]), "n": int(got[method]["n"]),
           "resamples": resamples, "map_nll": float(got[MAP]["point"]["nll"]),
           "nll": float(got[method]["point"]["nll"]),
           "improved": bool(p["hi"] < -MIN_GAIN and math.isfinite(p["diff"]))}
    out["mark"] = not_better_line(method, out)
    return out


def _terms(probs: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    lp = torch.log(probs.detach().to(device="cpu", dtype=torch.float64).clamp_min(1e-300))
    return per_image_terms(lp, y)


def _predictors(model: nn.Module, posteriors: Mapping[str, Any], chosen: Mapping[str, Mapping[str, Any] | None],
                cfg: SearchConfig) -> dict[str, Any]:
    """``method -> predictor`` at each chosen ``(N, τ)`` with its chosen predictive (``c["pred_type"]``,
    else ``cfg.pred_type``) and the search's draws."""
    from laplace_core.posteriors.build import with_hyper

    out = {}
    for m, c in chosen.items():
        if c is None or m not in posteriors:
            continue
        post = with_hyper(posteriors[m], float(c["n_data"]), float(c["prior_precision"]))
        out[m] = make_predictor(model, post, c.get("pred_type") or cfg.pred_type, cfg.mc_samples, cfg.seed, 0)
    return out


def judge_chunks(model: nn.Module, posteriors: Mapping[str, Any], chosen: Mapping[str, Mapping[str, Any] | None],
                 chunks: Iterable[Any], cfg: SearchConfig) -> dict[str, dict[str, Any] | None]:
    """:func:`judge_terms` of every method of ``chosen`` over ``chunks`` (``pipelines.evaluation.chunks.Chunk``);
    ``None`` for a method with nothing chosen."""
    preds = _predictors(model, posteriors, chosen, cfg)
    per = {m: PerImage() for m in [MAP, *preds]}
    with torch.no_grad():
        for chunk in chunks:
            y = torch.cat(chunk.ys)
            per[MAP] = per[MAP].add(_terms(torch.cat(predict_chunk(model, None, chunk)), y), ood=False)
            for m, pred in preds.items():
                per[m] = per[m].add(_terms(torch.cat(predict_chunk(model, pred, chunk)), y), ood=False)
    return {m: judge_terms(per[MAP], per[m], m, RESAMPLES, cfg.seed) if m in preds else None for m in chosen}


def judge_shard(model: nn.Module, posteriors: Mapping[str, Any], chosen: Mapping[str, Mapping[str, Any] | None],
                batches: Iterable[Any], cfg: SearchConfig) -> dict[str, dict[str, Any] | None]:
    """:func:`judge_chunks` over ``(x, y)`` batches in one process (the search's :func:`search_shard`'s input)."""
    chunks = iter_chunks(batches, cfg.batch_size, cfg.batches_per_chunk, dtype=cfg.torch_dtype,
                         device=cfg.resolved_device)
    return judge_chunks(model, posteriors, chosen, chunks, cfg)


def judge(model: Mapping[str, Any], uris: Mapping[str, str], chosen: Mapping[str, Mapping[str, Any] | None],
          chunks: Sequence[Any], cfg: SearchConfig, store: RunStore = RunStore()) -> dict[str, dict[str, Any] | None]:
    """:func:`judge_chunks` on the search's chunk refs (:func:`pipelines.evaluation.tune.chunk_refs`), in one Ray task."""
    import ray

    from pipelines.evaluation.actors import await_round

    @ray.remote(num_cpus=cfg.cpus_per_actor, num_gpus=cfg.gpus_per_actor)
    def run(model, uris, chosen, chunks, cfg, store):
        from pipelines.evaluation.actors import ModelActor
        from pipelines.evaluation.chunks import load_chunk

        actor = ModelActor(model, {m: u for m, u in uris.items() if chosen.get(m) is not None}, None, cfg, store)
        if actor.init_error is not None:
            raise StageError(f"validation against MAP: {actor.init_error}")
        chunks_ = (load_chunk(ray.get(r), cfg.resolved_device) for r in chunks)
        return judge_chunks(actor.model, actor.posteriors, chosen, chunks_, cfg)

    return await_round([run.remote(dict(model), dict(uris), dict(chosen), list(chunks), cfg, store)], (), cfg,
                       "validation against MAP")[0]
