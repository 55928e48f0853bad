"""The three pass kinds on the partitioned-pass engine (:mod:`.engine`).

* :class:`Pass1Kind`: KFAC factors ``A = Σ a a^T`` (``n x n``), ``G = Σ g g^T`` (``m x m``) and
  the exact Fisher diagonal (``m x n``) per layer, :func:`laplace_core.curvature.collect.collect_statistics`.
  ``A`` and ``G`` are reduced and checkpointed as upper triangles.
* :class:`EfbKind`: the EFB sums ``Σ ((U_G^T g)(U_A^T a)^T)²`` (``m x n``) in the run's
  eigenbasis, :func:`laplace_core.curvature.collect.collect_efb`.
* :class:`SubnetFisherKind`: the ``S x S`` Fisher of the selected weights,
  :func:`laplace_core.curvature.subnet_fisher.collect_subnet_fisher` (added in place into one matrix per
  worker); reduced and checkpointed as its upper triangle.

MC labels are drawn from ``(seed, image key, draw)`` (:class:`laplace_core.curvature.keyed_rng.KeyedSampler`),
so it does not matter which worker sees which image, nor whether a worker was restarted.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch

from laplace_core.basis.eigenbasis import Eigenbasis
from laplace_core.curvature.statistics import CurvatureStatistics, LayerStatistics, sum_fields

from .comm import pack_symmetric, packed_size, unpack_symmetric
from .engine import PassKind
from .workers import DTYPES

__all__ = ["Pass1Kind", "EfbKind", "SubnetFisherKind", "pass1_payload_numbers", "efb_payload_numbers"]


def pass1_payload_numbers(shapes: Sequence[tuple[int, int]], diag_only: Sequence[tuple[int, int]] = ()) -> int:
    """Numbers pass 1 all-reduces per reduce: ``n(n+1)/2 + m(m+1)/2 + m n`` per ``(m, n)`` layer,
    ``m n`` per normalisation layer (``diag_only``: its Fisher diagonal alone)."""
    return int(sum(packed_size(n) + packed_size(m) + m * n for m, n in shapes) + sum(m * n for m, n in diag_only))


def efb_payload_numbers(shapes: Sequence[tuple[int, int]]) -> int:
    """Numbers the EFB pass all-reduces per reduce: ``m n`` per layer."""
    return int(sum(m * n for m, n in shapes))


def _precision(cfg, model: torch.nn.Module) -> dict[str, Any]:
    """``precision`` of the curvature config (``fp32`` when the config has none), and channels-last
    convolutions under a half precision on a GPU (NHWC is what its tensor cores run)."""
    precision = getattr(cfg, "precision", "fp32")
    weight = next(model.parameters())
    conv = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    return {"precision": precision, "channels_last": precision != "fp32" and conv and weight.device.type == "cuda"}


class Pass1Kind(PassKind):
    """Pass 1. State: per layer ``[A upper triangle, G upper triangle, diag]`` in ``stats_dtype``
    (a normalisation layer under ``norm_layers: diag``: ``[diag]`` alone,
    :func:`laplace_core.curvature.statistics.sum_fields`). :meth:`bind` gives it the model and its layers
    once they are loaded."""

    name = "pass1"
    title = "KFAC factors and diagonal"
    pass_no = 1
    fmt = "infoform.pass1_checkpoint"
    count_names = ("count", "skipped_batches", "skipped_examples")

    def __init__(self, cfg):
        self.cfg = cfg
        self.model = None
        self.infos: dict = {}
        self.excluded: dict = {}

    def bind(self, model, infos: Mapping, excluded: Mapping) -> "Pass1Kind":
        self.model, self.infos, self.excluded = model, dict(infos), dict(excluded)
        return self

    def _slots(self) -> list[tuple[str, str]]:
        """``(layer, field)`` of every state tensor, in order."""
        return [(k, f) for k, info in self.infos.items() for f in sum_fields(info)]

    def zero(self, device) -> list[torch.Tensor]:
        dt = DTYPES[self.cfg.stats_dtype]
        out = []
        for k, f in self._slots():
            m, n = self.infos[k].shape
            size = {"A": (packed_size(n),), "G": (packed_size(m),), "diag": (m, n)}[f]
            out.append(torch.zeros(size, dtype=dt, device=device))
        return out

    def collect(self, state: list[torch.Tensor], batches: Iterator) -> tuple[int, int, int]:
        from laplace_core.curvature.collect import collect_statistics
        from laplace_core.curvature.keyed_rng import KeyedSampler

        c = self.cfg
        local = collect_statistics(self.model, batches, fisher=c.fisher, mc_samples=c.mc_samples,
                                   generator=KeyedSampler(c.seed), dtype=DTYPES[c.stats_dtype],
                                   norm_layers=c.norm_layers, layers=c.layers, **_precision(c, self.model))
        for s, (k, f) in zip(state, self._slots()):
            t = getattr(local.layers[k], f).to(s.device)
            s.add_(t if f == "diag" else pack_symmetric(t))
        return local.count, local.skipped_batches, local.skipped_examples

    def to_tensors(self, flat: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        names = {"A": "A_triu", "G": "G_triu", "diag": "diag"}
        return {f"{k}/{names[f]}": t for (k, f), t in zip(self._slots(), flat)}

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        keys = list(self.to_tensors([None] * len(self._slots())))
        if set(tensors) != set(keys):
            raise ValueError("pass-1 checkpoint: its layers do not match the model's")
        return [tensors[k] for k in keys]

    def statistics(self, state: Sequence[torch.Tensor], counts: Mapping[str, int]) -> CurvatureStatistics:
        """The reduced :class:`CurvatureStatistics` (full, exactly symmetric ``A`` and ``G``) on the CPU."""
        got: dict[str, dict[str, torch.Tensor]] = {k: {} for k in self.infos}
        for (k, f), t in zip(self._slots(), state):
            m, n = self.infos[k].shape
            got[k][f] = t.cpu().clone() if f == "diag" else unpack_symmetric(t.cpu(), n if f == "A" else m)
        layers = {k: LayerStatistics(A=g.get("A"), G=g.get("G"), diag=g["diag"]) for k, g in got.items()}
        return CurvatureStatistics(layers=layers, infos=dict(self.infos), count=int(counts["count"]),
                                   skipped_batches=int(counts["skipped_batches"]),
                                   skipped_examples=int(counts["skipped_examples"]), fisher=self.cfg.fisher,
                                   mc_samples=self.cfg.mc_samples, excluded=dict(self.excluded))


class EfbKind(PassKind):
    """Pass 2 (EFB). State: per layer the ``m x n`` sum in ``stats_dtype``. The stage writes the
    reduced statistics right after it, so the finished pass is not checkpointed again."""

    name = "pass2"
    title = "EFB eigenvalues"
    pass_no = 2
    fmt = "infoform.efb_checkpoint"
    count_names = ("efb_count",)
    final_checkpoint = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.model = None
        self.infos: dict = {}
        self.basis: Eigenbasis | None = None

    def bind(self, model, infos: Mapping, basis: Eigenbasis | None) -> "EfbKind":
        # normalisation layers (norm_layers: diag) have no Kronecker eigenbasis and no EFB sums
        self.model, self.infos, self.basis = model, {k: i for k, i in infos.items() if not i.diag_only}, basis
        return self

    def zero(self, device) -> list[torch.Tensor]:
        dt = DTYPES[self.cfg.stats_dtype]
        return [torch.zeros(info.shape, dtype=dt, device=device) for info in self.infos.values()]

    def collect(self, state: list[torch.Tensor], batches: Iterator) -> tuple[int]:
        from laplace_core.curvature.collect import collect_efb
        from laplace_core.curvature.keyed_rng import KeyedSampler

        c = self.cfg
        efb, n = collect_efb(self.model, batches, self.basis, fisher=c.fisher, mc_samples=c.mc_samples,
                             generator=KeyedSampler(c.seed), dtype=DTYPES[c.stats_dtype], norm_layers=c.norm_layers,
                             layers=c.layers, **_precision(c, self.model))
        for s, k in zip(state, self.infos):
            s.add_(efb[k].to(s.device))
        return (n,)

    def to_tensors(self, flat: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"{k}/efb": t for k, t in zip(self.infos, flat)}

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if set(tensors) != {f"{k}/efb" for k in self.infos}:
            raise ValueError("EFB checkpoint: its layers do not match the model's")
        return [tensors[f"{k}/efb"] for k in self.infos]

    def efb(self, state: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: t.cpu().clone() for k, t in zip(self.infos, state)}


class SubnetFisherKind(PassKind):
    """The subnet pass. State: one ``S x S`` matrix (``collect_subnet_fisher`` adds into it in
    place); reduced (in place, see :func:`~pipelines.distributed.comm.allreduce_sum`) and
    checkpointed as its upper triangle (``fisher_triu``), so a reduce holds ``1.5 S²`` numbers
    per worker at its peak."""

    name = "subnet"
    title = "subnetwork Fisher"
    pass_no = 3
    fmt = "infoform.subnet_fisher_partial"
    count_names = ("count",)
    final_checkpoint = False
    tag = "subnet"

    def __init__(self, cfg, size: int, masks: Mapping[str, torch.Tensor], fisher: str, dtype: str,
                 memory_budget: int):
        self.cfg, self.size, self.masks = cfg, int(size), dict(masks)
        self.fisher, self.dtype, self.memory_budget = fisher, dtype, int(memory_budget)
        self.model = None

    def bind(self, model) -> "SubnetFisherKind":
        self.model = model
        return self

    def zero(self, device) -> torch.Tensor:
        return torch.zeros(self.size, self.size, dtype=DTYPES[self.dtype], device=device)

    def collect(self, state: torch.Tensor, batches: Iterator) -> tuple[int]:
        from laplace_core.curvature.keyed_rng import KeyedSampler
        from laplace_core.curvature.subnet_fisher import collect_subnet_fisher

        # batches are (x, y, keys): the MC labels come from (seed, example key, draw), the labels
        # collect_statistics drew in pass 1, from the forward pass the backward passes reuse
        _, n = collect_subnet_fisher(self.model, batches, self.masks, fisher=self.fisher,
                                     mc_samples=self.cfg.mc_samples, generator=KeyedSampler(self.cfg.seed),
                                     dtype=DTYPES[self.dtype], memory_budget=self.memory_budget, out=state)
        return (n,)

    def flatten(self, state: torch.Tensor) -> list[torch.Tensor]:
        return [pack_symmetric(state)]

    def unflatten(self, state: torch.Tensor, flat: Sequence[torch.Tensor]) -> None:
        unpack_symmetric(flat[0], self.size, out=state)

    def clear(self, state: torch.Tensor) -> None:
        state.zero_()

    def to_tensors(self, flat: Sequence[torch.Tensor]) -> dict[str, Any]:
        return {"fisher_triu": flat[0]}

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [tensors["fisher_triu"]]
