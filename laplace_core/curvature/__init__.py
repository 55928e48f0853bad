"""Floor 1 of ``laplace_core``: a model and its batches -> curvature statistics.

In the order the data meets them:

* :mod:`.layer_selection`, :mod:`.layers`: which layers carry curvature (``nn.Linear``,
  ``nn.Conv2d``, grouped-convolution and attention views, normalisation layers) and how a
  perturbation of ``W~ = [W, b]`` is applied to them;
* :mod:`.hooks`: capture of layer inputs and output gradients during one backward pass;
* :mod:`.keyed_rng`, :mod:`.likelihoods`: the labels drawn for the MC Fisher (keyed per
  example, so shards and reruns agree) and the likelihoods' output gradients;
* :mod:`.batch_loop`: the one loop over batches (mode, device, options) every pass runs;
* :mod:`.accumulate`: the per-layer sums (``A``, ``G``, diagonal, EFB) of one batch;
* :mod:`.statistics`: :class:`~.statistics.CurvatureStatistics`, the mergeable sums;
* :mod:`.collect`: :func:`~.collect.collect_statistics`, the pass that ties them together;
* :mod:`.subnet_fisher`: the other pass on the same loop, the full ``S x S`` Fisher over the
  weights a subnetwork selection (:mod:`laplace_core.posteriors.subnet`) keeps.

The next floor, :mod:`laplace_core.basis`, turns the statistics into an eigenbasis.
"""
