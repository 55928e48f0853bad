"""Floor 3 of ``laplace_core``: statistics (+ eigenbasis) -> a posterior.

* :mod:`.structures`: one module per posterior structure (diag, KFAC, EFB / exact-prior
  KFAC, INF, subnet) behind the :class:`~.structures.base.Posterior` interface, and the
  registry that rebuilds a saved posterior from its method name;
* :mod:`.sparsify`: Algorithm 1 (the sparse information form's low-rank part);
* :mod:`.methods`: the method registry (what each method needs, how it is built);
* :mod:`.build`: :func:`~.build.build_posterior`, statistics -> posterior for any method;
* :mod:`.subnet`: subnetwork Laplace (the selection; the posterior from the Fisher of
  :mod:`laplace_core.curvature.subnet_fisher`);
* :mod:`.sizes`: how many numbers each method stores (Lee et al.'s Table 3).

The next floor, :mod:`laplace_core.predictive`, predicts with a posterior.
"""
