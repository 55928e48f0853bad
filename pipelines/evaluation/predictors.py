"""What the search and evaluation actors predict with (``docs/design.md`` §1 "Predictive").

* :func:`model_ref` / :func:`load_eval_model`: the model an actor loads (a name and a
  weights URI, ``pipelines.ingest.models.load_model``), in eval mode, cast and placed;
* :func:`load_posteriors`: ``method -> Posterior`` from artifact URIs, optionally
  re-targeted to ``(N, τ)`` with ``laplace_core.posteriors.build.with_hyper``;
* :func:`make_predictor`: the predictive of a posterior, ``"nn"`` (MC over weight
  samples) or ``"glm"`` (MC-GLM; for a posterior over the last linear layer alone,
  ``posterior.layers: last``, the logit covariance in closed form,
  :class:`laplace_core.predictive.last_layer.LastLayerGLMPredictor`); sample ``t`` is drawn from ``(seed, t)``;
* :func:`predict_chunk`: the probabilities of the real rows of a chunk of fixed-size
  batches (``pipelines.evaluation.chunks``), MAP when no predictor is given.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from pipelines.config.choices import PRED_TYPES
from pipelines.storage.store import RunStore

__all__ = [
    "PRED_TYPES",
    "MAP",
    "check_pred_type",
    "make_predictor",
    "model_ref",
    "load_eval_model",
    "in_precision",
    "load_posteriors",
    "finite_or_reason",
    "predict_chunk",
    "predict_chunk_stats",
]

_PLANNED_PRED_TYPES: tuple[str, ...] = ()
#: Name of the MAP baseline in every result dict.
MAP = "map"


# --------------------------------------------------------------------------- predictors
def make_predictor(model: nn.Module, post: Any, pred_type: str, mc_samples: int, seed: int, cache_bytes: int):
    """``MCPredictor`` (``"nn"``: weight sampling) or ``GLMPredictor`` (``"glm"``: MC-GLM,
    Banerjee et al. Alg. 4, one JVP per sample); both draw sample ``t`` from ``(seed, t)``.
    ``"glm"`` on a posterior over the last ``nn.Linear`` alone: ``LastLayerGLMPredictor``
    (closed-form logit covariance, no weight sampling; MC-GLM where its output is not the logits)."""
    check_pred_type(pred_type)
    if pred_type == "nn":
        from laplace_core.predictive.monte_carlo import MCPredictor

        return MCPredictor(model, post, mc_samples, seed, cache_bytes=cache_bytes)
    if pred_type == "glm":
        from laplace_core.predictive.glm import GLMPredictor
        from laplace_core.predictive.last_layer import LastLayerGLMPredictor, last_linear_layer

        sampled = GLMPredictor(model, post, mc_samples, seed, link="mc", variance="mc", cache_bytes=cache_bytes)
        if last_linear_layer(model, post) is not None:
            return LastLayerGLMPredictor(model, post, mc_samples, seed, link="mc", fallback=sampled)
        return sampled
    raise ValueError(f"unknown pred_type {pred_type!r}; valid: {', '.join(PRED_TYPES)}")  # pragma: no cover


def check_pred_type(pred_type: str) -> None:
    """``ValueError`` for an unknown or not-yet-implemented predictive type."""
    if pred_type in _PLANNED_PRED_TYPES:
        raise ValueError(
            f"pred_type {pred_type!r} (linearised predictive) is not implemented yet; valid now: {', '.join(PRED_TYPES)}"
        )
    if pred_type not in PRED_TYPES:
        raise ValueError(f"unknown pred_type {pred_type!r}; valid: {', '.join(PRED_TYPES)}")


# --------------------------------------------------------------------------- loading
def model_ref(spec: Any) -> dict[str, Any]:
    """``{"name", "weights", "num_classes"}`` from a ``pipelines.config.schema.ModelSpec``-like object
    or a mapping (what actors receive; they call ``load_model`` with it)."""
    if isinstance(spec, Mapping):
        get = spec.get
    else:
        get = lambda k, d=None: getattr(spec, k, d)  # noqa: E731
    name = get("name")
    if not name or not isinstance(name, str):
        raise ValueError(f"model spec needs a model name, got {spec!r}")
    return {"name": name, "weights": get("weights"), "num_classes": get("num_classes")}


def load_eval_model(ref: Mapping[str, Any], *, dtype: torch.dtype, device: str,
                    store: RunStore = RunStore(), precision: str = "fp32") -> nn.Module:
    """``load_model(name, weights, num_classes)`` in eval mode, cast to ``dtype``, on ``device``,
    its forward run in ``precision`` (:func:`in_precision`)."""
    from pipelines.ingest.models import load_model

    model = load_model(ref["name"], ref.get("weights"), ref.get("num_classes"), options=store.options)
    return in_precision(model.to(device=device, dtype=dtype).eval(), precision)


def in_precision(model: nn.Module, precision: str) -> nn.Module:
    """``model`` whose forward runs under ``torch.autocast`` in ``precision`` (``"bf16"``,
    ``"fp16"``) and returns float32 outputs; ``"fp32"``: ``model`` untouched (bit for bit).

    Only the forward is wrapped (an instance attribute, so the module names and the
    posterior's layer names stay the same): the MC predictive's weight draws are formed
    before the forward, in the posterior's dtype, and applied inside it, in the compute
    dtype; the predictive averages the probabilities and the metrics sum in float64
    (docs/design.md, the dtype table). The GLM predictives stay in fp32 (the config
    refuses them with another precision)."""
    from laplace_core.curvature.batch_loop import PRECISIONS

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    half = PRECISIONS[precision]
    if half is None:
        return model
    inner = model.forward
    device_type = next(model.parameters()).device.type

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=half):
            out = inner(*args, **kwargs)
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    model.forward = forward
    return model


def load_posteriors(uris: Mapping[str, str], hyper: Mapping[str, Sequence[float]] | None = None,
                    store: RunStore = RunStore()) -> dict[str, Any]:
    """``method -> Posterior`` from artifact URIs; ``hyper[method] = (N, τ)`` re-targets a
    posterior with ``laplace_core.posteriors.build.with_hyper`` (no eigendecomposition redone)."""
    from laplace_core.posteriors.structures.base import load_posterior
    from laplace_core.posteriors.build import with_hyper

    out = {}
    for method, uri in uris.items():
        if method == MAP:
            raise ValueError(f"{MAP!r} is the baseline and always evaluated; do not pass a posterior under that name")
        post = load_posterior(uri, store.fsspec_options(uri))
        if hyper and method in hyper and hyper[method] is not None:
            n_data, tau = hyper[method]
            post = with_hyper(post, n_data, tau)
        out[method] = post
    if hyper:
        unknown = sorted(set(hyper) - set(uris))
        if unknown:
            raise ValueError(f"hyper given for methods without a posterior: {unknown}; posteriors: {sorted(uris)}")
    return out


# --------------------------------------------------------------------------- predictions
def finite_or_reason(p: torch.Tensor) -> str:
    """``""`` when every entry of ``p`` is finite, else the reason (how many are NaN/inf)."""
    if bool(torch.isfinite(p).all()):
        return ""
    return f"non-finite predictions ({int((~torch.isfinite(p)).sum())} entries NaN/inf)"


def predict_chunk(model: nn.Module, predictor: Any, chunk: Any) -> list[torch.Tensor]:
    """Probabilities of the real rows of each batch of ``chunk`` (a
    :class:`pipelines.evaluation.chunks.Chunk`): MAP when ``predictor`` is None."""
    from laplace_core.predictive.monte_carlo import map_predict

    if predictor is None:
        probs = [map_predict(model, x) for x in chunk.xs]
    else:
        probs = predictor.predict_batches(chunk.xs)
    return [p[:n].detach().cpu() for p, n in zip(probs, chunk.sizes)]


def predict_chunk_stats(model: nn.Module, predictor: Any, chunk: Any) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """``(log p [n, C] float64, E_t H(p_t) [n] or None, exact)`` of the real rows of ``chunk``.

    Log-probabilities come exactly from the logits: ``log_softmax`` for MAP (and
    ``predictor.predict_batches_stats`` of a temperature predictor), log-mean-exp over the
    draws for MC / MC-GLM predictors (:class:`laplace_core.predictive.monte_carlo.DrawStats`). A predictor
    that gives only probabilities: ``log max(p, NLL_EPS)`` and ``exact = False``."""
    from laplace_core.metrics.base import NLL_EPS

    if predictor is None:
        with torch.no_grad():
            stats = [(torch.log_softmax(model(x).to(torch.float64), dim=-1), None) for x in chunk.xs]
    else:
        fn = getattr(predictor, "predict_batches_stats", None)
        stats = fn(chunk.xs) if fn is not None else None
    if stats is None:
        probs = torch.cat(predict_chunk(model, predictor, chunk)).to(torch.float64)
        return torch.log(probs.clamp_min(NLL_EPS)), None, False
    lps = [lp[:n].detach().cpu() for (lp, _), n in zip(stats, chunk.sizes)]
    ents = [None if e is None else e[:n].detach().cpu() for (_, e), n in zip(stats, chunk.sizes)]
    ent = None if any(e is None for e in ents) else torch.cat(ents)
    return torch.cat(lps), ent, True
