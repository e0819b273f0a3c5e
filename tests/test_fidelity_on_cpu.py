"""Fidelity to the SPO reference (docs/FIDELITY.md): cutpoints from softmax(logits / T) whatever the
rollout's top-p/top-k, truncated responses scored 0 in R and in the Monte Carlo values, the
reference's reward rule, EOS never a cutpoint, and the high-ratio guard of the reference loss.

The hand-worked cases run on test doubles; the last tests check the cutpoints of verl's own vLLM
server on CPU (conftest.py) against a transformers forward pass of the same tiny model."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.workers.config import ActorConfig
from verl.workers.rollout.replica import TokenOutput

import spo_verl.register  # noqa: F401
from spo_verl.adapters.agent_loops.chain_agent_loop import SPOChainAgentLoop
from spo_verl.core.algorithms.segments import cut_by_length_limit, cutpoint_segment_starts, select_cutpoints
from spo_verl.adapters.advantage_channel import SPOBatchContext, provide_spo_rows
from spo_verl.core.config import SPOConfigError, parse_spo_settings
from spo_verl.adapters.policy_loss import SPOPolicyLossConfig, spo_ppo_loss
from spo_verl.adapters.rewards import compute_score
from spo_verl.core.rollout.chain import (
    low_probability_from_sampler,
    low_probability_tokens,
    monte_carlo_value,
    segment_starts,
)
from spo_workbench.testing.verl_harness import compose_ppo_trainer, loss_batch, run_sessions
from spo_verl.adapters.trainer.step_metrics import batch_metrics

in_session_loop = pytest.mark.asyncio(loop_scope="session")  # the server's client lives there
EOS = 99

# ---------------------------------------------------------------------------------------------
# 1. Cutpoints come from softmax(logits / T), not from the top-p renormalised log-probs
# ---------------------------------------------------------------------------------------------

# The issue's example (T = 0.6, top_p = 0.9, interval 2): p of each sampled token under softmax(logits / T)
# and, worked out by hand, its probability after vLLM's top-p renormalisation for a next-token
# distribution whose other tokens have the probabilities listed in OTHERS. Top-p drops the least likely
# tokens while their mass stays <= 1 - top_p = 0.1: p = 0.85 with others (0.06, 0.05, 0.04) keeps
# {0.85, 0.06}, so 0.85 / 0.91 = 0.934066; 0.88 with (0.07, 0.05) keeps {0.88, 0.07}: 0.926316;
# 0.60 with (0.32, 0.08) keeps {0.60, 0.32}: 0.652174; 0.50 and 0.30 lose no token; p >= 0.9 is kept alone.
ISSUE_P = [0.99, 0.85, 0.50, 0.88, 0.97, 0.30, 0.95, 0.60, 0.99]
OTHERS = [(0.01,), (0.06, 0.05, 0.04), (0.30, 0.20), (0.07, 0.05), (0.03,), (0.45, 0.25), (0.05,), (0.32, 0.08), (0.01,)]
ISSUE_Q = [1.0, 0.85 / 0.91, 0.50, 0.88 / 0.95, 1.0, 0.30, 1.0, 0.60 / 0.92, 1.0]


def top_p_renormalised(p, others, top_p):
    """vLLM's top-p (apply_top_k_top_p_pytorch) on one distribution: the sampled token's new probability."""
    ascending = sorted([p, *others])
    cumulative, kept = 0.0, 0.0
    for i, value in enumerate(ascending):
        cumulative += value
        if cumulative > 1 - top_p or i == len(ascending) - 1:
            kept += value
    return p / kept


def test_issue_example_reference_cutpoints_and_the_top_p_bug():
    assert [top_p_renormalised(p, o, 0.9) for p, o in zip(ISSUE_P, OTHERS)] == pytest.approx(ISSUE_Q, abs=1e-12)
    assert cutpoint_segment_starts(ISSUE_P, 0.9, 2) == [1, 3, 7]  # the reference
    assert cutpoint_segment_starts(ISSUE_Q, 0.9, 2) == [2, 7]  # cutpoints on vLLM's processed log-probs


def test_issue_example_sampler_log_probs_decide_what_they_can():
    log_q = [math.log(q) for q in ISSUE_Q]
    decided = low_probability_from_sampler(log_q, threshold=0.9, top_p=0.9, top_k=-1)
    # q < 0.9: low for sure (p <= q). Kept alone (q = 1): p >= top_p = 0.9, not low. 0.934 and 0.926:
    # p lies in [q * 0.9, q], which straddles 0.9, so only the untruncated distribution can tell.
    assert decided == [False, None, True, None, False, True, False, True, False]
    resolved = [p < 0.9 if low is None else low for low, p in zip(decided, ISSUE_P)]
    assert select_cutpoints([t for t, low in enumerate(resolved) if low], 2) == [1, 3, 7]


def test_sampler_log_probs_without_truncation_are_the_policy_probabilities():
    log_p = [math.log(p) for p in ISSUE_P]
    assert low_probability_from_sampler(log_p, 0.9, top_p=1.0, top_k=-1) == [p < 0.9 for p in ISSUE_P]
    # top-k keeps no known share of the mass: only q < threshold decides.
    assert low_probability_from_sampler(log_p, 0.9, top_p=1.0, top_k=5) == [None if p >= 0.9 else True for p in ISSUE_P]


class ToyEngine:
    """verl's server semantics (``LLMServerClient.generate``) over a fixed next-token distribution:
    ``weights[i]`` are the untempered probabilities (up to a constant) of the token at sequence index i.
    Prompt log-probs are untempered (as vLLM's); a draw at top_p 1 returns the token ``draws[i]`` and
    its log-prob under softmax(logits / T)."""

    def __init__(self, weights, draws):
        self.weights, self.draws, self.calls = weights, draws, []

    def log_softmax(self, index, temperature=1.0):
        scaled = [math.log(w) / temperature for w in self.weights[index]]
        norm = math.log(sum(math.exp(x) for x in scaled))
        return [x - norm for x in scaled]

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls.append(dict(sampling_params))
        if "prompt_logprobs" in sampling_params:
            # verl's layout: entry i scores prompt_ids[i + 1]; a dummy entry for the token after the last.
            scored = [[self.log_softmax(i)[prompt_ids[i]] if i in self.weights else 0.0] for i in range(1, len(prompt_ids))]
            scored.append([0.0])
            return TokenOutput(token_ids=[0], extra_fields={"prompt_logprobs": scored})
        assert sampling_params["top_p"] == 1.0 and sampling_params["top_k"] == -1 and sampling_params["max_tokens"] == 1
        index = len(prompt_ids)
        drawn = self.draws[index]
        return TokenOutput(token_ids=[drawn], log_probs=[self.log_softmax(index, sampling_params["temperature"])[drawn]])


PROMPT = [5, 6]


@pytest.mark.asyncio
async def test_undecided_tokens_are_asked_of_the_engine_at_any_temperature():
    """T = 0.5, top_p = 0.95, four response tokens (token 0, 0, 0, 2) at sequence indices 2..5.

    index 2, weights (6.5, 2, 1): p = 6.5^2 / (6.5^2 + 2^2 + 1) = 42.25 / 47.25 = 0.894180; top-p drops
      1 / 47.25 = 0.021 <= 0.05, so q = 42.25 / 46.25 = 0.913514 and q * 0.95 = 0.868 < 0.9: undecided.
      The engine draws token 0 itself: its log-prob is log p. Low (0.894 < 0.9).
    index 3, weights (7, 2, 1): p = 49 / 54 = 0.907407; q = 49 / 53 = 0.924528: undecided. The engine
      draws token 1: log p(0) = log p(1) + (log 0.7 - log 0.2) / 0.5 = log(4 / 54) + 2 log 3.5 = log(49 / 54).
      Not low. Requests: the draw, the untempered response, the untempered prompt + prefix + [1].
    index 4, weights (20, 1, 1): kept alone (q = 1), p >= 0.95: not low, no request.
    index 5, weights (1, 1, 1): q = 1/3 < 0.9: low, no request.
    """
    engine = ToyEngine(
        weights={2: (6.5, 2, 1), 3: (7, 2, 1), 4: (20, 1, 1), 5: (1, 1, 1)}, draws={2: 0, 3: 1}
    )
    tokens = [0, 0, 0, 2]
    log_q = [math.log(42.25 / 46.25), math.log(49 / 53), 0.0, math.log(1 / 3)]
    params = {"temperature": 0.5, "top_p": 0.95, "top_k": -1}
    assert low_probability_from_sampler(log_q, 0.9, 0.95, -1) == [None, None, False, True]
    low = await low_probability_tokens(engine.generate, "r", PROMPT, tokens, log_q, params, 0.9)
    assert low.positions == [0, 3] and low.requests == 4
    # The recovered p of index 3 is 49 / 54 = 0.9074074: thresholds either side of it.
    for threshold, positions in ((0.907407, [0, 3]), (0.907408, [0, 1, 3])):
        low = await low_probability_tokens(engine.generate, "r", PROMPT, tokens, log_q, params, threshold)
        assert low.positions == positions


@pytest.mark.asyncio
async def test_at_temperature_one_one_prompt_scoring_decides_all():
    """T = 1, top_p = 0.95: index 2 weights (17.6, 1.6, 0.8) / 20: p = 0.88, top-p drops 0.04, q = 0.88 /
    0.96 = 0.916667, undecided; index 3 weights (19.2, 0.8): p = 0.96, kept alone. vLLM's untempered prompt
    log-probs are the policy's at T = 1: one request."""
    engine = ToyEngine(weights={2: (17.6, 1.6, 0.8), 3: (19.2, 0.8)}, draws={})
    params = {"temperature": 1.0, "top_p": 0.95, "top_k": -1}
    low = await low_probability_tokens(engine.generate, "r", PROMPT, [0, 0], [math.log(0.88 / 0.96), 0.0], params, 0.9)
    assert low.positions == [0] and low.requests == 1 and engine.calls == [{"max_tokens": 1, "prompt_logprobs": 0}]


@pytest.mark.asyncio
async def test_a_final_eos_is_never_a_cutpoint():
    async def no_request(*args, **kwargs):
        raise AssertionError("no request expected without top-p/top-k")

    settings = parse_spo_settings({"chain": {"cutpoint_interval": 1}}).chain
    kwargs = dict(generate=no_request, request_id="r", prompt_ids=PROMPT, eos_token_ids={EOS},
                  sampling_params={"temperature": 0.6, "top_p": 1.0, "top_k": -1})
    half = math.log(0.5)
    assert await segment_starts(settings, [10, 11, EOS], [half] * 3, **kwargs) == ([0, 1], 0)
    assert await segment_starts(settings, [10, 11, 12], [half] * 3, **kwargs) == ([0, 1, 2], 0)


# ---------------------------------------------------------------------------------------------
# 2. Truncated responses: one setting for R and for the Monte Carlo values
# ---------------------------------------------------------------------------------------------


def test_truncated_response_score_setting():
    assert parse_spo_settings(None).truncated_response_score == "zero"
    assert parse_spo_settings({"truncated_response_score": "reward_function"}).truncated_response_score == "reward_function"
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.truncated_response_score must be one of "
                                             r"\['zero', 'reward_function'\], got 'none'"):
        parse_spo_settings({"truncated_response_score": "none"})


