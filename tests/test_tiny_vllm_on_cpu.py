"""verl's own vLLM server on CPU (a standalone vLLMReplica, requested through verl's LLMServerClient):
request handling, log-probs against a transformers forward pass, continuation from a prefix.

The server (tiny random Qwen2, built locally) is the session fixture of conftest.py (workbench/spo_workbench/testing/verl_server.py).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch


pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_MODEL_LEN = 1024  # as the session server (workbench/spo_workbench/testing/verl_server.py)
PROMPT_LENGTH, RESPONSE_LENGTH = 64, 48  # ditto: verl's server derives the default max_tokens from them


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny_model
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _hf_logprobs(hf_model, prompt_ids, token_ids, temperature: float) -> list[float]:
    """Teacher-forced log p(token_ids | prompt_ids) under log_softmax(logits / temperature)."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = hf_model(input_ids=ids).logits[0].float()
    pred = logits[len(prompt_ids) - 1 : len(prompt_ids) + len(token_ids) - 1]
    lp = torch.log_softmax(pred / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].tolist()


async def test_max_tokens_and_logprobs(llm_client, tiny_model):
    server = llm_client
    _, tok = tiny_model
    eos = tok.eos_token_id
    prompt = _prompt(tok, "What is 12+7?")
    requested = [1, 5, 17, 40, 40, 40, 40, 40]
    params = [{"temperature": 1.0, "max_tokens": m, "logprobs": True, "seed": i} for i, m in enumerate(requested)]
    sent = [dict(p) for p in params]
    outs = await asyncio.gather(
        *(server.generate(f"req-{i}", prompt_ids=prompt, sampling_params=p) for i, p in enumerate(params))
    )
    assert params == sent, "the caller's sampling_params must not be modified"
    for m, out in zip(requested, outs):
        n = len(out.token_ids)
        assert 1 <= n <= m
        if n < m:
            assert out.token_ids[-1] == eos
        assert eos not in out.token_ids[:-1]
        assert all(0 <= t < len(tok) for t in out.token_ids)
        assert out.stop_reason == "completed"
        # (b) one finite, non-positive log-prob per token
        assert out.log_probs is not None and len(out.log_probs) == n
        assert all(math.isfinite(x) and x <= 0.0 for x in out.log_probs)
    # The tiny model's EOS probability (~4% per step) makes some of the 40-token generations stop
    # early, and its head keeps log-probs spread out (not one-hot, not uniform).
    assert any(len(o.token_ids) < 40 for o in outs[3:])
    all_lp = [x for o in outs for x in o.log_probs]
    assert min(all_lp) < -3.0 and max(all_lp) > -0.5

    # No logprobs requested -> None (verl maps logprobs=False to vLLM logprobs=None).
    out = await server.generate("req-x", prompt_ids=prompt, sampling_params={"temperature": 1.0, "max_tokens": 3})
    assert out.log_probs is None and 1 <= len(out.token_ids) <= 3

    # max_new_tokens alias, default (min(response_length, prompt_length + response_length - len(prompt)))
    # and clamping to [1, max_model_len - len(prompt)]. The server's effective max_tokens is the number
    # of tokens generated with ignore_eos (or when one token is the most it may generate).
    out = await server.generate("req-y", prompt_ids=prompt, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert len(out.token_ids) == 4
    out = await server.generate("req-z", prompt_ids=prompt, sampling_params={"temperature": 1.0, "ignore_eos": True})
    assert len(out.token_ids) == min(RESPONSE_LENGTH, PROMPT_LENGTH + RESPONSE_LENGTH - len(prompt))
    long_prompt = (prompt * (MAX_MODEL_LEN // len(prompt) + 1))[: MAX_MODEL_LEN - 2]
    out = await server.generate(
        "req-long", prompt_ids=long_prompt, sampling_params={"max_tokens": 50, "ignore_eos": True}
    )
    assert len(out.token_ids) == 2
    out = await server.generate("req-zero", prompt_ids=prompt, sampling_params={"max_tokens": 0, "ignore_eos": True})
    assert len(out.token_ids) == 1
    with pytest.raises(ValueError, match="leaves no room to generate"):
        await server.generate("req-full", prompt_ids=prompt * MAX_MODEL_LEN, sampling_params={})


async def test_logprobs_are_temperature_scaled(llm_client, tiny_model, hf_model):
    server = llm_client
    _, tok = tiny_model
    prompt = _prompt(tok, "Compute (3*4)-5 and explain.")
    temperature = 0.6
    outs = await asyncio.gather(
        *(
            server.generate(
                f"t-{i}",
                prompt_ids=prompt,
                sampling_params={"temperature": temperature, "max_tokens": 24, "logprobs": True, "seed": 100 + i},
            )
            for i in range(3)
        )
    )
    max_err, max_raw_gap = 0.0, 0.0
    for out in outs:
        ref = _hf_logprobs(hf_model, prompt, out.token_ids, temperature)
        raw = _hf_logprobs(hf_model, prompt, out.token_ids, 1.0)
        max_err = max(max_err, max(abs(a - b) for a, b in zip(out.log_probs, ref)))
        max_raw_gap = max(max_raw_gap, max(abs(a - b) for a, b in zip(out.log_probs, raw)))
    assert max_err < 1e-3, f"vLLM log-probs differ from log_softmax(logits / T) by {max_err}"
    # ... and they are clearly not the untempered (raw) log-probs.
    assert max_raw_gap > 0.05


async def test_continue_from_prefix(recording_client, tiny_model, hf_model):
    server = recording_client
    _, tok = tiny_model
    prompt = _prompt(tok, "Continue: 1 2 3")
    # Greedy: continuing from prompt + first k generated tokens reproduces the rest.
    full = await server.generate(
        "g", prompt_ids=prompt, sampling_params={"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
    )
    assert len(full.token_ids) == 20
    k = 7
    cont = await server.generate(
        "g",
        prompt_ids=prompt + full.token_ids[:k],
        sampling_params={"temperature": 0.0, "max_tokens": 20 - k, "ignore_eos": True},
    )
    assert cont.token_ids == full.token_ids[k:]
    # verl's client sends each call to vLLM under a fresh id; the caller's id only routes.
    assert server.calls[-1]["request_id"] == server.calls[-2]["request_id"] == "g"
    vllm_request_ids = [c["vllm_request_id"] for c in server.calls[-2:]]
    assert None not in vllm_request_ids and vllm_request_ids[0] != vllm_request_ids[1]

    # Sampled continuation of a sampled prefix: valid tokens, log-probs conditioned on the prefix.
    first = await server.generate(
        "s", prompt_ids=prompt, sampling_params={"temperature": 1.0, "max_tokens": 12, "logprobs": True, "seed": 7}
    )
    k = min(5, len(first.token_ids) - 1) if first.token_ids[-1] == tok.eos_token_id else 5
    prefix = prompt + first.token_ids[:k]
    cont = await server.generate(
        "s", prompt_ids=prefix, sampling_params={"temperature": 0.8, "max_tokens": 10, "logprobs": True, "seed": 8}
    )
    assert 1 <= len(cont.token_ids) <= 10 and len(cont.log_probs) == len(cont.token_ids)
    assert len(cont.token_ids) == 10 or cont.token_ids[-1] == tok.eos_token_id  # shorter only by its own EOS
    assert all(0 <= t < len(tok) for t in cont.token_ids)
    ref = _hf_logprobs(hf_model, prefix, cont.token_ids, 0.8)
    assert max(abs(a - b) for a, b in zip(cont.log_probs, ref)) < 1e-3


async def test_concurrent_calls_and_recording(recording_client, verl_server, tiny_model):
    server = recording_client
    _, tok = tiny_model
    prompts = [_prompt(tok, f"Task {i}: add {i} and {2 * i}.") for i in range(10)]
    n_before = len(server.calls)
    outs = await asyncio.gather(
        *(
            server.generate(
                # request_id is only a routing key: repeated ids are fine.
                f"session-{i % 3}",
                prompt_ids=p,
                sampling_params={"temperature": 1.0, "top_p": 1.0, "max_tokens": 16 + i, "logprobs": True},
            )
            for i, p in enumerate(prompts)
        )
    )
    assert len(outs) == 10 and all(1 <= len(o.token_ids) <= 16 + i for i, o in enumerate(outs))
    new_calls = server.calls[n_before:]
    assert len(new_calls) == 10
    assert len({c["vllm_request_id"] for c in new_calls} - {None}) == 10
    by_prompt = {tuple(c["prompt_ids"]): c for c in new_calls}
    global_steps = await verl_server.global_steps()  # the server's weight version (None: never synced)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        c = by_prompt[tuple(p)]
        assert c["request_id"] == f"session-{i % 3}"
        assert c["sampling_params"]["max_tokens"] == 16 + i
        assert c["token_ids"] == o.token_ids and c["log_probs"] == o.log_probs and c["stop_reason"] == o.stop_reason
        assert o.extra_fields["global_steps"] == global_steps
        assert o.extra_fields["min_global_steps"] == o.extra_fields["max_global_steps"] == global_steps


async def _set_stop_strings(verl_server, stop):
    """Set ``rollout.custom.stop`` in the running server's own configuration (what the setting sets)."""
    (handle,) = verl_server.manager.server_handles

    def set_custom(actor):
        object.__setattr__(actor.config, "custom", None if stop is None else {"stop": stop})

    await handle.__ray_call__.remote(set_custom)


async def test_the_settings_stop_strings_end_every_request_and_the_reward_reads_what_comes_before(
        llm_client, verl_server, tiny_model):
    """``rollout.custom.stop`` (spo_verl/adapters/stop_strings.py) on verl's own server: the same seeded
    request stops at the first stop string, its token ids (what verl trains and decodes) a prefix of the
    unstopped ones ending with the stop string; a request naming its own ``stop`` keeps it; the reward
    scores the text before the stop string."""
    from spo_verl.adapters.rewards import before_stop_string

    _, tok = tiny_model
    prompt = _prompt(tok, "What is 12+7?")
    params = {"temperature": 1.0, "max_tokens": 40, "ignore_eos": True, "seed": 11}
    free = (await llm_client.generate("stop-free", prompt_ids=prompt, sampling_params=dict(params))).token_ids
    text = tok.decode(free)
    stop = tok.decode(free[20:22])
    assert stop and text.find(stop) > 0, (text, stop)
    await _set_stop_strings(verl_server, [stop])
    try:
        stopped = (await llm_client.generate("stop-set", prompt_ids=prompt, sampling_params=dict(params))).token_ids
        own = (await llm_client.generate("stop-own", prompt_ids=prompt, sampling_params={**params, "stop": []})).token_ids
    finally:
        await _set_stop_strings(verl_server, None)
    assert len(stopped) < len(free) and stopped == free[: len(stopped)]
    stopped_text = tok.decode(stopped)
    # It stopped at the token that completed the stop string.
    assert stop in stopped_text and stop not in tok.decode(stopped[:-1])
    assert before_stop_string(stopped_text, [stop]) == text[: text.find(stop)]
    assert own == free
