"""The one interface every posterior structure implements (docs/design.md §2, §3).

A posterior is a collection of independent per-layer Gaussians
``N(θ*_l, P_l^{-1})`` over ``vec(W~_l)`` (column stacking, ``W~`` is ``m x n``).
Every per-layer quantity is handled in the ``m x n`` shape of ``W~``; nothing is
ever flattened by index arithmetic.

Per layer (:class:`LayerPosterior`):

* ``precision_matvec(V)`` -> ``P V`` (``V`` is ``m x n``; the product is read as
  ``unvec(P vec(V))``).
* ``scale_matvec(Z)`` -> ``F Z`` with ``F F^T = P^{-1}``; ``sample`` only draws ``Z``.
* ``scale_factors(Z)`` -> ``(L, C, R)`` with ``F Z = L C R^T`` for the structures whose
  ``F Z`` ends in two basis products (KFAC, EFB, exact-prior KFAC); ``None`` for the
  others. A predictor can then apply ``F Z`` to a layer's inputs instead of its weights
  (``laplace_core.predictive.sample_apply``) without forming the ``m x n`` delta.
* ``to_dense()`` -> ``P`` as an ``(mn) x (mn)`` matrix in ``vec`` (column-stacking)
  order, for small layers in tests only.
* ``num_stored()`` -> numbers stored (Table 3 counting).
* ``tensors()`` / ``meta()`` and the class method ``from_tensors`` for
  serialisation; values are immutable after construction.

:class:`Posterior` maps layer names to :class:`LayerPosterior` objects and applies
the per-layer operations to dicts ``name -> tensor``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, NamedTuple

import torch

__all__ = ["LayerPosterior", "Posterior", "ScaleFactors", "vec", "unvec"]


class ScaleFactors(NamedTuple):
    """``F z = left @ core @ right^T``: ``left`` (m, m), ``core`` (k, m, n) (one per draw),
    ``right`` (n, n). ``left`` and ``right`` are the structure's own basis tensors (shared,
    never modified); ``core`` is new for every ``z``."""

    left: torch.Tensor
    core: torch.Tensor
    right: torch.Tensor

    def matrix(self) -> torch.Tensor:
        """``left @ core @ right^T`` (k, m, n): the same operations, in the same order, as
        the structure's ``scale_matvec``, so the same numbers bit for bit."""
        return self.left @ self.core @ self.right.T


def vec(x: torch.Tensor) -> torch.Tensor:
    """Column-stacking ``vec`` of the last two dims: ``(..., m, n)`` -> ``(..., m*n)``."""
    return x.transpose(-1, -2).reshape(*x.shape[:-2], -1)


