"""Floor 5 of ``laplace_core``: probabilities + labels -> mergeable evaluation metrics
(accuracy, NLL, Brier, ECE, entropy, OOD detection).

Every metric is an accumulator of sufficient statistics (counts, float64 sums,
fixed-edge histograms) whose ``update`` / ``merge`` / ``compute`` / ``to_json`` work
shard by shard; the conventions are stated in :mod:`laplace_core.metrics.base`.

* :mod:`laplace_core.metrics.base`: conventions, input checks, binning, the base classes;
* :mod:`laplace_core.metrics.scores`: ``Accuracy``, ``NLL``, ``Brier``;
* :mod:`laplace_core.metrics.calibration`: ``Calibration`` (ECE), ``Entropy``;
* :mod:`laplace_core.metrics.ood`: ``OODDetection``;
* :mod:`laplace_core.metrics.suite`: ``MetricSuite``, all of them at once.
"""
