"""Linearised (GLM) predictive for every posterior structure (Immer et al. 2021; Banerjee et al. 2025).

The network is linearised at the MAP ``θ*``: ``f_lin(x, θ) = f(x, θ*) + J(x)(θ − θ*)``.
Under ``θ ~ N(θ*, Σ)``, ``Σ = P^{-1}``, the logits are Gaussian with mean ``f(x, θ*)``
(the MAP output) and covariance ``J Σ J^T`` (Banerjee eq. 11). Perturbations live in
the ``W~`` layout: a dict ``name -> (m, n)`` delta per curvature layer.

* :func:`glm_jvp`: ``J(x) δ`` exactly, one forward-mode pass (``torch.func.jvp`` through
  ``torch.func.functional_call``; weights rebuilt from ``W~`` via the layer's weight
  shape and bias column); batched deltas ``(k, m, n)`` are ``vmap``-ed.
* :func:`glm_covariance`: exact ``J Σ J^T`` ``[B, C, C]``. Per layer, with the layer
  inputs ``a_{k,t}`` and the output Jacobian rows ``g_{k,t,c} = ∂f_c/∂z_{k,t}`` (one
  backward pass per output ``c``, captured with :mod:`laplace_core.curvature.hooks`):
  - Linear layers with one position (``T = 1``), closed forms (never forming ``J``):
    KFAC (Banerjee eq. 15): ``Σ_l = A'^{-1} ⊗ G'^{-1}`` gives
    ``J_l Σ_l J_l^T = (a^T A'^{-1} a) (Γ^T G'^{-1} Γ)``, ``Γ = [g_1 .. g_C]`` (m x C);
    eigenbasis-diagonal (``efb``, ``kfac_exact``) with ``ã = U_A^T a``, ``Γ̃ = U_G^T Γ``:
    ``Γ̃^T diag((N Λ + τ)^{-1} ã²) Γ̃``; diagonal: ``Γ^T diag(P^{-1} a²) Γ``.
  - otherwise the generic route: ``J_l[c] = Σ_t g_{t,c} a_t^T`` (``m x n`` per output),
    ``Σ_l J_l[c]`` by the structure's ``covariance_matvec`` (``P^{-1} v``; INF by
    Woodbury, subnet by Cholesky solves across layers), then inner products.
  Cross-layer terms vanish for the block-diagonal structures; the subnet posterior
  couples layers and is handled as a whole.
* MC-GLM (Banerjee Alg. 4): ``η_t ~ N(0, Σ)`` from the posterior's own sampler, keyed by
  ``(seed, t)`` exactly like :func:`laplace_core.predictive.monte_carlo.draw_sample` (so every batch
  and shard sees the same ``η_t``), pushed through one JVP each:
  ``logits_t = f(x, θ*) + J η_t``. The paper's finite-difference form
  ``J η ≈ (f(θ* + ε η) − f(θ*)) / ε`` is the option ``fd_eps=ε``.
* :class:`GLMPredictor`: probabilities from the Gaussian logits, with the link
  ``"mc"`` (average softmax over the MC-GLM logits), ``"probit_pi8"``
  (``softmax(f / sqrt(1 + π/8 diag Σ_f))``, MacKay / laplace-torch's "probit") or
  ``"probit"`` (pairwise mean-field probit, Lu et al. 2020:
  ``p_c ∝ 1 / (1 + Σ_{j≠c} exp(−(f_c − f_j)/sqrt(1 + π/8 v_cj)))`` with
  ``v_cj = Σ_cc + Σ_jj − 2 Σ_cj``; exact binary probit approximation when ``C = 2``),
  using ``variance="exact"`` (:func:`glm_covariance`) or ``"mc"`` (the MC-GLM estimate
  ``(1/K) Σ_t (J η_t)(J η_t)^T``; the mean ``0`` is known, so ``1/K`` rather than
  Alg. 4's ``1/(K−1)``).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call, jvp, vmap

from ..curvature.hooks import capture, layer_inputs, layer_output_grads, norm_grads, reference_attention
from ..curvature.free_grads import free_grads, free_views
from ..curvature.layers import LayerKind, find_layers, get_matrix, layer_kind, owner_params, perturbed
from .jvp_budget import JVP_BYTES, forward_with_bytes, jvp_plan
from .monte_carlo import SampleCache, check_layers, draw_stats, eval_mode, quiet_jit_deprecation, sample_seed
from ..posteriors.structures.base import LayerPosterior, Posterior
from ..posteriors.structures.diag import DiagLayer
from ..posteriors.structures.efb import EigenDiagLayer
from ..posteriors.structures.kron import KronLayer

__all__ = ["LINKS", "VARIANCES", "glm_jvp", "glm_fd", "output_jacobian_pieces", "covariance_matvec", "glm_covariance",
           "kfac_glm_covariance", "probit_pi8", "probit_pairwise", "GLMPredictor"]

LINKS = ("mc", "probit", "probit_pi8")
VARIANCES = ("exact", "mc")
_PI8 = math.pi / 8.0


# =========================================================================== helpers
def _modules(model: nn.Module, modules: Mapping[str, nn.Module] | None) -> dict[str, nn.Module]:
    return dict(find_layers(model, norm_layers="diag")[0] if modules is None else modules)


def _param_keys(model: nn.Module, modules: Mapping[str, nn.Module]) -> dict[str, tuple[tuple[str, torch.Tensor] | None, ...]]:
    """``layer name -> ((weight key, parameter), (bias key, parameter) or None, rows)``: the
    owning parameters in ``model.named_parameters()`` naming, and the rows (dim 0) of them
    that the layer's ``W~`` covers (all of them for a module; one group of a grouped conv)."""
    ids = {id(p): k for k, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for name, mod in modules.items():
        owner, _, wa, ba, rows = owner_params(mod, name)
        w = getattr(owner, wa)
        wk = ids.get(id(w))
        if wk is None:
            raise ValueError(f"layer {name!r} is not a submodule of the model")
        b = None if ba is None else getattr(owner, ba)
        out[name] = ((wk, w), None if b is None else (ids[id(b)], b), rows)
    return out


def _split_delta(mod: nn.Module, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``W~``-layout delta ``(..., m, n)`` -> (weight-shaped, bias-shaped or None) tangents."""
    k = mod.weight[0].numel()
    lead = tuple(delta.shape[:-2])
    w = delta[..., :k].reshape(*lead, *mod.weight.shape)
    b = delta[..., k] if mod.bias is not None else None
    return w, b


def _check_deltas(modules: Mapping[str, nn.Module], deltas: Mapping[str, torch.Tensor]) -> int | None:
    """Validates shapes; returns the batch size ``k`` for ``(k, m, n)`` deltas, None for ``(m, n)``."""
    if not deltas:
        raise ValueError("deltas is empty: pass name -> (m, n) or (k, m, n) perturbations of W~")
    lead = None
    for name, d in deltas.items():
        if name not in modules:
            raise ValueError(f"delta for unknown layer {name!r}; model layers: {list(modules)}")
        shape = tuple(get_matrix(modules[name]).shape)
        if d.dim() not in (2, 3) or tuple(d.shape[-2:]) != shape:
            raise ValueError(f"layer {name!r}: delta must be {shape} or (k, *{shape}), got {tuple(d.shape)}")
        this = d.shape[0] if d.dim() == 3 else None
        if lead is not None and this != lead[0]:
            raise ValueError("deltas mix batched and unbatched (or different k) layers")
        lead = (this,)
    return lead[0]


# =========================================================================== J δ
def glm_jvp(
    model: nn.Module,
    x: torch.Tensor,
    deltas: Mapping[str, torch.Tensor],
    *,
    modules: Mapping[str, nn.Module] | None = None,
    return_output: bool = False,
):
    """``J(x) δ``: ``[B, C]`` for ``(m, n)`` deltas, ``[k, B, C]`` for ``(k, m, n)`` deltas.

    Exact forward-mode derivative of ``f(x, θ)`` at ``θ*`` in the direction ``δ``
    (``torch.func.jvp`` through ``functional_call``; layers absent from ``deltas`` get a
    zero direction). Eval mode, no autograd graph. With ``return_output`` also returns
    ``f(x, θ*)`` (``[B, C]``), which the JVP computes anyway.
    """
    modules = _modules(model, modules)
    k = _check_deltas(modules, deltas)
    keys = _param_keys(model, modules)
    primals, tangents = {}, {}
    lead = () if k is None else (k,)
    for name, d in deltas.items():
        mod = modules[name]
        wp, bp, rows = keys[name]
        w_t, b_t = _split_delta(mod, d.to(dtype=mod.weight.dtype, device=mod.weight.device))
        for kp, t in ((wp, w_t), (bp, b_t)):
            if kp is None:
                continue
            key, p = kp
            primals[key] = p.detach()
            if rows == slice(None):
                tangents[key] = t
                continue
            # a layer view (conv group): its rows of the owning parameter's tangent
            if key not in tangents:
                tangents[key] = p.new_zeros(*lead, *p.shape)
            tangents[key][(slice(None),) * len(lead) + (rows,)] = t

    def f(p):
        return functional_call(model, p, (x,))

    with torch.no_grad(), eval_mode(model), reference_attention(model), quiet_jit_deprecation():
        if k is None:
            out, jv = jvp(f, (primals,), (tangents,))
        else:
            out = f(primals)
            jv = vmap(lambda t: jvp(f, (primals,), (t,))[1])(tangents)
    return (out, jv) if return_output else jv


def glm_fd(
    model: nn.Module,
    x: torch.Tensor,
    deltas: Mapping[str, torch.Tensor],
    eps: float,
    *,
    modules: Mapping[str, nn.Module] | None = None,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Finite-difference ``J δ ≈ (f(x, θ* + ε δ) − f(x, θ*)) / ε`` (Banerjee Alg. 4), ``[B, C]``. ``δ`` unbatched ``(m, n)`` per layer. ``base``: ``f(x, θ*)`` if already computed.
    Error ``O(ε)`` for smooth networks (plus round-off ``O(u/ε)``).
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"fd_eps must be a finite number > 0, got {eps!r}")
    modules = _modules(model, modules)
    if _check_deltas(modules, deltas) is not None:
        raise ValueError("glm_fd takes unbatched (m, n) deltas")
    with torch.no_grad(), eval_mode(model):
        f0 = model(x) if base is None else base
        with perturbed(modules, {k: eps * d for k, d in deltas.items()}):
            f1 = model(x)
    return (f1 - f0) / eps


# =========================================================================== J Σ J^T
def output_jacobian_pieces(
    model: nn.Module, x: torch.Tensor, modules: Mapping[str, nn.Module] | None = None
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``(f(x, θ*) [B, C], {name: (a [B, T, n], g [C, B, T, m])})``. ``a``: layer input rows (``W~`` layout, bias column included); ``g[c]``: gradient of
    ``Σ_k f_c(x_k)`` w.r.t. the layer output, i.e. per example ``∂f_c(x_k)/∂z_{k,t}``
    (examples are independent in eval mode). ``J_l[k, c] = Σ_t g[c, k, t] a[k, t]^T``.
    One forward and ``C`` backward passes. A normalisation layer (kind ``"norm"``) has no
    ``(a, g)`` factorisation: its entry is ``(None, J [C, B, m, n])``, the per-example
    Jacobian rows from :func:`laplace_core.curvature.hooks.norm_grads`; a free parameter's
    (:func:`laplace_core.curvature.free_grads.free_grads`, one-hot seeds) likewise.
    """
    modules = _modules(model, modules)
    free = free_views(modules)
    with eval_mode(model), capture(model, modules) as cap, torch.enable_grad():
        out = model(x)
        if out.dim() != 2:
            raise ValueError(f"GLM predictive needs model output (B, C), got {tuple(out.shape)}")
        missing = cap.missing()
        if missing:
            raise ValueError(f"layers not called in the forward pass: {missing[:5]}")
        B, C = out.shape
        hooked = {k: mod for k, mod in modules.items() if k not in free}
        gs: dict[str, list[torch.Tensor]] = {k: [] for k in hooked}
        for c in range(C if hooked else 0):
            e = torch.zeros_like(out)
            e[:, c] = 1
            grads = cap.backward(out, e, retain_graph=c < C - 1)
            for k, mod in hooked.items():
                if layer_kind(mod) is LayerKind.NORM:
                    gs[k].append(norm_grads(mod, cap.inputs[k], grads[k]).detach())
                else:
                    gs[k].append(layer_output_grads(mod, grads[k]).detach())
        pieces = {k: (None if layer_kind(mod) is LayerKind.NORM else layer_inputs(mod, cap.inputs[k]).detach(),
                      torch.stack(gs[k])) for k, mod in hooked.items()}
        if free:
            eye = torch.eye(C, dtype=out.dtype, device=out.device)[:, None, :].expand(C, B, C)
            pieces.update({k: (None, J) for k, J in free_grads(model, free, x, eye, cap=cap).items()})
    return out.detach(), {k: pieces[k] for k in modules}


def covariance_matvec(posterior: Posterior, v: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Σ v = P^{-1} v`` for a dict ``name -> (m, n) / (k, m, n)``: the posterior's own
    ``covariance_matvec`` when it has one (subnet), else layer by layer."""
    own = getattr(posterior, "covariance_matvec", None)
    if own is not None:
        return own(v)
    return {k: posterior.layers[k].covariance_matvec(t) for k, t in v.items()}


def _closed_form(lp: LayerPosterior, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """``J_l Σ_l J_l^T`` ``[B, C, C]`` for one position, ``a`` (B, n), ``g`` (C, B, m); None if no closed form."""
    dt = a.dtype
    if isinstance(lp, KronLayer):  # Banerjee eq. 15
        qa = ((a @ lp.U_A.to(dt)) ** 2 / lp.a.to(dt)).sum(-1)  # a^T A'^{-1} a, (B,)
        gt = (g @ lp.U_G.to(dt)) * torch.rsqrt(lp.g.to(dt))  # (C, B, m): Γ^T U_G diag(g^{-1/2})
        return qa[:, None, None] * torch.einsum("cbi,dbi->bcd", gt, gt)
    if isinstance(lp, EigenDiagLayer):
        w = ((a @ lp.U_A.to(dt)) ** 2) @ (1.0 / lp.eig.to(dt)).T  # (B, m): Σ_j ã_j² / eig_ij
        gt = g @ lp.U_G.to(dt)  # (C, B, m)
        return torch.einsum("cbi,bi,dbi->bcd", gt, w, gt)
    if isinstance(lp, DiagLayer):
        w = (a * a) @ (1.0 / lp.precision.to(dt)).T  # (B, m)
        return torch.einsum("cbi,bi,dbi->bcd", g, w, g)
    return None


def glm_covariance(
    model: nn.Module,
    posterior: Posterior,
    x: torch.Tensor,
    *,
    modules: Mapping[str, nn.Module] | None = None,
    closed_form: bool = True,
    max_elements: int = 2**25,
    return_output: bool = False,
):
    """Exact GLM logit covariance ``J(x) Σ J(x)^T``: ``[B, C, C]`` (float64).

    ``closed_form``: use the per-layer closed forms (KFAC: Banerjee eq. 15; eigenbasis-
    diagonal and diagonal analogues) for Linear layers with one position; everything
    else (convs, INF, subnet, ``closed_form=False``) goes through ``J_l`` (``C`` rows of
    ``m x n`` per example, chunked to ``max_elements``) and ``covariance_matvec``.
    Cost: ``C`` backward passes plus the structure's matvecs; meant for small ``C``.
    """
    modules = _modules(model, modules)
    missing = [k for k in posterior.layers if k not in modules]
    if missing:
        raise ValueError(f"posterior layers not found in the model: {missing}; model layers: {list(modules)}")
    out, pieces = output_jacobian_pieces(model, x, {k: modules[k] for k in posterior.layers})
    B, C = out.shape
    f64 = torch.float64
    cov = torch.zeros(B, C, C, dtype=f64, device=out.device)
    joint = getattr(posterior, "covariance_matvec", None) is not None
    generic = []
    for k, lp in posterior.layers.items():
        a, g = pieces[k]
        if not joint and closed_form and a is not None and a.shape[1] == 1:
            part = _closed_form(lp, a[:, 0].to(f64), g[:, :, 0].to(f64))
            if part is not None:
                cov += part
                continue
        generic.append(k)
    if generic:
        per = C * sum(math.prod(posterior.layers[k].shape) for k in generic)
        bs = max(1, min(B, max_elements // max(1, per)))
        for i0 in range(0, B, bs):
            Jl = {}
            for k in generic:
                a, g = pieces[k]
                if a is None:  # normalisation layer: g is J itself, [C, B, m, n]
                    Jl[k] = g[:, i0:i0 + bs].to(f64).transpose(0, 1)
                    continue
                a_, g_ = a[i0:i0 + bs].to(f64), g[:, i0:i0 + bs].to(f64)
                Jl[k] = torch.einsum("cbtm,btn->bcmn", g_, a_)  # (b, C, m, n)
            b = next(iter(Jl.values())).shape[0]
            flat = {k: J.reshape(b * C, *J.shape[2:]).to(_layer_dtype(posterior, k)) for k, J in Jl.items()}
            SJ = covariance_matvec(posterior, flat)
            for k, J in Jl.items():
                cov[i0:i0 + b] += torch.einsum("bcmn,bdmn->bcd", J, SJ[k].to(f64).reshape(J.shape))
    cov = 0.5 * (cov + cov.transpose(1, 2))
    return (out, cov) if return_output else cov


def _layer_dtype(posterior: Posterior, k: str) -> torch.dtype:
    t = next(iter(posterior.layers[k].tensors().values()))
    return t.dtype if t.dtype.is_floating_point else torch.float64


def kfac_glm_covariance(
    model: nn.Module, posterior: Posterior, x: torch.Tensor, *, modules: Mapping[str, nn.Module] | None = None
) -> torch.Tensor:
    """Banerjee eq. 15 only: ``Σ_l (a_l^T A'^{-1} a_l)(Γ_l^T G'^{-1} Γ_l)`` ``[B, C, C]`` for a
    KFAC posterior whose layers are all Linear with one position (else ``ValueError``)."""
    modules = _modules(model, modules)
    out, pieces = output_jacobian_pieces(model, x, {k: modules[k] for k in posterior.layers})
    B, C = out.shape
    cov = torch.zeros(B, C, C, dtype=torch.float64, device=out.device)
    for k, lp in posterior.layers.items():
        a, g = pieces[k]
        if not isinstance(lp, KronLayer) or a is None or a.shape[1] != 1:
            raise ValueError(f"layer {k!r}: eq. 15 needs a KFAC layer on a (B, n) input; use glm_covariance")
        cov += _closed_form(lp, a[:, 0].double(), g[:, :, 0].double())
    return cov


# =========================================================================== links
def probit_pi8(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``softmax(f / sqrt(1 + π/8 σ²))`` per class (``mean``, ``var`` ``[B, C]``)."""
    return torch.softmax(mean / torch.sqrt(1.0 + _PI8 * var), dim=-1)


def probit_pairwise(mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Mean-field pairwise probit (Lu et al. 2020), normalised: ``mean`` ``[B, C]``, ``cov`` ``[B, C, C]``.

    ``p_c ∝ 1 / (1 + Σ_{j≠c} exp(−(f_c − f_j) / sqrt(1 + π/8 v_cj)))``,
    ``v_cj = Σ_cc + Σ_jj − 2 Σ_cj`` (variance of the logit difference). For ``C = 2`` this
    is the binary probit approximation ``σ((f_1 − f_0)/sqrt(1 + π/8 v))``. Cost ``O(B C²)``.
    """
    d = torch.diagonal(cov, dim1=-2, dim2=-1)
    v = (d[:, :, None] + d[:, None, :] - 2.0 * cov).clamp_min(0.0)
    z = (mean[:, :, None] - mean[:, None, :]) / torch.sqrt(1.0 + _PI8 * v)  # (B, C, C), z[c, c] = 0
    # 1 + Σ_{j≠c} exp(−z_cj) = Σ_j exp(−z_cj) (the j = c term is exp(0) = 1)
    p = torch.exp(-torch.logsumexp(-z, dim=-1))
    return p / p.sum(-1, keepdim=True)


# =========================================================================== predictor
class GLMPredictor:
    """Linearised predictive of ``model`` under ``posterior`` (module docstring).

    ``link``: ``"mc"`` (MC-GLM, average softmax of ``f + J η_t``, ``t < n_samples``),
    ``"probit"`` (pairwise mean-field probit) or ``"probit_pi8"`` (scaled logits).
    ``variance``: covariance estimate for the probit links, ``"exact"``
    (:func:`glm_covariance`) or ``"mc"`` (from the ``n_samples`` MC-GLM directions).
    ``link="mc"`` samples weights and needs ``variance="mc"`` (output-space sampling
    from the exact covariance would not be shard-invariant). ``fd_eps``: use the
    finite-difference form of Alg. 4 with step ``ε`` instead of exact JVPs.
    ``chunk``: at most this many MC directions go through one ``vmap``-ed JVP, and with the
    examples of the batch they share, within ``jvp_bytes`` (:mod:`.jvp_budget`). ``likelihood="regression"``:
    :meth:`predict` returns the mean ``f(x, θ*)`` and :meth:`predict_mean_var` the variance.
    ``η_t`` = :func:`laplace_core.predictive.monte_carlo.draw_sample` ``(posterior, seed, t)``: the same
    weight directions as :class:`~laplace_core.predictive.monte_carlo.MCPredictor` with that seed.
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: Posterior,
        n_samples: int = 100,
        seed: int = 0,
        link: str = "mc",
        variance: str = "mc",
        fd_eps: float | None = None,
        likelihood: str = "classification",
        *,
        modules: Mapping[str, nn.Module] | None = None,
        chunk: int = 16,
        cache_bytes: int = 0,
        jvp_bytes: int = JVP_BYTES,
    ):
        if link not in LINKS:
            raise ValueError(f"unknown GLM link {link!r}; valid: {', '.join(LINKS)}")
        if variance not in VARIANCES:
            raise ValueError(f"unknown GLM variance {variance!r}; valid: {', '.join(VARIANCES)}")
        if likelihood not in ("classification", "regression"):
            raise ValueError(f"unknown likelihood {likelihood!r}; valid: classification, regression")
        if link == "mc" and variance == "exact" and likelihood == "classification":
            raise ValueError("link='mc' averages softmax over weight samples (MC-GLM) and needs variance='mc'; "
                             "use link='probit' or 'probit_pi8' with variance='exact'")
        if not isinstance(n_samples, int) or isinstance(n_samples, bool) or n_samples < 1:
            raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
        if fd_eps is not None and not (isinstance(fd_eps, (int, float)) and math.isfinite(fd_eps) and fd_eps > 0):
            raise ValueError(f"fd_eps must be None or a finite number > 0, got {fd_eps!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        sample_seed(seed, 0)  # validates seed
        self.model, self.posterior = model, posterior
        self.n_samples, self.seed, self.link, self.variance = n_samples, seed, link, variance
        self.fd_eps, self.likelihood, self.chunk, self.jvp_bytes = fd_eps, likelihood, chunk, jvp_bytes
        self._bytes: dict[tuple, int] = {}  # module-output bytes per example, by input shape
        self._param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.modules = _modules(model, modules)
        check_layers(self.modules, posterior)
        self._samples = SampleCache(posterior, seed, n_samples, cache_bytes)

    # ------------------------------------------------------------------ pieces
    def sample(self, t: int) -> dict[str, torch.Tensor]:
        """Weight direction ``η_t ~ N(0, Σ)`` (``name -> (m, n)``), keyed by ``(seed, t)``."""
        return self._samples.get(t)

    def logit_directions(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f(x, θ*) [B, C], J η_t [K, B, C])`` for ``t < n_samples`` (JVP or finite differences)."""
        rows, shape = [], (tuple(x.shape[1:]), x.dtype, x.device)
        with torch.no_grad(), eval_mode(self.model):
            if shape in self._bytes:
                f0 = self.model(x)
            else:
                f0, self._bytes[shape] = forward_with_bytes(self.model, x)
        k, b = jvp_plan(self.n_samples, self.chunk, x.shape[0], self._bytes[shape], self._param_bytes,
                        self.jvp_bytes)
        for t0 in range(0, self.n_samples, k):
            ts = range(t0, min(self.n_samples, t0 + k))
            if self.fd_eps is not None:
                for t in ts:
                    rows.append(glm_fd(self.model, x, self.sample(t), self.fd_eps, modules=self.modules, base=f0)[None])
            else:
                samples = [self.sample(t) for t in ts]
                batched = {n: torch.stack([s[n] for s in samples]) for n in samples[0]}
                rows.append(torch.cat([glm_jvp(self.model, x[i:i + b], batched, modules=self.modules)
                                       for i in range(0, x.shape[0], b)], 1))
        return f0, torch.cat(rows, 0)

    def logit_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean [B, C], cov [B, C, C])`` of the linearised logits (``variance`` estimate)."""
        if self.variance == "exact":
            out, cov = glm_covariance(self.model, self.posterior, x, modules=self.modules, return_output=True)
            return out, cov
        f0, jv = self.logit_directions(x)
        jv = jv.to(torch.float64)
        return f0, torch.einsum("kbc,kbd->bcd", jv, jv) / jv.shape[0]

    # ------------------------------------------------------------------ predictions
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Classification: probabilities ``[B, C]`` (model dtype). Regression: the mean ``f(x, θ*)``."""
        if self.likelihood == "regression":
            with torch.no_grad(), eval_mode(self.model):
                return self.model(x)
        if self.link == "mc":
            f0, jv = self.logit_directions(x)
            probs = torch.softmax((f0[None] + jv).to(torch.float64), dim=-1).mean(0)
            return probs.to(f0.dtype)
        f0, cov = self.logit_moments(x)
        if self.link == "probit_pi8":
            p = probit_pi8(f0.to(torch.float64), torch.diagonal(cov, dim1=-2, dim2=-1))
        else:
            p = probit_pairwise(f0.to(torch.float64), cov)
        return p.to(f0.dtype)

    def sample_probs(self, x: torch.Tensor) -> torch.Tensor:
        """``[K, B, C]`` float64: ``softmax(f(x, θ*) + J η_t)`` per sample (``link="mc"``,
        classification); their mean is :meth:`predict`."""
        if self.link != "mc" or self.likelihood != "classification":
            raise ValueError("per-sample probabilities need link='mc' and a classification likelihood")
        f0, jv = self.logit_directions(x)
        return torch.softmax((f0[None] + jv).to(torch.float64), dim=-1)

    def predict_mean_var(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f(x, θ*) [B, C], diag(J Σ J^T) [B, C])``: the linearised function's mean and
        variance (regression: add the observation noise variance for the predictive)."""
        f0, cov = self.logit_moments(x)
        return f0, torch.diagonal(cov, dim1=-2, dim2=-1).to(f0.dtype)

    def predict_batches(self, batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One ``[B_j, C]`` tensor per batch, equal to :meth:`predict` on that batch (the
        ``η_t`` depend only on ``(seed, t)``). Same call shape as ``MCPredictor.predict_batches``."""
        if iter(batches) is batches:
            raise ValueError("predict_batches needs a re-iterable sequence of batches, not a one-shot iterator")
        return [self.predict(x) for x in batches]

    def predict_batches_stats(self, batches: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """MC-GLM: one ``(log p̄ [B_j, C], E_t H(p_t) [B_j])`` per batch, float64, exact
        log-mean-exp of the draws (:func:`laplace_core.predictive.monte_carlo.draw_stats`); None for the
        probit links and regression (no draws: probabilities are all there is)."""
        if self.link != "mc" or self.likelihood != "classification":
            return None
        out = []
        for x in batches:
            f0, jv = self.logit_directions(x)
            out.append(draw_stats(f0[None] + jv))
        return out
