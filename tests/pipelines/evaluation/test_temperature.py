"""Temperature scaling (pipelines.evaluation.temperature): the fit against a dense float64
reference, and the calibration it buys on a deliberately over-confident model."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from laplace_core.posteriors.methods import REGISTRY, TEMPERATURE, layer_methods, method_info, posterior_methods
from laplace_core.metrics.calibration import Calibration
from laplace_core.posteriors.build import resolve_method
from pipelines.evaluation.temperature import T_BOUNDS, TemperaturePredictor, fit_temperature, temperature_nll


def _dense_reference(z: np.ndarray, y: np.ndarray) -> float:
    """argmin_T of the float64 NLL: bounded Brent in log T (scipy), refined to its tolerance."""
    from scipy.optimize import minimize_scalar
    from scipy.special import logsumexp

    def nll(log_t):
        s = z / math.exp(log_t)
        return float(np.mean(logsumexp(s, axis=1) - s[np.arange(len(y)), y]))

    r = minimize_scalar(nll, bounds=(math.log(T_BOUNDS[0]), math.log(T_BOUNDS[1])), method="bounded",
                        options={"xatol": 1e-12, "maxiter": 2000})
    return math.exp(r.x)


@pytest.mark.parametrize("scale,seed", [(8.0, 0), (0.5, 1), (3.0, 2)])
def test_fit_equals_a_dense_reference(scale, seed):
    rng = np.random.default_rng(seed)
    n, c = 400, 7
    y = rng.integers(0, c, n)
    z = rng.normal(size=(n, c)) + 1.5 * np.eye(c)[y]  # informative logits, then too sharp / too flat
    z = z * scale
    fit = fit_temperature(z.astype(np.float32), y)
    ref = _dense_reference(z.astype(np.float32).astype(np.float64), y)
    assert not fit["at_bound"]
    assert fit["temperature"] == pytest.approx(ref, rel=1e-6)
    # the minimum: no point of a fine grid around it is lower
    grid = fit["temperature"] * np.exp(np.linspace(-0.05, 0.05, 101))
    nlls = [temperature_nll(z.astype(np.float32), y, t) for t in grid]
    assert fit["nll_after"] <= min(nlls) + 1e-12
    assert fit["nll_after"] <= fit["nll_before"]
    # independent of the row order (the actors' sharding)
    perm = rng.permutation(n)
    assert fit_temperature(z.astype(np.float32)[perm], y[perm])["temperature"] == fit["temperature"]


def test_fit_at_the_bound_and_bad_input():
    z = np.array([[10.0, 0.0], [0.0, 10.0]])
    fit = fit_temperature(z, np.array([0, 1]))  # every example right with a margin: NLL falls as T -> 0
    assert fit["at_bound"] and fit["temperature"] == pytest.approx(T_BOUNDS[0])
    with pytest.raises(ValueError, match="labels outside"):
        fit_temperature(z, np.array([0, 2]))
    with pytest.raises(ValueError, match="not all finite"):
        fit_temperature(np.array([[np.nan, 0.0]]), np.array([0]))
    with pytest.raises(ValueError, match="logits \\[n, C\\]"):
        fit_temperature(np.zeros((0, 3)), np.zeros(0, dtype=int))


def test_temperature_is_a_registry_row_without_a_posterior():
    info = method_info(TEMPERATURE)
    assert not info.posterior and info.builder is None and info.num_stored == 1
    assert TEMPERATURE in REGISTRY and TEMPERATURE not in posterior_methods() and TEMPERATURE not in layer_methods()
    with pytest.raises(ValueError, match="unknown posterior method 'temperature'"):
        resolve_method(TEMPERATURE)


def _overconfident_model():
    """A small MLP trained 1000 full-batch Adam steps, no regularisation, on 60 points of three
    overlapping Gaussian classes: it fits the training set and is over-confident elsewhere."""
    g = torch.Generator().manual_seed(0)
    means = torch.tensor([[0.0, 0.0], [1.2, 0.0], [0.6, 1.0]], dtype=torch.float64)

    def draw(n):
        y = torch.randint(0, 3, (n,), generator=g)
        return means[y] + 0.6 * torch.randn(n, 2, generator=g, dtype=torch.float64), y

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)).double()
    x, y = draw(60)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(1000):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), draw(1000), draw(2000)


def test_temperature_scaling_fixes_an_overconfident_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared CI machine
    try:
        model, (x_val, y_val), (x_test, y_test) = _overconfident_model()
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        fit = fit_temperature(model(x_val).numpy(), y_val.numpy())
        T = fit["temperature"]
        assert T > 1.5, fit  # over-confident: the fit flattens the predictive
        p_map = torch.softmax(model(x_test), -1)
        p_ts = TemperaturePredictor(model, T).predict_batches([x_test])[0]

    def metrics(p):
        nll = float(-torch.log(p[torch.arange(len(y_test)), y_test]).mean())
        return nll, Calibration("equal_width", 15).update(p, y_test).compute()["ece"]

    (nll_map, ece_map), (nll_ts, ece_ts) = metrics(p_map), metrics(p_ts)
    assert nll_ts < nll_map and ece_ts < ece_map, (nll_map, nll_ts, ece_map, ece_ts)
    assert ece_ts < 0.5 * ece_map  # not a marginal change
    assert torch.equal(p_map.argmax(1), p_ts.argmax(1))
    print(f"T={T:.3f} NLL {nll_map:.4f} -> {nll_ts:.4f}, ECE {ece_map:.4f} -> {ece_ts:.4f}")  # T > 0 never changes the predicted class


def test_a_separable_search_split_falls_back_to_T_1_and_says_why():
    """Issue 27: every search image right with a margin -> the fit runs to T_min; the row is
    evaluated at T = 1 (MAP's probabilities), not at T = 1e-3, with one line saying why."""
    from pipelines.evaluation.temperature import with_fallback

    z = np.array([[10.0, 0.0], [0.0, 10.0], [7.0, 1.0]])
    fit = with_fallback(fit_temperature(z, np.array([0, 1, 0])))
    assert fit["temperature"] == 1.0 and fit["temperature_fit"] == pytest.approx(T_BOUNDS[0])
    assert "separable" in fit["fallback"] and "T = 1" in fit["fallback"] and "\n" not in fit["fallback"]
    assert fit["nll_after"] == fit["nll_before"]
    ok = with_fallback(fit_temperature(np.array([[2.0, 0.0], [2.0, 0.0]]), np.array([0, 1])))
    assert ok["fallback"] == "" and ok["temperature"] == ok["temperature_fit"] != 1.0


def test_evaluation_nll_of_a_confident_mistake_is_exact():
    """MAP and temperature rows through the evaluation path: logits (60, 0) on an image of class 1
    give NLL 60 + log(1 + e^-60) (log-softmax), not the 27.6 of a 1e-12 probability floor."""
    from pipelines.evaluation.evaluate import evaluate_shard
    from pipelines.evaluation.runtime import EvalConfig

    lin = nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[60.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    cfg = EvalConfig(batch_size=4, dtype="float64", torch_threads=1)
    acc, info = evaluate_shard(lin.eval(), {}, [(x, torch.tensor([1]))], None, cfg, temperature=2.0)
    assert not info["failed"]
    got = {m: a.compute() for m, a in acc.items()}
    assert got["map"]["nll"] == pytest.approx(60.0 + math.log1p(math.exp(-60.0)), rel=1e-14)
    assert got["temperature"]["nll"] == pytest.approx(30.0 + math.log1p(math.exp(-30.0)), rel=1e-14)
    assert got["map"]["nll_from"] == "log-probabilities (exact)"


def test_a_fit_on_few_mistakes_says_so_and_one_on_many_does_not():
    """The demo's converged CNN misclassifies 1 of its 269 search images; T (0.27) then rests on
    that one mistake and on how confident the rest are: the fit's note says so (the log prints it)."""
    from pipelines.evaluation.temperature import FEW_ERRORS

    rng = np.random.default_rng(0)
    n, c = 300, 5
    y = rng.integers(0, c, n)
    z = 2.0 * rng.normal(size=(n, c)) + 3.0 * np.eye(c)[y]
    errors = int((z.argmax(1) != y).sum())
    assert errors >= FEW_ERRORS
    many = fit_temperature(z, y)
    assert many["errors"] == errors and many["note"] == "" and not many["at_bound"]
    wrong = np.flatnonzero(z.argmax(1) != y)
    z_few = z.copy()
    z_few[wrong[2:], y[wrong[2:]]] += 20.0  # all but two mistakes made right: 2 misclassified remain
    few = fit_temperature(z_few, y)
    assert few["errors"] == 2 and not few["at_bound"]
    assert few["note"].startswith(f"only 2 of the {n} fitting examples are misclassified") and "\n" not in few["note"]
    z_few[wrong[1], y[wrong[1]]] += 20.0  # one mistake left: 'is'
    assert fit_temperature(z_few, y)["note"].startswith(f"only 1 of the {n} fitting examples is misclassified")


def test_evaluation_progress_comes_per_method_and_adds_up_to_the_images():
    """A resnet18's evaluation of 40 test images (one chunk per actor, 5 rows, K = 30) printed no
    progress line for minutes: progress came once per chunk, after every method. Now each method
    reports its share of the chunk; the shares add up to the chunk's images."""
    from pipelines.evaluation.evaluate import evaluate_shard
    from pipelines.evaluation.runtime import EvalConfig

    lin = nn.Linear(2, 3).double().eval()
    x = torch.randn(10, 2, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    calls = []
    cfg = EvalConfig(batch_size=4, dtype="float64", torch_threads=1)
    evaluate_shard(lin, {}, [(x[:6], y[:6]), (x[6:], y[6:])], [(x[:3], y[:3])], cfg, temperature=2.0,
                   progress=lambda split, n: calls.append((split, n)))
    # one chunk of 10 in-domain images, one of 3 OOD images; rows: map and temperature
    assert calls == [(0, 5.0), (0, 5.0), (1, 1.5), (1, 1.5)], calls
