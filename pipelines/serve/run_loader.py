"""A finished run, read back: ``infoform.load_run(uri)`` and what ``infoform score`` checks first.

:func:`read_run` reads a run's output (``config.json``, ``run.json``, the stage markers) into a
:class:`RunInfo`: the model (name, weights, classes), one posterior URI per method, the
``(N, τ)`` the search chose per method, the fitted temperature, the evaluation's predictive
settings and the run's image transforms. Anything missing or inconsistent is a
:class:`RunError` (one line) before any model or data is touched.

:func:`load_run` loads the model and the posteriors (re-targeted to the chosen ``(N, τ)``) into
this process and returns a :class:`LoadedRun`, whose ``predict`` gives the probabilities and
the uncertainty columns of :mod:`pipelines.serve.uncertainty` with the evaluation's own
predictors and keyed draws (the numbers of the audit)::

    run = load_run("runs/smoke")
    out = run.predict(images, method="inf")          # probs, pred, entropy, mutual_information, ...
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from pipelines.storage import layout
from pipelines.storage import uris as storage
from pipelines.storage.store import RunStore

__all__ = ["RunError", "RunInfo", "LoadedRun", "read_run", "load_run", "as_options"]


class RunError(ValueError):
    """A run that cannot be used (missing, unfinished, another model): one line."""


def as_options(storage_options: Any) -> storage.StorageOptions | None:
    """``load_run``'s ``storage_options`` as :class:`~pipelines.storage.uris.StorageOptions`: ``None``,
    an endpoint string, StorageOptions, or a dict of s3fs keyword arguments (its endpoint taken out)."""
    if storage_options is None or isinstance(storage_options, storage.StorageOptions):
        return storage_options
    if isinstance(storage_options, str):
        return storage.StorageOptions(storage_options)
    if isinstance(storage_options, Mapping):
        opts = dict(storage_options)
        return storage.StorageOptions(opts.pop("endpoint_url", None), opts)
    raise RunError(f"storage_options must be None, an endpoint URL, StorageOptions or a dict, "
                   f"got {type(storage_options).__name__}")


@dataclass(frozen=True)
class RunInfo:
    """What a finished run holds (see the module docstring). ``uri``: the model's own output
    folder (``models/<name>/`` inside an audit); ``root``: the run's output (its config);
    ``store``: the run's store as reached from here (every read, and the scores' writes)."""

    uri: str
    root: str
    config: Any
    model: dict[str, Any]
    posterior_uris: dict[str, str]
    hyper: dict[str, tuple[float, float]]
    temperature: float | None
    store: RunStore = RunStore()
    #: ``method -> "nn" | "glm"``: the predictive the run's search chose for each method
    #: (``search.pred_types``); a method not listed uses the run's ``evaluate.pred_type``.
    pred_types: dict[str, str] = dataclasses.field(default_factory=dict)

    def pred_type_of(self, method: str) -> str:
        """The predictive the run evaluated ``method`` with: its search's choice, else ``evaluate.pred_type``."""
        return self.pred_types.get(method) or self.config.evaluate.pred_type

    @property
    def methods(self) -> tuple[str, ...]:
        """Every method ``predict`` and ``score`` accept: ``map``, the posteriors, ``temperature``."""
        return ("map", *self.posterior_uris, *(("temperature",) if self.temperature is not None else ()))

    def default_method(self) -> str:
        return "inf" if "inf" in self.posterior_uris else next(iter(self.posterior_uris), "map")

    def check_method(self, method: str) -> str:
        if method not in self.methods:
            raise RunError(f"run {self.uri} has no method {method!r}; it has {', '.join(self.methods)}")
        return method

    def eval_config(self, **overrides: Any):
        """The run's evaluation settings (:class:`pipelines.evaluation.runtime.EvalConfig`)."""
        from pipelines.evaluation.runtime import eval_config

        return eval_config(self.config, **overrides)

    def data_config(self, root: str):
        """The run's image transforms (size, resize, mean, std) for the unlabeled images under ``root``."""
        from pipelines.ingest.plan import DataPlan, data_config

        mean = std = None
        if self.config.data.demo:
            from pipelines.ingest.demo_data import NORMALIZE_MEAN, NORMALIZE_STD

            mean, std = NORMALIZE_MEAN, NORMALIZE_STD
        plan = DataPlan(root=root, ood=None, mean=mean, std=std, demo=None)
        dc = data_config(self.config, plan, None, unlabeled=True)
        return dataclasses.replace(dc, storage_options=self.store.options, format="auto")

    def split(self, name: str = "test"):
        """``(index, data config)`` of one of the run's own splits (``test``, ``search``, ``ood``),
        the very images its stages read (scanned as the run scans them)."""
        from pipelines.ingest.plan import config_plan, scan_splits

        s = scan_splits(self.config, config_plan(self.config, self.root))
        got = {"test": (s.test, s.test_config), "search": (s.search, s.search_config),
               "ood": (s.ood, s.ood_config)}.get(name)
        if got is None or got[0] is None:
            raise RunError(f"run {self.uri} has no {name!r} split (valid: test, search, ood)")
        return got


