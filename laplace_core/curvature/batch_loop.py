"""The batch loop shared by every pass over the data: pass 1 and the EFB pass
(:mod:`laplace_core.curvature.collect`) and the subnetwork Fisher (:mod:`laplace_core.posteriors.subnet`).

:func:`model_batches` runs the model on each batch with the layer capture installed and
yields a :class:`ModelBatch` (inputs, outputs, labels, keys); the passes draw their labels
with :func:`draw_targets` and back-propagate through :attr:`ModelBatch.capture`. Their
options are one frozen :class:`PassOptions`.

Precision (``PassOptions.precision``, docs/design.md §1): ``"fp32"`` runs the model in its
own dtype (bit for bit what the passes computed before the option existed); ``"bf16"`` /
``"fp16"`` run the forward under ``torch.autocast``, so the layers' inputs and output
gradients are captured in the compute dtype. The logits are read in float32 for the label
draws and the output gradient; the consumers cast the captured rows to the model's dtype
(float32) before the products, which accumulate in float32 and are added to the float64
sums (:class:`laplace_core.curvature.accumulate.Accumulator`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from ..names import DTYPE_NAMES, PRECISION_NAMES
from .hooks import Capture, capture
from .keyed_rng import KeyedSampler

__all__ = [
    "PRECISIONS",
    "PassOptions",
    "ModelBatch",
    "split_batch",
    "model_batches",
    "draw_targets",
]

#: ``PRECISION_NAMES`` -> the autocast dtype (``None``: full precision)
PRECISIONS = {n: {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[n] for n in PRECISION_NAMES}
#: ``DTYPE_NAMES`` (``curvature.model_dtype`` / ``stats_dtype``, ``evaluate.dtype``) -> the torch dtype
DTYPES = {n: getattr(torch, n) for n in DTYPE_NAMES}


@dataclass(frozen=True)
class PassOptions:
    """Options of one pass over the data (pass 1, the EFB pass, the subnetwork Fisher).

    ``fisher``/``mc_samples``/``generator``: the labels (:func:`draw_targets`); ``dtype``:
    the sums; ``likelihood``: ``"classification"`` or ``"regression"``; ``progress(n)``:
    called after each batch with the examples seen; ``max_chunk_elements``: the largest
    intermediate; ``flush_examples``: examples summed in the compute dtype before being added
    to the ``dtype`` sums; ``efb_order``: force the EFB contraction order (tests);
    ``norm_layers`` / ``layers``: which layers (:func:`laplace_core.curvature.layers.find_layers`);
    ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (module docstring);
    ``channels_last``: run convolutions on channels-last inputs and weights.
    """

    fisher: str = "mc"
    mc_samples: int = 1
    generator: torch.Generator | KeyedSampler | None = None
    dtype: torch.dtype = torch.float64
    likelihood: str = "classification"
    progress: Callable[[int], None] | None = None
    max_chunk_elements: int = 2**26
    flush_examples: int = 256
    efb_order: str | None = None
    norm_layers: str = "map"
    layers: Any = "all"
    precision: str = "fp32"
    channels_last: bool = False

    def __post_init__(self):
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}")
        if int(self.flush_examples) < 1:
            raise ValueError(f"flush_examples must be positive, got {self.flush_examples}")
        if int(self.max_chunk_elements) < 1:
            raise ValueError(f"max_chunk_elements must be positive, got {self.max_chunk_elements}")

    @classmethod
    def build(cls, options: "PassOptions | None" = None, **changes) -> "PassOptions":
        """``options`` (default: the defaults) with ``changes``; ``_efb_order`` is accepted for
        ``efb_order`` (the keyword the public functions have always taken)."""
        if "_efb_order" in changes:
            changes["efb_order"] = changes.pop("_efb_order")
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
        return dataclasses.replace(options or cls(), **changes)

    @property
    def keyed(self) -> bool:
        """Labels drawn per example key (batches must carry keys)."""
        return self.fisher == "mc" and isinstance(self.generator, KeyedSampler)


@dataclass
class ModelBatch:
    """One batch after the forward pass: ``inputs`` on the model's device, ``outputs`` with
    their graph to the captured layers, ``logits`` the detached outputs (float32 when the
    forward ran in a half dtype), ``labels`` as given, ``keys`` (checked when keyed)."""

    index: int
    inputs: torch.Tensor
    outputs: torch.Tensor
    logits: torch.Tensor
    labels: Any
    keys: torch.Tensor | None
    capture: Capture

    @property
    def size(self) -> int:
        return int(self.inputs.shape[0])


# --------------------------------------------------------------------------- batches
def split_batch(batch, i: int) -> tuple[torch.Tensor, object, object]:
    """``(x, y, keys)``; ``keys`` (per-example integer ids for keyed MC sampling) come from
    a dict batch's ``"key"`` entry or the third element of an ``(x, y, keys)`` tuple."""
    if isinstance(batch, Mapping):
        x = batch["image"] if "image" in batch else batch.get("x")
        y = batch["label"] if "label" in batch else batch.get("y")
        if x is None:
            raise ValueError(f"batch {i}: dict batches need an 'image' (or 'x') entry, got keys {sorted(batch)}")
        return x, y, batch.get("key")
    if isinstance(batch, (tuple, list)):
        if len(batch) not in (2, 3):
            raise ValueError(f"batch {i}: expected an (x, y) pair or (x, y, keys), got a sequence of length {len(batch)}")
        return batch[0], batch[1], (batch[2] if len(batch) == 3 else None)
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    raise ValueError(f"batch {i}: expected (x, y), a dict with 'image'/'label', or a tensor; got {type(batch).__name__}")


