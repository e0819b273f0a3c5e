"""verl's FSDP language-model engine with shared prefixes packed (``algorithm.spo.packing.enable``).

:func:`enable_packed_training` turns an engine built by verl (``FSDPEngineWithLMHead``, in the actor
or reference worker) into one whose ``forward_step`` runs each micro-batch as one packed sequence:
every prefix that rows of the micro-batch share -- a GRPO group's prompt, an SPO tree's prompt and
common segments, a few-shot preamble every prompt starts with, verl's identical padding rows -- is
computed once (:mod:`spo_verl.core.packing.tree_pack`, :mod:`spo_verl.core.packing.cascade_attention`). This
serves every algorithm alike, since nothing but the tokens decides what is shared. Log-probs (and
entropies) are gathered back into verl's no-padding row layout, so verl's loss, SPO's loss, the
trained-segment mask, old and reference log-probs and every metric stay as they are.

What stays verl's: ``forward_backward_batch`` (token counts for the loss, micro-batching, gradient
accumulation, the backward pass) and the loss. The packed forward goes through the root module's
``__call__`` (the instance ``forward`` of the causal LM is wrapped once), so FSDP's unshard and
backward hooks run as for a per-row forward; the vocabulary projection is chunked inside it.

Where a micro-batch shares little (``packed tokens > max_token_ratio x row tokens``), packing would
cost more than it saves, and that micro-batch runs verl's own per-row forward instead. The attention
implementation is set per micro-batch, before its forward, and stays until the next one: verl runs a
micro-batch's backward (and gradient checkpointing's replay) before the next forward.

Rows pack only with rows of the same micro-batch: how much is saved depends on what shares one
(``spo/packing/*`` metrics say it); the result does not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from spo_verl.core.config import SPOSettings
from spo_verl.core.packing.cascade_attention import CASCADE_ATTENTION, register_cascade_attention
from spo_verl.adapters.packing.micro_batches import tree_micro_batches
from spo_verl.core.packing.packed_forward import packed_token_scores
from spo_verl.core.packing.tree_pack import PackedTree
from spo_verl.core.packing.verl_rows import micro_batch_forest

__all__ = [
    "PACKED_FORWARD_KWARG",
    "PackedTrainingSettings",
    "PackedEngineMixin",
    "enable_packed_training",
    "micro_batch_forest",
    "to_verl_rows",
]

PACKED_FORWARD_KWARG = "spo_packed_forward"
_INSTALLED = "__spo_packed_forward__"


_SPO_DEFAULTS = SPOSettings()


@dataclass(frozen=True)
class PackedTrainingSettings:
    """The engine's view of the ``algorithm.spo.packed_*`` settings (:meth:`from_spo`; their defaults
    and checks are those of :class:`spo_verl.core.config.SPOSettings`).

    ``chunk_tokens``: hidden states projected to the vocabulary at a time (never full logits).
    ``check_updates``: in that many first training passes, also run every micro-batch per row (no
    gradient) and report the largest differences as ``spo/packing/check/*`` metrics.
    ``max_token_ratio``: a micro-batch is packed only when its packed tokens are at most this share
    of its row tokens; otherwise it runs verl's per-row forward (``spo/packing/per_row_micro_batches``).
    ``prob_mask_threshold``: the probability mask's threshold, for the old-log-prob probe (below)."""

    chunk_tokens: int = _SPO_DEFAULTS.packing.chunk_tokens
    check_updates: int = 0
    max_token_ratio: float = _SPO_DEFAULTS.packing.max_token_ratio
    prob_mask_threshold: float | None = _SPO_DEFAULTS.prob_mask.threshold

    @classmethod
    def from_spo(cls, settings: SPOSettings) -> PackedTrainingSettings:
        return cls(chunk_tokens=settings.packing.chunk_tokens, check_updates=int(settings.packing.check),
                   max_token_ratio=settings.packing.max_token_ratio, prob_mask_threshold=settings.prob_mask.threshold)


@dataclass(frozen=True)
class _PackedRequest:
    """What the wrapped causal-LM forward receives through :data:`PACKED_FORWARD_KWARG`."""

    packed: PackedTree
    temperature: float
    chunk_tokens: int
    with_entropy: bool


def to_verl_rows(packed: PackedTree, token_values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-packed-token values (N,) of *predicted* tokens (log-probs, entropies) in verl's layout: a
    jagged nested tensor over each row's prompt + response whose position ``t`` holds the value of
    row token ``t + 1`` (verl rolls ``input_ids`` by one), 0 at each row's last position. Differentiable."""
    lengths = offsets.diff().to(token_values.device)
    width = int(lengths.max()) if lengths.numel() else 0
    index = torch.full((packed.row_index.shape[0], width), -1, dtype=torch.long)
    shifted = packed.row_index[:, 1:width + 1]
    index[:, : shifted.shape[1]] = shifted
    table = packed.gather_rows(token_values, index=index)  # (B, width)
    valid = torch.arange(width, device=table.device)[None, :] < lengths[:, None]
    return torch.nested.nested_tensor_from_jagged(table[valid], offsets.to(table.device).long())


def _single_temperature(micro_batch) -> float:
    temperature = micro_batch["temperature"] if "temperature" in micro_batch.keys() else 1.0
    if isinstance(temperature, torch.Tensor):
        values = torch.unique(temperature.float().cpu())
        if values.numel() != 1:
            raise ValueError(f"packed training needs one sampling temperature per micro-batch, got {values.tolist()}")
        return float(values[0])
    return float(getattr(temperature, "data", temperature))


def _causal_lm(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM under verl's FSDP wrapping (FSDP2 wraps in place, FSDP1 holds it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        module = module.module
    if type(module).__name__.startswith("Peft"):
        raise ValueError("algorithm.spo.packing.enable does not support LoRA (PEFT) models yet")
    if module.get_output_embeddings() is None:
        raise ValueError("algorithm.spo.packing.enable needs a causal LM with an output embedding (lm_head)")
    return module


def install_packed_forward(causal_lm: torch.nn.Module) -> None:
    """Wrap the instance ``forward``: with :data:`PACKED_FORWARD_KWARG` it returns the packed token
    scores, otherwise it is the model's own forward. Idempotent."""
    if getattr(causal_lm, _INSTALLED, False):
        return
    original = causal_lm.forward

    def forward(*args, **kwargs):
        request: _PackedRequest | None = kwargs.pop(PACKED_FORWARD_KWARG, None)
        if request is None:
            return original(*args, **kwargs)
        return packed_token_scores(causal_lm, request.packed, request.temperature, request.chunk_tokens,
                                   with_entropy=request.with_entropy)

    causal_lm.forward = forward
    setattr(causal_lm, _INSTALLED, True)


@contextlib.contextmanager
def _attention_restored(causal_lm: torch.nn.Module):
    """Whatever attention implementation the micro-batches chose, the model's own one afterwards."""
    config = causal_lm.config
    previous = config._attn_implementation
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def _prompt_micro_batches():
    """verl's FSDP engine cuts micro-batches with the module-level ``prepare_micro_batches``; within
    the packed engine's forward_backward_batch it keeps each uid's rows together instead."""
    from verl.workers.engine.fsdp import transformer_impl

    verl_function = transformer_impl.prepare_micro_batches
    if getattr(verl_function, "__name__", "") != "prepare_micro_batches":
        raise RuntimeError("verl's FSDP engine no longer cuts micro-batches with prepare_micro_batches; "
                           "spo_verl.adapters.packing.micro_batches must be reviewed for this verl version")
    transformer_impl.prepare_micro_batches = tree_micro_batches
    try:
        yield
    finally:
        transformer_impl.prepare_micro_batches = verl_function


class PackedEngineMixin:
    """Put before verl's ``FSDPEngineWithLMHead`` in the MRO (see :func:`enable_packed_training`)."""

    spo_packing: PackedTrainingSettings
    _spo_optimizer_steps = 0
    _spo_steps_at_train_start = -1
    _spo_train_depth = 0

    def train_mode(self, **kwargs):
        return self._outermost_counted(super().train_mode(**kwargs))

    @contextlib.contextmanager
    def _outermost_counted(self, context):
        # verl's worker enters train mode once around an actor update (all its mini-batches and epochs)
        # and again around each mini-batch: the update starts where the outermost one is entered.
        if self._spo_train_depth == 0:
            self._spo_steps_at_train_start = self._spo_optimizer_steps
        self._spo_train_depth += 1
        try:
            with context as value:
                yield value
        finally:
            self._spo_train_depth -= 1

    def optimizer_step(self):
        self._spo_optimizer_steps += 1
        return super().optimizer_step()

    def _old_log_prob_probe(self, micro_batch, output: dict) -> dict:
        """Before an update's first optimizer step the actor is the policy that sampled the batch, so
        its log-probs should equal the batch's old log-probs: recomputed by the actor (verl's default)
        or the rollout's own (``algorithm.rollout_correction.bypass_mode``, which skips verl's
        rollout-vs-actor metrics). The largest probability gap and the tokens whose probability mask
        (p < threshold) would differ, as ``spo/old_log_probs/*`` metrics of the first mini-batch."""
        from verl.utils.metric import Metric
        from verl.workers.utils.padding import no_padding_2_padding

        if self._spo_optimizer_steps != self._spo_steps_at_train_start or "old_log_probs" not in micro_batch.keys():
            return {}
        actor = no_padding_2_padding(output["model_output"]["log_probs"], micro_batch).float()
        old = micro_batch["old_log_probs"]
        old = (old.to_padded_tensor(0.0) if old.is_nested else old).to(actor.device).float()[:, : actor.shape[1]]
        mask = micro_batch["response_mask"]
        mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).to(actor.device).bool()[:, : actor.shape[1]]
        if not mask.any():
            return {}
        threshold = self.spo_packing.prob_mask_threshold
        threshold = float("inf") if threshold is None else threshold  # no mask: no token can flip
        actor_p, old_p = actor.exp()[mask], old.exp()[mask]
        return {
            "spo/old_log_probs/probs_diff_max": Metric("max", float((actor_p - old_p).abs().max())),
            "spo/old_log_probs/prob_mask_flips": Metric("sum", int(((actor_p < threshold) != (old_p < threshold)).sum())),
            "spo/old_log_probs/tokens": Metric("sum", int(mask.sum())),
        }

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        checking = not forward_only and self._spo_checks_left > 0
        self._spo_checking = checking
        try:
            with _attention_restored(_causal_lm(self.module)), _prompt_micro_batches():
                return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        finally:
            self._spo_checking = False
            if checking:
                self._spo_checks_left -= 1

    def _per_row_check(self, micro_batch, loss_function, packed_output: dict) -> dict:
        """The same micro-batch through verl's own per-row forward and loss, without gradients:
        largest differences to the packed result, as metrics (aggregated by max)."""
        from verl.utils.metric import Metric
        from verl.workers.utils.padding import no_padding_2_padding

        causal_lm = _causal_lm(self.module)
        packed_attention = causal_lm.config._attn_implementation
        causal_lm.config._attn_implementation = self._spo_row_attention
        try:
            with torch.no_grad():
                _, reference = super().forward_step(micro_batch, loss_function=loss_function, forward_only=True)
        finally:
            causal_lm.config._attn_implementation = packed_attention
        mask = micro_batch["response_mask"].bool()
        if mask.is_nested:
            mask = mask.to_padded_tensor(False)
        mask = mask.to(packed_output["model_output"]["log_probs"].device)
        row_lp = no_padding_2_padding(reference["model_output"]["log_probs"], micro_batch)
        packed_lp = no_padding_2_padding(packed_output["model_output"]["log_probs"], micro_batch)
        log_prob_diff = float((row_lp - packed_lp)[mask[:, : row_lp.shape[1]]].abs().max()) if mask.any() else 0.0
        return {
            "spo/packing/check/log_prob_max_abs_diff": Metric("max", log_prob_diff),
            "spo/packing/check/loss_max_abs_diff": Metric("max", abs(reference["loss"] - packed_output["loss"])),
            "spo/packing/check/micro_batches": Metric("sum", 1),
        }

    def forward_step(self, micro_batch, loss_function, forward_only):
        from verl.utils import tensordict_utils as tu
        from verl.utils.dataset.dataset_utils import DatasetPadMode
        from verl.utils.metric import Metric

        pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
        if pad_mode != DatasetPadMode.NO_PADDING:
            raise ValueError(f"algorithm.spo.packing.enable needs verl's no-padding layout, got pad_mode={pad_mode}")
        packed = micro_batch_forest(micro_batch)
        causal_lm = _causal_lm(self.module)
        if packed.num_packed_tokens > self.spo_packing.max_token_ratio * packed.num_row_tokens:
            causal_lm.config._attn_implementation = self._spo_row_attention
            loss, output = super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
            computed, per_row = packed.num_row_tokens, 1
        else:
            causal_lm.config._attn_implementation = CASCADE_ATTENTION
            loss, output = self._packed_forward_step(micro_batch, packed, loss_function, forward_only)
            computed, per_row = packed.num_packed_tokens, 0
        metrics = output["metrics"] = dict(output["metrics"])
        metrics["spo/packing/packed_tokens"] = Metric("sum", computed)
        metrics["spo/packing/unique_tokens"] = Metric("sum", packed.num_packed_tokens)
        metrics["spo/packing/row_tokens"] = Metric("sum", packed.num_row_tokens)
        metrics["spo/packing/per_row_micro_batches"] = Metric("sum", per_row)
        if getattr(self, "_spo_checking", False) and loss_function is not None and not per_row:
            metrics.update(self._per_row_check(micro_batch, loss_function, output))
        if not forward_only:
            metrics.update(self._old_log_prob_probe(micro_batch, output))
        return loss, output

    def _packed_forward_step(self, micro_batch, packed: PackedTree, loss_function, forward_only):
        from verl.utils import tensordict_utils as tu
        from verl.utils.device import get_device_id, get_device_name
        from verl.workers.engine.fsdp.transformer_impl import detach_tree

        micro_batch = micro_batch.to(get_device_id())
        with_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        request = _PackedRequest(packed.to(get_device_id()), _single_temperature(micro_batch),
                                 self.spo_packing.chunk_tokens, with_entropy)
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast = (contextlib.nullcontext() if autocast_dtype == torch.float32
                    else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype))
        with autocast:
            log_probs, entropy = self.module(**{PACKED_FORWARD_KWARG: request})
            offsets = micro_batch["input_ids"].offsets()
            model_output = {"log_probs": to_verl_rows(request.packed, log_probs, offsets)}
            if with_entropy:
                model_output["entropy"] = to_verl_rows(request.packed, entropy, offsets)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                if not forward_only:
                    raise ValueError("a training step needs a loss function")
                loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


def enable_packed_training(engine: Any, settings: PackedTrainingSettings) -> None:
    """Switch a built verl FSDP language-model engine to packed forwards (idempotent)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    if not isinstance(engine, FSDPEngineWithLMHead) or isinstance(engine, FSDPEngineWithValueHead):
        raise ValueError(f"algorithm.spo.packing.enable needs verl's FSDP language-model engine, got "
                         f"{type(engine).__name__}")
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        raise ValueError("algorithm.spo.packing.enable does not support ulysses_sequence_parallel_size > 1")
    register_cascade_attention()
    causal_lm = _causal_lm(engine.module)
    install_packed_forward(causal_lm)
    if not isinstance(engine, PackedEngineMixin):
        base = type(engine)
        engine.__class__ = type(f"SPOPacked{base.__name__}", (PackedEngineMixin, base), {})
        engine._spo_row_attention = causal_lm.config._attn_implementation  # what the per-row check runs
    engine.spo_packing = settings
    engine._spo_checks_left = settings.check_updates

