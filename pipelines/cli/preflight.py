"""Preflight: everything the job can check before any cluster work, each failure one line.

Run by the job (``pipelines.cli.main.main``) before Ray starts: the configuration's model names
and weights, that each model takes the run's image size (a forward on the meta device), the data,
OOD and weights URIs, that the output prefix is writable, and the weights
themselves (read and matched against the model's state dict and the data's classes), all
with the run's own store settings (:class:`pipelines.storage.uris.StorageOptions`) and the
credentials of the AWS chain. A wrong endpoint, a missing bucket, denied access or a
missing object is a :class:`PreflightError` (a ``ValueError``) naming the URI and the
endpoint (a dead endpoint is "cannot reach" whatever the credentials; missing credentials are
said only when the endpoint answers); the job prints it and exits with code 2. The store is probed through a fresh
filesystem with short timeouts and one retry, so a wrong endpoint fails in seconds rather
than after s3fs's and botocore's back-off (minutes).
"""
from __future__ import annotations

import difflib
import uuid
from typing import Any

from pipelines.storage import uris as storage
from pipelines.config.schema import ModelSpec, RunConfig
from pipelines.errors import PreflightError

__all__ = ["PreflightError", "preflight", "check_uri", "check_writable", "check_forward"]

#: Seconds to connect to / read from the store while probing it.
CONNECT_TIMEOUT_S = 3
READ_TIMEOUT_S = 8


def _probe_fs(uri: str, opts: storage.StorageOptions):
    """A filesystem for ``uri`` that fails fast: short timeouts, one attempt, no instance cache."""
    if not storage.is_remote(uri):
        return storage.get_fs(uri)
    import fsspec

    kwargs = opts.s3_kwargs()
    config = dict(kwargs.pop("config_kwargs", {}) or {})
    config.update(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                  retries={"max_attempts": 1, "mode": "standard"})
    fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config, **kwargs)
    fs.retries = 1  # s3fs's own retry loop (5 with back-off by default)
    return fs, storage.get_fs(uri, opts)[1]


def _bucket_exists(fs, bucket: str) -> bool:
    """HEAD the bucket: ``False`` when it does not exist; connection and permission problems
    raise (s3fs's ``exists`` would report them as a missing bucket)."""
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
        return True
    except FileNotFoundError:
        return False
    except Exception as e:
        resp = getattr(e, "response", None) or {}
        code = str(resp.get("Error", {}).get("Code", "")) if isinstance(resp, dict) else ""
        if code in ("404", "NoSuchBucket", "NotFound"):
            return False
        raise


#: what to check when the store does not answer: the CLI flag and its config key
CHECK_ENDPOINT = "check --endpoint-url (storage.endpoint_url)"


def _where(opts: storage.StorageOptions) -> str:
    return f"endpoint {opts.endpoint}" if opts.endpoint else "AWS's default endpoint"


def _explain(e: BaseException, uri: str, opts: storage.StorageOptions) -> str:
    """One line for an exception raised while probing ``uri``."""
    text = " ".join(str(e).split()) or type(e).__name__
    name = type(e).__name__
    low = text.lower()
    if not storage.is_remote(uri):  # a local path: no endpoint or credentials to name
        return f"{uri} ({name}: {text[:200]})"
    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError") \
            or "unable to locate credentials" in low:
        why = storage.unreachable(opts, CONNECT_TIMEOUT_S)
        if why:  # botocore asks for credentials before it connects: the endpoint is the first cause
            return f"cannot reach the S3 store at the {_where(opts)} for {uri} ({why}); {CHECK_ENDPOINT}"
        return (f"no AWS credentials found for {uri} (the {_where(opts)} answers): set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, a shared config profile or an instance role")
    if "nosuchbucket" in low or "bucket does not exist" in low or "specified bucket does not exist" in low:
        return f"bucket {bucket!r} does not exist at the {_where(opts)} ({uri})"
    if isinstance(e, PermissionError) or "accessdenied" in low or "access denied" in low or "forbidden" in low \
            or "invalidaccesskeyid" in low or "signaturedoesnotmatch" in low:
        return (f"access denied to {uri} at the {_where(opts)}: check the credentials of the AWS chain "
                f"(environment, shared config, instance role) and the bucket policy ({text[:160]})")
    if "connect" in low or "endpoint" in low or "timeout" in low or "timed out" in low or "name or service" in low \
            or name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ClientConnectorError"):
        return f"cannot reach the S3 store at the {_where(opts)} for {uri} ({name}: {text[:160]}); {CHECK_ENDPOINT}"
    return f"cannot read {uri} at the {_where(opts)} ({name}: {text[:200]})"


