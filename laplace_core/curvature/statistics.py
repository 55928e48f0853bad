"""Curvature statistics: per-layer sums plus the example count, mergeable by addition.

Conventions (docs/design.md §1). A layer's weight with bias appended is ``W~ = [W, b]`` of
shape ``m x n`` (``m`` outputs, ``n`` fan-in incl. the bias column). For ``M``
examples with per-example log-likelihood gradients ``d_k`` (``m x n``):

* ``A``    (n x n): ``Σ_{k,t} a_{k,t} a_{k,t}^T / T``   (``T = 1`` for Linear)
* ``G``    (m x m): ``Σ_{k,t} g_{k,t} g_{k,t}^T``
* ``diag`` (m x n): ``Σ_k d_k ∘ d_k``                   (exact Fisher diagonal)
* ``efb``  (m x n): ``Σ_k (U_G^T d_k U_A)^2``           (EFB eigenvalue sums; second pass)

With ``mc_samples = S`` sampled labels per example, every output-gradient
quantity (``G``, ``diag``, ``efb``) is averaged over the ``S`` draws, so each
example still counts once in ``count``.

Normalisation layers (kind ``"norm"``, :mod:`laplace_core.curvature.layers`) carry only ``diag``
(``A``, ``G`` and ``efb`` are ``None``): their posterior is diagonal whatever the method.

``count`` is ``M`` for ``A``, ``G`` and ``diag``; ``efb_count`` is the number of
examples behind ``efb`` (the second pass may run on a subset). Averages are taken
only when a posterior is built. Everything here is a plain sum, so two shards
merge by addition (:meth:`CurvatureStatistics.merge`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["LayerInfo", "LayerStatistics", "CurvatureStatistics", "sum_fields", "flat_sums", "layers_from_sums",
           "zero_layer"]


@dataclass(frozen=True)
class LayerInfo:
    """Static description of one curvature layer.

    ``kind`` is the registry key (``"linear"`` or ``"conv2d"``); ``out_features`` is
    ``m``; ``in_features`` is ``n`` including the bias column; ``has_bias`` says
    whether the last column of ``W~`` is the bias; ``weight_shape`` is the module's
    own weight shape (e.g. ``(c_out, c_in, kh, kw)``).
    """

    name: str
    kind: str
    out_features: int
    in_features: int
    has_bias: bool
    weight_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """``(m, n)``: the shape of ``W~`` and of every per-weight matrix."""
        return (self.out_features, self.in_features)

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def diag_only(self) -> bool:
        """A normalisation layer: only the Fisher diagonal, a diagonal posterior block."""
        return self.kind == "norm"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["weight_shape"] = list(self.weight_shape)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "LayerInfo":
        return cls(
            name=str(d["name"]),
            kind=str(d["kind"]),
            out_features=int(d["out_features"]),
            in_features=int(d["in_features"]),
            has_bias=bool(d["has_bias"]),
            weight_shape=tuple(int(s) for s in d["weight_shape"]),
        )


@dataclass(frozen=True)
class LayerStatistics:
    """Sums for one layer. Shapes: ``A`` (n, n), ``G`` (m, m), ``diag`` (m, n),
    ``efb`` (m, n) or ``None`` when no eigenbasis pass has run. A normalisation layer
    has ``A = G = None`` (only its diagonal is collected)."""

    A: torch.Tensor | None
    G: torch.Tensor | None
    diag: torch.Tensor
    efb: torch.Tensor | None = None

    def merge(self, other: "LayerStatistics") -> "LayerStatistics":
        if (self.efb is None) != (other.efb is None):
            raise ValueError("cannot merge statistics with and without EFB sums")
        if (self.A is None) != (other.A is None):
            raise ValueError("cannot merge statistics with and without KFAC factors")
        return LayerStatistics(
            A=None if self.A is None else self.A + other.A,
            G=None if self.G is None else self.G + other.G,
            diag=self.diag + other.diag,
            efb=None if self.efb is None else self.efb + other.efb,
        )

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "LayerStatistics":
        def cv(t):
            return None if t is None else t.to(device=device, dtype=dtype)

        return LayerStatistics(A=cv(self.A), G=cv(self.G), diag=cv(self.diag), efb=cv(self.efb))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"diag": self.diag} if self.A is None else {"A": self.A, "G": self.G, "diag": self.diag}
        if self.efb is not None:
            out["efb"] = self.efb
        return out


def sum_fields(info: LayerInfo) -> tuple[str, ...]:
    """The pass-1 sums a layer has: ``("A", "G", "diag")``, or ``("diag",)`` for a
    normalisation layer (diagonal only)."""
    return ("diag",) if info.diag_only else ("A", "G", "diag")


def flat_sums(layers: Mapping[str, LayerStatistics], infos: Mapping[str, LayerInfo]) -> list[torch.Tensor]:
    """Every layer's pass-1 sums in ``infos`` order, :func:`sum_fields` each (for all-reduces)."""
    return [getattr(layers[k], f) for k, i in infos.items() for f in sum_fields(i)]