def test_cut_by_length_limit():
    assert cut_by_length_limit([1, 2, 3], 3, {EOS})
    assert not cut_by_length_limit([1, 2, EOS], 3, {EOS})  # EOS as the last allowed token: finished
    assert not cut_by_length_limit([1, EOS], 3, {EOS})
    assert not cut_by_length_limit([1, 2], 3, {EOS})  # stopped before the budget without EOS (a stop token)


@pytest.mark.asyncio
@pytest.mark.parametrize(("score_truncated", "value", "scored"), [(False, 2 / 3, 2), (True, 1.0, 3)])
async def test_monte_carlo_value_scores_cut_continuations(score_truncated, value, scored):
    """Prefix [1, 2] of a 5-token response leaves a budget of 3. Continuations: [7, EOS] finished, [7, 8, 9]
    cut by the budget, [7, 8, EOS] finished on its last token. The reward function gives every one 1."""
    continuations = iter([[7, EOS], [7, 8, 9], [7, 8, EOS]])
    sent, scored_texts = [], []

    async def generate(request_id, *, prompt_ids, sampling_params):
        sent.append((list(prompt_ids), sampling_params["max_tokens"]))
        return TokenOutput(token_ids=next(continuations))

    async def reward(response_ids):
        scored_texts.append(response_ids)
        return 1.0

    result = await monte_carlo_value(generate, "r", PROMPT, [1, 2], {"temperature": 1.0}, 3, 5, reward, {EOS},
                                     score_truncated)
    assert sent == [(PROMPT + [1, 2], 3)] * 3
    assert result.value == pytest.approx(value, abs=1e-12) and result.truncated == 1
    assert result.continuations == 3 and result.continuation_tokens == 8 and len(scored_texts) == scored