def check_uri(uri: str, what: str, opts: storage.StorageOptions) -> None:
    """``uri`` exists in its store (a file, a folder or a prefix with objects under it)."""
    fs, path = _probe_fs(uri, opts)
    try:
        if storage.is_remote(uri):
            bucket = path.split("/", 1)[0]
            if not _bucket_exists(fs, bucket):
                raise PreflightError(f"bucket {bucket!r} does not exist at the {_where(opts)} ({what}: {uri})")
        fs.invalidate_cache(path)
        found = fs.exists(path)
    except PreflightError:
        raise
    except Exception as e:  # botocore / aiohttp / s3fs raise many kinds; each becomes one line
        raise PreflightError(f"{what}: {_explain(e, uri, opts)}") from None
    if not found:
        raise PreflightError(f"{what} not found: {uri}" + (f" (at the {_where(opts)})" if storage.is_remote(uri) else ""))


def check_writable(uri: str, opts: storage.StorageOptions) -> None:
    """Write and delete a small probe object under the output prefix ``uri``."""
    probe = storage.join(uri, f".infoform-preflight-{uuid.uuid4().hex[:12]}")
    try:
        if storage.is_remote(uri):
            fs, path = _probe_fs(uri, opts)
            bucket = path.split("/", 1)[0]
            if not _bucket_exists(fs, bucket):
                raise PreflightError(f"bucket {bucket!r} does not exist at the {_where(opts)} (output: {uri})")
            ppath = storage.get_fs(probe, opts)[1]
            fs.pipe_file(ppath, b"ok")
            fs.rm(ppath)
        else:
            storage.write_bytes_atomic(probe, b"ok")
            storage.remove(probe)
    except PreflightError:
        raise
    except Exception as e:
        raise PreflightError(f"output is not writable: {_explain(e, uri, opts)}") from None


def weights_cache_file(enum) -> str:
    """Where torchvision keeps the file of weights ``enum`` once downloaded (torch hub's cache)."""
    import os
    from urllib.parse import urlsplit

    import torch

    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlsplit(enum.url).path))


def _check_enum_weights(name: str, cfg: RunConfig) -> None:
    import os

    from pipelines.ingest.models import resolve_weights_enum

    enum = resolve_weights_enum(name)
    if cfg.storage.allow_download:
        return
    path = weights_cache_file(enum)
    if not os.path.isfile(path):
        raise PreflightError(
            f"torchvision weights {name} are not in this machine's cache ({path}); every node would download them "
            "and clusters often have no internet access: save the state dict once where there is access and pass "
            "it as --weights s3://.../file.pt, or --set storage.allow_download=true")