def layers_from_sums(tensors: list[torch.Tensor], infos: Mapping[str, LayerInfo]) -> dict[str, LayerStatistics]:
    """Inverse of :func:`flat_sums`."""
    out, it = {}, iter(tensors)
    for k, i in infos.items():
        got = {f: next(it) for f in sum_fields(i)}
        out[k] = LayerStatistics(A=got.get("A"), G=got.get("G"), diag=got["diag"])
    return out


def zero_layer(info: LayerInfo, dtype: torch.dtype, device) -> LayerStatistics:
    """Zero sums of one layer (a shard that saw no examples)."""
    m, n = info.shape
    z = {f: torch.zeros(*{"A": (n, n), "G": (m, m), "diag": (m, n)}[f], dtype=dtype, device=device)
         for f in sum_fields(info)}
    return LayerStatistics(A=z.get("A"), G=z.get("G"), diag=z["diag"])


@dataclass(frozen=True)
class CurvatureStatistics:
    """Per-layer sums plus counts; the unit that shards produce and merge.

    ``layers`` maps the module's qualified name to its sums, in model order;
    ``infos`` maps the same names to :class:`LayerInfo`. ``count`` = ``M``
    (examples behind ``A``, ``G``, ``diag``), ``efb_count`` = examples behind
    ``efb`` (0 when absent). ``skipped_batches`` counts batches dropped because
    their gradients were not finite. ``excluded`` lists modules with parameters
    that were left deterministic (name -> reason). ``fisher`` is ``"mc"`` or
    ``"empirical"``; ``mc_samples`` the label draws per example.
    """

    layers: dict[str, LayerStatistics]
    infos: dict[str, LayerInfo]
    count: int
    efb_count: int = 0
    skipped_batches: int = 0
    skipped_examples: int = 0
    fisher: str = "mc"
    mc_samples: int = 1
    excluded: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if list(self.layers) != list(self.infos):
            raise ValueError("layers and infos must list the same layer names in the same order")

    # ------------------------------------------------------------------ algebra
    def merge(self, other: "CurvatureStatistics") -> "CurvatureStatistics":
        """Sum of two shards' statistics (same model, same Fisher settings)."""
        if list(self.layers) != list(other.layers):
            raise ValueError("cannot merge statistics of different layer sets")
        if (self.fisher, self.mc_samples) != (other.fisher, other.mc_samples):
            raise ValueError(
                f"cannot merge fisher={self.fisher}/mc_samples={self.mc_samples} with "
                f"fisher={other.fisher}/mc_samples={other.mc_samples}"
            )
        return CurvatureStatistics(
            layers={k: self.layers[k].merge(other.layers[k]) for k in self.layers},
            infos=dict(self.infos),
            count=self.count + other.count,
            efb_count=self.efb_count + other.efb_count,
            skipped_batches=self.skipped_batches + other.skipped_batches,
            skipped_examples=self.skipped_examples + other.skipped_examples,
            fisher=self.fisher,
            mc_samples=self.mc_samples,
            excluded={**self.excluded, **other.excluded},
        )

    @staticmethod
    def merge_all(parts: list["CurvatureStatistics"]) -> "CurvatureStatistics":
        if not parts:
            raise ValueError("merge_all needs at least one statistics object")
        out = parts[0]
        for p in parts[1:]:
            out = out.merge(p)
        return out

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "CurvatureStatistics":
        return dataclasses.replace(self, layers={k: v.to(dtype, device) for k, v in self.layers.items()})

    def with_efb(self, efb: Mapping[str, torch.Tensor], efb_count: int) -> "CurvatureStatistics":
        """Copy with EFB sums (m x n per layer) from a second pass attached (none for the
        diagonal-only normalisation layers)."""
        layers = {}
        for k, v in self.layers.items():
            if self.infos[k].diag_only:
                layers[k] = v
                continue
            if k not in efb or efb[k] is None:
                raise ValueError(f"EFB sums missing for layer {k!r}")
            layers[k] = dataclasses.replace(v, efb=efb[k])
        return dataclasses.replace(self, layers=layers, efb_count=int(efb_count))

    @property
    def has_efb(self) -> bool:
        return self.efb_count > 0 and all(
            v.efb is not None for k, v in self.layers.items() if not self.infos[k].diag_only)

    # ------------------------------------------------------------------ (de)serialisation
    def meta(self) -> dict[str, Any]:
        """JSON-able metadata (everything except tensors)."""
        return {
            "format": "infoform.statistics",
            "version": 1,
            "count": self.count,
            "efb_count": self.efb_count,
            "skipped_batches": self.skipped_batches,
            "skipped_examples": self.skipped_examples,
            "fisher": self.fisher,
            "mc_samples": self.mc_samples,
            "excluded": dict(self.excluded),
            "layers": [self.infos[k].to_json() for k in self.layers],
        }

    def flat_tensors(self) -> dict[str, torch.Tensor]:
        """``{"<layer>/<A|G|diag|efb>": tensor}`` for safetensors."""
        out = {}
        for k, v in self.layers.items():
            for f, t in v.tensors().items():
                out[f"{k}/{f}"] = t.detach().contiguous()
        return out

    @classmethod
    def from_flat(cls, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> "CurvatureStatistics":
        if meta.get("format") != "infoform.statistics":
            raise ValueError("not an infoform statistics file (format tag missing)")
        infos = {d["name"]: LayerInfo.from_json(d) for d in meta["layers"]}
        layers = {}
        for name, info in infos.items():
            try:
                layers[name] = LayerStatistics(
                    A=None if info.diag_only else tensors[f"{name}/A"],
                    G=None if info.diag_only else tensors[f"{name}/G"],
                    diag=tensors[f"{name}/diag"],
                    efb=tensors.get(f"{name}/efb"),
                )
            except KeyError as e:
                raise ValueError(f"statistics file is missing tensor {e.args[0]!r}") from None
        return cls(
            layers=layers,
            infos=infos,
            count=int(meta["count"]),
            efb_count=int(meta.get("efb_count", 0)),
            skipped_batches=int(meta.get("skipped_batches", 0)),
            skipped_examples=int(meta.get("skipped_examples", 0)),
            fisher=str(meta.get("fisher", "mc")),
            mc_samples=int(meta.get("mc_samples", 1)),
            excluded=dict(meta.get("excluded", {})),
        )

    def save(self, uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
        """Write safetensors + JSON manifest (see :mod:`laplace_core.io`); ``storage_options``
        are fsspec's keyword arguments for a remote ``uri``. An exactly symmetric ``A`` / ``G`` is
        stored as its upper triangle (``<layer>/A_triu``, row-major; half the bytes), restored
        bit for bit by :meth:`load`."""
        from ..io import save_tensors

        flat = {}
        for name, t in self.flat_tensors().items():
            if name.rsplit("/", 1)[-1] in ("A", "G") and t.dim() == 2 and torch.equal(t, t.T):
                iu = torch.triu_indices(t.shape[0], t.shape[0], device=t.device)
                flat[f"{name}_triu"] = t[iu[0], iu[1]]
            else:
                flat[name] = t
        save_tensors(uri, flat, self.meta(), storage_options)

    @classmethod
    def load(cls, uri: str, storage_options: Mapping[str, Any] | None = None) -> "CurvatureStatistics":
        from ..io import load_tensors

        tensors, meta = load_tensors(uri, storage_options)
        for name in [k for k in tensors if k.endswith(("/A_triu", "/G_triu"))]:
            v = tensors.pop(name)
            n = int(round(((8 * v.numel() + 1) ** 0.5 - 1) / 2))
            iu = torch.triu_indices(n, n)
            full = torch.empty(n, n, dtype=v.dtype)
            full[iu[0], iu[1]] = v
            full[iu[1], iu[0]] = v
            tensors[name[: -len("_triu")]] = full
        return cls.from_flat(meta, tensors)

    def summary(self) -> str:
        return json.dumps({k: v for k, v in self.meta().items() if k != "layers"} | {"num_layers": len(self.layers)})
