"""A tiny, fully local Qwen2 model and a real vLLM engine on CPU, for tests and the CPU demo.

Nothing here downloads anything: the tokenizer is built with the ``tokenizers`` library and the
model is a randomly initialised ``Qwen2ForCausalLM`` saved with ``save_pretrained``.

* :func:`build_tiny_tokenizer` -- a deterministic character-level tokenizer (<= 128 tokens) with a
  Qwen-style chat template.
* :func:`build_tiny_qwen2` -- a 2-layer Qwen2 (hidden 128, head_dim 64) whose output head is
  calibrated so that sampling at temperature 1 gives a mix of likely and unlikely tokens and the
  EOS token ``<|im_end|>`` has a probability of a few percent per step.
* :class:`CPUvLLMServer` -- a ``vllm.v1.engine.async_llm.AsyncLLM`` on CPU exposing the
  ``generate(request_id, *, prompt_ids, sampling_params, ...) -> TokenOutput`` interface that verl's
  agent loops call on their ``server_manager`` (``verl.workers.rollout.llm_server.LLMServerClient``),
  with the request handling of ``vLLMHttpServer.generate``
  (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``). A lightweight stand-in (no Ray) for
  the CPU demo (``spo_verl/cpu_demo.py``). The tests and the benchmark
  do not use it: they run verl's own vLLM server replica and client on the ``spo_cpu`` platform
  (``spo_verl/testing/verl_server.py``).

Log-probs: the engine is created with ``logprobs_mode="processed_logprobs"`` (verl's default,
``RolloutConfig.logprobs_mode``), so the log-probs vLLM returns are those of the distribution the
token was sampled from, i.e. ``log_softmax(logits / temperature)`` (after top-k/top-p, which are
off unless requested). ``tests/test_tiny_vllm_on_cpu.py`` checks this, on verl's server with the
same engine settings, against a teacher-forced transformers forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = [
    "CHAT_TEMPLATE",
    "CPU_ENGINE_ENV",
    "EOS_TOKEN",
    "CPUvLLMServer",
    "build_tiny_qwen2",
    "build_tiny_tokenizer",
]

# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
DOC_END_TOKEN = "<eos>"
#: The token generation stops on. As in Qwen2.5-Instruct it is the end-of-turn token, so a finished
#: assistant response already ends the way the chat template closes a message.
EOS_TOKEN = IM_END_TOKEN

SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, IM_START_TOKEN, IM_END_TOKEN, DOC_END_TOKEN]
CHARACTERS = (
    list("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    + [" ", "\n"]
    + list("+-*/=()")
    + list(".,:;?!'_<>")
    + ["#"]  # GSM8K-style answers ("#### 7"), scored by verl's own gsm8k reward
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/Qwen byte-level alphabet: byte -> printable unicode character (space -> 'Ġ', '\\n' -> 'Ċ')."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Qwen-style ChatML template. ``add_generation_prompt`` appends ``<|im_start|>assistant\n``.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{- message['content'] }}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' }}{%- endif -%}"
)


def build_tiny_tokenizer(directory: str | os.PathLike):
    """Build a deterministic character-level tokenizer, save it to ``directory`` and return it.

    Vocabulary (87 tokens, ids in this order): ``<pad>`` (0), ``<unk>`` (1), ``<|im_start|>`` (2),
    ``<|im_end|>`` (3), ``<eos>`` (4), then the digits, ``a``-``z``, ``A``-``Z``, space, newline and
    ``+-*/=().,:;?!'_<>#``. Special tokens are matched as whole strings.

    It is a byte-level BPE *without merges* (every character is one token), i.e. the same pipeline
    as Qwen2's tokenizer: transformers 5 always loads a ``model_type == "qwen2"`` checkpoint with
    ``Qwen2Tokenizer`` (byte-level BPE, NFC, Qwen pre-tokenizer regex), whatever class is saved,
    so this is the only way ``AutoTokenizer.from_pretrained`` (used by verl and vLLM) encodes and
    decodes exactly like the returned object. Characters outside the vocabulary are silently
    dropped by the byte-level BPE (there is no unknown-token fallback in Qwen2Tokenizer).

    ``eos_token`` is ``<|im_end|>`` (end of turn, what generation stops on), ``pad_token`` is
    ``<pad>``, ``bos_token`` is ``<eos>`` (a document separator playing the role of Qwen's
    ``<|endoftext|>``; it is never added automatically). The chat template is ChatML/Qwen-style
    (:data:`CHAT_TEMPLATE`).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        (b,) = ch.encode("utf-8")
        vocab[byte_char[b]] = len(vocab)
    assert len(vocab) == len(SPECIAL_TOKENS) + len(CHARACTERS) <= 128
    bpe = models.BPE(
        vocab=vocab,
        merges=[],
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    # Same normalizer / pre-tokenizer / decoder as transformers' Qwen2Tokenizer.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=DOC_END_TOKEN,
        extra_special_tokens=[IM_START_TOKEN],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    Path(directory).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(directory))
    return hf_tok


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def _calibrate_head(model, tokenizer, seed: int, eos_prob: float, bias_dim: int) -> None:
    """Scale the output head and set the EOS 'bias' so the sampling distribution is interesting.

    See :func:`build_tiny_qwen2` for the construction. Runs a few teacher-forced forward passes over
    fixed random sequences (deterministic for a given seed).
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    vocab = model.config.vocab_size
    char_ids = torch.arange(len(SPECIAL_TOKENS), vocab)
    seqs = char_ids[torch.randint(len(char_ids), (8, 64), generator=gen)]
    with torch.no_grad():
        out = model.model(input_ids=seqs)
        h = out.last_hidden_state.reshape(-1, model.config.hidden_size)  # after the final norm
        # h[:, bias_dim] is (nearly) the same at every position -> lm_head[:, bias_dim] is a bias.
        h_bias = h[:, bias_dim].mean().item()
        w = model.lm_head.weight
        # 1) Temperature-1 logits from the content dims with std ~2.5: a peaked but far from
        #    one-hot distribution (a few likely tokens, a long tail of unlikely ones).
        w[:, bias_dim] = 0.0
        std = (h @ w.T).std().item()
        w.mul_(2.5 / std)
        # 2) Biases: special tokens other than EOS are strongly suppressed; EOS gets the bias
        #    for which its mean probability over the calibration positions is ``eos_prob``.
        bias = torch.zeros(vocab)
        eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        for t in SPECIAL_TOKENS:
            if t != EOS_TOKEN:
                bias[tokenizer.convert_tokens_to_ids(t)] = -10.0
        content_logits = h @ w.T
        lo, hi = -20.0, 20.0
        for _ in range(50):  # bisection on the EOS bias
            mid = (lo + hi) / 2
            bias[eos_id] = mid
            p = torch.softmax(content_logits + bias, dim=-1)[:, eos_id].mean().item()
            lo, hi = (mid, hi) if p < eos_prob else (lo, mid)
        bias[eos_id] = (lo + hi) / 2
        w[:, bias_dim] = bias / h_bias


def build_tiny_qwen2(directory: str | os.PathLike, tokenizer, seed: int = 0, eos_prob: float = 0.04) -> str:
    """Build a randomly initialised tiny ``Qwen2ForCausalLM``; save it (+ tokenizer) to ``directory``.

    Architecture: hidden 128, 2 layers, 2 attention heads (head_dim 64 -- vLLM's CPU attention
    supports 64 but not e.g. 16), 1 KV head, MLP 256, vocab = ``len(tokenizer)``,
    ``tie_word_embeddings=False`` (tied embeddings break vLLM weight reloading), float32,
    ``max_position_embeddings=2048``. Weights are saved as safetensors together with the tokenizer
    and a ``generation_config.json`` whose ``eos_token_id`` is the tokenizer's EOS (``<|im_end|>``).

    Qwen2's output head has no bias and a plain random init gives near-uniform next-token
    distributions, so the weights are edited deterministically after ``torch.manual_seed(seed)``:

    * **Embeddings** are redrawn from N(0, 1) (instead of std 0.02) so the next point works.
    * **A constant 'bias' dimension.** The last hidden dimension of every token embedding is set to
      a constant and no layer writes to it (the corresponding rows of every ``o_proj`` and
      ``down_proj`` are zeroed), so after the final RMSNorm that coordinate is almost the same at
      every position and column ``lm_head[:, -1]`` acts as a per-token output bias.
    * **Head scale.** The rest of ``lm_head`` is rescaled so the temperature-1 logits have a std of
      about 2.5 across positions/tokens: the distribution is neither uniform nor one-hot (a few
      likely tokens, a tail of unlikely ones), which gives log-probs spread over a wide range.
    * **Biases.** Special tokens other than EOS get a bias of -10 (essentially never sampled); the
      EOS bias is found by bisection so that EOS has a mean probability of ``eos_prob`` (default
      4%) per step on random character sequences. Measured on the model's own samples (temperature
      1, seed 0) the per-step EOS rate is also ~4%: the mean free-running length is ~25 tokens, so
      with ``max_tokens`` of ~20-40 a good share of generations stop early and the rest are cut.

    Returns ``str(directory)``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    bias_dim = config.hidden_size - 1
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        # Make the embeddings O(1) so the constant coordinate is comparable to the others.
        emb.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
        emb[:, bias_dim] = math.sqrt(config.hidden_size - 1) / 2
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[bias_dim, :] = 0.0
            layer.mlp.down_proj.weight[bias_dim, :] = 0.0
        _calibrate_head(model, tokenizer, seed, eos_prob, bias_dim)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return str(directory)


