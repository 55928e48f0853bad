"""Predictive distributions: MAP and Monte-Carlo over posterior weight samples.

MC predictive (docs/design.md §1 "Predictive"): for ``t = 0..K-1`` draw ``θ_t = θ* + δ_t``
with ``δ_t ~ N(0, P^{-1})`` from the posterior, and return

    p(y | x) ≈ (1/K) Σ_t softmax(f(x; θ_t))            (average of probabilities)

``δ_t`` is a deterministic function of ``(seed, t)`` and the posterior's device
type only: sample ``t`` is ``posterior.sample(1, g_t)`` with a fresh
``torch.Generator`` seeded by :func:`sample_seed` (a BLAKE2b hash of
``(seed, t)``, stable across processes and Python versions). Every actor, every
batch and every shard therefore sees the same ``θ_t``, whatever the batch order.
Each draw is applied by :func:`laplace_core.predictive.sample_apply.applied`: added to the weights
(``W + δ`` in place, the MAP values restored exactly from saved copies), or, for the
factored draws of KFAC / EFB / exact-prior KFAC on layers that see fewer input columns
than they have outputs, added to the layer's output as ``δ x~`` without forming ``δ``
(the same numbers up to rounding; ``sample_space`` picks, default the cheaper). The model
runs in ``eval()`` mode under ``torch.no_grad()``; the modules' training flags are
restored afterwards.

Memory is flat in ``K``: one sample's deltas and one saved MAP copy (each the size of
the curvature layers' weights) plus one ``[B, C]`` float64 running sum. Trade-off for large data:
``predict(x)`` redraws ``δ_t`` for every batch (``K`` draws per batch; for INF and
Diag a draw costs far less than a forward pass). :meth:`MCPredictor.predict_batches`
instead draws each ``δ_t`` once and loops batches inside (needs a re-iterable
sequence of batches and holds all ``[N, C]`` running sums), and ``cache_bytes``
keeps all ``K`` deltas in memory when they fit that budget. All three give the
same numbers (same ``θ_t``, same summation order over ``t``).

GLM / MC-GLM / probit predictives live elsewhere (not here yet).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..curvature.layers import find_layers, get_matrix
from .sample_apply import SAMPLE_SPACES, applied
from ..posteriors.structures.base import Posterior, ScaleFactors

__all__ = [
    "LIKELIHOODS",
    "sample_seed",
    "sample_generator",
    "draw_sample",
    "draw_sample_factored",
    "map_predict",
    "mc_predict",
    "MCPredictor",
    "eval_mode",
    "quiet_jit_deprecation",
    "DrawStats",
    "draw_stats",
]

LIKELIHOODS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "classification": lambda logits: torch.softmax(logits, dim=-1),
}


def _link(likelihood: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"unknown likelihood {likelihood!r}; valid: {', '.join(LIKELIHOODS)}")
    return LIKELIHOODS[likelihood]


class DrawStats:
    """Exact log-predictive of an average of softmaxes, one draw at a time (float64).

    ``add(logits)`` folds in one draw's logits ``[B, C]``; :meth:`result` returns
    ``(log p̄ [B, C], E_t H(p_t) [B])`` with ``log p̄ = logsumexp_t log_softmax(z_t) − log K``
    (log-mean-exp: no probability is floored, a confident mistake keeps its exact
    ``−log p̄_y``) and the mean entropy of the draws in nats (the aleatoric part: the mutual
    information is ``H(p̄) − E_t H(p_t)``)."""

    def __init__(self) -> None:
        self.lse: torch.Tensor | None = None
        self.ent: torch.Tensor | None = None
        self.k = 0

    def add(self, logits: torch.Tensor) -> "DrawStats":
        ls = torch.log_softmax(logits.to(torch.float64), dim=-1)
        ent = -(torch.exp(ls) * ls).sum(-1)
        self.lse = ls if self.lse is None else torch.logaddexp(self.lse, ls)
        self.ent = ent if self.ent is None else self.ent + ent
        self.k += 1
        return self

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k == 0:
            raise ValueError("DrawStats: no draw added")
        return self.lse - math.log(self.k), self.ent / self.k


def draw_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`DrawStats` of ``K`` draws at once: ``logits`` ``[K, B, C]``."""
    ls = torch.log_softmax(logits.to(torch.float64), dim=-1)
    ent = -(torch.exp(ls) * ls).sum(-1).mean(0)
    return torch.logsumexp(ls, dim=0) - math.log(logits.shape[0]), ent


def sample_seed(seed: int, t: int) -> int:
    """64-bit generator seed of MC sample ``t`` under run seed ``seed`` (BLAKE2b of both)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seed, t)):
        raise ValueError(f"seed and sample index must be ints, got {seed!r}, {t!r}")
    digest = hashlib.blake2b(f"infoform.mc:{seed}:{t}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def sample_generator(seed: int, t: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with :func:`sample_seed` ``(seed, t)``."""
    g = torch.Generator(device=device)
    g.manual_seed(sample_seed(seed, t))
    return g


