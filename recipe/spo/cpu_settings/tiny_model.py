"""A tiny, fully local Qwen2 model and its tokenizer: the model of the ``cpu-tiny`` setting and of the
tests. Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library and the model is
a randomly initialised ``Qwen2ForCausalLM`` saved with ``save_pretrained``.

* :func:`build_tiny_tokenizer` -- a deterministic character-level tokenizer (<= 128 tokens) with a
  Qwen-style chat template.
* :func:`temporary_tiny_qwen2` -- both in a temporary folder for the length of a ``with`` block (the
  benchmarks' model).
* :func:`build_tiny_qwen2` -- a 2-layer Qwen2 (hidden 128, head_dim 64) whose output head is
  calibrated so that sampling at temperature 1 gives a mix of likely and unlikely tokens and the
  EOS token ``<|im_end|>`` has a probability of a few percent per step.

``tests/test_tiny_vllm_on_cpu.py`` checks, on verl's vLLM server for this model, that the log-probs
vLLM returns are those of the distribution the token was sampled from (``log_softmax(logits /
temperature)``), against a teacher-forced transformers forward pass.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

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


def _character_byte_level_bpe(characters: Sequence[str]):
    """The special tokens, then one token per character, in Qwen2's byte-level pipeline with no merges
    (see :func:`build_tiny_tokenizer`)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_char = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in characters:
        (b,) = ch.encode("utf-8")
        vocab[byte_char[b]] = len(vocab)
    assert len(vocab) == len(SPECIAL_TOKENS) + len(characters) <= 128
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
    return tok


def build_tiny_tokenizer(directory: str | os.PathLike, characters: Sequence[str] = CHARACTERS):
    """Build a deterministic character-level tokenizer, save it to ``directory`` and return it.

    Vocabulary (87 tokens by default, ids in this order): ``<pad>`` (0), ``<unk>`` (1), ``<|im_start|>``
    (2), ``<|im_end|>`` (3), ``<eos>`` (4), then ``characters``, by default the digits, ``a``-``z``,
    ``A``-``Z``, space, newline and ``+-*/=().,:;?!'_<>#``. Special tokens are matched as whole strings.

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
    from transformers import PreTrainedTokenizerFast

    tok = _character_byte_level_bpe(characters)
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


def _tiny_qwen2_config(tokenizer, eos_id: int):
    """The tiny model's architecture (see :func:`build_tiny_qwen2`)."""
    from transformers import Qwen2Config

    return Qwen2Config(
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


def _add_bias_dimension(model, seed: int, bias_dim: int) -> None:
    """O(1) embeddings whose ``bias_dim`` is a constant no layer writes to (see :func:`build_tiny_qwen2`);
    under ``torch.no_grad()``."""
    import torch

    emb = model.model.embed_tokens.weight
    # Make the embeddings O(1) so the constant coordinate is comparable to the others.
    emb.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    emb[:, bias_dim] = math.sqrt(model.config.hidden_size - 1) / 2
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[bias_dim, :] = 0.0
        layer.mlp.down_proj.weight[bias_dim, :] = 0.0


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
    from transformers import GenerationConfig, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = _tiny_qwen2_config(tokenizer, eos_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    bias_dim = config.hidden_size - 1
    with torch.no_grad():
        _add_bias_dimension(model, seed, bias_dim)
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


@contextlib.contextmanager
def temporary_tiny_qwen2(seed: int = 0):
    """The tiny model and its tokenizer built in a temporary folder, whose path the block gets; removed
    afterwards."""
    with tempfile.TemporaryDirectory() as model_dir:
        build_tiny_qwen2(model_dir, build_tiny_tokenizer(model_dir), seed=seed)
        yield model_dir


def train_on_answers(model, sequences: Sequence[tuple[list[int], list[int]]], pad_token_id: int, steps: int,
                     lr: float = 3e-3) -> None:
    """Teacher-forced full-batch training of ``model`` on ``(prompt ids, answer ids)`` pairs, the loss on
    the answer tokens only: how the CPU settings' and the rehearsal's small models learn a format."""
    import torch

    width = max(len(prompt) + len(answer) for prompt, answer in sequences)
    ids = torch.full((len(sequences), width), pad_token_id)
    labels = torch.full((len(sequences), width), -100)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, (prompt, answer) in enumerate(sequences):
        tokens = prompt + answer
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, len(prompt): len(tokens)] = torch.tensor(answer)
        attention[row, : len(tokens)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
