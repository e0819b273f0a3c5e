"""Packed training through verl's own actor worker: verl's ``TrainingWorker`` with its FSDP2 engine on
CPU (gloo, one process), verl's ``ppo_loss``, the same batch run per row and then packed by
:func:`spo_verl.adapters.packing.engine.enable_packed_training` on the same engine.

The batch holds what every algorithm's batches hold: random SPO trees (2-2; 3-3 with early EOS at
depth 1; 2-2-2 with 1-6-token segments; a one-leaf tree); three prompt groups as GRPO, PPO and
SPO-chain batches have them (4 responses under one uid, prompts opening with a preamble common to all
groups, responses sharing their first tokens, an early EOS in each group); three rows of their own; two
rows as verl's batch padding makes them (EOS tokens, one uid ``pad...``, the first row's metadata
copied, nothing trained). Packing reads none of the metadata: rows share what their tokens share.

In float32 (verl's engine has no float64) the tolerances are float32's: log-probs and entropies
within 2e-5 absolute (measured ~3e-6 at log-probs down to -20), the loss within 1e-6 relative,
parameter gradients within 1e-5 of the largest gradient (measured ~3e-7). The float64 exactness of
the packed forward itself (1e-15 / 1e-14) is tested in test_tree_packing_on_cpu. In verl's default
bfloat16 mixed precision the bounds are bfloat16's (see the constants below).
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
    from spo_workbench.testing.verl_engine import (start_process_group, build_actor_worker, tree_training_batch,
                                                    parameter_gradients)
    start_process_group()
    import torch, verl
    from transformers import AutoTokenizer
    from verl.workers.utils.padding import no_padding_2_padding
    from spo_verl.adapters.packing.engine import PackedTrainingSettings, enable_packed_training
    from spo_workbench.testing.random_trees import tree_2_2, tree_2_2_2, tree_3_3_early, tree_one_leaf

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
        "rows split over micro-batches": dict(micro_batch_size=7),
        "dynamic batch size (as the CPU runs)": dict(use_dynamic_bsz=True, max_token_len=60),
        "temperature 0.7": dict(temperature=0.7),
    }

    def batch(case, **more):
        return tree_training_batch(trees, pad_token_id=tokenizer.pad_token_id, response_length=20,
                                   rng=random.Random(1), plain_rows=3, padding_rows=2, vocab=vocab, groups=3,
                                   **CASES[case], **more)

    def run(case, on_policy=False, engine=engine):
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
            "log_probs": no_padding_2_padding(inferred["log_probs"], data).float(),
            "entropy": no_padding_2_padding(inferred["entropy"], data).float(),
            "mask": data["response_mask"].bool(),
            "loss": sum(trained["loss"]),
            "gradients": gradients,
            "tokens": {k.removeprefix("spo/packing/"): int(metrics[k].aggregate()) for k in metrics
                       if k.startswith("spo/packing/") and "/check/" not in k},
            "check": {k.removeprefix("spo/packing/check/"): float(v.aggregate()) for k, v in metrics.items()
                      if k.startswith("spo/packing/check/")},
            "probe": {k.removeprefix("spo/old_log_probs/"): float(v.aggregate()) for k, v in metrics.items()
                      if k.startswith("spo/old_log_probs/")},
            "micro_batches": len(trained["loss"]),
            "row_tokens": int(data["input_ids"].offsets()[-1]),
            "sequences": [row.tolist() for row in data["input_ids"].unbind()],
        }

    def compare(a, b):
        largest = max(g.abs().max().item() for g in a["gradients"].values())
        return {
            "log_prob_diff": (a["log_probs"] - b["log_probs"])[a["mask"]].abs().max().item(),
            "entropy_diff": (a["entropy"] - b["entropy"])[a["mask"]].abs().max().item(),
            "loss": [a["loss"], b["loss"]],
            "gradient_names": sorted(a["gradients"]) == sorted(b["gradients"]) and len(a["gradients"]) > 0,
            "gradient_diff_over_largest": max((a["gradients"][k] - b["gradients"][k]).abs().max().item()
                                              for k in a["gradients"]) / largest,
        }

    per_row = {case: run(case) for case in CASES}
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7))
    # Again (idempotent), now with the per-row check in each case's training pass.
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7, check_updates=len(CASES)))
    packed = {case: run(case) for case in CASES}
    distinct = lambda rows: len({tuple(r[: i + 1]) for r in rows for i in range(len(r))})

    results = {"class": type(engine).__name__, "cases": {}}
    for case in CASES:
        a, b = per_row[case], packed[case]
        results["cases"][case] = {**compare(a, b), "per_row_tokens_metric": a["tokens"],
                                  "packed_tokens_metric": b["tokens"], "row_tokens": a["row_tokens"],
                                  "distinct_prefixes": distinct(a["sequences"]), "check": b["check"],
                                  "per_row_check": a["check"], "micro_batches": b["micro_batches"]}

    # Sharing too little for packing to pay (every micro-batch above the ratio): verl's per-row forward.
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7, check_updates=1, max_token_ratio=0.05))
    fallback = run("dynamic batch size (as the CPU runs)")
    results["fallback"] = {**compare(per_row["dynamic batch size (as the CPU runs)"], fallback),
                           "tokens": fallback["tokens"], "check": fallback["check"],
                           "micro_batches": fallback["micro_batches"]}

    # verl's default mixed precision (bfloat16 forward and backward), as on a GPU: packed against per
    # row in bfloat16, and both against float32 (the per-row float32 results above, same weights).
    bf16_worker, _ = build_actor_worker(model_dir, micro_batch_size=64, gradient_checkpointing=True,
                                        mixed_precision="verl")
    bf16_cases = ("one micro-batch", "dynamic batch size (as the CPU runs)")
    bf16_rows = {case: run(case, engine=bf16_worker.engine) for case in bf16_cases}
    enable_packed_training(bf16_worker.engine, PackedTrainingSettings(chunk_tokens=7, check_updates=len(bf16_cases)))
    bf16_packed = {case: run(case, engine=bf16_worker.engine) for case in bf16_cases}
    results["bf16"] = {case: {**compare(bf16_rows[case], bf16_packed[case]), "check": bf16_packed[case]["check"],
                              "rows_vs_fp32": compare(per_row[case], bf16_rows[case]),
                              "packed_vs_fp32": compare(per_row[case], bf16_packed[case])}
                       for case in bf16_cases}

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
    tied_rows = run("one micro-batch", on_policy=True, engine=engine)
    enable_packed_training(engine, PackedTrainingSettings(chunk_tokens=7))
    tied_packed = run("one micro-batch", on_policy=True, engine=engine)
    # An actor update of two mini-batches, as verl's worker runs it (train mode around the update and
    # around each mini-batch): only the first mini-batch, before any optimizer step, is probed.
    probed = []
    with engine.train_mode():
        for _ in range(2):
            with engine.train_mode():
                engine.optimizer_zero_grad()
                out = engine.forward_backward_batch(batch("one micro-batch"), loss_fn, forward_only=False)
                engine.optimizer_step()
            probed.append(sorted(k for k in out["metrics"] if k.startswith("spo/old_log_probs/")))
    results["probed_mini_batches"] = probed
    results["tied_head"] = {**compare(tied_rows, tied_packed), "probe": tied_packed["probe"],
                            "random_old_probe": packed["one micro-batch"]["probe"],
                            "response_tokens": int(batch("one micro-batch")["response_mask"].sum())}
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


CASES = ["one micro-batch", "rows split over micro-batches", "dynamic batch size (as the CPU runs)", "temperature 0.7"]


def assert_float32_close(result):
    assert result["log_prob_diff"] < 2e-5
    assert result["entropy_diff"] < 2e-5
    per_row_loss, packed_loss = result["loss"]
    assert packed_loss == pytest.approx(per_row_loss, rel=1e-6, abs=1e-7)
    assert result["gradient_names"]
    assert result["gradient_diff_over_largest"] < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_packed_engine_matches_per_row_engine(results, case):
    assert_float32_close(results["cases"][case])


@pytest.mark.parametrize("case", CASES)
def test_the_packing_check_reports_the_per_row_differences(results, case):
    """``algorithm.spo.packing.check``: the packed engine also runs each micro-batch per row
    and reports the largest differences, within the same float32 tolerances."""
    result = results["cases"][case]
    assert result["per_row_check"] == {}
    check = result["check"]
    assert check["micro_batches"] == result["micro_batches"] >= 1
    assert check["log_prob_max_abs_diff"] < 2e-5
    assert check["loss_max_abs_diff"] < 1e-6


def test_packed_engine_with_a_tied_output_head(results):
    """The output head is the input embedding (SmolLM2, the CPU default): the packed forward's chunked
    head runs inside the root module call, where FSDP2 holds that weight."""
    assert_float32_close(results["tied_head"])


def test_first_mini_batch_compares_the_old_log_probs_with_the_actor(results):
    """Before an update's first optimizer step the actor is the sampling policy: ``spo/old_log_probs/*``
    say how far the batch's old log-probs are from it (the rollout's own, when verl's bypass mode
    skips recomputing them) and on how many tokens the probability mask would differ."""
    tied = results["tied_head"]
    assert tied["probe"]["tokens"] == tied["response_tokens"] > 0
    assert tied["probe"]["probs_diff_max"] < 1e-4 and tied["probe"]["prob_mask_flips"] == 0  # on policy
    random_old = tied["random_old_probe"]  # the other cases' old log-probs are random
    assert random_old["probs_diff_max"] > 0.1 and random_old["prob_mask_flips"] > 0
    # Two mini-batches of one update: after the first optimizer step the actor has moved on.
    assert results["probed_mini_batches"] == [["spo/old_log_probs/prob_mask_flips", "spo/old_log_probs/probs_diff_max",
                                               "spo/old_log_probs/tokens"], []]


def test_packed_engine_counts_its_tokens(results):
    assert results["class"] == "SPOPackedFSDPEngineWithLMHead"
    cases = results["cases"]
    one = cases["one micro-batch"]
    # Per row the engine reports nothing; packed, every row token is counted once as a row token.
    assert one["per_row_tokens_metric"] == {}
    for case in CASES:
        assert cases[case]["packed_tokens_metric"]["row_tokens"] == one["row_tokens"]
        assert cases[case]["packed_tokens_metric"]["per_row_micro_batches"] == 0
    # One micro-batch: every distinct prefix of its rows once -- the trees' prompts and shared
    # segments, each group's prompt (and the preamble all groups open with) and shared first response
    # tokens, verl's two identical padding rows.
    assert one["packed_tokens_metric"]["packed_tokens"] == one["distinct_prefixes"] < 0.6 * one["row_tokens"]
    split = cases["rows split over micro-batches"]["packed_tokens_metric"]["packed_tokens"]
    assert one["distinct_prefixes"] < split < one["row_tokens"]
    # verl's dynamic batch size would scatter each prompt's rows; the packed engine's micro-batches
    # keep each uid's rows whole within the 60-token budget, so they pack nearly as well as one.
    dynamic = cases["dynamic batch size (as the CPU runs)"]
    assert dynamic["micro_batches"] > 1
    assert dynamic["packed_tokens_metric"]["packed_tokens"] < 0.75 * one["row_tokens"]


def test_micro_batches_that_share_too_little_run_verls_per_row_forward(results):
    """``packing.max_token_ratio``: above it a micro-batch runs verl's own forward, so its results are
    the per-row ones (to float32 rounding: the micro-batches keep each uid together, so their padded
    shapes differ from verl's), it is counted, and the per-row check has nothing to compare."""
    fallback = results["fallback"]
    assert_float32_close(fallback)
    tokens = fallback["tokens"]
    assert tokens["per_row_micro_batches"] == fallback["micro_batches"] > 1
    assert tokens["packed_tokens"] == tokens["row_tokens"] > tokens["unique_tokens"]
    assert fallback["check"] == {}


# bfloat16 tolerances (verl's default FSDP mixed precision: bf16 parameters and activations, float32
# gradient reduction). Packed and per-row compute the same values in another order (gathered keys,
# other matmul shapes, chunked head), so they differ by bfloat16 rounding: measured 0.057 in log-prob
# (log-probs down to about -20), 2.5e-4 relative in loss and 1 % of the largest gradient; and packed is
# no further from float32 than per-row bfloat16 is (measured 0.057 against 0.095 in log-prob).
BF16_LOG_PROB = 0.1
BF16_LOSS_REL = 2e-2
BF16_GRADIENT = 0.1


@pytest.mark.parametrize("case", ["one micro-batch", "dynamic batch size (as the CPU runs)"])
def test_packed_engine_in_bfloat16_mixed_precision(results, case):
    result = results["bf16"][case]
    assert result["log_prob_diff"] < BF16_LOG_PROB
    assert result["entropy_diff"] < BF16_LOG_PROB
    per_row_loss, packed_loss = result["loss"]
    assert packed_loss == pytest.approx(per_row_loss, rel=BF16_LOSS_REL)
    assert result["gradient_diff_over_largest"] < BF16_GRADIENT
    rows, packed = result["rows_vs_fp32"], result["packed_vs_fp32"]
    assert rows["log_prob_diff"] > 1e-4  # bfloat16 really ran
    assert packed["log_prob_diff"] < 1.5 * rows["log_prob_diff"] + 1e-3
    assert packed["gradient_diff_over_largest"] < 1.5 * rows["gradient_diff_over_largest"] + 1e-2
    check = result["check"]
    assert check["micro_batches"] >= 1 and check["log_prob_max_abs_diff"] < BF16_LOG_PROB
