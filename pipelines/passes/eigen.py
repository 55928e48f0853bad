"""The eigenbasis stage: the per-layer eigendecompositions spread over the workers, and its I/O.

The cost of one layer's eigenbasis is dominated by two dense symmetric
eigendecompositions, ``O(n^3 + m^3)`` for ``A`` (n x n) and ``G`` (m x m). The
assignment is a pure function of the layer shapes and the worker count — no Ray —
so every worker computes the same plan without talking to the others.

Greedy LPT (longest processing time first): sort layers by cost, descending (ties
by name), give each to the currently least-loaded worker (ties by lowest rank).
LPT's makespan is at most ``4/3 - 1/(3W)`` of the optimum.
"""
from __future__ import annotations

import threading
import time
from typing import Mapping, Sequence

import torch

from laplace_core.basis.eigenbasis import Eigenbasis, LayerBasis, layer_eigenbasis
from laplace_core.io import load_tensors, save_tensors
from laplace_core.curvature.statistics import CurvatureStatistics
from pipelines.storage.store import RunStore
from pipelines.distributed.progress import say

__all__ = ["eigh_cost", "assign_layers", "loads", "save_eigenbasis", "load_eigenbasis", "distributed_eigenbasis"]


def eigh_cost(m: int, n: int) -> float:
    """Arithmetic cost model of one layer's eigenbasis: ``n^3 + m^3``."""
    return float(n) ** 3 + float(m) ** 3


def assign_layers(shapes: Mapping[str, tuple[int, int]], num_workers: int) -> dict[int, list[str]]:
    """Greedy layer-to-worker assignment on ``n^3 + m^3``.

    ``shapes``: layer name -> ``(m, n)`` (the ``W~`` shape). Returns
    ``rank -> [layer names]`` for ranks ``0..num_workers-1`` (possibly empty lists),
    each list in the order the layers appear in ``shapes``. Deterministic: depends
    only on the names, shapes and ``num_workers``.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    order = {name: i for i, name in enumerate(shapes)}
    jobs = sorted(shapes, key=lambda k: (-eigh_cost(*shapes[k]), order[k]))
    load = [0.0] * num_workers
    plan: dict[int, list[str]] = {r: [] for r in range(num_workers)}
    for name in jobs:
        r = min(range(num_workers), key=lambda i: (load[i], i))
        plan[r].append(name)
        load[r] += eigh_cost(*shapes[name])
    return {r: sorted(names, key=order.__getitem__) for r, names in plan.items()}


def loads(shapes: Mapping[str, tuple[int, int]], plan: Mapping[int, Sequence[str]]) -> dict[int, float]:
    """Total cost per worker under ``plan``."""
    return {r: sum(eigh_cost(*shapes[k]) for k in names) for r, names in plan.items()}


# --------------------------------------------------------------------------- eigenbasis I/O
def save_eigenbasis(uri: str, basis: Eigenbasis, count: int, store: RunStore) -> None:
    """``<uri>/`` artifact with ``<layer>/{U_A,S_A,U_G,S_G}`` and the clamp counts."""
    meta = {
        "format": "infoform.eigenbasis",
        "version": 1,
        "names": list(basis.layers),
        "clamped": {k: int(v) for k, v in basis.clamped.items()},
        "count": int(count),
    }
    save_tensors(uri, basis.flat_tensors(), meta, store.fsspec_options(uri))


def load_eigenbasis(uri: str, store: RunStore = RunStore()) -> Eigenbasis:
    tensors, meta = load_tensors(uri, store.fsspec_options(uri))
    if meta.get("format") != "infoform.eigenbasis":
        raise ValueError(f"{uri}: not an eigenbasis artifact (format {meta.get('format')!r})")
    return Eigenbasis.from_flat(tensors, list(meta["names"]), meta.get("clamped", {}))


# --------------------------------------------------------------------------- the eigenbasis, spread over the workers
def distributed_eigenbasis(stats: CurvatureStatistics, rank: int, world: int, device, rec: dict,
                           every_s: float | None = None) -> Eigenbasis:
    """Each rank decomposes its layers (:func:`pipelines.passes.eigen.assign_layers`), then every
    rank broadcasts its packed results (one collective per rank). With ``every_s``, rank 0 says
    how many of its layers are done whenever that long has passed since its last line."""
    import torch.distributed as dist

    shapes = {k: info.shape for k, info in stats.infos.items() if not info.diag_only}  # norm layers: no factors
    plan = assign_layers(shapes, world)
    t0 = time.perf_counter()
    # on the worker's device (a GPU's float64 eigh of resnet50's factors: ~1.5 s, against
    # minutes on a few CPU threads); kept on the CPU afterwards like the statistics
    mine: dict[str, LayerBasis] = {}
    stop = threading.Event()
    if rank == 0 and every_s is not None:  # one float64 eigh of a 4608 x 4608 factor takes minutes on CPUs
        def tick() -> None:
            while not stop.wait(every_s):
                say(f"[curvature] eigenbasis: {len(mine)}/{len(plan[rank])} layers of worker 0 done after "
                    f"{time.perf_counter() - t0:.0f} s")

        threading.Thread(target=tick, name="eigen-progress", daemon=True).start()
    try:
        for k in plan[rank]:
            mine[k] = layer_eigenbasis(stats.layers[k].A.to(device), stats.layers[k].G.to(device), stats.count,
                                       name=k).to(device="cpu")
    finally:
        stop.set()
    rec["eigh_s"] = time.perf_counter() - t0
    rec["eigh_layers"] = list(plan[rank])
    t0 = time.perf_counter()
    got: dict[str, LayerBasis] = {}
    nbytes = 0
    for src in range(world):
        names = plan[src]
        sizes = []
        for k in names:
            m, n = shapes[k]
            sizes.append((n * n, n, m * m, m, 1))
        total = sum(sum(s) for s in sizes)
        if total == 0:
            continue
        if src == rank:
            buf = torch.cat([torch.cat([b.U_A.reshape(-1), b.S_A, b.U_G.reshape(-1), b.S_G,
                                        torch.tensor([float(b.clamped)], dtype=torch.float64)])
                             for b in (mine[k] for k in names)]).to(device=device, dtype=torch.float64)
        else:
            buf = torch.empty(total, dtype=torch.float64, device=device)
        dist.broadcast(buf, src=src)
        nbytes += buf.numel() * 8
        buf = buf.cpu()
        off = 0
        for k, (a2, a, g2, g, _) in zip(names, sizes):
            m, n = shapes[k]
            U_A = buf[off: off + a2].reshape(n, n); off += a2
            S_A = buf[off: off + a]; off += a
            U_G = buf[off: off + g2].reshape(m, m); off += g2
            S_G = buf[off: off + g]; off += g
            clamped = int(buf[off]); off += 1
            got[k] = mine[k] if src == rank else LayerBasis(U_A.clone(), S_A.clone(), U_G.clone(), S_G.clone(), clamped)
    rec["eigen_broadcast_s"] = time.perf_counter() - t0
    rec["eigen_broadcast_bytes"] = nbytes
    layers = {k: got[k] for k in stats.layers if k in shapes}
    return Eigenbasis(layers=layers, clamped={k: b.clamped for k, b in layers.items()})