def _read_json(uri: str, store: RunStore, what: str) -> Any:
    try:
        return store.read_json(uri)
    except FileNotFoundError:
        raise RunError(f"{uri} not found: {what}") from None
    except (OSError, ValueError) as e:
        raise RunError(f"cannot read {uri}: {type(e).__name__}: {e}") from None


def _model_dir(uri: str, store: RunStore, model_name: str | None) -> tuple[str, dict[str, Any]]:
    """The model's own output folder and its run.json (the sub-run of an audit by ``model_name``)."""
    run_json = _read_json(layout.run_json_uri(uri), store, "not the output of a finished run (no run.json)")
    if isinstance(run_json.get("models"), dict):  # an audit of several models
        names = sorted(run_json["models"])
        if model_name is None or model_name not in names:
            raise RunError(f"{uri} is an audit of models {', '.join(names)}: "
                           f"{'give' if model_name is None else 'not ' + repr(model_name) + '; give'} --model-name")
        sub = layout.model_dir(uri, model_name)
        return sub, _read_json(layout.run_json_uri(sub), store, f"model {model_name!r} of the audit has not finished")
    return uri, run_json


def read_run(store: RunStore, model_name: str | None = None) -> RunInfo:
    """The :class:`RunInfo` of the run at ``store.output`` (read with the store's options, built
    by the caller: ``score`` or :func:`load_run`); :class:`RunError` (one line) when it is not
    a finished run, when ``model_name`` names another model, or when its weights or
    posteriors are missing."""
    from laplace_core.io import MANIFEST_FILE
    from pipelines.config.load import from_dict
    from pipelines.config.schema import ConfigError, RunConfig

    uri = store.output.rstrip("/") or store.output
    store = store.at(uri)
    sub, run_json = _model_dir(uri, store, model_name)
    try:
        cfg = from_dict(RunConfig, _read_json(layout.config_uri(uri), store, "the run's config.json is missing"))
    except ConfigError as e:
        raise RunError(f"{layout.config_uri(uri)}: {e}") from None
    if store.options.endpoint:  # the store as reached from here (the run's own config may name none)
        cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, endpoint_url=store.options.endpoint))
    model = dict(run_json.get("model") or {})
    if model_name is not None and model.get("name") != model_name:
        raise RunError(f"run {uri} holds model {model.get('name')!r}, not {model_name!r}")
    spec = next((m for m in cfg.all_models() if m.name == model.get("name")), cfg.model)
    num_classes = spec.num_classes or (run_json.get("data") or {}).get("num_classes")
    model = {"name": model.get("name"), "weights": model.get("weights"), "num_classes": num_classes}
    weights = model["weights"]
    if weights and ("/" in weights or "." in weights) and not store.exists(weights):
        raise RunError(f"run {uri}: its model weights {weights} are missing")
    fitted = (run_json.get("reused") or {}).get("search") or sub  # a scheduled audit's origin (pipelines.cli.reuse)
    post = _read_json(layout.stage_marker_uri(fitted, "posterior"), store, "the run has no posterior stage")
    uris = {m: layout.posterior_uri(fitted, m) for m in (post.get("summary") or {}).get("posteriors") or {}}
    for m, u in uris.items():
        if not store.exists(storage.join(u, MANIFEST_FILE)):
            raise RunError(f"run {uri}: the {m} posterior at {u} is missing")
    hyper, temperature, pred_types = {}, None, {}
    search_uri = layout.stage_marker_uri(fitted, "search")
    if store.exists(search_uri):
        srch = _read_json(search_uri, store, "")["summary"]
        hyper = {m: (float(c["n_data"]), float(c["prior_precision"]))
                 for m, c in (srch.get("chosen") or {}).items() if c and m in uris}
        pred_types = {m: c["pred_type"] for m, c in (srch.get("chosen") or {}).items()
                      if c and m in uris and c.get("pred_type")}
        if srch.get("temperature"):
            temperature = float(srch["temperature"]["temperature"])
    return RunInfo(uri=sub, root=uri, config=cfg, model=model, posterior_uris=uris, hyper=hyper,
                   temperature=temperature, store=store, pred_types=pred_types)


