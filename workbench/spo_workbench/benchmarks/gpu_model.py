"""The GPU check's model: a randomly initialised Qwen2 of DeepSeek-R1-Distill-Qwen-1.5B's shape (the
``math-r1-1.5b`` setting's model), built on the device with nothing downloaded, computing as verl's
FSDP2 actor does; the parameter-gradient sums both sides of a comparison are read from; and the
device-synchronised call every timed measurement goes through.

Sizes, from the published ``config.json`` of Qwen2-1.5B / Qwen2.5-1.5B / DeepSeek-R1-Distill-Qwen-1.5B:
hidden 1536, 28 layers, 12 attention heads (head_dim 128), 2 KV heads, MLP 8960, vocabulary 151,936,
RMSNorm eps 1e-6, full attention. R1-Distill's output head is untied and its RoPE theta 10,000 (Qwen2-
1.5B ties the head and uses 1e6); the untied head is the cluster's model: 1.78 B parameters.
"""

from __future__ import annotations

import torch

QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 10000.0})
# The dry run: the same architecture (GQA 2:1, untied head) small enough for seconds on a CPU.
DRY_RUN = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# The tests' tiny model scales its head to this logit std (recipe/spo/cpu_settings/tiny_model.py): a plain
# random init predicts nearly uniformly over 151,936 tokens, where rounding barely moves a log-prob.
LOGIT_STD = 2.5


def build_model(sizes: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """``Qwen2ForCausalLM`` with ``sizes``, parameters in ``dtype`` on ``device`` (buffers such as RoPE's
    inverse frequencies stay float32, as under FSDP2's mixed precision), head scaled to :data:`LOGIT_STD`,
    gradient checkpointing on (verl's default), training mode (no dropout in Qwen2)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**sizes, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: no 7 GB of float32 weights through the host
        model = Qwen2ForCausalLM(config)
    model.to(device)
    _scale_head(model, seed)
    set_parameter_dtype(model, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@torch.no_grad()
def _scale_head(model, seed: int) -> None:
    device = model.lm_head.weight.device
    generator = torch.Generator(device="cpu").manual_seed(seed + 1)
    ids = torch.randint(model.config.vocab_size, (1, 256), generator=generator).to(device)
    hidden = model.model(input_ids=ids).last_hidden_state[0]
    model.lm_head.weight.mul_(LOGIT_STD / model.lm_head(hidden).float().std().item())


def set_parameter_dtype(model, dtype: torch.dtype) -> None:
    """Parameters only (``model.to(dtype)`` would also round the float32 RoPE buffers). bfloat16 to
    float32 and back is exact, so the float32 reference runs the very weights the bfloat16 sides run."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
        parameter.grad = None


class GradientSum:
    """float32 sums of the parameters' gradients over one pass's backward calls: verl's FSDP reduces
    each micro-batch's bfloat16 gradients into float32, so a pass over many row micro-batches is not
    rounded to bfloat16 at every addition."""

    def __init__(self, model):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.parameters]

    def zero(self) -> None:
        for total in self.sums:
            total.zero_()

    def fold(self) -> None:
        """Add the gradients of the last backward and clear them."""
        for parameter, total in zip(self.parameters, self.sums):
            if parameter.grad is not None:
                total.add_(parameter.grad)
                parameter.grad = None


def gradient_differences(a: GradientSum, b: GradientSum) -> dict[str, float]:
    """Largest |a - b| over all parameters, largest |b|, and ||a - b|| / ||b|| over all of them."""
    diff_max = scale = 0.0
    diff_sq = norm_sq = 0.0
    for x, y in zip(a.sums, b.sums):
        delta = x - y
        diff_max = max(diff_max, delta.abs().max().item())
        scale = max(scale, y.abs().max().item())
        diff_sq += torch.linalg.vector_norm(delta, dtype=torch.float64).item() ** 2
        norm_sq += torch.linalg.vector_norm(y, dtype=torch.float64).item() ** 2
    return {"max_abs_diff": diff_max, "max_abs": scale, "rel_diff": (diff_sq / norm_sq) ** 0.5 if norm_sq else 0.0}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_call(call, device: torch.device, peaks: list[float]):
    """``call`` ending with a device synchronisation, so a timer around it holds the GPU's work; its
    peak memory above what was allocated just before it is appended to ``peaks`` (GiB; CUDA only:
    torch keeps no allocator statistics on the CPU)."""

    def run():
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        result = call()
        synchronize(device)
        if cuda:
            peaks.append((torch.cuda.max_memory_allocated(device) - base) / 2**30)
        return result

    return run
