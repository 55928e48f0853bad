"""What a run writes, said before it writes it, and what it removes once it is redundant.

:func:`expected_bytes` counts from the layer shapes (the same per-layer counts as ``infoform
sizes``, :mod:`laplace_core.posteriors.sizes`) the bytes of the statistics (``stats/reduced``: ``A``, ``G``
as upper triangles, the diagonal and the EFB sums), the
eigenbasis, the pass-1 checkpoint (packed upper triangles; removed at the end of the curvature
stage, when ``stats/reduced`` holds the same sums) and each posterior (``kfac`` / ``efb``
reference the eigenbasis' eigenvectors instead of storing them again; INF at its lower bound).
:func:`drop` removes artifacts and says how much; :func:`tree_bytes` measures a folder.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from pipelines.storage.store import RunStore

__all__ = ["expected_bytes", "announce", "tree_bytes", "drop", "human"]


def human(n: float) -> str:
    """Bytes as ``12.3 MiB`` / ``1.20 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}" if unit != "GiB" else f"{n / size:.2f} GiB"
    return f"{int(n)} B"


def expected_bytes(report: Any, methods: Iterable[str], *, stats_bytes: int = 8, post_bytes: int = 8,
                   efb: bool = True) -> dict[str, Any]:
    """``{"statistics", "eigenbasis", "checkpoint", "posteriors": {method: bytes}}`` for a
    :class:`laplace_core.posteriors.sizes.SizeReport` (its layers' ``m``, ``n``, counts and INF bound)."""
    stats = basis = ckpt = 0
    for ls in report.layers:
        m, n = ls.m, ls.n
        full = ls.counts.get("kfac", 0) != m * n or (m, n) == (1, 1)  # a norm layer stores its diagonal only
        if full:
            stats += n * (n + 1) // 2 + m * (m + 1) // 2 + m * n * (2 if efb else 1)  # A, G as upper triangles
            basis += n * n + m * m + n + m
            ckpt += n * (n + 1) // 2 + m * (m + 1) // 2 + m * n
        else:
            stats += m * n
            ckpt += m * n
    posts = {meth: num * post_bytes for meth in methods if (num := _posterior_numbers(meth, report.layers)) is not None}
    return {"statistics": stats * stats_bytes, "eigenbasis": basis * 8, "checkpoint": ckpt * stats_bytes,
            "posteriors": posts}


def _posterior_numbers(meth: str, layers: Iterable[Any]) -> int | None:
    """Numbers a saved posterior of ``meth`` stores (None: a method not counted here)."""
    if meth == "kfac":  # eigenvalues only, the eigenvectors are the eigenbasis'
        return sum((ls.m + ls.n) if ls.counts.get("kfac", 0) != ls.m * ls.n else ls.m * ls.n for ls in layers)
    if meth in ("efb", "kfac_exact"):
        return sum(ls.m * ls.n for ls in layers)
    if meth == "inf":
        return sum(ls.inf_lower or ls.m * ls.n for ls in layers)
    if meth == "diag":
        return sum(ls.counts["diag"] for ls in layers)
    return None


def announce(est: Mapping[str, Any], keep_stats: bool) -> str:
    """One log line from :func:`expected_bytes`."""
    posts = est["posteriors"]
    per = ", ".join(f"{m} {human(b)}" for m, b in posts.items())
    stays = est["eigenbasis"] + sum(posts.values()) + (est["statistics"] if keep_stats else 0)
    return (f"disk: about {human(est['statistics'])} of statistics, {human(est['eigenbasis'])} eigenbasis, "
            f"{human(est['checkpoint'])} pass-1 checkpoint (removed after the stage), posteriors {per or 'none'}; "
            f"{human(stays)} stay after the run" + ("" if keep_stats else " (storage.keep_stats=false)"))


def tree_bytes(uri: str, store: RunStore) -> int:
    """Bytes of every file under ``uri`` (0 when it does not exist)."""
    if not store.exists(uri):
        return 0
    fs, path = store.fs(uri)
    return int(sum(fs.du(path, total=False).values())) if fs.isdir(path) else int(fs.size(path))


def drop(uris: Iterable[str], store: RunStore) -> int:
    """Remove the artifacts at ``uris`` (folders); returns the bytes freed."""
    freed = 0
    for uri in uris:
        if store.exists(uri):
            freed += tree_bytes(uri, store)
            store.remove(uri, recursive=True)
    return freed
