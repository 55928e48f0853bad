"""``evaluate.precision`` (issue 31): the actors' forwards under autocast, the draws outside it.

``in_precision(model, "fp32")`` leaves the model alone (the predictions are bit for bit those of
the plain model); ``"bf16"`` runs every layer of the forward in bfloat16 (seen by a hook), keeps
the weight draws in the posterior's dtype (they are formed before the forward, equal to the
fp32 predictor's) and gives float32 outputs whose probabilities stay close to float32's. Only
the ``nn`` predictive takes a precision: MC-GLM's Jacobian-vector products and the closed-form
last-layer GLM stay in float32, and the config refuses ``pred_type: glm`` with bf16.

The tolerance is bfloat16's: an 8-bit mantissa gives a relative rounding of 2^-8 per operation;
through the tiny CNN's layers the probabilities move by a few thousandths (measured 0.0066 on the
shared fixture's 3-class CNN, 0.0007 on a 4-class one), bound 0.05. With autocast off they would
be equal, hence the second assertion that they differ.
"""
from __future__ import annotations

import pytest
import torch

from laplace_core.predictive.monte_carlo import MCPredictor
from pipelines.evaluation.predictors import in_precision
from pipelines.ingest.models import tiny_cnn

#: max |p_bf16 - p_fp32| over classes and images: bfloat16 rounding (2^-8 relative) through
#: the CNN's layers and a softmax; measured 0.0066 (module docstring).
BF16_PROB_TOL = 0.05
K = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the weights of the shared fixture's tiny_cnn(3)
    return tiny_cnn(3).eval()


@pytest.fixture(scope="module")
def setup(tiny_cnn_posteriors):
    made = tiny_cnn_posteriors(32, ["diag"])
    assert all(torch.equal(a, b) for a, b in zip(_model().state_dict().values(), made["net"].state_dict().values()))
    return {"all": made["posts"]["diag"]}, torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def test_fp32_is_the_model_itself(setup):
    posts, x = setup
    model = _model()
    assert in_precision(model, "fp32") is model and "forward" not in vars(model)
    with pytest.raises(ValueError, match="unknown precision 'tf32'"):
        in_precision(model, "tf32")


def test_bf16_forward_same_draws_close_probabilities(setup):
    posts, x = setup
    fp32 = MCPredictor(_model(), posts["all"], K, seed=3)
    ref = fp32.predict(x)
    model = in_precision(_model(), "bf16")
    seen = []
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Conv2d, torch.nn.Linear)):
            mod.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    pred = MCPredictor(model, posts["all"], K, seed=3)
    p = pred.predict(x)
    assert seen and set(seen) == {torch.bfloat16}, seen  # every layer ran in bf16
    assert p.dtype == torch.float32 and torch.allclose(p.sum(-1), torch.ones(6), atol=1e-5)
    for name, d in pred.sample(0).items():  # the draws: formed outside autocast, the fp32 predictor's
        assert torch.equal(d, fp32.sample(0)[name]), name
    err = (p - ref).abs().max().item()
    assert 0 < err <= BF16_PROB_TOL, err


def test_the_config_refuses_what_autocast_cannot_run():
    from pipelines.config.schema import EvalSpec

    assert EvalSpec(precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match="runs a float32 model under autocast"):
        EvalSpec(precision="bf16", dtype="float64")
    with pytest.raises(ValueError, match="pred_type glm"):
        EvalSpec(precision="bf16", pred_type="glm")
