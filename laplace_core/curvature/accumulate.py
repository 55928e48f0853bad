"""Per-layer accumulators of the curvature pass: the KFAC factors, the exact Fisher
diagonal and the EFB sums of one layer (or all groups of a grouped convolution) for one
batch of captured inputs and output gradients.

The sums and their cost are those stated in :mod:`laplace_core.curvature.collect` (which runs
the pass and owns the batching, label draws and finiteness checks); this module holds
the arithmetic: :class:`LayerSums` for a layer ``W~`` (``m x n``) over ``T`` positions,
:class:`GroupedConvSums` for the groups of one grouped convolution, both accumulating
into :class:`Accumulator` (a ``dtype`` total plus a compute-dtype partial sum).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .hooks import group_output_grads, group_rows, layer_inputs, layer_output_grads, norm_grads, num_positions
from .tap_major import conv_rows_tap_major, tap_major_perm
from .statistics import LayerInfo

__all__ = [
    "EFB_ORDERS",
    "PAIRS_MAX_T",
    "Accumulator",
    "LayerSums",
    "GroupedConvSums",
    "efb_contraction_order",
    "sym_blocks",
]

EFB_ORDERS = ("form", "rotate")

def efb_contraction_order(m: int, n: int, T: int, *, have_d: bool) -> str:
    """``"form"`` or ``"rotate"``, whichever needs fewer multiplies per example:
    form ``d_k`` then rotate: ``(0 if have_d else mnT) + m²n + mn²``; rotate ``a``
    and ``g`` first: ``n²T + m²T + mnT`` (docs/design.md §1). ``have_d``: the Fisher diagonal
    already forms ``d_k`` in the same pass."""
    form = (0 if have_d else m * n * T) + m * m * n + m * n * n
    rotate = n * n * T + m * m * T + m * n * T
    return "form" if form < rotate else "rotate"


PAIRS_MAX_T = 8  # positions up to which Σ_k (g_k^T a_k)^2 is one GEMM over position pairs
FLUSH_SLICE = 2**18  # elements per slice when a partial sum is added into its total


class Accumulator:
    """A sum in ``dtype`` plus a partial sum in the compute dtype.

    Matrix products accumulate into the partial buffer inside the GEMM (``beta=1``),
    which :meth:`flush` adds into the ``dtype`` total every few hundred examples (the
    float64 read-modify-write of all sums per batch would otherwise cost ~15% of a
    resnet18 pass). ``sym_blocks = k > 1`` marks a symmetric sum whose products only
    fill the upper block triangle, one GEMM per row panel (a blocked SYRK:
    ``(k+1)/2k`` of the multiplies), mirrored at flush time.
    """

    def __init__(self, shape, dtype, cdtype, device, sym_blocks: int = 1):
        self.dtype = dtype
        self._total: torch.Tensor | None = None  # made by the first flush (no zero fill, no temporary)
        self.part = torch.empty(shape, dtype=cdtype, device=device)
        self.fresh = True
        self.order: tuple[torch.Tensor | None, torch.Tensor | None] | None = None  # (rows, cols) to flush
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

    def add_square(self, t: torch.Tensor, alpha: float) -> None:
        """``part += alpha * t∘t`` (one fused pass over ``t``)."""
        if self.fresh:
            torch.mul(t, t, out=self.part)
            if alpha != 1.0:
                self.part.mul_(alpha)
        else:
            self.part.addcmul_(t, t, value=alpha)
        self.fresh = False

    @property
    def total(self) -> torch.Tensor:
        """The ``dtype`` sum of everything flushed (zeros before the first flush)."""
        if self._total is None:
            self._total = torch.zeros(self.part.shape, dtype=self.dtype, device=self.part.device)
        return self._total

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
        if self.order is not None:
            self._flush_reordered()
        elif self._total is None:
            self._total = self.part.to(self.dtype, copy=True)
        else:  # in slices: the promoted temporary of a mixed-dtype add_ stays in cache
            total, part = self._total.view(-1), self.part.view(-1)
            for i in range(0, part.numel(), FLUSH_SLICE):
                total[i:i + FLUSH_SLICE].add_(part[i:i + FLUSH_SLICE])
        self.fresh = True
        return check

    def reorder(self, rows: torch.Tensor | None, cols: torch.Tensor | None) -> None:
        """Flush ``part[rows][:, cols]`` into the total: the products ran in another row /
        column order (tap-major conv rows, :func:`~laplace_core.curvature.tap_major.tap_major_perm`)."""
        dev = self.part.device
        self.order = tuple(None if i is None else i.to(dev) for i in (rows, cols))

    def _flush_reordered(self) -> None:
        """``total += part[rows][:, cols]``, a slice of rows at a time (2-D sums)."""
        rows, cols = self.order
        first = self._total is None
        if first:
            self._total = torch.empty(self.part.shape, dtype=self.dtype, device=self.part.device)
        step = max(1, FLUSH_SLICE // self.part.shape[1])
        for r0 in range(0, self.part.shape[0], step):
            r1 = min(r0 + step, self.part.shape[0])
            src = self.part[r0:r1] if rows is None else self.part.index_select(0, rows[r0:r1])
            src = src if cols is None else src.index_select(1, cols)
            if first:
                self._total[r0:r1].copy_(src)
            else:
                self._total[r0:r1].add_(src)


def sym_blocks(n: int) -> int:
    """Row panels for the symmetric ``A`` product. Measured on a quiet CPU, one thread
    (resnet18's shapes at 64x64, 2026-11-25): ``n = 147`` 18.6 ms as one GEMM, 16.0 with 2
    panels; ``n = 576`` 53.6 -> 38.1 with 4; ``n = 2304`` 54.6 -> 32.0 with 8; below ~128
    columns one GEMM is as fast."""
    return 1 if n < 128 else (2 if n < 384 else (4 if n < 2048 else 8))


_PAIR_CACHE: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _pairs(T: int, device, dtype):
    key = (T, device, dtype)
    if key not in _PAIR_CACHE:
        i, j = torch.triu_indices(T, T, device=device)
        w = torch.where(i == j, 1.0, 2.0).to(dtype).unsqueeze(1)
        _PAIR_CACHE[key] = (i, j, w)
    return _PAIR_CACHE[key]


def _square_sum(acc: Accumulator, g: torch.Tensor, a: torch.Tensor, alpha: float) -> None:
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


def _square_sum_per_example(acc: Accumulator, g: torch.Tensor, a: torch.Tensor, alpha: float) -> None:
    """``acc += alpha * Σ_k (g_k^T a_k)∘(g_k^T a_k)`` for g (b, T, m), a (b, T, n), one example
    at a time through one ``m x n`` scratch that stays in the CPU's cache. The batched form
    writes a ``(b, m, n)`` intermediate to memory and reads it twice; with few positions
    (``T`` = 16 at ``m x n`` = 256 x 2304, resnet18's layer3 at 64x64) that traffic, not the
    ``mnT`` multiplies, is the cost: measured 9.5 ms against 48.9 ms for 32 examples, one
    thread (benchmarks/RESULTS.md, issue 31's diagonal)."""
    scratch = g.new_empty(g.shape[2], a.shape[2])
    for k in range(g.shape[0]):
        torch.mm(g[k].T, a[k], out=scratch)
        acc.add_square(scratch, alpha)


PER_EXAMPLE_MIN = 2**20  # elements of the batched (b, m, n) intermediate from which a CPU forms d_k one at a time


def _per_example_in_cache(t: torch.Tensor, elements: int) -> bool:
    """Whether the diagonal's per-example gradients are formed one at a time: on a CPU once the
    batched ``(b, m, n)`` intermediate (``elements``) would leave the cache (below ~1M elements
    the two are equally fast and the batched product makes fewer Python calls); accelerators
    keep the batched product (bandwidth is plentiful, launches are not)."""
    return t.device.type == "cpu" and elements >= PER_EXAMPLE_MIN


@dataclass
class LayerSums:
    """Accumulators of one layer and its EFB basis in the compute dtype."""

    name: str
    module: nn.Module
    info: LayerInfo
    A: Accumulator | None
    G: Accumulator | None
    diag: Accumulator | None
    efb: Accumulator | None
    U_A: torch.Tensor | None
    U_G: torch.Tensor | None
    force_order: str | None

    def __post_init__(self):
        """A convolution's products run on tap-major rows (a cheaper gather,
        :func:`~laplace_core.curvature.tap_major.conv_rows_tap_major`): ``U_A``'s rows are put
        in that order, and ``A`` and ``diag`` are flushed back into ``weight.reshape(m, -1)``
        order (``efb``'s columns are eigen-directions, the same in both)."""
        self.perm = None
        if self.info.kind != "conv2d" or self.info.diag_only:
            return
        self.perm = tap_major_perm(self.module)
        inv = torch.argsort(self.perm)
        if self.U_A is not None:
            self.U_A = self.U_A[self.perm.to(self.U_A.device)]
        if self.A is not None:
            self.A.reorder(inv, inv)
        if self.diag is not None:
            self.diag.reorder(None, inv)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return layer_inputs(self.module, x) if self.perm is None else conv_rows_tap_major(self.module, x)

    @property
    def names(self) -> list[str]:
        return [self.name]

    def accumulators(self) -> list[Accumulator]:
        return [x for x in (self.A, self.G, self.diag, self.efb) if x is not None]

    def totals(self) -> dict[str, tuple]:
        return {self.name: tuple(None if a is None else a.total for a in (self.A, self.G, self.diag, self.efb))}

    def add(self, x: torch.Tensor, grads: list[torch.Tensor], max_chunk: int) -> None:
        """Add one batch: ``x`` the module input, ``grads`` one output gradient per label draw."""
        if self.info.diag_only:  # normalisation layer: per-example gradients of [γ, β] directly
            if self.diag is not None:
                for g in grads:
                    self.diag.add(norm_grads(self.module, x, g).square_().sum(0), 1.0 / len(grads))
            return
        m, n = self.info.shape
        B = x.shape[0]
        T = num_positions(self.module, x)
        kfac = self.A is not None
        pairs = T <= PAIRS_MAX_T and self.force_order != "form"
        order = None
        if self.efb is not None:
            order = "rotate" if pairs else (self.force_order or efb_contraction_order(m, n, T, have_d=kfac))
        diag_apart = kfac and not pairs and order != "form" and _per_example_in_cache(x, B * m * n)
        need_d = (kfac and not pairs and not diag_apart) or order == "form"
        per = max(T * n, T * m, m * n if need_d else 0, (T * (T + 1) // 2) * max(m, n) if pairs else 0, 1)
        bs = max(1, min(B, max_chunk // per))
        for i0 in range(0, B, bs):
            i1 = min(B, i0 + bs)
            a3 = self._rows(x[i0:i1] if bs < B else x)  # (b, T, n)
            ar = a3.reshape(-1, n)
            if kfac:
                self.A.syrk(ar, 1.0 / T)
            a3_rot = (ar @ self.U_A).view(a3.shape) if order == "rotate" else None
            for g in grads:
                g3 = layer_output_grads(self.module, g[i0:i1] if bs < B else g)  # (b, T, m)
                self._add_draw(a3, a3_rot, g3, 1.0 / len(grads), pairs=pairs, order=order, need_d=need_d)
                if diag_apart:
                    _square_sum_per_example(self.diag, g3, a3, 1.0 / len(grads))

    def _add_draw(self, a3, a3_rot, g3, weight: float, *, pairs: bool, order: str | None, need_d: bool) -> None:
        """One label draw's output gradients ``g3`` (b, T, m) against the inputs ``a3`` (b, T, n);
        the diagonal here when it comes from the pair GEMM or the batched ``d`` (``need_d``)."""
        kfac = self.A is not None
        gr = g3.reshape(-1, g3.shape[2])
        if kfac:
            self.G.mm(gr.T, gr, weight)
            if pairs:
                _square_sum(self.diag, g3, a3, weight)
        d = torch.bmm(g3.transpose(1, 2), a3) if need_d else None  # (b, m, n) per-example gradients
        if order == "form":
            d_rot = torch.matmul(self.U_G.T, torch.matmul(d, self.U_A))
            self.efb.add(d_rot.square_().sum(0), weight)
            del d_rot
        elif order == "rotate":
            g3_rot = (gr @ self.U_G).view(g3.shape)
            if pairs:
                _square_sum(self.efb, g3_rot, a3_rot, weight)
            else:
                d_rot = torch.bmm(g3_rot.transpose(1, 2), a3_rot)
                self.efb.add(d_rot.square_().sum(0), weight)
                del d_rot
        if kfac and d is not None:
            self.diag.add(d.square_().sum(0), weight)
        del d


class GroupedConvSums:
    """All ``g`` groups of one grouped convolution, accumulated together with group-batched
    products (one Python step per convolution, not per group; depthwise convolutions have
    hundreds of groups). Per group ``k`` the sums are exactly those of its own
    :class:`LayerSums`: ``A_k = Σ a_k a_k^T / T``, ``G_k = Σ g_k g_k^T``, ``diag_k = Σ d_k∘d_k``
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

    def accumulators(self) -> list[Accumulator]:
        return [x for x in (self.A, self.G, self.diag, self.efb) if x is not None]

    def add(self, x: torch.Tensor, grads: list[torch.Tensor], max_chunk: int) -> None:
        g = self.conv.groups
        B = x.shape[0]
        T = num_positions(self.conv, x)
        m, n = self.conv.out_channels // g, (self.conv.in_channels // g) * math.prod(self.conv.kernel_size) + (
            self.conv.bias is not None)
        per = max(1, T * g * n, T * g * m, g * m * n * 2)
        bs = max(1, min(B, max_chunk // per))
        per_draw = 1.0 / len(grads)
        for i0 in range(0, B, bs):
            i1 = min(B, i0 + bs)
            a = group_rows(self.conv, x[i0:i1])  # (b, T, g, n)
            if self.A is not None:
                self.A.add(torch.einsum("btgi,btgj->gij", a, a), 1.0 / T)
            for gr in grads:
                q = group_output_grads(self.conv, gr[i0:i1])  # (b, T, g, m)
                d = torch.einsum("btgm,btgn->bgmn", q, a)  # per-example gradients of every group
                if self.G is not None:
                    self.G.add(torch.einsum("btgi,btgj->gij", q, q), per_draw)
                    self.diag.add(d.square().sum(0), per_draw)
                if self.efb is not None:
                    self.efb.add(torch.matmul(self.U_G.transpose(1, 2), torch.matmul(d, self.U_A)).square_().sum(0), per_draw)
                del d

    def totals(self) -> dict[str, tuple]:
        parts = [None if a is None else a.total for a in (self.A, self.G, self.diag, self.efb)]
        return {k: tuple(None if t is None else t[i].clone() for t in parts) for i, k in enumerate(self.names)}