def unvec(v: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Inverse of :func:`vec`: ``(..., m*n)`` -> ``(..., m, n)``."""
    return v.reshape(*v.shape[:-1], n, m).transpose(-1, -2)


class LayerPosterior(abc.ABC):
    """Gaussian over one layer's ``W~`` (``m x n``) given by its precision ``P``."""

    method: ClassVar[str]

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """``(m, n)``."""

    @abc.abstractmethod
    def precision_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``P v`` for ``v`` of shape ``(m, n)`` or ``(k, m, n)`` (batched)."""

    @abc.abstractmethod
    def scale_matvec(self, z: torch.Tensor) -> torch.Tensor:
        """``F z`` with ``F F^T = P^{-1}``, ``z`` of shape ``(m, n)`` or ``(k, m, n)``."""

    def scale_factors(self, z: torch.Tensor) -> "ScaleFactors | None":
        """``F z`` in factored form ``L C R^T`` (:class:`ScaleFactors`), ``z`` of shape
        ``(k, m, n)``; ``None`` (the default) when the structure has no such form."""
        return None

    @abc.abstractmethod
    def to_dense(self) -> torch.Tensor:
        """Dense ``P`` (``mn x mn``, vec order). Tests only; refuses big layers."""

    @abc.abstractmethod
    def num_stored(self) -> int:
        """Numbers stored for this layer."""

    @abc.abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Tensors needed to rebuild the layer (flat names, no '/')."""

    @abc.abstractmethod
    def meta(self) -> dict[str, Any]:
        """JSON-able scalars needed to rebuild the layer."""

    @classmethod
    @abc.abstractmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> "LayerPosterior":
        """Inverse of ``tensors()``/``meta()``."""

    def marginal_variance(self) -> torch.Tensor:
        """``diag(P^{-1})`` as ``m x n``. Default: exact via dense inverse (small layers);
        structures override with their closed forms."""
        m, n = self.shape
        cov = torch.linalg.inv(self.to_dense())
        return unvec(torch.diagonal(cov), m, n)

    def covariance_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``P^{-1} v`` (the posterior covariance applied) for ``v`` of shape ``(m, n)`` or
        ``(k, m, n)``. Default: dense solve (small layers, tests); structures override it
        with their closed forms (used by the GLM predictive, ``laplace_core.predictive.glm``)."""
        m, n = self.shape
        P = self.to_dense()
        x = vec(v).reshape(-1, m * n).T
        out = torch.linalg.solve(P, x.to(P.dtype)).T
        return unvec(out, m, n).reshape(v.shape).to(v.dtype)

    def _check_dense_size(self, limit: int = 20_000) -> None:
        m, n = self.shape
        if m * n > limit:
            raise ValueError(f"to_dense() is for small layers (tests); this layer has {m * n} weights")


@dataclass(frozen=True)
class Posterior:
    """A Laplace posterior over all curvature layers: ``name -> LayerPosterior``.

    ``method`` is the registry name (``diag``, ``kfac``, ``kfac_exact``, ``efb``,
    ``inf``, ...); ``n_data`` and ``prior_precision`` are the hyperparameters
    ``N`` and ``τ`` of ``P = N F/M + τ I``; ``info`` holds run counts (e.g. clipped
    ``D`` entries) for the run summary.
    """

    method: str
    layers: dict[str, LayerPosterior]
    n_data: float
    prior_precision: float
    rank: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- linear maps
    def precision_matvec(self, v: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.layers[k].precision_matvec(t) for k, t in v.items()}

    def scale_matvec(self, z: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.layers[k].scale_matvec(t) for k, t in z.items()}

    def sample(self, n: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``n`` zero-mean draws per layer: ``name -> (n, m, n_in)`` deltas to add to ``W~``.

        Draws ``z ~ N(0, I)`` layer by layer in model order from ``generator`` and
        returns ``F z``; the same generator state gives the same samples.
        """
        return {k: lp.scale_matvec(z) for k, lp, z in self._normals(n, generator)}

    def sample_factored(self, n: int, generator: torch.Generator | None = None) -> dict[str, Any]:
        """The draws of :meth:`sample` from the same generator state (the same ``z``, in
        the same order), each layer as its :class:`ScaleFactors` where the structure has
        them (``factors.matrix()`` equals ``sample``'s delta bit for bit), else as the
        ``(n, m, n_in)`` delta."""
        out: dict[str, Any] = {}
        for k, lp, z in self._normals(n, generator):
            f = lp.scale_factors(z)
            out[k] = lp.scale_matvec(z) if f is None else f
        return out

    def _normals(self, n: int, generator: torch.Generator | None) -> Iterator[tuple[str, LayerPosterior, torch.Tensor]]:
        """``(name, layer, z)`` with ``z ~ N(0, I)`` ``(n, m, n_in)``, layer by layer in model order."""
        for k, lp in self.layers.items():
            ref = self._ref_tensor(lp)
            yield k, lp, torch.randn((n, *lp.shape), generator=generator, dtype=ref.dtype, device=ref.device)

    def to_dense(self, layer: str) -> torch.Tensor:
        return self.layers[layer].to_dense()

    def marginal_variance(self) -> dict[str, torch.Tensor]:
        return {k: lp.marginal_variance() for k, lp in self.layers.items()}

    def num_stored(self) -> int:
        return int(sum(lp.num_stored() for lp in self.layers.values()))

    @staticmethod
    def _ref_tensor(lp: LayerPosterior) -> torch.Tensor:
        ts = lp.tensors()
        return next(iter(ts.values()))

    # ---------------------------------------------------------------- serialisation
    def state_dict(self) -> dict[str, Any]:
        """``{"meta": json-able dict, "tensors": {"<layer>/<field>": tensor}}``."""
        tensors: dict[str, torch.Tensor] = {}
        layer_meta: dict[str, Any] = {}
        for k, lp in self.layers.items():
            for f, t in lp.tensors().items():
                tensors[f"{k}/{f}"] = t.detach().contiguous()
            layer_meta[k] = {"method": lp.method, **lp.meta()}
        meta = {
            "format": "infoform.posterior",
            "version": 1,
            "method": self.method,
            "n_data": float(self.n_data),
            "prior_precision": float(self.prior_precision),
            "rank": self.rank,
            "info": self.info,
            "layers": layer_meta,
            "order": list(self.layers),
        }
        return {"meta": meta, "tensors": tensors}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "Posterior":
        layer_class, posterior_class = _STRUCTURES["layer"], _STRUCTURES["posterior"]
        meta = state["meta"]
        if meta.get("format") != "infoform.posterior":
            raise ValueError("not an infoform posterior (format tag missing)")
        if cls is Posterior:  # whole-network structures (e.g. "subnet") have their own class
            target = posterior_class(meta.get("method"))
            if target is not Posterior:
                return target.from_state_dict(state)
        tensors = state["tensors"]
        layers = {}
        for k in meta["order"]:
            lm = dict(meta["layers"][k])
            lcls = layer_class(lm.pop("method"))
            prefix = f"{k}/"
            lt = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix) and "/" not in name[len(prefix):]}
            layers[k] = lcls.from_tensors(lt, lm)
        return cls(
            method=meta["method"],
            layers=layers,
            n_data=float(meta["n_data"]),
            prior_precision=float(meta["prior_precision"]),
            rank=meta.get("rank"),
            info=dict(meta.get("info", {})),
        )

    def to(self, device: torch.device | str) -> "Posterior":
        """The same posterior with every tensor on ``device`` (dtypes kept), rebuilt
        through :meth:`state_dict` / :meth:`from_state_dict`, so every structure
        (including whole-network ones such as ``subnet``) moves the same way. Draws
        then happen on ``device``: ``torch.randn`` with a CUDA generator gives other
        numbers than with a CPU one, so samples depend on the device (not their law)."""
        device = torch.device(device)
        sd = self.state_dict()
        moved = {k: t.to(device=device) for k, t in sd["tensors"].items()}
        return type(self).from_state_dict({"meta": sd["meta"], "tensors": moved})

    @classmethod
    def load(cls, uri: str, storage_options: Mapping[str, Any] | None = None) -> "Posterior":
        """The posterior saved with :meth:`save` at ``uri`` (checked by
        :func:`laplace_core.io.load_tensors`: format, size, SHA-256); ``storage_options`` as there."""
        from ...io import load_tensors

        tensors, meta = load_tensors(uri, storage_options)
        if not isinstance(meta, dict) or meta.get("format") != "infoform.posterior":
            got = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"{uri}: artifact is not a posterior (meta format {got!r})")
        if meta.get("version") != 1:
            raise ValueError(f"{uri}: unsupported posterior version {meta.get('version')!r}")
        try:
            return Posterior.from_state_dict({"meta": meta, "tensors": tensors})
        except KeyError as e:
            raise ValueError(f"{uri}: posterior artifact is missing {e.args[0]!r}") from None

    def save(self, uri: str, storage_options: Mapping[str, Any] | None = None,
             refs: Mapping[str, Any] | None = None) -> None:
        """Write the posterior as a :mod:`laplace_core.io` artifact; ``storage_options`` are
        fsspec's keyword arguments for a remote ``uri`` (ignored for local paths). ``refs``:
        tensors stored in another artifact instead (e.g. the eigenbasis), as
        :func:`laplace_core.io.save_tensors` takes them; :meth:`load` reads them from there."""
        from ...io import save_tensors

        sd = self.state_dict()
        save_tensors(uri, sd["tensors"], sd["meta"], storage_options, refs=refs)


#: The registry's resolvers (:func:`register_structures`, called by :mod:`.registry` when the
#: package is imported, which Python does before this module can be used).
_STRUCTURES: dict[str, Any] = {}


def register_structures(layer_class, posterior_class) -> None:
    """Give :meth:`Posterior.from_state_dict` the resolvers ``method -> LayerPosterior class``
    and ``method -> Posterior (sub)class`` (:mod:`.registry`)."""
    _STRUCTURES.update(layer=layer_class, posterior=posterior_class)


def load_posterior(uri: str, storage_options: Mapping[str, Any] | None = None) -> Posterior:
    """:meth:`Posterior.load`: a saved posterior of any structure."""
    return Posterior.load(uri, storage_options)