# ----------------------------------------------------------------------------------------------
# vLLM engine on CPU
# ----------------------------------------------------------------------------------------------


#: Environment variables the engine is started with (each only if not already set). They are
#: set while the engine starts and restored afterwards: the two child processes inherit them at
#: spawn time, the pytest / script process is left as it was.
CPU_ENGINE_ENV = {
    # Do not pin OpenMP threads to cores (the default "auto" binding reserves cores and is fragile
    # on small machines / containers).
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # The CPU platform forces "spawn" for the worker anyway; set it before the engine-core process
    # is created so that one is spawned too (forking a process running pytest/asyncio threads is
    # unsafe). Spawn re-imports ``__main__``: scripts need an ``if __name__ == "__main__":`` guard.
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    # vLLM's CPU sampler calls a ``torch.compile``-d ``compiled_random_sample``; compiling it with
    # inductor on the first sampled request takes ~25 s on a 2-core machine. Disabling dynamo in
    # the engine processes runs it eagerly (same math). The model itself runs eagerly anyway
    # (``enforce_eager=True``).
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@contextlib.contextmanager
def _cpu_engine_env(kv_cache_gib: int):
    """Set :data:`CPU_ENGINE_ENV` plus ``VLLM_CPU_KVCACHE_SPACE`` (GiB) while the engine starts."""
    # torch reads TORCH_COMPILE_DISABLE when torch._dynamo is first imported: import it now so
    # only the (freshly spawned) engine processes are affected, not this process.
    import torch._dynamo  # noqa: F401

    env = dict(CPU_ENGINE_ENV, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    added = [k for k in env if k not in os.environ]
    for k in added:
        os.environ[k] = env[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class CPUvLLMServer:
    """A real vLLM ``AsyncLLM`` engine on CPU behind verl's ``server_manager.generate`` interface.

    Create with ``server = await CPUvLLMServer.start(model_dir)`` and close with
    ``await server.shutdown()``, or use ``async with await CPUvLLMServer.start(model_dir) as server``
    (``async with CPUvLLMServer(...)`` also works: ``__aenter__`` starts the engine if needed).
    All calls must come from the event loop the server was started in.

    :meth:`generate` mirrors verl 0.9.1: the client ``LLMServerClient.generate``
    (``verl/workers/rollout/llm_server.py``: a fresh uuid as vLLM request id per call, the caller's
    ``request_id`` only routes; ``extra_fields`` gets ``global_steps``/``min_global_steps``/
    ``max_global_steps``) and the server ``vLLMHttpServer.generate``
    (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``):

    * ``max_tokens`` = ``sampling_params["max_tokens"]``, else ``["max_new_tokens"]``, else
      ``min(response_length, prompt_length + response_length - len(prompt_ids))``; then clamped
      to ``[1, max_model_len - len(prompt_ids)]`` (a prompt with no headroom raises ``ValueError``);
    * ``logprobs=True`` -> vLLM ``logprobs=0`` (only the sampled token's log-prob), otherwise no
      log-probs (``TokenOutput.log_probs is None``);
    * ``repetition_penalty`` defaults to 1.0, ``ignore_eos`` to False; other keys go to
      ``vllm.SamplingParams`` unchanged (e.g. ``temperature``, ``top_p``, ``top_k``, ``seed``);
    * result ``TokenOutput(token_ids, log_probs, stop_reason, num_preempted, extra_fields)`` with
      ``stop_reason`` "completed" for vLLM finish reasons "stop"/"length" (EOS or max_tokens --
      verl does not distinguish them), "aborted" for "abort", anything else passed through;
      ``extra_fields`` holds ``global_steps`` (the attribute :attr:`global_steps`, default 0),
      ``min_global_steps``, ``max_global_steps`` and ``num_cached_tokens`` (prefix-cache hits).

    Log-probs are *processed* (``logprobs_mode="processed_logprobs"``, verl's default), i.e.
    ``log_softmax(logits / temperature)`` of the distribution the token was sampled from. Note
    that with ``temperature=0`` vLLM samples greedily and the processed log-probs are those of
    the untempered logits.

    The caller's ``sampling_params`` dict is never modified. Every call is appended to
    :attr:`calls` as a dict with ``request_id``, ``vllm_request_id``, ``prompt_ids``,
    ``sampling_params`` (a copy of what the caller sent), ``max_tokens`` (the effective value),
    ``token_ids``, ``log_probs`` and ``stop_reason``.

    Engine: ``vllm.v1.engine.async_llm.AsyncLLM.from_engine_args`` with ``enforce_eager=True``
    (no torch.compile / graphs), ``enable_prefix_caching=True``, ``dtype="float32"``, a small
    ``max_model_len`` and KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB), a fixed ``seed``. It runs in
    two spawned child processes (engine core + CPU worker); :data:`CPU_ENGINE_ENV` lists the
    environment variables set while it starts. ``shutdown()`` stops both (~5 s).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        prompt_length: int = 512,
        response_length: int = 256,
        max_num_seqs: int = 64,
        dtype: str = "float32",
        kv_cache_gib: int = 1,
        logprobs_mode: str = "processed_logprobs",
        engine_kwargs: Optional[dict[str, Any]] = None,
    ):
        self.model_dir = str(model_dir)
        self.seed = seed
        self.max_model_len = max_model_len
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.max_num_seqs = max_num_seqs
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.logprobs_mode = logprobs_mode
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine = None
        #: Reported in ``TokenOutput.extra_fields["global_steps"]`` like verl's server.
        self.global_steps: int = 0
        #: One dict per :meth:`generate` call, in completion order.
        self.calls: list[dict[str, Any]] = []

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    async def start(cls, model_dir: str | os.PathLike, **kwargs) -> "CPUvLLMServer":
        """Create the server and start its engine (takes ~15-30 s on a small CPU machine)."""
        server = cls(model_dir, **kwargs)
        await server._start_engine()
        return server

    async def _start_engine(self) -> None:
        if self.engine is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(self.max_model_len, 2048),
            enforce_eager=True,
            enable_prefix_caching=True,
            logprobs_mode=self.logprobs_mode,
            disable_log_stats=True,
            skip_tokenizer_init=False,
            trust_remote_code=False,
            tensor_parallel_size=1,
        )
        args.update(self.engine_kwargs)
        # AsyncLLM.__init__ blocks until the engine-core process has loaded the model (the event
        # loop is blocked meanwhile); it must run in the loop's thread because its output-handler
        # task binds to the running loop.
        with _cpu_engine_env(self.kv_cache_gib):
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    async def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine and its child processes (force-killed after ``timeout`` s, vLLM's
        default 5 s). Idempotent."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown(timeout=timeout)

    async def __aenter__(self) -> "CPUvLLMServer":
        await self._start_engine()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # -- verl server-manager interface -----------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        **kwargs: Any,
    ):
        """Token-in/token-out generation with verl's semantics; see the class docstring."""
        from vllm import SamplingParams, TokensPrompt
        from verl.workers.rollout.replica import TokenOutput

        if self.engine is None:
            raise RuntimeError("CPUvLLMServer is not started (use `await CPUvLLMServer.start(...)`)")
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError("CPUvLLMServer serves a text-only model")
        priority = kwargs.pop("priority", 0)
        kwargs.pop("audio_data", None)
        kwargs.pop("mm_processor_kwargs", None)
        kwargs.pop("mm_processor_output", None)

        prompt_ids = [int(t) for t in prompt_ids]
        sent = dict(sampling_params)
        params = dict(sampling_params)  # verl's server pops from (a Ray copy of) the dict

        max_possible_tokens = self.max_model_len - len(prompt_ids)
        if max_possible_tokens < 1:
            raise ValueError(
                f"Prompt length ({len(prompt_ids)}) leaves no room to generate within the "
                f"model's maximum context length ({self.max_model_len}); need at least "
                f"1 token of headroom."
            )
        if "max_tokens" in params:
            max_tokens = params.pop("max_tokens")
        elif "max_new_tokens" in params:
            max_tokens = params.pop("max_new_tokens")
        else:
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        max_tokens = max(1, min(int(max_tokens), max_possible_tokens))

        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        params.setdefault("repetition_penalty", 1.0)
        params.setdefault("ignore_eos", False)
        vllm_params = SamplingParams(max_tokens=max_tokens, **params)

        vllm_request_id = uuid.uuid4().hex  # fresh per call, as LLMServerClient._vllm_request_id
        final_res = None
        async for output in self.engine.generate(
            prompt=TokensPrompt(prompt_token_ids=prompt_ids),
            sampling_params=vllm_params,
            request_id=vllm_request_id,
            priority=priority,
        ):
            final_res = output
        assert final_res is not None

        extra_fields: dict[str, Any] = {
            "global_steps": self.global_steps,
            "min_global_steps": self.global_steps,
            "max_global_steps": self.global_steps,
        }
        if not final_res.outputs:
            result = TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=extra_fields)
        else:
            extra_fields["num_cached_tokens"] = getattr(final_res, "num_cached_tokens", None)
            completion = final_res.outputs[0]
            token_ids = list(completion.token_ids)
            log_probs = None
            if vllm_params.logprobs is not None:
                log_probs = [lp[token_ids[i]].logprob for i, lp in enumerate(completion.logprobs)]
            finish_reason = completion.finish_reason
            if finish_reason == "abort":
                stop_reason = "aborted"
            elif finish_reason in ("stop", "length"):
                stop_reason = "completed"
            else:
                stop_reason = finish_reason
            result = TokenOutput(
                token_ids=token_ids,
                log_probs=log_probs,
                stop_reason=stop_reason,
                num_preempted=getattr(completion, "num_preempted", None),
                extra_fields=extra_fields,
            )
        self.calls.append(
            {
                "request_id": request_id,
                "vllm_request_id": vllm_request_id,
                "prompt_ids": prompt_ids,
                "sampling_params": sent,
                "max_tokens": max_tokens,
                "token_ids": list(result.token_ids),
                "log_probs": None if result.log_probs is None else list(result.log_probs),
                "stop_reason": result.stop_reason,
            }
        )
        return result
