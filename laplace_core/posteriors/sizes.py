"""Numbers each posterior structure stores, counted from layer shapes (Lee et al. 2020, Table 3).

Per curvature layer with ``W~ = [W, b]`` of shape ``m x n`` (``m`` outputs, ``n`` fan-in
incl. the bias column; docs/design.md §1), the counts are:

==============  ==========================================  =================================
method          stores                                      numbers
==============  ==========================================  =================================
``diag``        Fisher diagonal (``m x n``)                 ``mn``
``kfac``        factors ``A`` (``n x n``), ``G`` (``m x m``)  ``n² + m²``
``kfac_exact``  ``U_A``, ``U_G`` + eigenvalue matrix        ``n² + m² + mn``
``efb``         ``U_A``, ``U_G``, ``Λ`` (``m x n``)         ``n² + m² + mn``
``inf``         ``U_g = U_G[:, I]``, ``U_a = U_A[:, J]``,   ``|I| m + |J| n + |I||J| + mn``
                ``Λ_L = Λ[I][:, J]``, ``D`` (``m x n``)
==============  ==========================================  =================================

Normalisation layers (kind ``"norm"``, ``norm_layers="diag"``) have a diagonal block under
every method: each method stores ``mn`` numbers for them (INF: ``D`` only, exact).

Coverage (:attr:`SizeReport.coverage`): weights under the posterior (``Σ mn``), weights left
at MAP and the module types they are in (from the model, when one is given).

Table 3 of the paper follows the same rule (resnet18: Diag 11,679,912 = every Conv/Linear weight
and bias, BatchNorm excluded; KFAC 95,013,546 = ``Σ n² + m²``; EFB = KFAC + Diag).
Sizes are reported in MB = 2^20 bytes at 4 bytes per number (float32), so resnet18's
Diag is 44.6 MB as in the paper.

INF's ``I``/``J`` (the distinct rows/columns of the top-``K`` entries of ``Λ``, Algorithm 1)
depend on the EFB eigenvalues, i.e. on data. Without statistics only a **lower bound** is
available: the smallest ``a m + b n + a b + mn`` over all row/column counts ``a <= m``,
``b <= n`` that can hold ``K`` entries (``a b >= K``), see :func:`inf_lower_bound`.
With statistics (``efb`` sums), :func:`count_sizes` uses the real ``I``/``J`` from
:func:`laplace_core.posteriors.sparsify.sparsify`.

Pure functions of shapes: no data, no weights, no Ray; a model on the ``meta`` device works.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .methods import layer_methods, table3_methods
from ..curvature.statistics import CurvatureStatistics, LayerInfo

__all__ = [
    "METHODS",
    "BYTES_PER_NUMBER",
    "MB",
    "LayerSizes",
    "SizeReport",
    "shape_counts",
    "inf_count",
    "inf_lower_bound",
    "count_sizes",
    "model_sizes",
    "parameters_at_map",
    "statistics_sizes",
    "to_mb",
    "format_table",
]

METHODS: tuple[str, ...] = layer_methods()
BYTES_PER_NUMBER = 4  # float32, as in the paper's Table 3
MB = 2**20  # bytes per MB (the paper's 44.6 MB for resnet18 Diag is 11,679,912 * 4 / 2^20)


def to_mb(numbers: int, bytes_per_number: int = BYTES_PER_NUMBER) -> float:
    """Size in MB (2^20 bytes) of ``numbers`` values of ``bytes_per_number`` bytes each."""
    return numbers * bytes_per_number / MB


def _check_shape(m: int, n: int) -> None:
    if int(m) != m or int(n) != n or m < 1 or n < 1:
        raise ValueError(f"layer shape must be two positive integers, got m={m!r}, n={n!r}")


def shape_counts(m: int, n: int) -> dict[str, int]:
    """Numbers stored for one ``m x n`` layer by the shape-only methods (see module table)."""
    _check_shape(m, n)
    m, n = int(m), int(n)
    return {
        "diag": m * n,
        "kfac": n * n + m * m,
        "kfac_exact": n * n + m * m + m * n,
        "efb": n * n + m * m + m * n,
    }


def inf_count(m: int, n: int, n_rows: int, n_cols: int) -> int:
    """INF numbers stored: ``|I| m + |J| n + |I||J| + mn`` (``U_g``, ``U_a``, ``Λ_L``, ``D``).

    ``n_rows = |I|`` indexes rows of ``Λ`` (eigenvectors of ``G``, each of length ``m``),
    ``n_cols = |J|`` columns (eigenvectors of ``A``, length ``n``).
    """
    _check_shape(m, n)
    if not (1 <= n_rows <= m and 1 <= n_cols <= n):
        raise ValueError(f"need 1 <= |I| <= m={m} and 1 <= |J| <= n={n}, got |I|={n_rows}, |J|={n_cols}")
    return n_rows * m + n_cols * n + n_rows * n_cols + m * n


def _check_rank(rank: int) -> int:
    if isinstance(rank, bool) or int(rank) != rank or rank < 1:
        raise ValueError(f"rank K must be a positive integer, got {rank!r}")
    return int(rank)


def inf_lower_bound(m: int, n: int, rank: int) -> tuple[int, int, int]:
    """Smallest possible INF count for an ``m x n`` layer at rank ``K`` without statistics.

    Returns ``(count, a, b)``: the minimum of ``a m + b n + a b + mn`` over ``1 <= a <= m``,
    ``1 <= b <= n`` with ``a b >= K`` (``K`` entries need at least that many rows/columns),
    attained at ``(a, b)``. For fixed ``a`` the minimum is at ``b = ceil(K / a)``.
    ``K`` larger than ``mn`` keeps everything (``K`` is taken as ``mn``).
    """
    _check_shape(m, n)
    k = min(_check_rank(rank), m * n)
    best: tuple[int, int, int] | None = None
    for a in range(1, m + 1):
        b = -(-k // a)
        if b > n:
            continue
        c = inf_count(m, n, a, b)
        if best is None or c < best[0]:
            best = (c, a, b)
    assert best is not None  # a = m, b = ceil(k/m) <= n always fits
    return best


@dataclass(frozen=True)
class LayerSizes:
    """Counts for one layer. ``inf`` is exact when ``inf_rows``/``inf_cols`` came from
    statistics, else ``None`` and ``inf_lower`` holds the bound."""

    name: str
    m: int
    n: int
    counts: dict[str, int]
    inf: int | None = None
    inf_rows: int | None = None
    inf_cols: int | None = None
    inf_lower: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "m": self.m,
            "n": self.n,
            **self.counts,
            "inf": self.inf,
            "inf_rows": self.inf_rows,
            "inf_cols": self.inf_cols,
            "inf_lower_bound": self.inf_lower,
        }


@dataclass(frozen=True)
class SizeReport:
    """Per-layer and total counts for every method.

    ``totals[method]`` is the exact total for ``diag``/``kfac``/``kfac_exact``/``efb`` and for
    ``inf`` when statistics were given; otherwise ``totals["inf"]`` is ``None`` and
    ``inf_lower_bound`` is the bound (``None`` when no rank was given).
    """

    layers: tuple[LayerSizes, ...]
    rank: int | None
    excluded: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    inf_from_statistics: bool = False
    at_map: dict[str, int] | None = None  # module type -> parameters left at MAP (None: no model given)
    norm_layers: str = "map"
    selection: str = "all"  # the layer selection (laplace_core.curvature.layer_selection.selection_label)
    at_map_why: dict[str, str] | None = None  # module type -> its parameters at MAP and why

    @property
    def totals(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {
            k: sum(ls.counts[k] for ls in self.layers) for k in table3_methods()
        }
        out["inf"] = sum(ls.inf for ls in self.layers) if self.inf_from_statistics else None  # type: ignore[misc]
        return out

    @property
    def inf_lower_bound(self) -> int | None:
        if self.rank is None:
            return None
        return sum(ls.inf_lower for ls in self.layers)  # type: ignore[misc]

    @property
    def num_weights(self) -> int:
        """Weights (incl. biases) under the posterior, ``Σ mn``."""
        return sum(ls.m * ls.n for ls in self.layers)

    @property
    def coverage(self) -> dict[str, Any]:
        """``weights_under_posterior``, ``weights_at_map``, ``total_parameters``, ``fraction``
        (under / total) and ``at_map_by_type`` (module type -> parameters at MAP); the last
        four are ``None`` without a model."""
        under = self.num_weights
        if self.at_map is None:
            return {"weights_under_posterior": under, "weights_at_map": None, "total_parameters": None,
                    "fraction": None, "at_map_by_type": None, "norm_layers": self.norm_layers,
                    "layers": self.selection}
        at_map = sum(self.at_map.values())
        return {"weights_under_posterior": under, "weights_at_map": at_map, "total_parameters": under + at_map,
                "fraction": under / max(1, under + at_map), "at_map_by_type": dict(self.at_map),
                "at_map_why": dict(self.at_map_why or {}), "norm_layers": self.norm_layers, "layers": self.selection}

    def rows(self) -> list[dict[str, Any]]:
        """One row per method: ``method``, ``numbers`` (None when unknown), ``mb``, ``note``."""
        totals = self.totals
        out = []
        for meth in METHODS:
            num = totals[meth]
            note = ""
            if meth == "inf":
                if self.rank is None:
                    note = "needs --rank K"
                elif num is None:
                    lb = self.inf_lower_bound
                    out.append(
                        {
                            "method": meth,
                            "numbers": None,
                            "mb": None,
                            "lower_bound": lb,
                            "lower_bound_mb": to_mb(lb),
                            "note": f"rank {self.rank}: exact count needs --stats; lower bound only",
                        }
                    )
                    continue
                else:
                    note = f"rank {self.rank}, from statistics"
            out.append({"method": meth, "numbers": num, "mb": None if num is None else to_mb(num), "note": note})
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "rank": self.rank,
            "bytes_per_number": BYTES_PER_NUMBER,
            "mb_bytes": MB,
            "num_layers": len(self.layers),
            "num_weights": self.num_weights,
            "inf_from_statistics": self.inf_from_statistics,
            "methods": {r.pop("method"): r for r in self.rows()},
            "layers": [ls.to_json() for ls in self.layers],
            "excluded": dict(self.excluded),
            "coverage": self.coverage,
        }


def _default_sparsify() -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    from .sparsify import sparsify  # Algorithm 1

    return sparsify


def count_sizes(
    infos: Mapping[str, LayerInfo],
    *,
    rank: int | None = None,
    eigenvalues: Mapping[str, torch.Tensor] | None = None,
    excluded: Mapping[str, str] | None = None,
    model: str | None = None,
    sparsify: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> SizeReport:
    """Count the numbers stored per layer and method.

    ``infos``: layer name -> :class:`LayerInfo` (``m = out_features``, ``n = in_features``).
    ``eigenvalues``: optional layer name -> EFB eigenvalues ``Λ`` (``m x n``, any positive scale);
    with ``rank`` given, INF's ``I``/``J`` come from ``sparsify(Λ, K) -> (rows, cols)``
    (Algorithm 1, default :func:`laplace_core.posteriors.sparsify.sparsify`) and the INF count is exact.
    """
    if rank is not None:
        rank = _check_rank(rank)
    if eigenvalues is not None:
        if rank is None:
            raise ValueError("eigenvalues were given but no rank K: the INF count needs both")
        missing = [k for k, i in infos.items() if k not in eigenvalues and not i.diag_only]
        if missing:
            raise ValueError(f"EFB eigenvalues missing for layers {missing[:5]}")
        sparsify = sparsify or _default_sparsify()
    layers = []
    for name, info in infos.items():
        m, n = info.shape
        if info.diag_only:  # normalisation layer: a diagonal block under every method
            c = shape_counts(m, n)["diag"]
            layers.append(LayerSizes(name, m, n, {k: c for k in table3_methods()},
                                     c if eigenvalues is not None else None, None, None,
                                     c if rank is not None else None))
            continue
        counts = shape_counts(m, n)
        inf = rows = cols = lower = None
        if rank is not None:
            lower = inf_lower_bound(m, n, rank)[0]
        if eigenvalues is not None:
            lam = eigenvalues[name]
            if tuple(lam.shape) != (m, n):
                raise ValueError(f"layer {name!r}: eigenvalues have shape {tuple(lam.shape)}, expected {(m, n)}")
            r, c = sparsify(lam, min(rank, m * n))  # type: ignore[misc, arg-type]
            rows, cols = int(torch.as_tensor(r).numel()), int(torch.as_tensor(c).numel())
            inf = inf_count(m, n, rows, cols)
        layers.append(LayerSizes(name, m, n, counts, inf, rows, cols, lower))
    return SizeReport(
        layers=tuple(layers),
        rank=rank,
        excluded=dict(excluded or {}),
        model=model,
        inf_from_statistics=eigenvalues is not None,
    )


def statistics_sizes(
    stats: CurvatureStatistics,
    *,
    rank: int | None = None,
    model: str | None = None,
    sparsify: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> SizeReport:
    """:func:`count_sizes` for a statistics file; INF is exact when it holds EFB sums and a
    rank is given (``Λ = efb / efb_count``)."""
    eig = None
    if rank is not None and stats.has_efb:
        eig = {k: v.efb / stats.efb_count for k, v in stats.layers.items()  # type: ignore[operator]
               if not stats.infos[k].diag_only}
    return count_sizes(stats.infos, rank=rank, eigenvalues=eig, excluded=stats.excluded, model=model, sparsify=sparsify)


def model_sizes(
    model: nn.Module,
    *,
    rank: int | None = None,
    stats: CurvatureStatistics | None = None,
    name: str | None = None,
    sparsify: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    norm_layers: str = "map",
    layers="all",
) -> SizeReport:
    """Counts for ``model``'s curvature layers (``find_layers``; works on the meta device).

    With ``stats`` (same layers and shapes as the model, else ``ValueError``) and ``rank``,
    the INF count is exact. ``norm_layers``, ``layers``: as in :func:`laplace_core.curvature.layers.find_layers`
    (a layer selection counts the selected layers only; the others are at MAP).
    The report's coverage counts the parameters left at MAP per module type.
    """
    import dataclasses

    from ..curvature.layer_selection import selection_label
    from ..curvature.layers import find_layers

    _, infos, excluded = find_layers(model, norm_layers=norm_layers, layers=layers)
    label = selection_label(layers)
    at_map, why = parameters_at_map(model, excluded), at_map_reasons(model, excluded)
    if stats is None:
        rep = count_sizes(infos, rank=rank, excluded=excluded, model=name)
        return dataclasses.replace(rep, at_map=at_map, norm_layers=norm_layers, selection=label, at_map_why=why)
    want = {k: v.shape for k, v in infos.items()}
    have = {k: v.shape for k, v in stats.infos.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:3]
        raise ValueError(f"statistics do not match the model's layers (name, (m, n)) differences: {diff}")
    rep = statistics_sizes(stats, rank=rank, model=name, sparsify=sparsify)
    return SizeReport(rep.layers, rep.rank, dict(excluded), name, rep.inf_from_statistics, at_map, norm_layers, label,
                      why)


def _why(mod: nn.Module, reason: str) -> str:
    from ..curvature.layers import NORM_TYPES

    if not reason.endswith("is not in the layer registry (point estimate)"):
        return reason
    if isinstance(mod, NORM_TYPES):
        return "normalisation layer at MAP (--norm-layers diag puts it under a diagonal posterior)"
    if any(p.dim() == 0 for p in mod.parameters(recurse=False)):
        return "scalar parameters of no Linear, Conv or normalisation module: point estimates"
    return ("parameters of no Linear, Conv or normalisation module: at MAP (--norm-layers diag puts them under "
            "their exact Fisher diagonal, like the norm layers)")


def at_map_reasons(model: nn.Module, excluded: Mapping[str, str]) -> dict[str, str]:
    """Module type -> ``"{its parameters' names}: why"`` over the ``excluded`` modules that own
    trainable parameters (what :func:`parameters_at_map` counts)."""
    mods = dict(model.named_modules())
    names: dict[str, set[str]] = {}
    why: dict[str, str] = {}
    for name, reason in excluded.items():
        mod = mods.get(name)
        own = [k for k, p in mod.named_parameters(recurse=False) if p.requires_grad] if mod is not None else []
        if own:
            names.setdefault(type(mod).__name__, set()).update(own)
            why.setdefault(type(mod).__name__, _why(mod, reason))
    return {t: f"{', '.join(sorted(names[t]))}: {why[t]}" for t in names}


def parameters_at_map(model: nn.Module, excluded: Mapping[str, str]) -> dict[str, int]:
    """Module type -> trainable parameters it owns directly, over the ``excluded`` modules
    (those left at MAP), most first. Works on the meta device."""
    mods = dict(model.named_modules())
    out: dict[str, int] = {}
    for name in excluded:
        mod = mods.get(name)
        if mod is None:
            continue
        k = sum(p.numel() for p in mod.parameters(recurse=False) if p.requires_grad)
        if k:
            out[type(mod).__name__] = out.get(type(mod).__name__, 0) + int(k)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _layers_note(cov: Mapping[str, Any]) -> str:
    return "" if cov.get("layers", "all") == "all" else f", layers: {cov['layers']}"


def format_table(report: SizeReport) -> str:
    """Plain-text table: method, numbers stored, MB (2^20 bytes at 4 bytes/number), note."""
    head = f"{'method':<11} {'numbers stored':>16} {'MB':>10}  note"
    lines = []
    if report.model:
        lines.append(f"model: {report.model}")
    lines.append(
        f"curvature layers: {len(report.layers)}, weights under the posterior: {report.num_weights:,}; "
        f"excluded (point estimate): {len(report.excluded)}"
    )
    cov = report.coverage
    if cov["total_parameters"] is not None:
        by = ", ".join(f"{k} {v:,}" for k, v in cov["at_map_by_type"].items()) or "none"
        lines.append(f"coverage: {100 * cov['fraction']:.2f}% of {cov['total_parameters']:,} parameters under the "
                     f"posterior (norm layers: {cov['norm_layers']}{_layers_note(cov)}); at MAP: {cov['weights_at_map']:,} ({by})")
        lines += [f"  at MAP in {t}: {w}" for t, w in cov["at_map_why"].items()]
    lines += [head, "-" * len(head)]
    for r in report.rows():
        if r["numbers"] is None and "lower_bound" in r:
            lines.append(f"{r['method']:<11} {'>= ' + format(r['lower_bound'], ','):>16} {'>= ' + format(r['lower_bound_mb'], '.1f'):>10}  {r['note']}")
        elif r["numbers"] is None:
            lines.append(f"{r['method']:<11} {'-':>16} {'-':>10}  {r['note']}")
        else:
            lines.append(f"{r['method']:<11} {r['numbers']:>16,} {r['mb']:>10.1f}  {r['note']}")
    lines.append(f"MB = 2^20 bytes at {BYTES_PER_NUMBER} bytes per number (Lee et al. 2020, Table 3 counting).")
    return "\n".join(lines)

