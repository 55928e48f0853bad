"""One pass over the data: KFAC factors, the exact Fisher diagonal and EFB sums.

For ``M`` examples and every registered layer (``W~`` is ``m x n``, DESIGN §1), with
input rows ``a_{k,t}`` (``n``) and output-gradient rows ``g_{k,t}`` (``m``) of the
per-example log-likelihood ``log p(y_k | x_k)`` over ``T`` positions:

* ``A    = Σ_{k,t} a a^T / T``                       (n x n)
* ``G    = Σ_{k,t} g g^T``                           (m x m)
* ``diag = Σ_k d_k ∘ d_k``, ``d_k = Σ_t g_{k,t} a_{k,t}^T`` (m x n, exact)
* ``efb  = Σ_k (U_G^T d_k U_A)^2``                   (m x n, George et al. 2018;
  with a basis from :func:`laplace_core.eigenbasis.eigenbasis`)

Labels ``y_k`` are sampled from the model's predictive (``fisher="mc"``,
``mc_samples`` draws per example, output-gradient quantities averaged over the draws)
or are the true labels (``fisher="empirical"``). Everything is a sum plus a count,
accumulated in ``dtype`` (float64 by default) while the matrix products run in the
model's dtype.

Cost per example and layer (multiply counts, DESIGN §1): forward ``mnT`` and the
back-propagation of output gradients ``≈ mnT`` (weight gradients are never formed);
``A``: ``n²T``, as a blocked symmetric product (upper blocks only, ``(k+1)/2k`` of
that); ``G``: ``m²T``; ``diag``: for ``T > 8`` positions ``d_k`` by a batched matmul
(``mnT``), squared and summed; for ``T <= 8`` one GEMM over position pairs,
``Σ_k d_k∘d_k = Σ_{t<=t'} w (g_t∘g_t')^T (a_t∘a_t')`` (``mnT(T+1)/2`` multiplies at
full GEMM speed instead of a memory-bound ``m x n`` intermediate per example; for
``T = 1`` it is ``(g∘g)^T (a∘a)``). EFB takes the cheaper of "form ``d_k`` then
rotate" (``mnT + m²n + mn²``, the ``mnT`` free when the diagonal already formed
``d_k``) and "rotate ``a`` and ``g`` first" (``n²T + m²T + mnT``); small ``T``
always rotates first and squares through the pair GEMM. Work is chunked over
examples so that no intermediate exceeds ``max_chunk_elements`` elements; sums over
about ``flush_examples`` examples stay in the compute dtype (inside the GEMMs) before
being added to the ``dtype`` totals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from .eigenbasis import Eigenbasis, LayerBasis
from .hooks import capture, group_output_grads, group_rows, layer_inputs, layer_output_grads, norm_grads, num_positions
from .keyed_rng import KeyedSampler, keyed_categorical, keyed_normal
from .layers import GroupView, check_norm_layers, find_layers
from .statistics import CurvatureStatistics, LayerInfo, LayerStatistics

__all__ = [
    "FISHER_TYPES",
    "LIKELIHOODS",
    "collect_statistics",
    "collect_efb",
    "sample_targets",
    "output_gradients",
    "efb_contraction_order",
    "likelihood_for",
    "check_fisher",
    "split_batch",
]

FISHER_TYPES = ("mc", "empirical")
EFB_ORDERS = ("form", "rotate")


# =========================================================================== likelihoods
class _Classification:
    """Categorical likelihood on logits ``f`` (B, C): ``log p(y|f) = log_softmax(f)[y]``.
    Gradient w.r.t. ``f``: ``onehot(y) - softmax(f)``."""

    name = "classification"

    def check(self, out: torch.Tensor, labels: torch.Tensor | None, fisher: str) -> torch.Tensor | None:
        if out.dim() != 2:
            raise ValueError(f"classification expects model output of shape (B, C), got {tuple(out.shape)}")
        if labels is None:
            if fisher == "empirical":
                raise ValueError("fisher='empirical' needs labels in every batch")
            return None
        if not isinstance(labels, torch.Tensor):
            labels = torch.as_tensor(labels)
        if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"classification labels must be integers, got dtype {labels.dtype}")
        if labels.dim() != 1 or labels.shape[0] != out.shape[0]:
            raise ValueError(f"labels must have shape ({out.shape[0]},), got {tuple(labels.shape)}")
        C = out.shape[1]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= C):
            raise ValueError(f"labels must lie in [0, {C}), got range [{int(labels.min())}, {int(labels.max())}]")
        return labels.to(device=out.device, dtype=torch.long)

    def sample(self, out: torch.Tensor, S: int, generator: torch.Generator | None) -> torch.Tensor:
        probs = torch.softmax(out, dim=1)
        return torch.multinomial(probs, S, replacement=True, generator=generator).T.contiguous()  # (S, B)

    def sample_keyed(self, out: torch.Tensor, S: int, seed: int, keys: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(out.to(torch.float64), dim=1)
        return torch.stack([keyed_categorical(probs, seed, keys, s) for s in range(S)]).to(out.device)

    def log_lik(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(out, dim=1)
        return logp.gather(1, targets.T).sum()

    def output_grad(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        S = targets.shape[0]
        grad = -torch.softmax(out, dim=1).unsqueeze(0).repeat(S, 1, 1)  # (S, B, C)
        grad.scatter_add_(2, targets.unsqueeze(2), torch.ones_like(grad[..., :1]))
        return grad


class _Regression:
    """Gaussian likelihood with unit noise: ``log p(y|f) = -||y - f||² / 2`` (+ const).
    Gradient w.r.t. ``f``: ``y - f``; MC targets ``y = f + ε``, ``ε ~ N(0, I)``."""

    name = "regression"

    def check(self, out: torch.Tensor, labels: torch.Tensor | None, fisher: str) -> torch.Tensor | None:
        if labels is None:
            if fisher == "empirical":
                raise ValueError("fisher='empirical' needs targets in every batch")
            return None
        if not isinstance(labels, torch.Tensor):
            labels = torch.as_tensor(labels)
        if labels.shape != out.shape:
            if labels.numel() == out.numel() and labels.dim() >= 1 and labels.shape[0] == out.shape[0]:
                labels = labels.reshape(out.shape)
            else:
                raise ValueError(f"regression targets must have the output's shape {tuple(out.shape)}, got {tuple(labels.shape)}")
        return labels.to(device=out.device, dtype=out.dtype)

    def sample(self, out: torch.Tensor, S: int, generator: torch.Generator | None) -> torch.Tensor:
        eps = torch.randn((S,) + tuple(out.shape), generator=generator, dtype=out.dtype, device=out.device)
        return out.unsqueeze(0) + eps

    def sample_keyed(self, out: torch.Tensor, S: int, seed: int, keys: torch.Tensor) -> torch.Tensor:
        eps = torch.stack([keyed_normal(tuple(out.shape[1:]), seed, keys, s) for s in range(S)])
        return out.unsqueeze(0) + eps.to(device=out.device, dtype=out.dtype)

    def log_lik(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -0.5 * (targets - out.unsqueeze(0)).square().sum()

    def output_grad(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets - out.unsqueeze(0)


LIKELIHOODS: dict[str, object] = {"classification": _Classification(), "regression": _Regression()}


def likelihood_for(name: str):
    """The likelihood object of ``LIKELIHOODS[name]`` (one-line error for an unknown name)."""
    if name not in LIKELIHOODS:
        raise ValueError(f"unknown likelihood {name!r}; valid: {', '.join(LIKELIHOODS)}")
    return LIKELIHOODS[name]


def check_fisher(fisher: str, mc_samples: int) -> int:
    """Validate ``fisher`` and ``mc_samples``; the number of label draws per example (1 for empirical)."""
    if fisher not in FISHER_TYPES:
        raise ValueError(f"unknown fisher {fisher!r}; valid: {', '.join(FISHER_TYPES)}")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive integer, got {mc_samples!r}")
    return mc_samples if fisher == "mc" else 1


def sample_targets(
    out: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    likelihood: str = "classification",
) -> torch.Tensor:
    """Targets ``(S, B, ...)`` whose log-likelihood the Fisher differentiates.

    ``fisher="mc"``: ``S = mc_samples`` draws from the model's predictive given the
    outputs ``out`` (classification: ``Categorical(softmax(out))`` via
    ``torch.multinomial(..., generator)``; regression: ``out + N(0, I)``).
    ``fisher="empirical"``: the labels, ``S = 1``. This is exactly what
    :func:`collect_statistics` draws for a batch, so a test can reproduce its labels
    with a generator in the same state.
    """
    lik = likelihood_for(likelihood)
    S = check_fisher(fisher, mc_samples)
    out = out.detach()
    labels = lik.check(out, labels, fisher)
    if fisher == "empirical":
        return labels.unsqueeze(0)
    return lik.sample(out, S, generator)


def output_gradients(out: torch.Tensor, targets: torch.Tensor, likelihood: str = "classification") -> torch.Tensor:
    """``∂ log p(targets[s, k] | out[k]) / ∂ out[k]`` stacked as ``(S, *out.shape)``."""
    return likelihood_for(likelihood).output_grad(out.detach(), targets)


# =========================================================================== per-layer work
def efb_contraction_order(m: int, n: int, T: int, *, have_d: bool) -> str:
    """``"form"`` or ``"rotate"``, whichever needs fewer multiplies per example:
    form ``d_k`` then rotate: ``(0 if have_d else mnT) + m²n + mn²``; rotate ``a``
    and ``g`` first: ``n²T + m²T + mnT`` (DESIGN §1). ``have_d``: the Fisher diagonal
    already forms ``d_k`` in the same pass."""
    form = (0 if have_d else m * n * T) + m * m * n + m * n * n
    rotate = n * n * T + m * m * T + m * n * T
    return "form" if form < rotate else "rotate"


PAIRS_MAX_T = 8  # positions up to which Σ_k (g_k^T a_k)^2 is one GEMM over position pairs


class _Acc:
    """A sum in ``dtype`` plus a partial sum in the compute dtype.

    Matrix products accumulate into the partial buffer inside the GEMM (``beta=1``),
    which :meth:`flush` adds into the ``dtype`` total every few hundred examples (the
    float64 read-modify-write of all sums per batch would otherwise cost ~15% of a
    resnet18 pass). ``sym_blocks = k > 1`` marks a symmetric sum whose products only
    fill the upper block triangle, one GEMM per row panel (a blocked SYRK:
    ``(k+1)/2k`` of the multiplies), mirrored at flush time.
    """

    def __init__(self, shape, dtype, cdtype, device, sym_blocks: int = 1):
        self.total = torch.zeros(shape, dtype=dtype, device=device)
        self.part = torch.empty(shape, dtype=cdtype, device=device)
        self.fresh = True
        self.edges = None
        if sym_blocks > 1:
            n = shape[0]
            self.edges = [round(i * n / sym_blocks) for i in range(sym_blocks + 1)]

    def mm(self, x: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
        """``part += alpha * x @ y``."""
        self.part.addmm_(x, y, beta=0.0 if self.fresh else 1.0, alpha=alpha)
        self.fresh = False

    def syrk(self, rows: torch.Tensor, alpha: float) -> None:
        """``part += alpha * rows^T rows`` (rows: (K, n)), upper blocks only when blocked."""
        if self.edges is None:
            self.mm(rows.T, rows, alpha)
            return
        e = self.edges
        beta = 0.0 if self.fresh else 1.0
        for bi in range(len(e) - 1):  # row panel bi: its diagonal block and everything right of it
            lo, hi = e[bi], e[bi + 1]
            self.part[lo:hi, lo:].addmm_(rows[:, lo:hi].T, rows[:, lo:], beta=beta, alpha=alpha)
        self.fresh = False

    def add(self, t: torch.Tensor, alpha: float) -> None:
        if self.fresh:
            torch.mul(t, alpha, out=self.part)
        else:
            self.part.add_(t, alpha=alpha)
        self.fresh = False

    def flush(self) -> torch.Tensor | None:
        """Add the partial sum into the total; returns its sum (for a finiteness check)."""
        if self.fresh:
            return None
        if self.edges is not None:
            e = self.edges
            for bi in range(len(e) - 1):
                for bj in range(bi + 1, len(e) - 1):
                    self.part[e[bj]:e[bj + 1], e[bi]:e[bi + 1]] = self.part[e[bi]:e[bi + 1], e[bj]:e[bj + 1]].T
        check = self.part.sum()
        self.total.add_(self.part)
        self.fresh = True
        return check


def _sym_blocks(n: int) -> int:
    """Row panels for the symmetric ``A`` product (measured on CPU: panels pay from
    ~1000 columns on; below that one GEMM is faster)."""
    return 1 if n < 1024 else (4 if n < 4096 else 8)


_PAIR_CACHE: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _pairs(T: int, device, dtype):
    key = (T, device, dtype)
    if key not in _PAIR_CACHE:
        i, j = torch.triu_indices(T, T, device=device)
        w = torch.where(i == j, 1.0, 2.0).to(dtype).unsqueeze(1)
        _PAIR_CACHE[key] = (i, j, w)
    return _PAIR_CACHE[key]


def _square_sum(acc: _Acc, g: torch.Tensor, a: torch.Tensor, alpha: float) -> None:
    """``acc += alpha * Σ_k (g_k^T a_k)∘(g_k^T a_k)`` for g (b, T, m), a (b, T, n), without
    forming ``g_k^T a_k``: ``(Σ_t g_t a_t^T)^2 = Σ_{t,t'} (g_t∘g_t')(a_t∘a_t')^T``, one
    GEMM over the ``T(T+1)/2`` position pairs (off-diagonal pairs counted twice).
    ``T = 1``: ``(g∘g)^T (a∘a)``."""
    b, T, m = g.shape
    n = a.shape[2]
    if T == 1:
        gp, ap = g.reshape(b, m).square(), a.reshape(b, n).square()
    else:
        i, j, w = _pairs(T, g.device, g.dtype)
        gp = (g[:, i] * (g[:, j] * w)).reshape(-1, m)
        ap = (a[:, i] * a[:, j]).reshape(-1, n)
    acc.mm(gp.T, ap, alpha)


@dataclass
class _Layer:
    """Accumulators of one layer and its EFB basis in the compute dtype."""

    name: str
    module: nn.Module
    info: LayerInfo
    A: _Acc | None
    G: _Acc | None
    diag: _Acc | None
    efb: _Acc | None
    U_A: torch.Tensor | None
    U_G: torch.Tensor | None
    force_order: str | None

    def accumulators(self) -> list[_Acc]:
        return [x for x in (self.A, self.G, self.diag, self.efb) if x is not None]

    def add(self, x: torch.Tensor, grads: list[torch.Tensor], max_chunk: int) -> None:
        """Add one batch: ``x`` the module input, ``grads`` one output gradient per label draw."""
        if self.info.diag_only:  # normalisation layer: per-example gradients of [γ, β] directly
            if self.diag is not None:
                for g in grads:
                    self.diag.add(norm_grads(self.module, x, g).square_().sum(0), 1.0 / len(grads))
            return
        m, n = self.info.shape
        S = len(grads)
        B = x.shape[0]
        T = num_positions(self.module, x)
        kfac = self.A is not None
        efb = self.efb is not None
        pairs = T <= PAIRS_MAX_T and self.force_order != "form"
        order = None
        if efb:
            order = "rotate" if pairs else (self.force_order or efb_contraction_order(m, n, T, have_d=kfac))
        need_d = (kfac and not pairs) or order == "form"
        per = max(T * n, T * m, m * n if need_d else 0, (T * (T + 1) // 2) * max(m, n) if pairs else 0, 1)
        bs = max(1, min(B, max_chunk // per))
        inv_S = 1.0 / S
        for i0 in range(0, B, bs):
            i1 = min(B, i0 + bs)
            b = i1 - i0
            a3 = layer_inputs(self.module, x[i0:i1] if bs < B else x)  # (b, T, n)
            ar = a3.reshape(b * T, n)
            if kfac:
                self.A.syrk(ar, 1.0 / T)
            if order == "rotate":
                a3_rot = (ar @ self.U_A).view(b, T, n)
            for g in grads:
                g3 = layer_output_grads(self.module, g[i0:i1] if bs < B else g)  # (b, T, m)
                gr = g3.reshape(b * T, m)
                if kfac:
                    self.G.mm(gr.T, gr, inv_S)
                    if pairs:
                        _square_sum(self.diag, g3, a3, inv_S)
                d = torch.bmm(g3.transpose(1, 2), a3) if need_d else None  # (b, m, n) per-example gradients
                if efb:
                    if order == "form":
                        d_rot = torch.matmul(self.U_G.T, torch.matmul(d, self.U_A))
                        self.efb.add(d_rot.square_().sum(0), inv_S)
                        del d_rot
                    else:
                        g3_rot = (gr @ self.U_G).view(b, T, m)
                        if pairs:
                            _square_sum(self.efb, g3_rot, a3_rot, inv_S)
                        else:
                            d_rot = torch.bmm(g3_rot.transpose(1, 2), a3_rot)
                            self.efb.add(d_rot.square_().sum(0), inv_S)
                            del d_rot
                if kfac and not pairs:
                    self.diag.add(d.square_().sum(0), inv_S)
                del d


class _GroupedConv:
    """All ``g`` groups of one grouped convolution, accumulated together with group-batched
    products (one Python step per convolution, not per group; depthwise convolutions have
    hundreds of groups). Per group ``k`` the sums are exactly those of its own
    :class:`_Layer`: ``A_k = Σ a_k a_k^T / T``, ``G_k = Σ g_k g_k^T``, ``diag_k = Σ d_k∘d_k``
    with ``d_k = Σ_t g_{k,t} a_{k,t}^T``, ``efb_k = Σ (U_Gk^T d_k U_Ak)^2``; stored as
    ``(g, ., .)`` stacks and split per group at the end (:meth:`totals`)."""

    def __init__(self, names, conv, info, kfac: bool, bases, acc):
        self.names, self.conv = list(names), conv
        g, (m, n) = len(names), info.shape
        self.A = acc(g, n, n) if kfac else None
        self.G = acc(g, m, m) if kfac else None
        self.diag = acc(g, m, n) if kfac else None
        self.efb = acc(g, m, n) if bases else None
        self.U_A = torch.stack([b[0] for b in bases]) if bases else None  # (g, n, n)
        self.U_G = torch.stack([b[1] for b in bases]) if bases else None  # (g, m, m)

    def accumulators(self) -> list[_Acc]:
        return [x for x in (self.A, self.G, self.diag, self.efb) if x is not None]

    def add(self, x: torch.Tensor, grads: list[torch.Tensor], max_chunk: int) -> None:
        g = self.conv.groups
        B = x.shape[0]
        T = num_positions(self.conv, x)
        m, n = self.conv.out_channels // g, (self.conv.in_channels // g) * math.prod(self.conv.kernel_size) + (
            self.conv.bias is not None)
        per = max(1, T * g * n, T * g * m, g * m * n * 2)
        bs = max(1, min(B, max_chunk // per))
        inv_S = 1.0 / len(grads)
        for i0 in range(0, B, bs):
            i1 = min(B, i0 + bs)
            a = group_rows(self.conv, x[i0:i1])  # (b, T, g, n)
            if self.A is not None:
                self.A.add(torch.einsum("btgi,btgj->gij", a, a), 1.0 / T)
            for gr in grads:
                q = group_output_grads(self.conv, gr[i0:i1])  # (b, T, g, m)
                d = torch.einsum("btgm,btgn->bgmn", q, a)  # per-example gradients of every group
                if self.G is not None:
                    self.G.add(torch.einsum("btgi,btgj->gij", q, q), inv_S)
                    self.diag.add(d.square().sum(0), inv_S)
                if self.efb is not None:
                    self.efb.add(torch.matmul(self.U_G.transpose(1, 2), torch.matmul(d, self.U_A)).square_().sum(0), inv_S)
                del d

    def totals(self) -> dict[str, tuple]:
        parts = [None if a is None else a.total for a in (self.A, self.G, self.diag, self.efb)]
        return {k: tuple(None if t is None else t[i].clone() for t in parts) for i, k in enumerate(self.names)}


# =========================================================================== batches
def split_batch(batch, i: int) -> tuple[torch.Tensor, object, object]:
    """``(x, y, keys)``; ``keys`` (per-example integer ids for keyed MC sampling) come from
    a dict batch's ``"key"`` entry or the third element of an ``(x, y, keys)`` tuple."""
    if isinstance(batch, Mapping):
        x = batch["image"] if "image" in batch else batch.get("x")
        y = batch["label"] if "label" in batch else batch.get("y")
        if x is None:
            raise ValueError(f"batch {i}: dict batches need an 'image' (or 'x') entry, got keys {sorted(batch)}")
        return x, y, batch.get("key")
    if isinstance(batch, (tuple, list)):
        if len(batch) not in (2, 3):
            raise ValueError(f"batch {i}: expected an (x, y) pair or (x, y, keys), got a sequence of length {len(batch)}")
        return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    raise ValueError(f"batch {i}: expected (x, y), a dict with 'image'/'label', or a tensor; got {type(batch).__name__}")


def _resolve_basis(basis, infos: Mapping[str, LayerInfo], cdtype, device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    layers = basis.layers if isinstance(basis, Eigenbasis) else basis
    if not isinstance(layers, Mapping):
        raise ValueError(f"basis must be an Eigenbasis or a mapping name -> LayerBasis, got {type(basis).__name__}")
    out = {}
    for name, info in infos.items():
        if info.diag_only:
            continue  # normalisation layers: no eigenbasis, no EFB sums
        if name not in layers:
            raise ValueError(f"basis has no entry for layer {name!r}")
        lb = layers[name]
        if not isinstance(lb, LayerBasis):
            raise ValueError(f"basis entry {name!r} is {type(lb).__name__}, expected LayerBasis")
        m, n = info.shape
        if tuple(lb.U_A.shape) != (n, n) or tuple(lb.U_G.shape) != (m, m):
            raise ValueError(
                f"basis for layer {name!r} has U_A {tuple(lb.U_A.shape)}, U_G {tuple(lb.U_G.shape)}; "
                f"expected ({n}, {n}) and ({m}, {m})"
            )
        out[name] = (lb.U_A.to(device=device, dtype=cdtype), lb.U_G.to(device=device, dtype=cdtype))
    return out


@dataclass(frozen=True)
class _PassResult:
    layers: dict[str, tuple]  # name -> (A, G, diag, efb) totals (None where not computed)
    infos: dict[str, LayerInfo]
    excluded: dict[str, str]
    count: int
    skipped_batches: int
    skipped_examples: int
    S: int


def _run(
    model: nn.Module,
    batches: Iterable,
    *,
    kfac: bool,
    basis,
    fisher: str,
    mc_samples: int,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    likelihood: str,
    progress: Callable[[int], None] | None,
    max_chunk_elements: int,
    flush_examples: int,
    efb_order: str | None,
    norm_layers: str = "map",
) -> _PassResult:
    lik = likelihood_for(likelihood)
    S = check_fisher(fisher, mc_samples)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if efb_order is not None and efb_order not in EFB_ORDERS:
        raise ValueError(f"unknown EFB contraction order {efb_order!r}; valid: {', '.join(EFB_ORDERS)}")
    if int(flush_examples) < 1:
        raise ValueError(f"flush_examples must be positive, got {flush_examples}")
    if int(max_chunk_elements) < 1:
        raise ValueError(f"max_chunk_elements must be positive, got {max_chunk_elements}")
    modules, infos, excluded = find_layers(model, norm_layers=check_norm_layers(norm_layers))
    if not modules:
        raise ValueError("model has no supported trainable layers (nn.Linear / nn.Conv2d with groups=1)")
    first = next(iter(modules.values())).weight
    cdtype, device = first.dtype, first.device
    bases = _resolve_basis(basis, infos, cdtype, device) if basis is not None else {}

    def acc(*shape, sym=1):
        return _Acc(shape, dtype, cdtype, device, sym_blocks=sym)

    layers: dict[str, _Layer] = {}
    grouped: dict[int, list[str]] = {}  # all groups of a grouped conv go to one _GroupedConv
    for name, mod in modules.items():
        if isinstance(mod, GroupView):
            grouped.setdefault(id(mod.parent), []).append(name)
    grouped = {pid: ns for pid, ns in grouped.items() if len(ns) == modules[ns[0]].parent.groups and len(ns) > 1}
    in_group = {n for ns in grouped.values() for n in ns}
    gconvs = [_GroupedConv(ns, modules[ns[0]].parent, infos[ns[0]], kfac,
                           [bases[k] for k in ns] if basis is not None else None, acc) for ns in grouped.values()]
    for name, mod in modules.items():
        if name in in_group:
            continue
        m, n = infos[name].shape
        U_A, U_G = bases.get(name, (None, None))
        dg = infos[name].diag_only
        layers[name] = _Layer(
            name=name, module=mod, info=infos[name],
            A=acc(n, n, sym=_sym_blocks(n)) if kfac and not dg else None, G=acc(m, m) if kfac and not dg else None,
            diag=acc(m, n) if kfac else None, efb=acc(m, n) if basis is not None and not dg else None,
            U_A=U_A, U_G=U_G, force_order=efb_order,
        )

    def flush(i):
        checks = [c for layer in (*layers.values(), *gconvs) for a in layer.accumulators() if (c := a.flush()) is not None]
        if checks and not bool(torch.isfinite(torch.stack(checks)).all()):
            raise FloatingPointError(
                f"batch {i}: finite activations and gradients overflowed in the curvature products "
                f"(compute dtype {cdtype}); run the model in float64"
            )

    modes = {mod: mod.training for mod in model.modules()}
    model.eval()
    count = seen = skipped_batches = skipped_examples = n_batches = pending = 0
    try:
        with capture(model, modules) as cap, torch.enable_grad():
            for i, batch in enumerate(batches):
                n_batches += 1
                x, y, keys = split_batch(batch, i)
                if not isinstance(x, torch.Tensor):
                    x = torch.as_tensor(x)
                if x.dim() == 0 or x.shape[0] == 0:
                    raise ValueError(f"batch {i}: empty input of shape {tuple(x.shape)}")
                x = x.to(device=device, dtype=cdtype if x.dtype.is_floating_point else x.dtype)
                B = x.shape[0]
                out = model(x)
                if not isinstance(out, torch.Tensor):
                    raise ValueError(f"model output must be a tensor, got {type(out).__name__}")
                if out.shape[0] != B:
                    raise ValueError(f"batch {i}: model output has batch size {out.shape[0]}, input has {B}")
                missing = cap.missing()
                if missing:
                    raise ValueError(f"layers not called in the forward pass: {missing[:5]}")
                labels = lik.check(out.detach(), y, fisher)
                seen += B
                od = out.detach()
                if not bool(torch.isfinite(od).all()):
                    skipped_batches += 1
                    skipped_examples += B
                    if progress is not None:
                        progress(seen)
                    continue
                if fisher == "empirical":
                    targets = labels.unsqueeze(0)
                elif isinstance(generator, KeyedSampler):
                    if keys is None:
                        raise ValueError(f"batch {i}: a KeyedSampler needs per-example keys (dict key 'key')")
                    keys = torch.as_tensor(keys).reshape(-1)
                    if keys.shape[0] != B:
                        raise ValueError(f"batch {i}: {keys.shape[0]} keys for {B} examples")
                    targets = lik.sample_keyed(od, S, generator.seed, keys)
                else:
                    targets = lik.sample(od, S, generator)
                go = lik.output_grad(od, targets).to(out.dtype)
                checks = [lik.log_lik(od, targets).reshape(1)]
                grads: dict[str, list[torch.Tensor]] = {k: [] for k in modules}
                for s in range(S):
                    gs = cap.backward(out, go[s], retain_graph=s < S - 1)
                    for k in modules:
                        grads[k].append(gs[k])
                del out
                checks += [cap.inputs[k].sum().reshape(1).to(cdtype) for k in modules]
                checks += [g.sum().reshape(1) for k in modules for g in grads[k]]
                if not bool(torch.isfinite(torch.cat(checks)).all()):
                    skipped_batches += 1
                    skipped_examples += B
                    if progress is not None:
                        progress(seen)
                    continue
                for k, layer in layers.items():
                    layer.add(cap.inputs[k], grads[k], int(max_chunk_elements))
                    grads[k] = []
                for gc in gconvs:  # the groups share the convolution's input and output gradient
                    gc.add(cap.inputs[gc.names[0]], grads[gc.names[0]], int(max_chunk_elements))
                    for k in gc.names:
                        grads[k] = []
                count += B
                pending += B
                if pending >= flush_examples:
                    flush(i)
                    pending = 0
                if progress is not None:
                    progress(seen)
                cap.clear()
            if pending:
                flush(n_batches - 1)
    finally:
        for mod, mode in modes.items():
            mod.training = mode
    if n_batches == 0 or seen == 0:
        raise ValueError("no batches: the data iterable was empty")
    totals = {
        k: tuple(None if a is None else a.total for a in (l.A, l.G, l.diag, l.efb)) for k, l in layers.items()
    }
    for gc in gconvs:
        totals.update(gc.totals())
    totals = {k: totals[k] for k in modules}  # model order
    return _PassResult(totals, infos, excluded, count, skipped_batches, skipped_examples, S)


# =========================================================================== public
def collect_statistics(
    model: nn.Module,
    batches: Iterable,
    *,
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | KeyedSampler | None = None,
    basis: Eigenbasis | Mapping[str, LayerBasis] | None = None,
    dtype: torch.dtype = torch.float64,
    likelihood: str = "classification",
    progress: Callable[[int], None] | None = None,
    max_chunk_elements: int = 2**26,
    flush_examples: int = 256,
    _efb_order: str | None = None,
    norm_layers: str = "map",
) -> CurvatureStatistics:
    """KFAC sums ``A``, ``G``, the exact Fisher diagonal and the count ``M`` in one pass;
    with ``basis`` also the EFB sums ``efb`` (and ``efb_count = M``).

    ``batches``: iterable of ``(x, y)`` pairs or dicts with ``"image"``/``"label"``
    (or ``"x"``/``"y"``); ``y`` may be ``None`` for ``fisher="mc"``. The model runs in
    ``eval()`` mode (each module's mode is restored afterwards); parameters keep
    ``requires_grad`` and ``.grad`` is never written. ``generator`` drives the label
    sampling (see :func:`sample_targets`); a :class:`~laplace_core.keyed_rng.KeyedSampler`
    instead draws each label from ``(seed, example key, draw)`` so that the sums do not
    depend on batching, sharding or restarts (batches then carry keys: ``"key"`` in dict
    batches or ``(x, y, keys)``). A batch whose outputs, log-likelihood,
    captured inputs or gradients are not finite is skipped and counted in
    ``skipped_batches`` / ``skipped_examples``. ``progress(n)`` is called after each
    batch with the number of examples seen so far. Products run in the model's dtype
    and are summed there over about ``flush_examples`` examples (whole batches) (inside the GEMMs)
    before being added into the ``dtype`` sums. ``_efb_order`` (``"form"`` /
    ``"rotate"``, tests only) forces the EFB contraction order.

    Shapes per layer (``W~`` is ``m x n``): ``A`` (n, n), ``G`` (m, m), ``diag`` and
    ``efb`` (m, n). Identities: DESIGN §1; KFC (Grosse & Martens 2016) for convs.

    ``norm_layers="diag"`` adds the normalisation layers (:mod:`laplace_core.layers`):
    only their exact Fisher diagonal ``Σ_k d_k ∘ d_k`` (``d_k`` from
    :func:`laplace_core.hooks.norm_grads`), no ``A``, ``G`` or ``efb``.
    """
    res = _run(
        model, batches, kfac=True, basis=basis, fisher=fisher, mc_samples=mc_samples, generator=generator,
        dtype=dtype, likelihood=likelihood, progress=progress, max_chunk_elements=max_chunk_elements,
        flush_examples=flush_examples, efb_order=_efb_order, norm_layers=norm_layers,
    )
    layers = {k: LayerStatistics(A=A, G=G, diag=diag, efb=efb) for k, (A, G, diag, efb) in res.layers.items()}
    return CurvatureStatistics(
        layers=layers,
        infos=res.infos,
        count=res.count,
        efb_count=res.count if basis is not None else 0,
        skipped_batches=res.skipped_batches,
        skipped_examples=res.skipped_examples,
        fisher=fisher,
        mc_samples=res.S,
        excluded=res.excluded,
    )


def collect_efb(
    model: nn.Module,
    batches: Iterable,
    basis: Eigenbasis | Mapping[str, LayerBasis],
    *,
    fisher: str = "mc",
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    likelihood: str = "classification",
    progress: Callable[[int], None] | None = None,
    max_chunk_elements: int = 2**26,
    flush_examples: int = 256,
    _efb_order: str | None = None,
    norm_layers: str = "map",
) -> tuple[dict[str, torch.Tensor], int]:
    """The EFB second pass alone: ``({name: Σ_k (U_G^T d_k U_A)^2}, M)``.

    Same arguments as :func:`collect_statistics`; no ``A``/``G``/``diag`` work, so the
    contraction order is chosen with ``have_d=False``. Attach the result with
    ``stats.with_efb(efb, count)``. Skipped batches are not in ``M``. Normalisation layers
    (``norm_layers="diag"``) have no EFB sums and are not in the result.
    """
    if basis is None:
        raise ValueError("collect_efb needs an eigenbasis (laplace_core.eigenbasis(stats))")
    res = _run(
        model, batches, kfac=False, basis=basis, fisher=fisher, mc_samples=mc_samples, generator=generator,
        dtype=dtype, likelihood=likelihood, progress=progress, max_chunk_elements=max_chunk_elements,
        flush_examples=flush_examples, efb_order=_efb_order, norm_layers=norm_layers,
    )
    return {k: t[3] for k, t in res.layers.items() if not res.infos[k].diag_only}, res.count
