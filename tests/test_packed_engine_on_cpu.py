"""Packed SPO-tree training through verl's own actor worker (issue #11): verl's ``TrainingWorker`` with
its FSDP2 engine on CPU (gloo, one process), verl's ``ppo_loss``, the same batch run per row and then
packed by :func:`spo_verl.packing.engine.enable_packed_training` on the same engine.

The batch holds random trees (2-2; 3-3 with early EOS at depth 1; 2-2-2 with 1-6-token segments; a
one-leaf tree), two rows without tree metadata (GRPO-like) and two rows as verl's batch padding makes
them (EOS tokens, one uid ``pad...``, the first row's tree metadata copied, nothing trained).

verl's engine runs float32 only (its precision table has no float64), so the tolerances are float32's:
log-probs and entropies within 2e-5 absolute (measured ~3e-6 at log-probs down to -20), the loss
within 1e-6 relative, parameter gradients within 1e-5 of the largest gradient (measured ~3e-7). The
float64 exactness of the packed forward itself (1e-15 / 1e-14) is tested in test_tree_packing_on_cpu.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent(
    r"""
    import json, random, sys
    from spo_verl.testing.verl_engine import (start_process_group, build_actor_worker, tree_training_batch,
                                              parameter_gradients)
    start_process_group()
    import torch, verl
    from transformers import AutoTokenizer
    from verl.workers.utils.padding import no_padding_2_padding
    from spo_verl.packing.engine import PackedTrainingSettings, enable_packed_training
    from spo_verl.testing.random_trees import tree_2_2, tree_2_2_2, tree_3_3_early, tree_one_leaf

    model_dir = sys.argv[1]
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    worker, loss_fn = build_actor_worker(model_dir, micro_batch_size=64, gradient_checkpointing=True)
    engine = worker.engine
    vocab = engine.module.config.vocab_size
    trees = [make(random.Random(seed), vocab=vocab)
             for seed, make in enumerate((tree_2_2, tree_3_3_early, tree_2_2_2, tree_one_leaf))]
    CASES = {  # name: batch settings
        "one micro-batch": dict(),  # micro_batch_size defaults to the whole batch
        "trees split over micro-batches": dict(micro_batch_size=11),
        "dynamic batch size (as the CPU runs)": dict(use_dynamic_bsz=True, max_token_len=60),
        "temperature 0.7": dict(temperature=0.7),
    }

    def batch(case, **more):
        return tree_training_batch(trees, pad_token_id=tokenizer.pad_token_id, response_length=20,
                                   rng=random.Random(1), plain_rows=2, padding_rows=2, vocab=vocab,
                                   **CASES[case], **more)

    def run(case, on_policy=False):
        with engine.eval_mode():
            inferred = engine.infer_batch(batch(case, calculate_entropy=True), loss_function=None)["model_output"]
        data = batch(case)
        if on_policy:  # old log-probs = the engine's own, as in a first PPO epoch (ratio 1)
            data["old_log_probs"] = no_padding_2_padding(inferred["log_probs"], data)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            trained = engine.forward_backward_batch(data, loss_fn, forward_only=False)
            gradients = parameter_gradients(engine.module)
        metrics = trained["metrics"]
        return {
            "log_probs": no_padding_2_padding(inferred["log_probs"], data),
            "entropy": no_padding_2_padding(inferred["entropy"], data),
            "mask": data["response_mask"].bool(),
            "loss": sum(trained["loss"]),
            "gradients": gradients,
            "tokens": [int(metrics[k].aggregate()) if k in metrics else None
                       for k in ("spo/packing/packed_tokens", "spo/packing/row_tokens")],
            "check": {k.removeprefix("spo/packing/check/"): float(v.aggregate()) for k, v in metrics.items()
                      if k.startswith("spo/packing/check/")},
            "micro_batches": len(trained["loss"]),
            "row_tokens": int(data["input_ids"].offsets()[-1]),
        }

    per_row = {case: run(case) for case in CASES}
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7))
    # Again (idempotent), now with the per-row check in each case's training pass.
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7, check_updates=len(CASES)))
    packed = {case: run(case) for case in CASES}

    results = {"class": type(engine).__name__, "unique_tokens": sum(t.unique_tokens for t in trees),
               "tree_row_tokens": sum(len(t.prompt) * len(t.responses) + sum(map(len, t.responses)) for t in trees),
               "cases": {}}
    for case in CASES:
        a, b = per_row[case], packed[case]
        largest = max(g.abs().max().item() for g in a["gradients"].values())
        results["cases"][case] = {
            "log_prob_diff": (a["log_probs"] - b["log_probs"])[a["mask"]].abs().max().item(),
            "entropy_diff": (a["entropy"] - b["entropy"])[a["mask"]].abs().max().item(),
            "loss": [a["loss"], b["loss"]],
            "gradient_names": sorted(a["gradients"]) == sorted(b["gradients"]) and len(a["gradients"]) > 0,
            "gradient_diff_over_largest": max((a["gradients"][k] - b["gradients"][k]).abs().max().item()
                                              for k in a["gradients"]) / largest,
            "per_row_tokens_metric": a["tokens"],
            "packed_tokens_metric": b["tokens"],
            "row_tokens": a["row_tokens"],
            "check": b["check"],
            "per_row_check": a["check"],
            "micro_batches": b["micro_batches"],
        }

    # A tied output head (SmolLM2's): lm_head is the input embedding, held by FSDP2's root unit.
    import tempfile
    from transformers import AutoModelForCausalLM
    tied_dir = tempfile.mkdtemp()
    tied = AutoModelForCausalLM.from_pretrained(model_dir)
    tied.config.tie_word_embeddings = True
    tied.model.embed_tokens.weight = tied.lm_head.weight  # the calibrated head: log-probs stay in range
    tied.save_pretrained(tied_dir)
    tokenizer.save_pretrained(tied_dir)
    tied_worker, _ = build_actor_worker(tied_dir, micro_batch_size=64, gradient_checkpointing=True)
    engine = tied_worker.engine
    assert engine.module.get_output_embeddings().weight is engine.module.get_input_embeddings().weight
    # Its logits are sharper than the untied model's (log-probs down to about -40): against random old
    # log-probs every ratio would be ~0 and every gradient 0, so this case trains on its own log-probs.
    tied_rows = run("one micro-batch", on_policy=True)
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7))
    tied_packed = run("one micro-batch", on_policy=True)
    largest = max(g.abs().max().item() for g in tied_rows["gradients"].values())
    results["tied_head"] = {
        "log_prob_diff": (tied_rows["log_probs"] - tied_packed["log_probs"])[tied_rows["mask"]].abs().max().item(),
        "loss": [tied_rows["loss"], tied_packed["loss"]],
        "gradient_names": sorted(tied_rows["gradients"]) == sorted(tied_packed["gradients"]),
        "gradient_diff_over_largest": max((tied_rows["gradients"][k] - tied_packed["gradients"][k]).abs().max().item()
                                          for k in tied_rows["gradients"]) / largest,
    }
    print("RESULTS" + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results(tiny_model):
    model_dir, _ = tiny_model
    process = subprocess.run(
        [sys.executable, "-c", CHECK, model_dir], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    line = next((line for line in process.stdout.splitlines() if line.startswith("RESULTS")), None)
    assert process.returncode == 0 and line, process.stdout[-3000:] + process.stderr[-6000:]
    return json.loads(line.removeprefix("RESULTS"))


CASES = ["one micro-batch", "trees split over micro-batches", "dynamic batch size (as the CPU runs)", "temperature 0.7"]


@pytest.mark.parametrize("case", CASES)
def test_packed_engine_matches_per_row_engine(results, case):
    result = results["cases"][case]
    assert result["log_prob_diff"] < 2e-5
    assert result["entropy_diff"] < 2e-5
    per_row_loss, packed_loss = result["loss"]
    assert packed_loss == pytest.approx(per_row_loss, rel=1e-6, abs=1e-7)
    assert result["gradient_names"]
    assert result["gradient_diff_over_largest"] < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_packed_training_check_reports_the_per_row_differences(results, case):
    """``algorithm.spo.tree.packed_training_check``: the packed engine also runs each micro-batch per
    row and reports the largest differences, within the same float32 tolerances."""
    result = results["cases"][case]
    assert result["per_row_check"] == {}
    check = result["check"]
    assert check["micro_batches"] == result["micro_batches"] >= 1
    assert check["log_prob_max_abs_diff"] < 2e-5
    assert check["loss_max_abs_diff"] < 1e-6


def test_packed_engine_with_a_tied_output_head(results):
    """The output head is the input embedding (SmolLM2, the CPU default): the packed forward's chunked
    head runs inside the root module call, where FSDP2 holds that weight."""
    result = results["tied_head"]
    assert result["log_prob_diff"] < 2e-5
    per_row_loss, packed_loss = result["loss"]
    assert packed_loss == pytest.approx(per_row_loss, rel=1e-6, abs=1e-7)
    assert result["gradient_names"]
    assert result["gradient_diff_over_largest"] < 1e-5


def test_packed_engine_counts_its_tokens(results):
    assert results["class"] == "SPOPackedFSDPEngineWithLMHead"
    cases = results["cases"]
    row_tokens = cases["one micro-batch"]["row_tokens"]
    # Per row the engine reports nothing; packed, every row token is counted once as a row token.
    assert cases["one micro-batch"]["per_row_tokens_metric"] == [None, None]
    for case in CASES:
        assert cases[case]["packed_tokens_metric"][1] == row_tokens
    # One micro-batch: each tree's unique tokens once, the plain rows as they are, and verl's two
    # padding rows (one template, one uid) once: 3 prompt + 1 response tokens.
    other_rows = row_tokens - results["tree_row_tokens"]
    one = cases["one micro-batch"]["packed_tokens_metric"][0]
    assert one == results["unique_tokens"] + other_rows - 4
    split = cases["trees split over micro-batches"]["packed_tokens_metric"][0]
    assert one < split < row_tokens
    # verl's dynamic batch size would scatter the trees; the packed engine's micro-batches keep each
    # tree whole within the 60-token budget (3 micro-batches here), so they pack as well as one.
    dynamic = cases["dynamic batch size (as the CPU runs)"]
    assert dynamic["packed_tokens_metric"][0] == one and dynamic["micro_batches"] > 1
