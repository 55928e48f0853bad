"""Ground truth for curvature tests: exact per-example gradients via ``torch.func``.

Independent of :mod:`laplace_core.curvature.hooks` / :mod:`laplace_core.curvature.collect`: it
differentiates ``log p(targets[k] | model(x[k]))`` with ``functional_call`` +
``vmap(grad)`` over all parameters of the registered layers, then reshapes each
layer's weight (and bias) gradient into the ``W~ = [W, b]`` layout (``m x n``).

API (all float64-friendly; run the model in float64 for 1e-10 comparisons)::

    targets = sample_targets(model(x), y, fisher="mc", mc_samples=S, generator=g)  # from laplace_core.curvature.likelihoods
    d  = per_example_grads(model, x, targets)        # {name: (S, M, m, n)}  (targets (S, M))
    d1 = per_example_grads(model, x, y)              # {name: (M, m, n)}     (targets (M,))
    F  = exact_fisher_blocks(model, x, targets)      # {name: (mn, mn)}  Σ_{s,k} vec d vec d^T / (S M)
    D  = exact_fisher_diag(model, x, targets)        # {name: (m, n)}    Σ_{s,k} d∘d / S   (a SUM over k)

``vec`` is column stacking (index of ``W~[i, j]`` is ``j*m + i``), as in docs/design.md §1.
The model is put in eval() mode for the call and restored afterwards.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from laplace_core.curvature.layers import find_layers, owner_params

__all__ = ["per_example_grads", "exact_fisher_blocks", "exact_fisher_diag", "vec", "dense_jacobian", "dense_covariance"]


def vec(mat: torch.Tensor) -> torch.Tensor:
    """Column stacking of the last two dims: ``(..., m, n) -> (..., m*n)``."""
    return mat.transpose(-1, -2).reshape(*mat.shape[:-2], -1)


def _log_lik(out: torch.Tensor, target: torch.Tensor, likelihood: str) -> torch.Tensor:
    if likelihood == "classification":
        return torch.log_softmax(out, dim=-1).gather(0, target.reshape(1))[0]
    if likelihood == "regression":
        return -0.5 * (target - out).square().sum()
    raise ValueError(f"unknown likelihood {likelihood!r}; valid: classification, regression")


def per_example_grads(model: nn.Module, x: torch.Tensor, targets: torch.Tensor,
                      likelihood: str = "classification", norm_layers: str = "map") -> dict[str, torch.Tensor]:
    """Per-example gradients of ``log p(targets | model(x))`` in ``W~`` layout.

    ``x``: (M, ...). ``targets``: (M,)/(M, out...) for one label per example, or
    (S, M)/(S, M, out...) for ``S`` draws (regression outputs must be (M, C)). Returns ``{name: (M, m, n)}`` or
    ``{name: (S, M, m, n)}`` for each layer of :func:`find_layers`.
    """
    modules, infos, _ = find_layers(model, norm_layers=norm_layers)
    params = {}
    where = {}  # layer name -> (weight key, bias key or None, rows) of the owning parameters
    for name, mod in modules.items():
        owner, oname, wa, ba, rows = owner_params(mod, name)
        wk = f"{oname}.{wa}" if oname else wa
        bk = None if ba is None else (f"{oname}.{ba}" if oname else ba)
        params[wk] = getattr(owner, wa).detach()
        if bk is not None:
            params[bk] = getattr(owner, ba).detach()
        where[name] = (wk, bk, rows)
    others = {k: v.detach() for k, v in model.named_parameters() if k not in params}
    buffers = {k: v for k, v in model.named_buffers()}
    # classification targets: (M,) or (S, M); regression targets: (M, C) or (S, M, C)
    per_draw = targets.dim() == (3 if likelihood == "regression" else 2)
    tg = targets if per_draw else targets.unsqueeze(0)

    def f(p, xk, tk):
        out = functional_call(model, {**p, **others, **buffers}, (xk.unsqueeze(0),))
        return _log_lik(out[0], tk, likelihood)

    was_training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        g_fn = vmap(grad(f), in_dims=(None, 0, 0))
        draws = [g_fn(params, x, tg[s]) for s in range(tg.shape[0])]
    finally:
        for m, t in was_training.items():
            m.training = t
    out = {}
    for name, mod in modules.items():
        m_out = infos[name].out_features
        per = []
        for gd in draws:
            wk, bk, rows = where[name]
            w = gd[wk][:, rows]
            mat = w.reshape(w.shape[0], m_out, -1)
            if bk is not None:
                b = gd[bk][:, rows]
                mat = torch.cat([mat, b.reshape(b.shape[0], m_out, 1)], dim=2)
            per.append(mat)
        st = torch.stack(per)  # (S, M, m, n)
        out[name] = st if per_draw else st[0]
    return out


def _as_draws(d: torch.Tensor, per_draw: bool) -> torch.Tensor:
    return d if per_draw else d.unsqueeze(0)


def exact_fisher_blocks(model: nn.Module, x: torch.Tensor, targets: torch.Tensor,
                        likelihood: str = "classification", norm_layers: str = "map") -> dict[str, torch.Tensor]:
    """Exact per-layer Fisher block ``Σ_{s,k} vec(d_{s,k}) vec(d_{s,k})^T / (S M)``, (mn, mn)."""
    grads = per_example_grads(model, x, targets, likelihood, norm_layers)
    out = {}
    for name, d in grads.items():
        d4 = d if d.dim() == 4 else d.unsqueeze(0)
        S, M = d4.shape[:2]
        v = vec(d4).reshape(S * M, -1)
        out[name] = v.T @ v / (S * M)
    return out


def exact_fisher_diag(model: nn.Module, x: torch.Tensor, targets: torch.Tensor,
                      likelihood: str = "classification", norm_layers: str = "map") -> dict[str, torch.Tensor]:
    """Exact Fisher diagonal as a SUM over examples, averaged over draws: ``Σ_k (1/S) Σ_s d∘d`` (m, n)."""
    grads = per_example_grads(model, x, targets, likelihood, norm_layers)
    out = {}
    for name, d in grads.items():
        d4 = d if d.dim() == 4 else d.unsqueeze(0)
        out[name] = d4.square().sum(1).mean(0)
    return out


def dense_jacobian(model, x, names, norm_layers="map"):
    """``[B, C, D]``: jacrev over the owning parameters, each layer's rows in vec(W~) order."""
    modules = find_layers(model, norm_layers=norm_layers)[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    blocks = []
    for name in names:
        _, owner, wa, ba, rows = owner_params(modules[name], name)
        wk, bk = (f"{owner}.{a}" if owner else a for a in (wa, ba))  # a parameter of the root: no prefix
        B, C = x.shape[0], jac[wk].shape[1]
        w = jac[wk][:, :, rows].reshape(B, C, modules[name].weight.shape[0], -1)
        if ba is not None:
            w = torch.cat([w, jac[bk][:, :, rows].reshape(B, C, -1, 1)], dim=3)
        blocks.append(vec(w))
    return torch.cat(blocks, dim=2)


def dense_covariance(post):
    """``Σ`` (D x D) in :func:`dense_jacobian`'s layer / vec order: the block-diagonal inverse of
    every layer's ``to_dense()``; subnet: the ``S x S`` inverse at the selected positions."""
    if post.method == "subnet":
        offs, o = [], 0
        for lp in post.layers.values():
            offs.append(o)
            o += lp.shape[0] * lp.shape[1]
        idx = torch.cat([lp.index + off for lp, off in zip(post.layers.values(), offs)])
        full = torch.zeros(post.d_total, post.d_total, dtype=torch.float64)
        full[idx[:, None], idx[None, :]] = torch.linalg.inv(post.to_dense())
        return full
    return torch.block_diag(*[torch.linalg.inv(lp.to_dense()) for lp in post.layers.values()])


def hand_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(B, T, c k k [+1]) patches of ``conv``'s input by explicit loops over output positions
    (no F.unfold): the reference for KFC's expanded inputs."""
    import torch.nn.functional as F

    ph, pw = conv.padding
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    xp = F.pad(x, (pw, pw, ph, ph))
    H = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    W = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for i in range(H):
        for j in range(W):
            patch = xp[:, :, i * sh: i * sh + dh * (kh - 1) + 1: dh, j * sw: j * sw + dw * (kw - 1) + 1: dw]
            r = patch.reshape(x.shape[0], -1)
            if conv.bias is not None:
                r = torch.cat([r, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
            rows.append(r)
    return torch.stack(rows, 1)


def tiny_images(n: int = 4, num_classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float64 ``3 x 8 x 8`` inputs and labels, seeded: the tiny timm models' data."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, num_classes, (n,), generator=g))