def estimator_batch(rewards, length, uids):
    response_mask = torch.ones(len(rewards), length)
    token_level_rewards = torch.zeros(len(rewards), length)
    token_level_rewards[:, -1] = torch.tensor(rewards)
    return DataProto.from_dict(
        tensors={"token_level_rewards": token_level_rewards, "response_mask": response_mask},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


@pytest.mark.parametrize(
    ("setting", "truncated_row"),
    [("zero", [0.0, -0.5, -0.5, -0.5]), ("reward_function", [0.0, 0.5, 0.5, 0.5])],
)
def test_chain_reward_of_a_truncated_response(setting, truncated_row):
    """Two responses with R = 1, one cutpoint at token 1 with V = 0.5; the first was cut by the length
    limit: R = 0 under "zero" (advantage 0 - 0.5), R = 1 under "reward_function" (1 - 0.5)."""
    data = estimator_batch([1.0, 1.0], 4, ["c", "c"])
    rows = [
        {"segment_starts": [1], "boundary_values": [0.5], "truncated": True},
        {"segment_starts": [1], "boundary_values": [0.5], "truncated": False},
    ]
    config = OmegaConf.create({"adv_estimator": "spo_chain", "spo": {"truncated_response_score": setting}})
    with provide_spo_rows(rows):
        advantages = compute_advantage(data, "spo_chain", config=config).batch["advantages"]
    assert advantages.tolist() == [pytest.approx(truncated_row), pytest.approx([0.0, 0.5, 0.5, 0.5])]


@pytest.mark.parametrize(("setting", "expected"), [("zero", [0.5, -0.5]), ("reward_function", [0.0, 0.0])])
def test_tree_reward_of_a_truncated_leaf(setting, expected):
    """A root with two one-segment leaves, both rewarded 1, the second cut by the length limit. "zero":
    V = 1 and 0, V(root) = 0.5, advantages +0.5 and -0.5. "reward_function": both 1, advantages 0."""
    data = estimator_batch([1.0, 1.0], 3, ["t", "t"])
    rows = [{"path": [1], "segment_ends": [3], "truncated": False}, {"path": [2], "segment_ends": [3], "truncated": True}]
    config = OmegaConf.create({"adv_estimator": "spo_tree", "spo": {"truncated_response_score": setting}})
    with provide_spo_rows(rows):
        advantages = compute_advantage(data, "spo_tree", config=config).batch["advantages"]
    assert advantages.tolist() == [pytest.approx([expected[0]] * 3), pytest.approx([expected[1]] * 3)]


def test_truncated_continuations_metric():
    def row(continuations, truncated, requests):
        return {"segment_starts": [1], "boundary_values": [0.5], "truncated": False,
                "chain": {"boundaries": 1, "mc_continuations": continuations, "mc_tokens": 10 * continuations,
                          "mc_truncated": truncated, "cutpoint_requests": requests, "no_cutpoint": False,
                          "capped": False}}

    context = SPOBatchContext(rows=[row(9, 3, 2), row(3, 0, 0), None])
    metrics = batch_metrics(context, torch.ones(3, 4))
    assert metrics["spo/chain/mc_truncated_fraction"] == 3 / 12
    assert metrics["spo/chain/cutpoint_requests"] == 2.0


# ---------------------------------------------------------------------------------------------
# 7. The reference's reward rule as a custom reward function
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data_source", "text", "truth", "score"),
    [
        ("openai/gsm8k", "3 + 4 = 7\n#### 7", "7", 1.0),
        ("openai/gsm8k", "so 1,234 in all\n#### 1,234", "1234", 1.0),  # commas dropped, as the reference
        ("openai/gsm8k", "#### 8", "7", 0.0),
        ("openai/gsm8k", "#### 7.", "7", 0.0),  # the whole text after '####', stripped
        ("openai/gsm8k", "the answer is 7", "7", 0.0),  # nothing to read
        ("openai/gsm8k", "#### 7\n#### 7", "7", -2.0),  # two answers
        ("openai/gsm8k", "########", "7", -2.0),  # '####' twice
        ("openai/gsm8k", "###### 7", "7", 0.0),  # once, then '## 7'
        ("HuggingFaceH4/MATH-500", "so $\\boxed{\\frac12}$", "\\frac{1}{2}", 1.0),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "4", 0.0),
        ("aime2024", "no box", "4", 0.0),
        ("aime2024", "\\boxed{4} #### 4 #### 4", "4", -2.0),
    ],
)
def test_reference_reward_rule(data_source, text, truth, score):
    assert compute_score(data_source, text, truth) == {"score": score, "acc": float(score == 1.0)}