def _model_inputs(x, i: int, weight: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(f"batch {i}: empty input of shape {tuple(x.shape)}")
    x = x.to(device=weight.device, dtype=weight.dtype if x.dtype.is_floating_point else x.dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def _checked_keys(keys, batch_size: int, i: int) -> torch.Tensor:
    if keys is None:
        raise ValueError(f"batch {i}: a KeyedSampler needs per-example keys ((x, y, keys) or dict key 'key')")
    keys = torch.as_tensor(keys).reshape(-1)
    if keys.shape[0] != batch_size:
        raise ValueError(f"batch {i}: {keys.shape[0]} keys for {batch_size} examples")
    return keys


def _forward(model: nn.Module, x: torch.Tensor, i: int, cap: Capture, precision: str) -> torch.Tensor:
    half = PRECISIONS[precision]
    autocast = torch.autocast(x.device.type, dtype=half) if half is not None else contextlib.nullcontext()
    with torch.enable_grad(), autocast:
        outputs = model(x)
    if not isinstance(outputs, torch.Tensor):
        raise ValueError(f"model output must be a tensor, got {type(outputs).__name__}")
    if outputs.dim() == 0 or outputs.shape[0] != x.shape[0]:
        raise ValueError(f"batch {i}: model output has shape {tuple(outputs.shape)}, input has {x.shape[0]} examples")
    missing = cap.missing()
    if missing:
        raise ValueError(f"layers not called in the forward pass: {missing[:5]}")
    return outputs


@contextlib.contextmanager
def _eval_mode(model: nn.Module, channels_last: bool):
    """``model.eval()`` (and channels-last parameters) for the pass; each module's mode (and
    contiguous parameters) restored afterwards, also on error."""
    modes = {mod: mod.training for mod in model.modules()}
    model.eval()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    try:
        yield
    finally:
        for mod, mode in modes.items():
            mod.training = mode
        if channels_last:
            model.to(memory_format=torch.contiguous_format)


def model_batches(model: nn.Module, batches: Iterable, modules: Mapping[str, nn.Module],
                  opts: PassOptions) -> Iterator[ModelBatch]:
    """Run ``model`` in ``eval()`` mode on every batch with ``modules`` captured and yield a
    :class:`ModelBatch`; keys are checked when ``opts.keyed``. Modes (and the capture hooks)
    are restored when the generator is exhausted or closed: consume it inside
    ``contextlib.closing`` so that an error in the consumer restores them at once."""
    weight = next(iter(modules.values())).weight
    with _eval_mode(model, opts.channels_last), capture(model, modules) as cap:
        for i, batch in enumerate(batches):
            x, labels, keys = split_batch(batch, i)
            x = _model_inputs(x, i, weight, opts.channels_last)
            outputs = _forward(model, x, i, cap, opts.precision)
            logits = outputs.detach()
            if logits.dtype in (torch.bfloat16, torch.float16):
                logits = logits.float()
            keys = _checked_keys(keys, x.shape[0], i) if opts.keyed else keys
            yield ModelBatch(i, x, outputs, logits, labels, keys, cap)


def draw_targets(lik, batch: ModelBatch, labels, draws: int, opts: PassOptions) -> torch.Tensor:
    """Targets ``(draws, B, ...)``: the checked ``labels`` for ``fisher="empirical"``, else
    ``draws`` labels from the predictive (keyed by example when ``opts.keyed``, else from
    ``opts.generator``'s stream)."""
    if opts.fisher == "empirical":
        return labels.unsqueeze(0)
    if opts.keyed:
        return lik.sample_keyed(batch.logits, draws, opts.generator.seed, batch.keys)
    return lik.sample(batch.logits, draws, opts.generator)
