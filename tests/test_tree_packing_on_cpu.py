"""Packed SPO trees: one forward per tree is exact against the per-leaf rows.

A tiny random Qwen2 (GQA: 4 query heads, 2 KV heads) runs once over the packed tree (its leaf rows
packed by their tokens, as verl's engine packs them: ``pack_sequences``) with the cascade attention
and once per leaf row (sdpa, the rows' own causal mask). In float64 the per-row response
log-probs agree to 1e-12 and the parameter gradients of sum(log-prob * weight) agree to 1e-10, both
when every token is trained once (SPO's trained-segment mask from ``tree_token_advantages``) and when
every row's tokens all count (the packed token then collects the weights of all rows through it).

float64 needs one patch, applied by the ``exact_rmsnorm`` fixture: transformers 5.10.4's Qwen2RMSNorm
computes in float32 whatever the input dtype (and eager attention's softmax too, which is why the row
reference uses sdpa). The rounding to float32 is the same op in both paths, so the forward log-probs
still agree to ~1e-15, but the gradients then differ at the float32 level (~1e-7 relative, ~4e-6
absolute: a shared token's gradient is rounded to float32 once as a sum instead of per row; see
:func:`test_float64_gradients_without_rmsnorm_patch_are_float32_close`). With the norm computed in the
input dtype both agree to ~1e-14. float32 (unpatched model): log-probs within 1e-5 (measured ~2e-6),
gradients within 1e-5 relative to the largest gradient (measured ~6e-7).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from spo_verl.core.algorithms.tree_rows import tree_token_advantages
from spo_verl.core.packing import (
    build_cascade_layout,
    pack_sequences,
    packed_row_log_probs,
)
from spo_verl.core.packing import cascade_attention as cascade_module
from spo_workbench.testing.random_trees import TREES, Tree, tree_2_2, tree_2_2_2, tree_3_3_early, tree_one_leaf

VOCAB = 61


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def exact_rmsnorm(monkeypatch):
    """Qwen2RMSNorm in the input dtype (transformers 5.10.4 always computes it in float32)."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def tiny_model(dtype=torch.float64, seed=0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(dtype)
    model.eval()  # no dropout; gradients still flow
    return model