def _posterior_device(posterior: Posterior) -> torch.device:
    if not posterior.layers:
        raise ValueError("posterior has no layers")
    lp = next(iter(posterior.layers.values()))
    return next(iter(lp.tensors().values())).device


def draw_sample(posterior: Posterior, seed: int, t: int) -> dict[str, torch.Tensor]:
    """Deltas of MC sample ``t``: ``name -> (m, n)`` perturbation of ``W~``, ``~ N(0, P^{-1})``."""
    g = sample_generator(seed, t, _posterior_device(posterior))
    return {k: v[0] for k, v in posterior.sample(1, g).items()}


def draw_sample_factored(posterior: Posterior, seed: int, t: int) -> dict[str, Any]:
    """Sample ``t`` as :func:`draw_sample`, with the layers that have one as
    :class:`~laplace_core.posteriors.structures.base.ScaleFactors` (core ``(1, m, n)``;
    ``factors.matrix()[0]`` is ``draw_sample``'s delta bit for bit), the others as deltas."""
    g = sample_generator(seed, t, _posterior_device(posterior))
    return {k: v if isinstance(v, ScaleFactors) else v[0] for k, v in posterior.sample_factored(1, g).items()}


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` inside, every module's training flag restored on exit."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, f in flags:
            m.training = f


@contextlib.contextmanager
def quiet_jit_deprecation() -> Iterator[None]:
    """Silences torch's own FutureWarning that ``torch.jit.script`` is deprecated, which the first
    ``torch.func.jvp`` of a process raises (registering its decompositions): nothing a user can act
    on, and a warning line in the log of every job that searches the GLM predictive. Only that
    message, only inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        yield


def map_predict(model: nn.Module, x: torch.Tensor, likelihood: str = "classification") -> torch.Tensor:
    """``softmax(f(x; θ*))``: ``x`` ``[B, ...]`` -> probabilities ``[B, C]`` (eval mode, no grad)."""
    link = _link(likelihood)
    with torch.no_grad(), eval_mode(model):
        return link(model(x))


def check_layers(modules: Mapping[str, nn.Module], posterior: Posterior) -> None:
    """Every posterior layer must exist in the model with the same ``W~`` shape."""
    missing = [k for k in posterior.layers if k not in modules]
    if missing:
        raise ValueError(f"posterior layers not found in the model: {missing}; model layers: {list(modules)}")
    for k, lp in posterior.layers.items():
        shape = tuple(get_matrix(modules[k]).shape)
        if tuple(lp.shape) != shape:
            raise ValueError(f"layer {k!r}: posterior W~ shape {tuple(lp.shape)} != model W~ shape {shape}")


class SampleCache:
    """Sample ``t`` of a posterior (``draw_sample(posterior, seed, t)``, or
    ``draw_sample_factored`` with ``factored``), kept in memory for reuse when all
    ``n_samples`` draws fit ``cache_bytes``; otherwise redrawn on demand (memory flat in
    ``K``). Shared by the weight-sampling and GLM predictors."""

    def __init__(self, posterior: Posterior, seed: int, n_samples: int, cache_bytes: int = 0, factored: bool = False):
        self.posterior, self.seed, self.n_samples = posterior, seed, n_samples
        self._draw = draw_sample_factored if factored else draw_sample
        per_sample = sum(
            lp.shape[0] * lp.shape[1] * next(iter(lp.tensors().values())).element_size()
            for lp in posterior.layers.values()
        )
        self.enabled = per_sample * n_samples <= cache_bytes
        self._cached: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, t: int) -> dict[str, Any]:
        if not 0 <= t < self.n_samples:
            raise ValueError(f"sample index {t} out of range [0, {self.n_samples})")
        if t in self._cached:
            return self._cached[t]
        d = self._draw(self.posterior, self.seed, t)
        if self.enabled:
            self._cached[t] = d
        return d


class MCPredictor:
    """MC predictive of ``model`` under ``posterior`` with ``n_samples`` weight samples.

    ``modules`` maps the posterior's layer names to the model's modules (default:
    :func:`laplace_core.curvature.layers.find_layers`). Every posterior layer must exist there
    with a ``W~`` of the same shape. ``cache_bytes``: keep the ``n_samples`` deltas
    in memory after first use when they need at most this many bytes (default 0:
    redraw per call). ``sample_space``: where factored draws go
    (:data:`laplace_core.predictive.sample_apply.SAMPLE_SPACES`; ``"auto"``, the default, takes the
    cheaper of weights and inputs per layer and call). Probabilities are summed over
    samples in float64 and returned in the model's output dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: Posterior,
        n_samples: int = 30,
        seed: int = 0,
        likelihood: str = "classification",
        *,
        modules: Mapping[str, nn.Module] | None = None,
        cache_bytes: int = 0,
        sample_space: str = "auto",
    ):
        if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
            raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
        if sample_space not in SAMPLE_SPACES:
            raise ValueError(f"unknown sample_space {sample_space!r}; valid: {', '.join(SAMPLE_SPACES)}")
        self.sample_space = sample_space
        sample_seed(seed, 0)  # validates seed
        self.link = _link(likelihood)
        self.model = model
        self.posterior = posterior
        self.n_samples = n_samples
        self.seed = seed
        self.likelihood = likelihood
        self.modules = dict(find_layers(model, norm_layers="diag")[0] if modules is None else modules)
        check_layers(self.modules, posterior)
        self._samples = SampleCache(posterior, seed, n_samples, cache_bytes, factored=sample_space != "weights")
        self.used: dict[str, str] = {}
        """``name -> "weights" / "inputs"``: where each factored layer's draw went on its last call."""

    def sample(self, t: int) -> dict[str, torch.Tensor]:
        """Deltas of sample ``t`` (see :func:`draw_sample`), from the cache when enabled."""
        return {k: v.matrix()[0] if isinstance(v, ScaleFactors) else v for k, v in self._samples.get(t).items()}

    def _applied(self, t: int):
        return applied(self.modules, self._samples.get(t), self.sample_space, self.used)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.link(self.model(x))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, ...]`` -> ``(1/K) Σ_t softmax(f(x; θ* + δ_t))`` ``[B, C]``."""
        total = None
        with torch.no_grad(), eval_mode(self.model):
            for t in range(self.n_samples):
                with self._applied(t):
                    p = self._forward(x)
                total = p.to(torch.float64) if total is None else total + p.to(torch.float64)
        return (total / self.n_samples).to(p.dtype)

    def sample_probs(self, x: torch.Tensor) -> torch.Tensor:
        """``[K, B, C]`` float64: ``softmax(f(x; θ* + δ_t))`` for each ``t`` (their mean is
        :meth:`predict`; per-sample entropies give the expected entropy / mutual information)."""
        out = []
        with torch.no_grad(), eval_mode(self.model):
            for t in range(self.n_samples):
                with self._applied(t):
                    out.append(self._forward(x).to(torch.float64))
        return torch.stack(out)

    def predict_batches(self, batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Samples outer, batches inner: each ``δ_t`` is drawn once. ``batches`` must be
        re-iterable (a list, or a DataLoader yielding input tensors in a fixed order);
        returns one ``[B_j, C]`` tensor per batch, equal to ``predict`` on that batch."""
        dtypes: list[torch.dtype] = []

        def start(x: torch.Tensor) -> torch.Tensor:
            p = self._forward(x)
            dtypes.append(p.dtype)
            return p.to(torch.float64)

        totals = self._over_samples(batches, start, lambda s, x: s + self._forward(x).to(torch.float64))
        return [(s / self.n_samples).to(dt) for s, dt in zip(totals, dtypes)]

    def predict_batches_stats(self, batches: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Like :meth:`predict_batches`, one ``(log p̄ [B_j, C], E_t H(p_t) [B_j])`` per batch
        (:class:`DrawStats`: exact log-mean-exp of the draws' log-softmax, float64)."""
        states = self._over_samples(batches, lambda x: DrawStats().add(self.model(x)),
                                    lambda s, x: s.add(self.model(x)))
        return [s.result() for s in states]

    def _over_samples(self, batches: Sequence[torch.Tensor], start: Callable, add: Callable) -> list:
        """Fold every batch's outputs over the samples ``t = 0..K-1`` (samples outer)."""
        if iter(batches) is batches:
            raise ValueError("predict_batches needs a re-iterable sequence of batches, not a one-shot iterator")
        states: list = []
        with torch.no_grad(), eval_mode(self.model):
            for t in range(self.n_samples):
                with self._applied(t):
                    self._fold_sample(t, batches, states, start, add)
        return states

    @staticmethod
    def _fold_sample(t: int, batches, states: list, start: Callable, add: Callable) -> None:
        """Fold sample ``t``'s outputs on every batch into ``states`` (``start`` on sample 0)."""
        j = -1
        for j, x in enumerate(batches):
            if t == 0:
                states.append(start(x))
            elif j >= len(states):
                raise ValueError("batches yielded more batches on a later pass")
            else:
                states[j] = add(states[j], x)
        if j + 1 != len(states):
            raise ValueError(f"batches yielded {j + 1} batches on pass {t}, {len(states)} on the first")


def mc_predict(
    model: nn.Module,
    posterior: Posterior,
    x: torch.Tensor,
    *,
    n_samples: int = 30,
    seed: int = 0,
    modules: Mapping[str, nn.Module] | None = None,
    likelihood: str = "classification",
    sample_space: str = "auto",
) -> torch.Tensor:
    """MC predictive probabilities ``[B, C]`` for ``x`` (see :class:`MCPredictor`)."""
    return MCPredictor(model, posterior, n_samples, seed, likelihood, modules=modules,
                       sample_space=sample_space).predict(x)
