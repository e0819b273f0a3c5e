"""Segment partitions of one response (docs/FIDELITY.md). Plain Python, the readable reference."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from spo_verl.core.config import check_positive_int, check_probability


def low_probability_positions(token_probs: Sequence[float], threshold: float = 0.9) -> list[int]:
    """Indices t with p_t < threshold: the places where the policy could have branched."""
    check_probability("threshold", threshold)
    return [t for t, p in enumerate(token_probs) if p < threshold]


def cutpoint_segment_starts(token_probs: Sequence[float], threshold: float = 0.9, interval: int = 5) -> list[int]:
    """Start index of each SPO-chain segment.

    Every ``interval``-th low-probability token starts a segment, beginning with the first one;
    no low-probability token means no segment (all advantages 0).
    """
    return select_cutpoints(low_probability_positions(token_probs, threshold), interval)


def select_cutpoints(low_positions: Sequence[int], interval: int = 5) -> list[int]:
    """Every ``interval``-th of the low-probability positions, beginning with the first."""
    return list(low_positions)[:: check_positive_int("interval", interval)]


def cut_by_length_limit(token_ids: Sequence[int], max_tokens: int, eos_token_ids: Collection[int]) -> bool:
    """Whether a generation was cut by its token budget: it used all ``max_tokens`` tokens and the last
    one is not EOS. (verl's server reports "completed" for both EOS and the length limit.)"""
    return len(token_ids) >= max_tokens and bool(token_ids) and token_ids[-1] not in eos_token_ids


def length_without_final_eos(token_ids: Sequence[int], eos_token_ids: Collection[int]) -> int:
    """The response's length less a final EOS: the reference strips EOS from its responses, so a final
    EOS is never a cutpoint (SPO-chain) or a fork (the cutpoint tree)."""
    return len(token_ids) - 1 if token_ids and token_ids[-1] in eos_token_ids else len(token_ids)


def fixed_count_segment_starts(num_tokens: int, num_segments: int) -> list[int]:
    """Split ``num_tokens`` into ``num_segments`` near-equal chunks (longer chunks first).

    Fewer tokens than segments gives one segment per token; an empty response gives none.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
    count = min(check_positive_int("num_segments", num_segments), num_tokens)
    if count == 0:
        return []
    base, extra = divmod(num_tokens, count)
    starts, position = [], 0
    for j in range(count):
        starts.append(position)
        position += base + (1 if j < extra else 0)
    return starts


def delimiter_segment_starts(token_ids: Sequence[int], delimiter_ids: Collection[int]) -> list[int]:
    """Reasoning-step partition (VinePPO style, the paper).

    The first segment starts at token 0 and every token right after a delimiter token (e.g. the
    id of a blank line) starts a new one; a trailing delimiter opens no empty segment.
    """
    if not token_ids:
        return []
    delimiters = set(delimiter_ids)
    starts = [0]
    starts.extend(t + 1 for t, token in enumerate(token_ids[:-1]) if token in delimiters)
    return starts