def tiny_llama(dtype=torch.float64, seed=0) -> LlamaForCausalLM:
    """The CPU default's architecture (SmolLM2 is a Llama with a tied head): its decoder takes no mask
    mapping, only a mask tensor or None."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, attn_implementation="sdpa",
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------------
# Random trees as per-leaf rows




def padded(responses, rng, extra=3):
    """Each response followed by a few random padding tokens (beyond the row's length)."""
    return [None if r is None else r + [rng.randrange(VOCAB) for _ in range(extra)] for r in responses]


def with_padding_rows(tree: Tree, rng, pads=(1, 3)):
    """Rows of ``tree`` with padding rows (None) inserted at ``pads``."""
    responses, paths, ends = list(tree.responses), list(tree.paths), list(tree.ends)
    for position in pads:
        position = min(position, len(responses))
        responses.insert(position, None)
        paths.insert(position, None)
        ends.insert(position, None)
    return padded(responses, rng), paths, ends


def pack_rows(prompts, responses, ends, response_width=None):
    """The rows as verl's engine packs them (:func:`pack_sequences`, by their tokens): each real row's
    prompt and its response up to its last segment end; a padding row (None) owns no token."""
    sequences = [[] if r is None else list(p) + list(r[: e[-1]]) for p, r, e in zip(prompts, responses, ends)]
    prompt_lengths = [0 if r is None else len(p) for p, r in zip(prompts, responses)]
    return pack_sequences(sequences, prompt_lengths, response_width)


# ---------------------------------------------------------------------------------------------------
# Per-row reference


def row_log_probs(model, prompts, responses, ends, width, temperature=1.0):
    """(B, width) response log-probs, one sdpa forward per real row."""
    dtype = next(model.parameters()).dtype
    out = torch.zeros(len(responses), width, dtype=torch.promote_types(dtype, torch.float32))
    rows = []
    for b, (prompt, response, row_ends) in enumerate(zip(prompts, responses, ends)):
        if response is None:
            continue
        length = row_ends[-1]
        ids = torch.tensor([list(prompt) + list(response[:length])])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        rows.append((b, length, lp))
    if rows:
        index = torch.zeros(len(responses), width, dtype=torch.long)
        flat = torch.cat([lp for _, _, lp in rows])
        offset = 1
        for b, length, _ in rows:
            index[b, :length] = torch.arange(offset, offset + length)
            offset += length
        out = torch.cat([flat.new_zeros(1), flat])[index]
    return out


def param_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def grad_diff_of(model, packed_lp, rows_lp, weights):
    """Max |gradient difference| of sum(log-prob * weights), packed vs rows, and the max |gradient|."""
    return max_grad_diff(param_grads(model, (packed_lp * weights).sum()), param_grads(model, (rows_lp * weights).sum()))


def max_grad_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a), max(a[k].abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------------
# Packing structure


@pytest.mark.parametrize("name", list(TREES))
def test_pack_counts_positions_and_gather(name):
    rng = random.Random(sum(map(ord, name)))
    tree = TREES[name](rng)
    responses, paths, ends = with_padding_rows(tree, rng)
    packed = pack_rows([tree.prompt] * len(responses), responses, ends)
    rows = [tree.prompt + r[: e[-1]] for r, e in zip(tree.responses, tree.ends)]
    assert packed.num_packed_tokens == distinct_prefixes(rows)  # each distinct prefix exactly once
    assert packed.num_row_tokens == sum(len(tree.prompt) + e[-1] for e in tree.ends)
    assert packed.response_width == max(e[-1] for e in tree.ends)
    # Parents precede children; every token's position id is its position on its own path.
    parents = packed.node_parents
    assert all(int(parents[k]) < k for k in range(1, packed.num_nodes))
    for b, (response, path, row_ends) in enumerate(zip(responses, paths, ends)):
        if path is None:
            assert packed.row_tree[b] == -1
            assert (packed.row_index[b] == -1).all() and (packed.response_index[b] == -1).all()
            continue
        row = tree.prompt + response[: row_ends[-1]]
        index = packed.row_index[b, : len(row)]
        assert packed.input_ids[index].tolist() == row
        assert packed.position_ids[index].tolist() == list(range(len(row)))
        assert (packed.row_index[b, len(row) :] == -1).all()
        assert packed.response_index[b, : row_ends[-1]].tolist() == index[len(tree.prompt) :].tolist()
        assert (packed.response_index[b, row_ends[-1] :] == -1).all()
        # The previous token on the path is the previous row position.
        assert packed.previous_position[index[1:]].tolist() == index[:-1].tolist()
        # The last node's ancestor chain holds exactly the row's tokens.
        leaf = int(packed.node_of_token[index[-1]])
        chain = [packed.input_ids[packed.node_starts[k] : packed.node_starts[k] + packed.node_lengths[k]]
                 for k in packed.ancestors(leaf)]
        assert torch.cat(chain).tolist() == row
    gathered = packed.gather_rows(packed.input_ids, fill=-7)
    for b, (response, row_ends) in enumerate(zip(responses, ends)):
        expected = [-7] * packed.response_width if response is None else (
            response[: row_ends[-1]] + [-7] * (packed.response_width - row_ends[-1]))
        assert gathered[b].tolist() == expected


def test_only_padding_rows():
    packed = pack_sequences([[], []], [0, 0], response_width=4)
    assert packed.num_packed_tokens == 0 and packed.num_row_tokens == 0
    lp = packed_row_log_probs(tiny_model(torch.float32), packed)
    assert lp.shape == (2, 4) and (lp == 0).all()


# ---------------------------------------------------------------------------------------------------
# Exactness of the packed forward


def _rows_for(name, seed):
    rng = random.Random(seed)
    tree = TREES[name](rng)
    responses, paths, ends = with_padding_rows(tree, rng)
    return tree, responses, paths, ends


@pytest.mark.parametrize("name", list(TREES))
def test_packed_log_probs_and_gradients_match_rows_float64(name, exact_rmsnorm):
    model = tiny_model(torch.float64)
    tree, responses, paths, ends = _rows_for(name, 11)
    prompts = [tree.prompt] * len(responses)
    packed = pack_rows(prompts, responses, ends)
    packed_lp = packed_row_log_probs(model, packed, chunk_tokens=7)  # several chunks
    rows_lp = row_log_probs(model, prompts, responses, ends, packed.response_width)
    assert packed_lp.shape == rows_lp.shape
    assert (packed_lp - rows_lp).abs().max().item() < 1e-12
    valid = packed.response_index >= 0
    assert (packed_lp[~valid] == 0).all()

    # (a) SPO's trained mask: every segment trained by exactly one row.
    rewards = torch.tensor([float(b % 3) for b in range(len(responses))], dtype=torch.float64)
    result = tree_token_advantages([None if p is None else "t" for p in paths], paths, ends, rewards, valid.long(),
                                   drop_zero_advantage=False)
    trained = result.trained_mask
    assert int(trained.sum()) == tree.unique_tokens - len(tree.prompt)
    generator = torch.Generator().manual_seed(3)
    weights_once = torch.randn(valid.shape, generator=generator, dtype=torch.float64) * trained
    # (b) every row's tokens count (shared tokens collect the weights of all rows through them).
    weights_all = torch.randn(valid.shape, generator=generator, dtype=torch.float64) * valid
    for weights in (weights_once, weights_all):
        packed_grads = param_grads(model, (packed_row_log_probs(model, packed) * weights).sum())
        rows_again = row_log_probs(model, prompts, responses, ends, packed.response_width)
        row_grads = param_grads(model, (rows_again * weights).sum())
        diff, scale = max_grad_diff(packed_grads, row_grads)
        assert scale > 1e-3
        assert diff < 1e-10, diff


@pytest.mark.parametrize("weighting", ["segment", "paths", "sqrt_paths"])
@pytest.mark.parametrize("name", ["2-2-2 variable", "3-3 early EOS"])
def test_the_loss_of_every_segment_weighting_matches_rows_float64(name, weighting, exact_rmsnorm):
    """SPO's reference loss (whitening, clipped ratio, mean over the probability-masked trained tokens)
    on each weighting's advantages and trained mask: loss and parameter gradients of the packed forward
    equal the per-row forward's, a segment trained by several rows included."""
    from spo_verl.core.algorithms.masked_loss import reference_policy_loss

    model = tiny_model(torch.float64, seed=4)
    tree, responses, paths, ends = _rows_for(name, 13)
    prompts = [tree.prompt] * len(responses)
    packed = pack_rows(prompts, responses, ends)
    valid = packed.response_index >= 0
    rewards = torch.tensor([float(b % 3) for b in range(len(responses))], dtype=torch.float64)
    result = tree_token_advantages([None if p is None else "t" for p in paths], paths, ends, rewards, valid.long(),
                                   zero_untrained=True, segment_weight=weighting)
    trained = result.trained_mask
    if weighting != "segment":  # a shared segment trained in several rows
        assert int(trained.sum()) > tree.unique_tokens - len(tree.prompt)
    with torch.no_grad():
        old = packed_row_log_probs(model, packed) + 0.3 * torch.randn(valid.shape, dtype=torch.float64,
                                                                      generator=torch.Generator().manual_seed(5))
    probability_mask = trained & (old.exp() < 0.9)

    def loss_of(log_probs):
        return reference_policy_loss(log_probs, old, result.token_advantages, probability_mask).loss

    packed_loss = loss_of(packed_row_log_probs(model, packed))
    rows_loss = loss_of(row_log_probs(model, prompts, responses, ends, packed.response_width))
    assert abs(packed_loss.item() - rows_loss.item()) < 1e-12
    packed_grads = param_grads(model, loss_of(packed_row_log_probs(model, packed)))
    row_grads = param_grads(model, loss_of(row_log_probs(model, prompts, responses, ends, packed.response_width)))
    diff, scale = max_grad_diff(packed_grads, row_grads)
    assert scale > 1e-4
    assert diff < 1e-10, diff


def test_llama_with_a_tied_head_matches_rows_float64(exact_rmsnorm):
    model = tiny_llama(torch.float64)
    tree, responses, paths, ends = _rows_for("3-3 early EOS", 5)
    packed = pack_rows([tree.prompt] * len(responses), responses, ends)
    packed_lp = packed_row_log_probs(model, packed, chunk_tokens=7)
    rows_lp = row_log_probs(model, [tree.prompt] * len(responses), responses, ends, packed.response_width)
    assert (packed_lp - rows_lp).abs().max().item() < 1e-12
    weights = torch.randn(rows_lp.shape, dtype=torch.float64) * (packed.response_index >= 0)
    diff, largest = grad_diff_of(model, packed_lp, rows_lp, weights)
    assert largest > 0 and diff < 1e-10


def test_forest_and_temperature_match_rows_float64(exact_rmsnorm):
    model = tiny_model(torch.float64, seed=1)
    rng = random.Random(9)
    trees = [tree_2_2_2(rng), tree_3_3_early(rng), tree_one_leaf(rng)]
    prompts, responses, ends = [], [], []
    for tree in trees:
        for response, row_ends in zip(tree.responses, tree.ends):
            prompts.append(tree.prompt)
            responses.append(response)
            ends.append(row_ends)
    order = list(range(len(responses))) + [None, None]
    rng.shuffle(order)  # rows of different trees interleaved, two padding rows among them
    pick = lambda xs: [None if i is None else xs[i] for i in order]  # noqa: E731
    prompts, responses, ends = map(pick, (prompts, responses, ends))
    responses = padded(responses, rng)
    packed = pack_rows(prompts, responses, ends, response_width=40)
    assert packed.response_width == 40
    packed_lp = packed_row_log_probs(model, packed, temperature=0.7)
    rows_lp = row_log_probs(model, prompts, responses, ends, 40, temperature=0.7)
    assert (packed_lp - rows_lp).abs().max().item() < 1e-12
    weights = torch.randn(packed_lp.shape, dtype=torch.float64) * (packed.response_index >= 0)
    diff, _ = grad_diff_of(model, packed_lp, rows_lp, weights)
    assert diff < 1e-10


def test_packed_matches_rows_float32():
    model = tiny_model(torch.float32, seed=2)
    tree, responses, paths, ends = _rows_for("2-2-2 variable", 21)
    prompts = [tree.prompt] * len(responses)
    packed = pack_rows(prompts, responses, ends)
    packed_lp = packed_row_log_probs(model, packed)
    rows_lp = row_log_probs(model, prompts, responses, ends, packed.response_width)
    assert (packed_lp - rows_lp).abs().max().item() < 1e-5
    weights = torch.randn(packed_lp.shape) * (packed.response_index >= 0)
    diff, scale = grad_diff_of(model, packed_lp, rows_lp, weights)
    assert diff < 1e-5 * scale


def test_float64_gradients_without_rmsnorm_patch_are_float32_close():
    """Documents why the float64 tests patch RMSNorm: unpatched, log-probs still agree to ~1e-15, but
    the gradients only to float32 precision."""
    model = tiny_model(torch.float64, seed=3)
    tree, responses, paths, ends = _rows_for("2-2-2 variable", 31)
    prompts = [tree.prompt] * len(responses)
    packed = pack_rows(prompts, responses, ends)
    packed_lp = packed_row_log_probs(model, packed)
    rows_lp = row_log_probs(model, prompts, responses, ends, packed.response_width)
    assert (packed_lp - rows_lp).abs().max().item() < 1e-12
    weights = torch.randn(packed_lp.shape, dtype=torch.float64) * (packed.response_index >= 0)
    diff, scale = grad_diff_of(model, packed_lp, rows_lp, weights)
    assert 0 < diff < 1e-6 * scale


# ---------------------------------------------------------------------------------------------------
# Cascade attention: no N x N tensor, GQA, one SDPA call per group per layer


def test_cascade_never_builds_a_packed_square(monkeypatch, exact_rmsnorm):
    model = tiny_model(torch.float64, seed=4)
    rng = random.Random(13)
    tree = Tree(rng, (3, 2, 2), lambda d, r: r.randint(2, 6), early_stop={(1,)})
    packed = pack_rows([tree.prompt] * len(tree.responses), padded(tree.responses, rng), tree.ends)
    n = packed.num_packed_tokens
    pairs = {(int(q), int(k)) for q, k in zip(packed.node_lengths, packed.node_path_lengths())}
    layout = build_cascade_layout(packed)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), attn_mask))
        assert (q.shape[-2], k.shape[-2]) in pairs  # one node's queries x that node's path keys
        # No mask tensor at all: plain causal, or torch's bottom-right CausalBias of this node's shape.
        assert attn_mask is None or (isinstance(attn_mask, CausalBias) and attn_mask.variant == CausalVariant.LOWER_RIGHT
                                     and (attn_mask.seq_len_q, attn_mask.seq_len_kv) == (q.shape[-2], k.shape[-2]))
        assert attn_mask is not None or kwargs.get("is_causal")
        assert k.shape[1] == 2 and q.shape[1] == 4 and kwargs.get("enable_gqa")  # GQA without repeating K/V
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    real_create_causal_mask = modeling_qwen2.create_causal_mask

    def no_mask(*args, **kwargs):
        mask = real_create_causal_mask(*args, **kwargs)
        assert mask is None, "the packed forward must not build a causal mask over the packed sequence"
        return mask

    monkeypatch.setattr(cascade_module, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(modeling_qwen2, "create_causal_mask", no_mask)
    lp = packed_row_log_probs(model, packed, layout=layout)
    lp.sum().backward()
    assert len(calls) == model.config.num_hidden_layers * len(layout.groups)
    largest = max(q[0] * q[2] * k[2] for q, k, _ in calls)  # batched scores per call (nodes x q x kv)
    assert largest < n * n
    assert max(q[2] * k[2] for q, k, _ in calls) <= max(a * b for a, b in pairs)
    # Groups cover each node once.
    assert sorted(int(x) for g in layout.groups for x in g.nodes) == list(range(packed.num_nodes))


def test_gradient_checkpointing_replays_the_cascade(exact_rmsnorm):
    """With gradient checkpointing the layers re-run in backward: the model must be switched to the
    cascade attention for the whole step (a forward-only switch is refused), and then it is exact."""
    from spo_verl.core.packing import CASCADE_ATTENTION, register_cascade_attention

    model = tiny_model(torch.float64, seed=5)
    tree, responses, paths, ends = _rows_for("3-3 early EOS", 41)
    prompts = [tree.prompt] * len(responses)
    packed = pack_rows(prompts, responses, ends)
    rows_lp = row_log_probs(model, prompts, responses, ends, packed.response_width)
    weights = torch.randn(rows_lp.shape, dtype=torch.float64) * (packed.response_index >= 0)
    row_grads = param_grads(model, (rows_lp * weights).sum())

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing is active in training mode only (attention dropout is 0)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        packed_row_log_probs(model, packed)
    register_cascade_attention()
    model.config._attn_implementation = CASCADE_ATTENTION
    packed_lp = packed_row_log_probs(model, packed)
    assert (packed_lp - rows_lp).abs().max().item() < 1e-12
    diff, _ = max_grad_diff(param_grads(model, (packed_lp * weights).sum()), row_grads)
    assert diff < 1e-10


# ---------------------------------------------------------------------------------------------------
# Rows packed by their tokens alone (pack_sequences: what verl's engine packs, for every algorithm)


def mixed_rows(rng, vocab=VOCAB):
    """(sequences, prompt lengths) of what one micro-batch may hold: two GRPO groups whose prompts start
    with a common few-shot preamble, responses sharing first tokens, an early EOS (1 token) and a row
    that is a prefix of another; an SPO tree (2-2, segment metadata ignored); two identical verl
    padding rows; a row that shares nothing."""
    draw = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    preamble = draw(9)
    sequences, prompts = [], []
    for _ in range(2):
        prompt = preamble + draw(rng.randint(2, 4))
        opening = draw(2)
        responses = [opening + draw(5), opening + draw(3), draw(1), opening + draw(4)]
        responses.append(responses[0][:4])  # a row that is a prefix of another row
        for response in responses:
            sequences.append(prompt + response)
            prompts.append(len(prompt))
    tree = tree_2_2(rng)
    for response, row_ends in zip(tree.responses, tree.ends):
        sequences.append(preamble + tree.prompt + response[: row_ends[-1]])
        prompts.append(len(preamble) + len(tree.prompt))
    for _ in range(2):
        sequences.append([0, 0, 0, 0])
        prompts.append(3)
    alone = draw(6)
    sequences.append(alone)
    prompts.append(2)
    order = list(range(len(sequences)))
    rng.shuffle(order)
    return [sequences[i] for i in order], [prompts[i] for i in order]


def distinct_prefixes(sequences) -> int:
    return len({tuple(s[: i + 1]) for s in sequences for i in range(len(s))})


def split_rows(sequences, prompt_lengths):
    """The per-row reference's inputs: prompts, responses and one segment end per row."""
    prompts = [s[:p] for s, p in zip(sequences, prompt_lengths)]
    responses = [s[p:] for s, p in zip(sequences, prompt_lengths)]
    return prompts, responses, [[len(r)] for r in responses]


def test_pack_sequences_shares_every_common_prefix_once():
    sequences, prompt_lengths = mixed_rows(random.Random(4))
    packed = pack_sequences(sequences, prompt_lengths)
    assert packed.num_packed_tokens == distinct_prefixes(sequences)
    assert packed.num_row_tokens == sum(map(len, sequences))
    assert packed.num_packed_tokens < 0.6 * packed.num_row_tokens
    assert all(int(packed.node_parents[k]) < k for k in range(1, packed.num_nodes))
    for b, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths)):
        index = packed.row_index[b, : len(sequence)]
        assert packed.input_ids[index].tolist() == sequence
        assert packed.position_ids[index].tolist() == list(range(len(sequence)))
        assert packed.previous_position[index[1:]].tolist() == index[:-1].tolist()
        assert packed.response_index[b, : len(sequence) - prompt_length].tolist() == index[prompt_length:].tolist()
        assert (packed.response_index[b, len(sequence) - prompt_length:] == -1).all()
    # A tree's rows packed by their tokens share at least what their metadata says they share.
    tree = tree_2_2(random.Random(8))
    rows = [tree.prompt + r[: e[-1]] for r, e in zip(tree.responses, tree.ends)]
    by_tokens = pack_sequences(rows, [len(tree.prompt)] * len(rows))
    assert by_tokens.num_packed_tokens == distinct_prefixes(rows) <= tree.unique_tokens
    with pytest.raises(ValueError, match="prompt length 5 outside its 3 tokens"):
        pack_sequences([[1, 2, 3]], [5])


