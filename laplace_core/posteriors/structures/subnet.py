"""Subnetwork Laplace posterior (Daxberger et al. 2021, §3-4, eq. 4).

A full-covariance Gaussian over ``S`` selected weights ``w_S`` (any layers, any
entries of their ``W~``), every other weight fixed at its MAP value (a Dirac delta)::

    q(w) = N(w_S; w*_S, P_S^{-1}) ∏_{r ∉ S} δ(w_r − w*_r),   P_S = N F_S + τ' I   (S x S)

``F_S = F_sum / count`` is the ``S x S`` (MC / empirical / GGN) Fisher over the
subnetwork (:func:`laplace_core.curvature.subnet_fisher.collect_subnet_fisher`), ``N`` = ``n_data`` and
``τ' = τ · prior_scale`` with ``prior_scale = S / D_total`` (Daxberger et al. §4,
appendix C: keeps the magnitude of the GLM kernel ``J Σ J^T``; ``D_total`` = weights of
all curvature layers) or ``1`` (unscaled).

The covariance couples layers, so this is a :class:`~.base.Posterior` subclass whose
maps act on whole ``name -> W~`` dicts: per layer it holds a
:class:`SubnetLayerView` (the vec positions of the selected entries, in ``vec``
column-stacking order, and their offset in the length-``S`` subnetwork vector, which
is ordered by layer (model order) then vec position). With ``P_S = L L^T`` (Cholesky):

* ``scale_matvec(z)``: ``F z`` with ``F = L^{-T}`` (``F F^T = P_S^{-1}``) on the gathered
  ``z_S``; zero outside the subnetwork.
* ``covariance_matvec(v)``: ``P_S^{-1} v_S`` (two triangular solves), zero outside.
* ``precision_matvec(v)``: ``P_S v_S``, zero outside (the precision of MAP weights is
  infinite; this is the subnetwork block).
* ``to_dense()``: ``P_S`` (``S x S``).

Storage: the symmetric ``F_S`` (``S(S+1)/2`` numbers counted; the full ``S x S`` is
written to disk) plus ``S`` indices; :meth:`SubnetPosterior.num_stored` returns
``S(S+1)/2 + S``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import torch

from .base import LayerPosterior, Posterior, unvec, vec
from .diag import check_hyper

__all__ = ["SubnetLayerView", "SubnetPosterior", "SUBNET_KEY"]

SUBNET_KEY = "__subnet__"
"""Prefix of the ``S x S`` tensors in :meth:`SubnetPosterior.state_dict` (not a layer name)."""


class SubnetLayerView(LayerPosterior):
    """One layer's part of a :class:`SubnetPosterior`: which vec positions of ``W~``
    (``m x n``) are in the subnetwork (``index``, int64, ascending) and where they start
    in the length-``S`` subnetwork vector (``offset``). The layer alone is not a
    Gaussian (its covariance is coupled to other layers): the per-layer linear maps
    raise; use the :class:`SubnetPosterior` methods."""

    method: ClassVar[str] = "subnet"

    def __init__(self, index: torch.Tensor, shape: tuple[int, int], offset: int):
        m, n = (int(s) for s in shape)
        if index.dim() != 1 or index.dtype != torch.int64:
            raise ValueError(f"SubnetLayerView: index must be a 1-D int64 tensor, got {index.dtype} {tuple(index.shape)}")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= m * n):
            raise ValueError(f"SubnetLayerView: index out of range [0, {m * n})")
        if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError("SubnetLayerView: index must be strictly increasing (vec order, no duplicates)")
        self.index = index.contiguous()
        self._shape = (m, n)
        self.offset = int(offset)

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def size(self) -> int:
        """``S_l``: selected weights in this layer."""
        return int(self.index.numel())

    def mask(self) -> torch.Tensor:
        """Boolean ``m x n`` mask of the selected entries."""
        m, n = self._shape
        flat = torch.zeros(m * n, dtype=torch.bool, device=self.index.device)
        flat[self.index] = True
        return unvec(flat, m, n)

    def _coupled(self, what: str):
        raise ValueError(
            f"subnet posterior: {what} is not defined per layer (the covariance couples layers); "
            "use the SubnetPosterior's own method on a dict name -> W~"
        )

    def precision_matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._coupled("precision_matvec")

    def scale_matvec(self, z: torch.Tensor) -> torch.Tensor:
        self._coupled("scale_matvec")

    def covariance_matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._coupled("covariance_matvec")

    def marginal_variance(self) -> torch.Tensor:
        self._coupled("marginal_variance")

    def to_dense(self) -> torch.Tensor:
        self._coupled("to_dense")

    def num_stored(self) -> int:
        return self.size

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"index": self.index}

    def meta(self) -> dict[str, Any]:
        return {"m": self._shape[0], "n": self._shape[1], "offset": self.offset}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "SubnetLayerView":
        return cls(tensors["index"].to(torch.int64), (meta["m"], meta["n"]), meta["offset"])


@dataclasses.dataclass(frozen=True, eq=False)
class SubnetPosterior(Posterior):
    """Full-covariance Laplace over a subnetwork; all other weights MAP (module docstring).

    ``layers``: name -> :class:`SubnetLayerView` for every curvature layer (model order;
    a layer may select no weight). ``fisher``: ``F_S = F_sum / count`` (``S x S``,
    symmetric). ``prior_precision`` is the user's ``τ``; the subnetwork uses
    ``τ' = τ · prior_scale``. ``n_data`` = ``N``.
    """

    method: str = "subnet"
    layers: dict = dataclasses.field(default_factory=dict)
    n_data: float = 1.0
    prior_precision: float = 1.0
    rank: int | None = None
    info: dict = dataclasses.field(default_factory=dict)
    fisher: torch.Tensor | None = None
    prior_scale: float = 1.0

    def __post_init__(self):
        if self.method != "subnet":
            raise ValueError(f"SubnetPosterior.method must be 'subnet', got {self.method!r}")
        if self.fisher is None or self.fisher.dim() != 2 or self.fisher.shape[0] != self.fisher.shape[1]:
            raise ValueError(f"SubnetPosterior: fisher must be a square S x S tensor, got "
                             f"{None if self.fisher is None else tuple(self.fisher.shape)}")
        N, tau = check_hyper(self.n_data, self.prior_precision)
        scale = float(self.prior_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"SubnetPosterior: prior_scale must be a finite number > 0, got {self.prior_scale!r}")
        S = self.fisher.shape[0]
        offset = 0
        for k, lp in self.layers.items():
            if not isinstance(lp, SubnetLayerView):
                raise ValueError(f"SubnetPosterior: layer {k!r} is {type(lp).__name__}, expected SubnetLayerView")
            if lp.offset != offset:
                raise ValueError(f"SubnetPosterior: layer {k!r} has offset {lp.offset}, expected {offset} (model order)")
            offset += lp.size
        if offset != S:
            raise ValueError(f"SubnetPosterior: the layers select {offset} weights but fisher is {S} x {S}")
        if S == 0:
            raise ValueError("SubnetPosterior: the subnetwork is empty (S = 0)")
        f64 = torch.float64
        F = self.fisher.to(f64)
        P = N * 0.5 * (F + F.T) + (tau * scale) * torch.eye(S, dtype=f64, device=F.device)
        L, info = torch.linalg.cholesky_ex(P)
        if int(info) != 0:
            raise ValueError(
                f"subnet precision N F_S + tau' I is not positive definite (Cholesky failed at column {int(info)}); "
                "use prior_precision > 0"
            )
        object.__setattr__(self, "n_data", N)
        object.__setattr__(self, "prior_precision", tau)
        object.__setattr__(self, "prior_scale", scale)
        object.__setattr__(self, "_chol", L.to(self.fisher.dtype))

    # ---------------------------------------------------------------- sizes
    @property
    def size(self) -> int:
        """``S``."""
        return int(self.fisher.shape[0])

    @property
    def d_total(self) -> int:
        """Weights in all curvature layers."""
        return int(sum(lp.shape[0] * lp.shape[1] for lp in self.layers.values()))

    @property
    def effective_prior_precision(self) -> float:
        """``τ' = τ · prior_scale``."""
        return self.prior_precision * self.prior_scale

    @property
    def cholesky(self) -> torch.Tensor:
        """Lower Cholesky factor ``L`` of ``P_S`` (``S x S``)."""
        return self._chol

    def masks(self) -> dict[str, torch.Tensor]:
        """``name -> bool m x n`` selection masks."""
        return {k: lp.mask() for k, lp in self.layers.items()}

    # ---------------------------------------------------------------- gather / scatter
    def gather(self, v: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``(..., S)`` subnetwork entries of a dict ``name -> (..., m, n)``; missing layers count as 0."""
        parts, lead = [], None
        for k, t in v.items():
            if k not in self.layers:
                raise ValueError(f"layer {k!r} is not in the subnet posterior; layers: {list(self.layers)}")
            if tuple(t.shape[-2:]) != tuple(self.layers[k].shape) or t.dim() not in (2, 3):
                raise ValueError(f"layer {k!r}: expected shape {self.layers[k].shape} or (k, m, n), got {tuple(t.shape)}")
            lead = tuple(t.shape[:-2])
        if lead is None:
            raise ValueError("empty dict: nothing to gather")
        ref = next(iter(v.values()))
        for k, lp in self.layers.items():
            if k in v:
                parts.append(vec(v[k]).index_select(-1, lp.index.to(ref.device)))
            else:
                parts.append(ref.new_zeros(*lead, lp.size))
        return torch.cat(parts, dim=-1)

    def scatter(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`gather`: ``(..., S)`` -> ``name -> (..., m, n)``, zero outside the subnetwork."""
        if x.shape[-1] != self.size:
            raise ValueError(f"expected a last dimension of size S = {self.size}, got {tuple(x.shape)}")
        out = {}
        lead = tuple(x.shape[:-1])
        for k, lp in self.layers.items():
            m, n = lp.shape
            flat = x.new_zeros(*lead, m * n)
            flat.index_copy_(-1, lp.index.to(x.device), x[..., lp.offset:lp.offset + lp.size])
            out[k] = unvec(flat, m, n)
        return out

    # ---------------------------------------------------------------- linear maps (dicts)
    def _solve_upper(self, x: torch.Tensor) -> torch.Tensor:
        """``L^{-T} x`` for ``x`` (..., S)."""
        L = self._chol.to(x.dtype)
        flat = x.reshape(-1, self.size).T
        return torch.linalg.solve_triangular(L.T, flat, upper=True).T.reshape(x.shape)

    def precision_matvec(self, v: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``P_S v_S`` scattered (zero outside the subnetwork)."""
        x = self.gather(v)
        L = self._chol.to(x.dtype)
        return self.scatter((x @ L) @ L.T)

    def scale_matvec(self, z: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``L^{-T} z_S`` scattered: ``F F^T = P_S^{-1}``; entries of ``z`` outside the subnetwork are ignored."""
        return self.scatter(self._solve_upper(self.gather(z)))

    def covariance_matvec(self, v: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``P_S^{-1} v_S`` scattered (``cholesky_solve``)."""
        x = self.gather(v)
        flat = x.reshape(-1, self.size).T
        out = torch.cholesky_solve(flat, self._chol.to(x.dtype), upper=False).T.reshape(x.shape)
        return self.scatter(out)

    def sample(self, n: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``n`` draws ``name -> (n, m, n_in)``: ``z ~ N(0, I_S)`` from ``generator``, then ``L^{-T} z``."""
        z = torch.randn((n, self.size), generator=generator, dtype=self._chol.dtype, device=self._chol.device)
        return self.scatter(self._solve_upper(z))

    def sample_factored(self, n: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """No per-layer factored form (the covariance couples layers): the deltas of :meth:`sample`."""
        return self.sample(n, generator)

    def to_dense(self, layer: str | None = None) -> torch.Tensor:
        """``P_S`` (``S x S``, subnetwork order). ``layer`` must be None (the matrix spans all layers)."""
        if layer is not None:
            raise ValueError("subnet posterior: to_dense() returns the whole S x S precision; pass no layer")
        if self.size > 20_000:
            raise ValueError(f"to_dense() is for small subnetworks (tests); S = {self.size}")
        L = self._chol
        return L @ L.T

    def covariance(self) -> torch.Tensor:
        """``P_S^{-1}`` (``S x S``), via the Cholesky factor."""
        return torch.cholesky_inverse(self._chol)

    def marginal_variance(self) -> dict[str, torch.Tensor]:
        """``diag(P_S^{-1})`` scattered; 0 for MAP weights. ``O(S³)``."""
        eye = torch.eye(self.size, dtype=self._chol.dtype, device=self._chol.device)
        Linv = torch.linalg.solve_triangular(self._chol, eye, upper=False)
        return self.scatter(Linv.square().sum(0))

    def num_stored(self) -> int:
        S = self.size
        return S * (S + 1) // 2 + S

    # ---------------------------------------------------------------- hyperparameters
    def with_hyper(self, n_data: float, prior_precision: float) -> "SubnetPosterior":
        """Same ``F_S`` under new ``(N, τ)`` (one ``S x S`` Cholesky); ``prior_scale`` kept."""
        N, tau = check_hyper(n_data, prior_precision)
        return dataclasses.replace(self, n_data=N, prior_precision=tau, info=dict(self.info))

    # ---------------------------------------------------------------- serialisation
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["tensors"][f"{SUBNET_KEY}/fisher"] = self.fisher.detach().contiguous()
        sd["meta"]["subnet"] = {"size": self.size, "prior_scale": self.prior_scale, "d_total": self.d_total}
        return sd

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "SubnetPosterior":
        meta = state["meta"]
        if meta.get("format") != "infoform.posterior" or meta.get("method") != "subnet":
            raise ValueError("not a subnet posterior (format/method tag)")
        tensors = state["tensors"]
        layers = {}
        for k in meta["order"]:
            lm = dict(meta["layers"][k])
            lm.pop("method", None)
            layers[k] = SubnetLayerView.from_tensors({"index": tensors[f"{k}/index"]}, lm)
        sub = meta["subnet"]
        return cls(
            method="subnet", layers=layers, n_data=float(meta["n_data"]),
            prior_precision=float(meta["prior_precision"]), rank=meta.get("rank"),
            info=dict(meta.get("info", {})), fisher=tensors[f"{SUBNET_KEY}/fisher"],
            prior_scale=float(sub["prior_scale"]),
        )