def make_method_predictor(model: torch.nn.Module, posteriors: Mapping[str, Any], method: str, pred_type: str,
                          n_samples: int, seed: int, cache_bytes: int = 256 << 20, temperature: float | None = None):
    """The evaluation's predictor of ``method`` (``None`` for MAP; ``softmax(f/T)`` for ``temperature``)."""
    from pipelines.evaluation.predictors import make_predictor

    if method == "map":
        return None
    if method == "temperature":
        from pipelines.evaluation.temperature import TemperaturePredictor

        return TemperaturePredictor(model, temperature)
    return make_predictor(model, posteriors[method], pred_type, n_samples, seed, cache_bytes)


class LoadedRun:
    """A run's model and posteriors in this process (:func:`load_run`).

    ``model``: the network in eval mode; ``posteriors``: ``method -> Posterior`` at the chosen
    ``(N, τ)`` (``hyper``); ``temperature``: the fitted ``T`` or None; ``data_config``: the run's
    transforms (``transform`` applies them to a PIL image); ``info``: the :class:`RunInfo`."""

    def __init__(self, info: RunInfo, device: str = "cpu"):
        from pipelines.evaluation.predictors import load_eval_model, load_posteriors

        self.info, self.device = info, device
        self.ev = info.eval_config()
        self.model = load_eval_model(info.model, dtype=self.ev.torch_dtype, device=device, store=info.store,
                                     precision=self.ev.precision)
        posts = load_posteriors(info.posterior_uris, info.hyper or None, info.store)
        self.posteriors = {m: p if torch.device(device).type == "cpu" else p.to(device) for m, p in posts.items()}
        self.hyper, self.temperature = dict(info.hyper), info.temperature
        self.data_config = info.data_config(info.uri)
        self._predictors: dict[tuple, Any] = {}

    def transform(self, image) -> torch.Tensor:
        """A PIL image (or encoded bytes) -> ``[3, H, W]`` with the run's eval transform."""
        from pipelines.ingest.decode import decode_image, eval_transform

        d = self.data_config
        if isinstance(image, (bytes, bytearray)):
            x, err = decode_image(bytes(image), d.image_size, d.resize_size, d.mean, d.std)
            if x is None:
                raise ValueError(f"cannot decode the image: {err}")
        else:
            x = eval_transform(image.convert("RGB"), d.image_size, d.resize_size, d.mean, d.std)
        return torch.from_numpy(x)

    def predictor(self, method: str | None = None, pred_type: str | None = None, n_samples: int | None = None):
        method = self.info.check_method(method or self.info.default_method())
        key = (method, pred_type or self.info.pred_type_of(method), n_samples or self.ev.mc_samples)
        if key not in self._predictors:
            self._predictors[key] = make_method_predictor(self.model, self.posteriors, method, key[1], key[2],
                                                          self.ev.seed, int(self.ev.sample_cache_mb * 2**20),
                                                          self.temperature)
        return self._predictors[key]

    def predict(self, x: Any, method: str | None = None, pred_type: str | None = None,
                n_samples: int | None = None, top_k: int = 5) -> dict[str, np.ndarray]:
        """Probabilities (``probs`` ``[B, C]``) and the uncertainty columns of
        :func:`pipelines.serve.uncertainty.predict_columns` for ``x``: a ``[B, 3, H, W]`` tensor
        already transformed, or a list of PIL images / encoded bytes. Defaults: the run's method
        ``inf`` (else its first), the predictive the run chose for it (``search.pred_types``, else
        ``evaluate.pred_type``), ``evaluate.mc_samples`` and seed."""
        from pipelines.serve.uncertainty import predict_columns

        if not isinstance(x, torch.Tensor):
            x = torch.stack([self.transform(im) for im in x])
        x = x.to(device=self.device, dtype=self.ev.torch_dtype)
        return predict_columns(self.model, self.predictor(method, pred_type, n_samples), x, top_k, keep_probs=True)


def load_run(uri: str, storage_options: Any = None, model_name: str | None = None,
             device: str = "cpu") -> LoadedRun:
    """Load a finished run (a local folder or ``s3://`` prefix) into this process. ``storage_options``:
    an endpoint URL, :class:`~pipelines.storage.uris.StorageOptions` or a dict of s3fs options;
    ``model_name``: which model of an audit."""
    return LoadedRun(read_run(RunStore.open(uri, as_options(storage_options)), model_name), device=device)