def test_reference_reward_is_selected_with_verls_custom_reward_function():
    selection = {"path": "pkg://spo_verl.adapters.rewards", "name": "compute_score"}
    score = get_custom_reward_fn(OmegaConf.create({"reward": {"custom_reward_function": selection}}))
    result = score(data_source="openai/gsm8k", solution_str="#### 7", ground_truth="7", extra_info={})
    assert result == {"score": 1.0, "acc": 1.0}
    with pytest.raises(ValueError, match=r"scores data_source \['openai/gsm8k'\].*got 'codecontests'"):
        compute_score("codecontests", "x", "y")


# ---------------------------------------------------------------------------------------------
# 9. The reference loss trains nothing on a micro-batch whose mean ratio exceeds 10
# ---------------------------------------------------------------------------------------------

OLD_LOG_PROB = torch.tensor([[0.5, 0.95, 0.2], [0.6, 0.3, 1.0]]).log()  # p < 0.9 at 4 of 5 response tokens
RESPONSE_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADVANTAGES = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.0]])


def actor_config(use_kl_loss=False):
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2, loss_agg_mode="token-mean",
        use_kl_loss=use_kl_loss, kl_loss_coef=1e-4,
        policy_loss=SPOPolicyLossConfig(loss_mode="spo_prob_mask", spo={}),
    )


