"""The GPU check's packed-against-per-row passes: one actor micro-batch of the cluster settings, forward
and backward of ``sum(log-prob x weight)`` through the project's packed forward
(:func:`spo_verl.core.packing.pack_sequences` + :func:`spo_verl.core.packing.packed_row_log_probs`, what
``algorithm.spo.packing.enable`` runs) and through the model's own SDPA attention row by row, in
micro-batches of at most the setting's token budget as verl cuts them. No verl import.

The micro-batch is what the packed engine would give the actor: a tree's leaf rows (or a group's
responses) cut by :func:`spo_verl.adapters.packing.micro_batches.tree_micro_batch_indices` under the setting's
``ppo_max_token_len_per_gpu``, its first (largest) micro-batch.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from spo_workbench.benchmarks.gpu_model import (GradientSum, gradient_differences, measured_call, set_parameter_dtype,
                                                 synchronize)
from spo_workbench.benchmarks.timing import compare
from spo_verl.core.packing import CASCADE_ATTENTION, build_cascade_layout, pack_sequences, packed_row_log_probs
from spo_verl.core.packing import register_cascade_attention
from spo_verl.adapters.packing.micro_batches import packed_token_count, tree_micro_batch_indices
from spo_verl.core.packing.packed_forward import _chunk_scores, _decoder_and_head
from spo_workbench.testing.random_trees import Tree

CHUNK_TOKENS = 4096  # algorithm.spo.packing.chunk_tokens' default, for both sides' vocabulary projection
TEMPERATURE = 0.6  # both cluster settings sample (and so compute log-probs) at 0.6


@dataclass(frozen=True)
class PackCase:
    """An SPO tree (``branching``; ``segments`` per depth, the last one the leaf's rest of the response)
    or a GRPO group (no branching; ``rows`` responses of ``segments[0]`` tokens) to one ``prompt``;
    ``budget`` is ``ppo_max_token_len_per_gpu`` (None: a fixed-size micro-batch holding all rows),
    ``row_budget`` the per-row side's, when it differs."""

    key: str
    setting: str
    branching: tuple[int, ...]
    prompt: int
    segments: tuple[int, ...]
    rows: int = 8
    budget: int | None = None
    row_budget: int | None = None
    float32_reference: bool = False
    rounds: int = 3
    whole: str = "one micro-batch of all its rows"  # what the micro-batch is when there is no budget

    def scaled(self, factor: int) -> "PackCase":
        """Every length divided by ``factor`` (the dry run): the same structure in a few hundred tokens."""
        shrink = lambda n, least=1: None if n is None else max(least, round(n / factor))  # noqa: E731
        return replace(self, prompt=shrink(self.prompt, 2), segments=tuple(shrink(s) for s in self.segments),
                       budget=shrink(self.budget), row_budget=shrink(self.row_budget), rounds=2)

    def shape(self) -> str:
        if self.branching:
            return (f"tree {'-'.join(map(str, self.branching))} ({self.prompt} + "
                    f"{'/'.join(map(str, self.segments))} tokens)")
        return f"GRPO {self.rows} x ({self.prompt} + {self.segments[0]})"

    def micro_batch(self) -> str:
        if self.budget is None:
            return self.whole
        return f"first micro-batch at ppo_max_token_len_per_gpu={self.budget:,}"


# In order of priority: the cluster's own micro-batches first. Lengths from recipe/spo/config/setting/: a ~150-token
# prompt; math-r1-1.5b: 6-6-6, 600-token segments, 1,900-token responses, ppo_max_token_len_per_gpu 4,824;
# gsm8k-rhomath-1.1b: 30-token segments, 1,024-token responses, 16,384 for trees, 8 sequences for GRPO.
# Every response runs to its full length (the most tokens a micro-batch holds). A math GRPO group gets a
# budget that holds it whole (at 4,824 a micro-batch holds two responses, 0.96 packed: verl's per-row
# forward runs it), and the math tree a larger budget too, where packing saves most.
CASES = (
    PackCase("math_tree_mb", "math-r1-1.5b", (6, 6, 6), 150, (600, 600, 700), budget=4824,
             float32_reference=True, rounds=5),
    PackCase("gsm8k_grpo_mb", "gsm8k-rhomath-1.1b", (), 150, (1024,), float32_reference=True, rounds=5,
             whole="a micro-batch of ppo_micro_batch_size_per_gpu=8 sequences"),
    PackCase("math_grpo_group", "math-r1-1.5b", (), 150, (1900,), budget=16384, rounds=5),
    PackCase("gsm8k_tree_mb", "gsm8k-rhomath-1.1b", (6, 6, 6), 150, (30, 30, 964), budget=16384),
    PackCase("math_tree_mb32k", "math-r1-1.5b", (6, 6, 6), 150, (600, 600, 700), budget=32768),
)
WHOLE_TREE = PackCase("math_tree_whole", "math-r1-1.5b", (6, 6, 6), 150, (600, 600, 700), row_budget=32768, rounds=2,
                      whole="the whole tree as one micro-batch (per-row: micro-batches of 32,768 tokens)")

# Where packing stops paying for a GRPO group on a GPU (``--share-sweep``): eight 1,024-token responses to one
# prompt, the prompt's length chosen for each packed share (what ``packing.max_token_ratio`` compares), the
# group one micro-batch. Ordered by share, after the cluster's own cases.
SWEEP_SHARES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
SWEEP_ROWS, SWEEP_RESPONSE = 8, 1024


def sweep_prompt(share: float, rows: int = SWEEP_ROWS, response: int = SWEEP_RESPONSE) -> int:
    """The prompt length whose group of ``rows`` responses packs to ``share`` of its row tokens:
    (prompt + rows * response) / (rows * (prompt + response)) = share."""
    return max(1, round(rows * response * (1 - share) / (rows * share - 1)))


SHARE_SWEEP = tuple(PackCase(f"grpo_share_{share:.2f}", "share sweep", (), sweep_prompt(share), (SWEEP_RESPONSE,),
                             rows=SWEEP_ROWS, whole="the group as one micro-batch")
                    for share in SWEEP_SHARES)


@dataclass
class Batch:
    sequences: list[list[int]]
    prompt_lengths: list[int]
    width: int  # longest response
    weights: torch.Tensor  # (B, width) loss weight of each response token, 0 past a row's response

    def row_tokens(self) -> int:
        return sum(map(len, self.sequences))


def case_batch(case: PackCase, vocab: int, device: torch.device, seed: int = 0) -> Batch:
    """The case's rows (random tokens; a tree's leaves in slot order, as the tree agent loop returns them),
    the micro-batch the packed engine cuts first from them, and random loss weights on their responses."""
    rng = random.Random(seed)
    if case.branching:
        tree = Tree(rng, case.branching, lambda depth, _rng: case.segments[depth], prompt_len=case.prompt, vocab=vocab)
        sequences = [tree.prompt + response for response in tree.responses]
    else:
        prompt = [rng.randrange(vocab) for _ in range(case.prompt)]
        sequences = [prompt + [rng.randrange(vocab) for _ in range(case.segments[0])] for _ in range(case.rows)]
    if case.budget is not None:
        first = tree_micro_batch_indices(sequences, [0] * len(sequences), case.budget)[0]
        sequences = [sequences[row] for row in first]
    prompt_lengths = [case.prompt] * len(sequences)
    responses = torch.tensor([len(s) - p for s, p in zip(sequences, prompt_lengths)])
    width = int(responses.max())
    valid = torch.arange(width)[None, :] < responses[:, None]
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(valid.shape, generator=generator) * valid / valid.sum()
    return Batch(sequences, prompt_lengths, width, weights.to(device))


def _row_chunks(sequences: list[list[int]], budget: int | None) -> list[list[int]]:
    """Consecutive rows of one length within ``budget`` tokens (a row over it alone): a padding-free
    batch for the model's own attention, as verl's per-row micro-batches hold at most the budget."""
    chunks: list[list[int]] = []
    for row, sequence in enumerate(sequences):
        last = chunks[-1] if chunks else None
        if (last and len(sequences[last[0]]) == len(sequence)
                and (budget is None or (len(last) + 1) * len(sequence) <= budget)):
            last.append(row)
        else:
            chunks.append([row])
    return chunks


def _scores(head, hidden: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``targets`` from the hidden states at ``sources``, ``CHUNK_TOKENS`` at a time and
    checkpointed, as :func:`spo_verl.core.packing.packed_token_scores` projects the packed side."""
    pieces = [checkpoint(_chunk_scores, head, hidden.index_select(0, sources[start:start + CHUNK_TOKENS]),
                         targets[start:start + CHUNK_TOKENS], TEMPERATURE, False, use_reentrant=False)
              for start in range(0, sources.numel(), CHUNK_TOKENS)]
    return torch.cat(pieces)


def per_row_pass(model, batch: Batch, grads: GradientSum, autocast, row_budget: int | None) -> torch.Tensor:
    """Forward and backward micro-batch by micro-batch of rows; (B, width) log-probs."""
    decoder, head = _decoder_and_head(model)
    device = batch.weights.device
    out = torch.zeros(batch.weights.shape, device=device)
    for chunk in _row_chunks(batch.sequences, row_budget):
        length = len(batch.sequences[chunk[0]])
        ids = torch.tensor([batch.sequences[row] for row in chunk])
        sources, targets, rows, columns = [], [], [], []
        for j, row in enumerate(chunk):
            prompt = batch.prompt_lengths[row]
            positions = torch.arange(prompt, length)
            sources.append(j * length + positions - 1)
            targets.append(ids[j, prompt:])
            rows.append(torch.full_like(positions, row))
            columns.append(positions - prompt)
        sources, targets, rows, columns = (torch.cat(x).to(device) for x in (sources, targets, rows, columns))
        with autocast():
            hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state
            log_probs = _scores(head, hidden.reshape(-1, hidden.shape[-1]), sources, targets)
        (log_probs * batch.weights[rows, columns]).sum().backward()
        grads.fold()
        out[rows, columns] = log_probs.detach().float()
    return out


def packed_pass(model, batch: Batch, grads: GradientSum, autocast) -> torch.Tensor:
    """The rows packed by their tokens (each shared prefix once), one forward and one backward."""
    device = batch.weights.device
    packed = pack_sequences(batch.sequences, batch.prompt_lengths, batch.width).to(device)
    with autocast():
        log_probs = packed_row_log_probs(model, packed, TEMPERATURE, chunk_tokens=CHUNK_TOKENS)
    (log_probs * batch.weights).sum().backward()
    grads.fold()
    return log_probs.detach().float()


@contextlib.contextmanager
def attention(model, implementation: str):
    """The attention implementation for a whole pass: gradient checkpointing replays it in backward."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = implementation
    try:
        yield
    finally:
        model.config._attn_implementation = previous


_SDPA_KERNELS = (("flash_attention_for_cpu", "flash (CPU)"), ("flash", "flash"), ("efficient", "memory-efficient"),
                 ("cudnn", "cuDNN"), ("math", "math"), ("overrideable", "overrideable"))


def _op_names(profiler) -> set[str]:
    """The op names torch's profiler recorded, from kineto's raw events: building torch's event tree
    (``key_averages``) took seconds per pass. (A dispatch mode would be lighter, but the cascade's
    ``CausalBias`` tensor subclass cannot be created under one.)"""
    try:
        return {event.name() for event in profiler.profiler.kineto_results.events()}
    except AttributeError:  # another torch's internals: the slow public way
        return {event.key for event in profiler.key_averages()}


def sdpa_kernels(call):
    """Run ``call`` under torch's profiler (CPU events: the aten op SDPA dispatched to, in forward,
    checkpoint replay and backward) and name the kernels seen, e.g. ``flash`` or ``flash+math``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        result = call()
    labels = {next((label for needle, label in _SDPA_KERNELS if needle in name), None)
              for name in _op_names(profiler) if name.startswith("aten::_") and "attention" in name}
    return result, "+".join(sorted(labels - {None})) or "none seen"


def _log_prob_stats(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    difference = (a - b)[valid].abs()
    return difference.max().item(), difference.mean().item()


def measure_case(model, case: PackCase, batch: Batch, dtype: torch.dtype, log) -> dict:
    """One case on its :func:`case_batch`: the check pass of each side (profiled for the SDPA kernels),
    the differences, the float32 reference where the case asks for it, then ``case.rounds``
    alternating timed rounds (:func:`spo_workbench.benchmarks.timing.compare`)."""
    device = batch.weights.device
    register_cascade_attention()
    row_budget = case.row_budget or case.budget
    mixed = dtype != torch.float32
    autocast = (lambda: torch.autocast(device_type=device.type, dtype=dtype)) if mixed else contextlib.nullcontext
    grads = {side: GradientSum(model) for side in ("per-row", "packed")}
    peaks: dict[str, list[float]] = {side: [] for side in grads}

    def side(name: str):
        def run():
            model.zero_grad(set_to_none=True)  # nothing left over from a failed case
            grads[name].zero()
            if name == "per-row":
                with attention(model, "sdpa"):
                    return per_row_pass(model, batch, grads[name], autocast, row_budget)
            with attention(model, CASCADE_ATTENTION):
                return packed_pass(model, batch, grads[name], autocast)
        return measured_call(run, device, peaks[name])

    started = time.perf_counter()
    packed = pack_sequences(batch.sequences, batch.prompt_lengths, batch.width).to(device)
    build_cascade_layout(packed, device)
    synchronize(device)
    pack_ms = (time.perf_counter() - started) * 1e3
    valid = (packed.response_index >= 0).to(device)
    log(f"{case.key}: {len(batch.sequences)} rows, {batch.row_tokens():,} row tokens, "
        f"{packed.num_packed_tokens:,} packed")
    rows_lp, row_kernels = sdpa_kernels(side("per-row"))
    packed_lp, packed_kernels = sdpa_kernels(side("packed"))
    # The shapes: both sides in the (rows, longest response) layout, every distinct prefix packed once.
    if packed_lp.shape != rows_lp.shape or rows_lp.shape != (len(batch.sequences), batch.width):
        raise AssertionError(f"log-prob layouts differ: packed {tuple(packed_lp.shape)}, "
                             f"per-row {tuple(rows_lp.shape)}")
    if packed.num_packed_tokens != packed_token_count(batch.sequences):
        raise AssertionError(f"{packed.num_packed_tokens} packed tokens, the rows have "
                             f"{packed_token_count(batch.sequences)} distinct prefixes")
    lp_max, lp_mean = _log_prob_stats(packed_lp, rows_lp, valid)
    grad = gradient_differences(grads["packed"], grads["per-row"])
    result = {
        "rows": len(batch.sequences), "row_tokens": batch.row_tokens(), "packed_tokens": packed.num_packed_tokens,
        "pack_ms": pack_ms, "logprob_max_abs_diff": lp_max, "logprob_mean_abs_diff": lp_mean,
        "grad_max_abs_diff": grad["max_abs_diff"], "grad_max_abs": grad["max_abs"], "grad_rel_diff": grad["rel_diff"],
        "a_sdpa": row_kernels, "b_sdpa": packed_kernels,
    }
    if case.float32_reference:
        result.update(_float32_reference(model, batch, dtype, row_budget, valid, rows_lp, packed_lp, grads))
    comparison = compare(side("per-row"), side("packed"), case.rounds, warmup=0)  # the check pass warmed both
    result.update({
        "a_ms": comparison.a_median * 1e3, "b_ms": comparison.b_median * 1e3, "ratio": comparison.ratio,
        "ratio_low": comparison.spread[0], "ratio_high": comparison.spread[1], "rounds": case.rounds,
        "a_peak_gib": max(peaks["per-row"]) if peaks["per-row"] else None,
        "b_peak_gib": max(peaks["packed"]) if peaks["packed"] else None,
    })
    return result


def _float32_reference(model, batch, dtype, row_budget, valid, rows_lp, packed_lp, grads) -> dict:
    """The per-row pass again with the same weights in float32 (no autocast, no TF32): how far each
    bfloat16 side is from it."""
    cuda = batch.weights.device.type == "cuda"
    tf32 = torch.backends.cuda.matmul.allow_tf32 if cuda else False
    reference = GradientSum(model)
    set_parameter_dtype(model, torch.float32)
    try:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
        with attention(model, "sdpa"):
            reference_lp = per_row_pass(model, batch, reference, contextlib.nullcontext, row_budget)
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        set_parameter_dtype(model, dtype)
    return {
        "a_vs_fp32_logprob_max": _log_prob_stats(rows_lp, reference_lp, valid)[0],
        "b_vs_fp32_logprob_max": _log_prob_stats(packed_lp, reference_lp, valid)[0],
        "a_vs_fp32_grad_rel": gradient_differences(grads["per-row"], reference)["rel_diff"],
        "b_vs_fp32_grad_rel": gradient_differences(grads["packed"], reference)["rel_diff"],
    }
