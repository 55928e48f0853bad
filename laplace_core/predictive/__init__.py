"""Floor 4 of ``laplace_core``: a model, a posterior and inputs -> predictive probabilities.

* :mod:`.sample_apply`: a posterior draw applied inside the forward pass, in the space
  where it is cheapest (never forming the ``m x n`` delta when a factored form is smaller);
* :mod:`.monte_carlo`: :class:`~.monte_carlo.MCPredictor`, the MC predictive with keyed
  draws ``(seed, t)`` shared by every shard, and the MAP predictive;
* :mod:`.glm`: the linearised (GLM) predictive, MC or probit;
* :mod:`.last_layer`: the closed-form GLM predictive of a last-layer posterior.

The next floor, :mod:`laplace_core.metrics`, scores the probabilities.
"""