def _check_models(cfg: RunConfig, opts: storage.StorageOptions, world: bool = True) -> None:
    from pipelines.ingest.models import (EXTRA_MODELS, RANDOM_WEIGHTS, is_enum_name, is_factory, model_names,
                                         resolve_factory, resolve_weights_enum)
    from pipelines.ingest.timm_models import check_timm_name, is_timm

    for spec in cfg.all_models():
        if is_factory(spec.name):  # a user's package.module:callable; it builds its own model
            resolve_factory(spec.name)
            if spec.weights not in (None, RANDOM_WEIGHTS) and world:
                check_uri(spec.weights, "weights file", opts)
            continue
        if is_timm(spec.name):  # timm's registry: timm installed, a known name (close matches otherwise)
            try:
                check_timm_name(spec.name)
            except ValueError as e:
                raise PreflightError(str(e)) from None
            if spec.weights is not None and is_enum_name(spec.weights):
                raise PreflightError(f"model {spec.name!r} has no torchvision weights; pass a state-dict file")
        elif spec.name not in EXTRA_MODELS and spec.name not in (valid := model_names()):  # imports torchvision
            fam = sorted(n for n in valid if n.startswith(("resnet", "densenet"))) + sorted(EXTRA_MODELS)
            close = difflib.get_close_matches(spec.name, sorted(valid), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise PreflightError(f"unknown model {spec.name!r}; {hint}valid: {', '.join(fam)} "
                                 "(or any torchvision classifier)")
        if spec.weights == RANDOM_WEIGHTS:
            continue
        if spec.weights is not None:
            if is_enum_name(spec.weights):
                resolve_weights_enum(spec.weights)
                if world:
                    _check_enum_weights(spec.weights, cfg)
            elif world:
                check_uri(spec.weights, "weights file", opts)
        elif spec.name != "demo_cnn":
            raise PreflightError(f"model {spec.name!r} needs --weights (a state-dict file, a torchvision weights name, "
                                 "or random: a test run with random initialisation)")
    if cfg.models and cfg.model != ModelSpec():
        raise PreflightError("both model (--model/--weights) and models: (an audit) are set; with models:, give each "
                             "model's weights in the list, e.g. --set 'models=[{name: resnet18, weights: ...}]'")
    _check_layer_selection(cfg)
    names = [spec.name for spec in cfg.all_models()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PreflightError(f"models: {', '.join(twice)} listed more than once; an audit writes each model to "
                             "<output>/models/<name>/, so model names must be unique")


def _check_layer_selection(cfg: RunConfig) -> None:
    """``posterior.layers`` names / globs against each model's curvature layers (built on the
    meta device, no weights): one that matches no layer is a PreflightError listing a few."""
    if isinstance(cfg.posterior.layers, str) and cfg.posterior.layers in ("all", "last"):
        return
    from laplace_core.curvature.layer_selection import LayerSelectionError
    from pipelines.ingest.models import is_factory, model_coverage

    for spec in cfg.all_models():
        if is_factory(spec.name):
            continue
        try:
            model_coverage(spec.name, spec.num_classes, cfg.posterior.norm_layers, cfg.posterior.layers)
        except LayerSelectionError as e:
            raise PreflightError(f"posterior.layers for {spec.name}: {e}") from None
        except ValueError:  # the model cannot be built without its weights here: checked at run time
            continue


def data_classes(cfg: RunConfig, opts: storage.StorageOptions) -> int | None:
    """How many classes the training split holds, from its folder names (ImageFolder) or the
    Parquet shards' metadata file; None where that is not known without a scan (flat layouts)."""
    if cfg.data.demo or not cfg.data.root or not cfg.data.train_split:
        return None
    from pipelines.ingest.parquet import PARQUET_META_FILE

    train = storage.join(cfg.data.root, cfg.data.train_split)
    try:
        meta = storage.join(train, PARQUET_META_FILE)
        if storage.exists(meta, opts):
            return len(storage.read_json(meta, opts).get("classes") or ()) or None
        fs, path = storage.get_fs(train, opts)
        dirs = [e for e in fs.ls(path, detail=True) if e.get("type") == "directory"
                and not str(e["name"]).rstrip("/").rsplit("/", 1)[-1].startswith(".")]
    except (OSError, ValueError):
        return None
    return len(dirs) or None


def check_weights_fit(cfg: RunConfig, opts: storage.StorageOptions) -> None:
    """Each model's state-dict file is read (safetensors header, or ``torch.load(weights_only=True)``)
    and matched against the model's state dict, and its classifier head against the number of
    classes in the data: a file that is not weights, missing / unexpected keys, shape mismatches
    and a head of another size are each one :class:`PreflightError` line."""
    from pipelines.ingest.models import RANDOM_WEIGHTS, check_weights, is_enum_name

    n_data = None
    for spec in cfg.all_models():
        if spec.weights in (None, RANDOM_WEIGHTS) or is_enum_name(spec.weights):
            continue
        try:
            fit = check_weights(spec.name, spec.weights, spec.num_classes, options=opts)
        except ValueError as e:
            raise PreflightError(f"--weights {spec.weights}: {e}") from None
        n_data = data_classes(cfg, opts) if n_data is None else n_data
        if n_data and fit["num_classes"] and fit["num_classes"] != n_data:
            raise PreflightError(
                f"--weights {spec.weights}: the classifier head {fit['head']!r} of {spec.name} has "
                f"{fit['num_classes']} outputs, but the data has {n_data} classes "
                f"({storage.join(cfg.data.root, cfg.data.train_split)}): train the head on these classes "
                "(the class folders, sorted by name, are the label order) or point --data at the classes it was trained on")


def check_forward(cfg: RunConfig) -> None:
    """Each model takes the run's images: a batch of two zero images at ``data.image_size`` through
    the model built on the ``meta`` device (shapes only: no memory, no arithmetic). A model whose
    layers are sized for another input (a Linear after a flatten, a ViT's fixed patch grid) or whose
    output is not ``(batch, classes)`` is one :class:`PreflightError` line naming the setting, before
    a Ray Train worker hits it. An error on the meta device is confirmed by the same forward on CPU
    with random weights before it is reported (an op the meta device lacks is no error of the
    model's); a model that cannot be built without its weights is checked at run time."""
    size = cfg.data.image_size
    for spec in cfg.all_models():
        why = _forward_error(spec.name, spec.num_classes, size)
        if why:
            raise PreflightError(why)


def _forward_error(name: str, num_classes: int | None, size: int) -> str | None:
    import torch

    from pipelines.ingest.models import RANDOM_WEIGHTS, build_meta, is_factory, load_model

    try:
        if is_factory(name):  # a user's callable: built under the meta device where it allows
            with torch.device("meta"):
                model = build_meta(name, num_classes)
        else:
            model = build_meta(name, num_classes)
    except Exception:  # noqa: BLE001 -- built, and its errors reported, at run time
        return None
    out, err = _zero_forward(model.to("meta"), size, "meta")
    if err is not None:
        try:
            model = load_model(name, RANDOM_WEIGHTS, num_classes)
        except Exception:  # noqa: BLE001
            return None
        out, err = _zero_forward(model, size, "cpu")
    if err is not None:
        return (f"model {name} does not take {size}x{size} images (data.image_size={size}): {err}; set "
                f"--set data.image_size=N --set data.resize_size=N to the size it was trained at")
    if isinstance(out, torch.Tensor) and (out.ndim != 2 or out.shape[0] != 2):
        return (f"model {name} returns a tensor of shape {tuple(out.shape)} for 2 images of {size}x{size}: "
                "a classifier returns (batch, classes) logits")
    return None


def _zero_forward(model, size: int, device: str):
    """``(output, None)`` or ``(None, "Type: message")`` for two zero images through ``model``."""
    import torch

    try:
        with torch.no_grad():
            return model.eval()(torch.zeros(2, 3, size, size, device=device)), None
    except Exception as e:  # noqa: BLE001 -- the model's own error, reported in one line
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _check_splits(cfg: RunConfig, root: str, opts: storage.StorageOptions) -> None:
    """The split folders the run reads exist: train (the curvature passes), val (scanned by every
    run: the search's images, and the evaluation's when there is no test split), test if set."""
    d = cfg.data
    wanted = [(d.train_split if "curvature" in cfg.stages else None, "train split (data.train_split)"),
              (d.val_split, "val split (data.val_split: held-out images for the (N, tau) search and, without "
                            "data.test_split, the evaluation; e.g. <root>/val/<class>/)"),
              (d.test_split, "test split (data.test_split)")]
    last = root.rstrip("/").rsplit("/", 1)[-1]
    for split, what in wanted:
        if not split:
            continue
        try:
            check_uri(storage.join(root, split), what, opts)
        except PreflightError as e:
            if last not in (d.train_split, d.val_split, d.test_split):
                raise
            parent = root.rstrip("/").rsplit("/", 1)[0] if "/" in root.rstrip("/") else "."
            raise PreflightError(f"{e}; --data is the root that holds {d.train_split}/ and {d.val_split}/, "
                                 f"not a split: did you mean --data {parent}?") from None


def preflight(cfg: RunConfig, *, dry_run: bool = False) -> dict[str, Any]:
    """Check ``cfg`` against the world before any cluster work; returns what was checked.
    Raises :class:`PreflightError` (one line) on the first problem. ``dry_run`` checks the
    configuration alone: no store is contacted, nothing is written, no cache is looked at."""
    opts = cfg.storage_options()
    checked: dict[str, Any] = {"endpoint": opts.endpoint}
    if not dry_run:  # the paths first: a wrong one is answered without importing torch or building a model
        if not cfg.data.demo:
            check_uri(cfg.data.root, "data root", opts)
        for o in cfg.data.ood:  # the demo's letters are written by the run; every configured set is checked
            try:
                check_uri(o.uri, "OOD folder", opts)
            except PreflightError as e:
                raise PreflightError(f"{e} (OOD set {o.name!r})") from None
        check_writable(cfg.output, opts)
    _check_models(cfg, opts, world=not dry_run)
    check_forward(cfg)
    if dry_run:
        return checked
    if not cfg.data.demo and not cfg.data.root.rstrip("/").lower().endswith(".parquet"):
        _check_splits(cfg, cfg.data.root, opts)
    checked["output"] = cfg.output
    check_weights_fit(cfg, opts)
    return checked