@pytest.mark.parametrize(("ratio", "skipped"), [(12.0, True), (9.0, False)])
def test_high_ratio_micro_batch_trains_nothing(ratio, skipped):
    """Every masked-in token has ratio ``ratio``: the mean over them is ``ratio`` (> 10: skipped)."""
    log_prob = (OLD_LOG_PROB + math.log(ratio)).requires_grad_(True)
    loss, metrics = get_policy_loss_fn("spo_prob_mask")(
        OLD_LOG_PROB, log_prob, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", actor_config(), None
    )
    assert metrics["spo/prob_mask/high_ratio_skipped"] == float(skipped)
    assert (loss.item() == 0.0) == skipped
    loss.backward()
    assert (log_prob.grad.abs().sum().item() == 0.0) == skipped


@pytest.mark.parametrize(("ratio", "skipped"), [(12.0, True), (9.0, False)])
def test_high_ratio_drops_the_masked_kl_too(ratio, skipped):
    # The reference model is the old policy: KL > 0 for ratio != 1.
    data, model_output = loss_batch(OLD_LOG_PROB + math.log(ratio), response_mask=RESPONSE_MASK,
                                    old_log_probs=OLD_LOG_PROB, ref_log_prob=OLD_LOG_PROB, advantages=ADVANTAGES)
    loss, metrics = spo_ppo_loss(actor_config(use_kl_loss=True), model_output, data)
    assert metrics["kl_loss"] > 0
    assert (loss.item() == 0.0) == skipped