def test_pack_sequences_matches_rows_float64(exact_rmsnorm):
    model = tiny_model(torch.float64, seed=4)
    sequences, prompt_lengths = mixed_rows(random.Random(6))
    packed = pack_sequences(sequences, prompt_lengths)
    prompts, responses, ends = split_rows(sequences, prompt_lengths)
    for temperature in (1.0, 0.7):
        packed_lp = packed_row_log_probs(model, packed, temperature=temperature, chunk_tokens=5)
        rows_lp = row_log_probs(model, prompts, responses, ends, packed.response_width, temperature=temperature)
        assert (packed_lp - rows_lp).abs().max().item() < 1e-12
    weights = torch.randn(packed_lp.shape, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(2)) * (packed.response_index >= 0)
    diff, largest = grad_diff_of(model, packed_row_log_probs(model, packed), row_log_probs(
        model, prompts, responses, ends, packed.response_width), weights)
    assert largest > 1e-3 and diff < 1e-10


def test_pack_sequences_in_bfloat16_is_as_close_to_float32_as_rows_are():
    """bfloat16 (verl's GPU precision): the packed forward computes the same values in another order
    (gathered keys, other matmul shapes), so it differs from the per-row bfloat16 forward by bfloat16
    rounding, and from float32 by no more than the per-row bfloat16 forward does (within 1.5x)."""
    model = tiny_model(torch.float32, seed=5)
    sequences, prompt_lengths = mixed_rows(random.Random(7))
    packed = pack_sequences(sequences, prompt_lengths)
    prompts, responses, ends = split_rows(sequences, prompt_lengths)
    valid = packed.response_index >= 0
    reference = row_log_probs(model, prompts, responses, ends, packed.response_width)
    model.to(torch.bfloat16)
    packed_lp = packed_row_log_probs(model, packed)
    rows_lp = row_log_probs(model, prompts, responses, ends, packed.response_width)
    packed_error = (packed_lp - reference)[valid].abs().max().item()
    rows_error = (rows_lp - reference)[valid].abs().max().item()
    between = (packed_lp - rows_lp)[valid].abs().max().item()
    print(f"bf16: packed-fp32 {packed_error:.3g}, rows-fp32 {rows_error:.3g}, packed-rows {between:.3g}")
    assert rows_error > 1e-4  # bfloat16 really ran
    assert packed_error < 1.5 * rows_error + 1e-3
    assert between < 0.1