# ---------------------------------------------------------------------------------------------
# On verl's vLLM server (CPU) against a transformers forward pass of the same model
# ---------------------------------------------------------------------------------------------

THRESHOLD = 0.9
NEAR = 1e-4  # vLLM and transformers agree to ~1e-6; a token this close to the threshold could go either way


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model[0], dtype=torch.float32).eval()


def prompt_ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def policy_probs(hf_model, prompt, response, temperature):
    """softmax(logits / T) of each response token, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = hf_model(input_ids=ids).logits[0].float()
    scores = torch.softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / temperature, dim=-1)
    return scores.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


@in_session_loop
async def test_verls_server_gives_untempered_prompt_log_probs(llm_client, tiny_model, hf_model):
    """What the engine-side resolution relies on: prompt log-probs are log softmax(logits), whatever the
    request's temperature (vLLM's prompt tokens skip the sampler)."""
    prompt = prompt_ids(tiny_model[1], "Compute 3*4 and explain.")
    sampled = await llm_client.generate("untempered", prompt_ids=prompt,
                                        sampling_params={"temperature": 1.0, "max_tokens": 20, "seed": 0})
    response = list(sampled.token_ids)
    out = await llm_client.generate("untempered", prompt_ids=prompt + response,
                                    sampling_params={"temperature": 0.6, "max_tokens": 1, "prompt_logprobs": 0})
    scored = [entry[0] for entry in out.extra_fields["prompt_logprobs"][len(prompt) - 1 : len(prompt) + len(response) - 1]]
    untempered = [math.log(p) for p in policy_probs(hf_model, prompt, response, 1.0)]
    tempered = [math.log(p) for p in policy_probs(hf_model, prompt, response, 0.6)]
    assert max(abs(a - b) for a, b in zip(scored, untempered)) < 1e-3
    assert max(abs(a - b) for a, b in zip(scored, tempered)) > 0.05


@in_session_loop
@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(0.6, 0.9, -1), (0.6, 0.8, -1), (1.0, 0.5, -1), (0.6, 1.0, 5)],
)
async def test_cutpoints_match_a_transformers_forward_pass(llm_client, tiny_model, hf_model, temperature, top_p, top_k):
    tokenizer = tiny_model[1]
    prompt = prompt_ids(tokenizer, "Compute 3*4 and explain.")
    params = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    requests, processed_differs = 0, False
    for seed in range(3):
        out = await llm_client.generate(f"fid-{seed}", prompt_ids=prompt,
                                        sampling_params={**params, "max_tokens": 40, "logprobs": True, "seed": seed})
        tokens = list(out.token_ids)
        low = await low_probability_tokens(llm_client.generate, f"fid-{seed}", prompt, tokens, out.log_probs, params,
                                           THRESHOLD)
        p = policy_probs(hf_model, prompt, tokens, temperature)
        expected = {t for t, pt in enumerate(p) if pt < THRESHOLD}
        near = {t for t, pt in enumerate(p) if abs(pt - THRESHOLD) < NEAR}
        assert set(low.positions) - near == expected - near, (seed, [round(x, 4) for x in p])
        requests += low.requests
        processed_differs |= {t for t, lp in enumerate(out.log_probs) if math.exp(lp) < THRESHOLD} - near != expected - near
    if top_p < THRESHOLD or top_k > 0:
        assert requests > 0  # tokens the truncation left undecided were asked of the engine
    if (temperature, top_p) == (0.6, 0.8):
        assert processed_differs  # top-p hid low-probability tokens from the sampler's own log-probs


@in_session_loop
async def test_chain_loop_cutpoints_truncation_flag_and_reference_reward(llm_client, tiny_model, hf_model):
    model_dir, tokenizer = tiny_model
    response_length, interval, temperature = 48, 3, 0.6
    config = compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        "actor_rollout_ref.rollout.prompt_length=64",
        "reward.custom_reward_function.path=pkg://spo_verl.adapters.rewards",
        "reward.custom_reward_function.name=compute_score",
        "+algorithm.spo.chain.mc_samples=2",
        f"+algorithm.spo.chain.cutpoint_interval={interval}",
    )
    sampling = {"temperature": temperature, "top_p": 0.8, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    outputs = await run_sessions(
        SPOChainAgentLoop, config, llm_client, tokenizer, "fidelity1", [{"role": "user", "content": "Say 7."}],
        sampling_params=sampling, data_source="openai/gsm8k", reward_model={"ground_truth": "7"}, extra_info={},
    )
    eos = tokenizer.eos_token_id
    for out in outputs:
        meta, tokens = out.extra_fields["spo"], out.response_ids
        end = len(tokens) - 1 if tokens[-1] == eos else len(tokens)  # a final EOS is no cutpoint
        p = policy_probs(hf_model, out.prompt_ids, tokens, temperature)[:end]
        if all(abs(pt - THRESHOLD) >= NEAR for pt in p):
            assert meta["segment_starts"] == select_cutpoints([t for t, pt in enumerate(p) if pt < THRESHOLD], interval)
        assert meta["truncated"] == (len(tokens) == response_length and tokens[-1] != eos)
        chain = meta["chain"]
        assert 0 <= chain["mc_truncated"] <= chain["mc_continuations"] and chain["cutpoint_requests"] >= 0
        assert all(v in (-2.0, -1.0, -0.5, 0.0, 0.5, 1.0) for v in meta["boundary_values"])  # means of 2 scores in {-2, 0, 1}


def test_the_reward_scores_the_text_before_the_rollouts_stop_string():
    """RhoMath writes the next problem after its answer; the rollout stops at "\\n\\n\\nProblem:", whose tokens
    end the response verl decodes. The reference scores the text before it (else its second #### is -2)."""
    from spo_verl.adapters.rewards import before_stop_string

    stop = ["\n\n\nProblem:"]
    text = "3 + 4 = 7.\n#### 7\n\n\nProblem:"
    assert before_stop_string(text, stop) == "3 + 4 = 7.\n#### 7"
    assert compute_score("openai/gsm8k", text, "7", stop=stop) == {"score": 1.0, "acc": 1.0}
    assert compute_score("openai/gsm8k", text, "7") == {"score": 0.0, "acc": 0.0}
    rambling = text + " What is 2 + 2?\n#### 4"
    assert compute_score("openai/gsm8k", rambling, "7") == {"score": -2.0, "acc": 0.0}
    assert compute_score("openai/gsm8k", rambling, "7", stop=stop) == {"score": 1.0, "acc": 1.0}
    assert before_stop_string("a|b#c", ["#", "|"]) == "a" and before_stop_string("abc", None) == "abc"


def test_stop_strings_come_from_the_setting_and_a_requests_own_win():
    from omegaconf import OmegaConf

    from spo_verl.adapters.stop_strings import stop_strings, with_stop_strings

    rollout = OmegaConf.create({"custom": {"stop": ["\n\n\nProblem:"]}})
    assert with_stop_strings({"temperature": 1.0}, rollout) == {"temperature": 1.0, "stop": ["\n\n\nProblem:"]}
    assert with_stop_strings({"stop": []}, rollout) == {"stop": []}
    assert with_stop_strings({"temperature": 1.0}, OmegaConf.create({"custom": None})) == {"temperature": 1.0}
    assert stop_strings(None) == []
    with pytest.raises(ValueError, match="rollout.custom.stop must be a list of non-empty strings"):
        stop_strings(OmegaConf.create({"custom": {"stop": "\n\n\nProblem:"}}))
