"""SPO settings: one namespace, ``algorithm.spo.*``, with the paper's defaults (docs/FIDELITY.md).

No verl import: parsing a mapping (a dict or an OmegaConf node) into frozen dataclasses, with an
error that names the key and the allowed values for anything invalid. verl adapters call
``parse_spo_settings`` at configuration time, before any GPU time is spent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

NAMESPACE = "algorithm.spo"
LOSS_NORMALIZATIONS = ("reference", "verl")
CHAIN_PARTITIONS = ("cutpoint", "fixed_count", "delimiter", "turn")
TRUNCATED_RESPONSE_SCORES = ("zero", "reward_function")
TREE_BRANCH_POINTS = ("fixed", "cutpoint", "turn")
TREE_SEGMENT_WEIGHTS = ("segment", "paths", "sqrt_paths")


class SPOConfigError(ValueError):
    """An ``algorithm.spo.*`` setting is invalid."""


def _fail(key: str, allowed: str, value: Any) -> SPOConfigError:
    return SPOConfigError(f"{key} must be {allowed}, got {value!r}")


def check_probability(key: str, value: Any) -> float:
    """``value`` as a probability threshold in (0, 1], or an error naming ``key``: the one rule for every
    threshold, the settings' and the maths' arguments alike."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise _fail(key, "a number in (0, 1]", value)
    return float(value)


def check_positive_int(key: str, value: Any) -> int:
    """``value`` as a positive integer, or an error naming ``key`` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(key, "a positive integer", value)
    return value


def _choice(allowed: Sequence[str]):
    def check(key: str, value: Any) -> str:
        if value not in allowed:
            raise _fail(key, f"one of {list(allowed)}", value)
        return value

    return check


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, "true or false", value)
    return value


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(key, "a non-empty string", value)
    return value


def _positive_int_list(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) == 0:
        raise _fail(key, "a non-empty list of positive integers", value)
    return tuple(check_positive_int(f"{key}[{i}]", item) for i, item in enumerate(value))


def _optional_text(key: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise _fail(key, "a non-empty string or null", value)
    return value


def _optional_positive_int(key: str, value: Any) -> int | None:
    return None if value is None else check_positive_int(key, value)


def _optional_probability(key: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        return check_probability(key, value)
    except ValueError:
        raise _fail(key, "a number in (0, 1], or null", value) from None


def _int_or_int_list(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (check_positive_int(key, value),)
    return _positive_int_list(key, value)


def setting(default: Any, check: Callable[[str, Any], Any]) -> Any:
    """A setting's field: its default and the check that turns a raw value into it, or an error naming the
    setting and the values it allows."""
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class ProbMaskSettings:
    """The probability mask of the policy loss.

    normalization:
      ``reference``: as the SPO reference code, per micro-batch: advantages whitened over the
      masked-in tokens, PPO-clip averaged over the masked-in tokens, k3 KL to the reference model
      summed over masked-in tokens and averaged over sequences. Micro-batches are combined by their
      share of the mini-batch's response tokens (verl's global normalisation).
      ``verl``: verl's ``vanilla`` PPO loss and aggregation (``actor.loss_agg_mode``) with the
      advantage of masked-out tokens set to 0; advantages as the estimator gave them; verl's KL
      loss over all response tokens. The denominator stays verl's global response-token count, so
      the step shrinks with the masked-in fraction.
    """

    threshold: float | None = setting(0.9, _optional_probability)
    normalization: str = setting("reference", _choice(LOSS_NORMALIZATIONS))


@dataclass(frozen=True)
class ChainSettings:
    """SPO-chain; the paper's headline is cutpoint int5 with 9 MC samples.

    ``max_boundaries`` caps the MC-estimated boundaries of one response and
    ``max_mc_tokens_per_response`` the tokens its continuations may generate (``mc_samples`` times the
    room left after each boundary, counted from the first boundary on); null means no cap. Segments
    past a cap merge into the last kept one, and ``spo/chain/capped_responses`` counts it. Together they
    bound the MC tokens of a step by ``train_batch_size * rollout.n`` times the per-response cap.
    """

    partition: str = setting("cutpoint", _choice(CHAIN_PARTITIONS))
    cutpoint_threshold: float = setting(0.9, check_probability)
    cutpoint_interval: int = setting(5, check_positive_int)
    num_segments: int = setting(4, check_positive_int)
    delimiter: str = setting("\n\n", _text)
    mc_samples: int = setting(9, check_positive_int)
    max_boundaries: int | None = setting(None, _optional_positive_int)
    max_mc_tokens_per_response: int | None = setting(None, _optional_positive_int)


@dataclass(frozen=True)
class CutpointTreeSettings:
    """SPO-tree with ``branch_at: cutpoint``: a tree that forks where the model is uncertain.

    Per prompt, ``responses`` whole responses are sampled. On each, the fork points are its cutpoints
    as SPO-chain finds them (tokens with p < ``threshold`` under softmax(logits / T), every
    ``interval``-th, a final EOS never), at most ``max_forks`` of them; from the prefix just before
    each fork token ``width`` continuations are sampled to the end. A path sampled in forking round r
    forks again while r < ``rounds`` (the first responses are round 0). A prompt has at most
    ``responses * sum((max_forks * width) ** r for r in 0..rounds)`` leaves, which must fit
    ``actor_rollout_ref.rollout.n``.
    """

    responses: int = setting(4, check_positive_int)
    width: int = setting(2, check_positive_int)
    max_forks: int = setting(2, check_positive_int)
    rounds: int = setting(1, check_positive_int)
    threshold: float = setting(0.9, check_probability)
    interval: int = setting(5, check_positive_int)



@dataclass(frozen=True)
class TreeSettings:
    """SPO-tree; the paper's headline is 6-6-6 with 600-token segments on MATH.

    ``segment_tokens`` is the token budget of each depth but the last (which runs to EOS or the
    response limit): one number for every depth, or one per depth.
    ``max_trained_segments_per_prompt``: null trains every segment once (on-policy); a number trains at
    most that many segments per prompt, drawn at random, and leaves the rest out of the actor update
    (the reference samples 32 per prompt and keeps the rest in a replay buffer for later steps).
    ``align_to_block``: null, or the rollout engine's KV-cache block size (vLLM's ``block_size``). Each
    depth's budget is then lengthened by less than a block so that a child's prefix (prompt and
    parent segments) ends one token past a block boundary. vLLM shares only whole cached blocks and
    always recomputes a prompt's last token, so each child then recomputes one prompt token instead of
    up to a block.
    ``branch_at``: ``fixed`` forks every node into ``branching`` children after ``segment_tokens``
    tokens; ``cutpoint`` forks at the model's low-probability tokens (``cutpoint``:
    :class:`CutpointTreeSettings`; ``branching``, ``segment_tokens`` and ``align_to_block`` are unused);
    ``turn`` forks a multi-turn episode between the model's turns (``turns``: :class:`TurnSettings`): each
    of the first ``len(branching) - 1`` depths is one turn and the environment's reply, the last depth the
    rest of the episode (``segment_tokens`` and ``align_to_block`` are unused).
    ``segment_weight``: how much each segment counts in the loss. ``segment`` (the paper's): each segment
    once, in the one row that owns it. ``paths``: each segment as often as sampled leaf paths run through
    it, i.e. every leaf row trained whole, as GRPO trains its responses (the expected update is then a
    multiple of the policy gradient in a tree whose leaves all reach the last depth). ``sqrt_paths``:
    every leaf row trained whole with a shared segment's advantage divided by the square root of its
    paths, so it counts ``sqrt(paths)`` times (TreeRL's reweighting).
    """

    branching: tuple[int, ...] = setting((6, 6, 6), _positive_int_list)
    segment_tokens: tuple[int, ...] = setting((600, 600), _int_or_int_list)
    std_normalize: bool = setting(False, _boolean)
    drop_zero_advantage: bool = setting(True, _boolean)
    max_trained_segments_per_prompt: int | None = setting(None, _optional_positive_int)
    align_to_block: int | None = setting(None, _optional_positive_int)
    branch_at: str = setting("fixed", _choice(TREE_BRANCH_POINTS))
    cutpoint: CutpointTreeSettings = field(default_factory=CutpointTreeSettings)
    segment_weight: str = setting("segment", _choice(TREE_SEGMENT_WEIGHTS))


@dataclass(frozen=True)
class TurnSettings:
    """Multi-turn episodes (``algorithm.spo.chain.partition=turn``): each of the model's turns is a segment,
    its value the Monte Carlo mean of continuing the dialogue from its start.

    ``environment``: what answers the model's turns (``spo_verl.core.episodes.environment``): a
    registered name or ``module:attribute``. ``max_turns``: the model's turns an episode may have; one
    that the environment has not ended by then scores 0. ``max_turn_tokens``: the most tokens of one
    turn (a turn that reaches it ends there and goes to the environment as it is); null: what is left of
    the response length.
    """

    environment: str | None = setting(None, _optional_text)
    max_turns: int = setting(8, check_positive_int)
    max_turn_tokens: int | None = setting(None, _optional_positive_int)


@dataclass(frozen=True)
class SampleLogSettings:
    """A few trained responses per step, written for people to look at (``spo_verl.adapters.trainer.sample_log``).

    ``dir``: a folder; the driver appends one JSON line per training step to ``<dir>/samples.jsonl``
    (decoded tokens, probabilities, probability mask, segments, advantages, and for SPO-tree the tree
    with each node's value and advantage). null writes nothing.
    ``responses_per_step``: responses logged per step (spo_chain, grpo, ...); spo_tree logs the whole
    tree of one prompt instead (every leaf of it).
    """

    dir: str | None = setting(None, _optional_text)
    responses_per_step: int = setting(4, check_positive_int)


@dataclass(frozen=True)
class DiagnosticsSettings:
    """What a run records for people to look at, besides verl's own metrics; none of it changes training.

    ``sample_log``: :class:`SampleLogSettings`.
    ``credit_metrics``: each step, where each wrong answer's negative advantage falls relative to its
    first wrong step (``spo/credit/*``), for tasks whose answers work a generated sum one equation a
    step (``spo_verl.core.credit.answer_errors``; answers it cannot place are counted, not measured).
    """

    sample_log: SampleLogSettings = field(default_factory=SampleLogSettings)
    credit_metrics: bool = setting(False, _boolean)


@dataclass(frozen=True)
class BudgetSettings:
    """``generated_tokens``: stop training once the rollout has generated this many tokens (each tree node
    once, chains with their Monte Carlo continuations; ``spo/generated_tokens``), so that algorithms are
    compared at equal sampling cost: the step that is expected to reach it (from the previous step's
    count) is the last, with verl's final validation and checkpoint. null: verl's
    ``trainer.total_training_steps``/``total_epochs`` alone decide.
    """

    generated_tokens: int | None = setting(None, _optional_positive_int)


@dataclass(frozen=True)
class PackingSettings:
    """``enable``: the actor and reference forwards run each micro-batch as one packed sequence in which
    every prefix its rows share (a prompt and its ``rollout.n`` responses, an SPO tree's segments, a
    preamble common to all prompts) is computed once (``spo_verl.core.packing``), for every algorithm;
    the results equal the per-row forwards. ``chunk_tokens``: hidden states projected to the vocabulary
    at a time. ``max_token_ratio``: a micro-batch whose packed tokens exceed this share of its row tokens
    runs verl's per-row forward instead (packing it would cost more than it saves). ``check``: in the
    first actor update, also run each packed micro-batch per row (no gradient) and log how far the packed
    log-probs and loss are from it (``spo/packing/check/*``).
    """

    enable: bool = setting(False, _boolean)
    chunk_tokens: int = setting(4096, check_positive_int)
    max_token_ratio: float = setting(0.9, check_probability)
    check: bool = setting(False, _boolean)


@dataclass(frozen=True)
class SPOSettings:
    """The SPO maths (``prob_mask``, ``chain``, ``tree``, ``turns``, ``truncated_response_score``), then how a
    run is executed and observed (``packing``, ``budget``, ``diagnostics``).

    ``truncated_response_score``: what a response cut by the length limit (no EOS at the end of its
    token budget) scores, for the trajectory reward R of SPO-chain and SPO-tree rows and for the Monte
    Carlo continuations that estimate SPO-chain's boundary values V, so V and R stay on one scale.
    ``zero``: 0, as the SPO reference scores an unfinished response. ``reward_function``: what the
    row's reward function gives the truncated text (verl's behaviour).
    """

    prob_mask: ProbMaskSettings = field(default_factory=ProbMaskSettings)
    chain: ChainSettings = field(default_factory=ChainSettings)
    tree: TreeSettings = field(default_factory=TreeSettings)
    turns: TurnSettings = field(default_factory=TurnSettings)
    truncated_response_score: str = setting("zero", _choice(TRUNCATED_RESPONSE_SCORES))
    packing: PackingSettings = field(default_factory=PackingSettings)
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    diagnostics: DiagnosticsSettings = field(default_factory=DiagnosticsSettings)


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def parse_section(cls: type, raw: Any, prefix: str) -> Any:
    """A settings dataclass ``cls`` from ``raw`` (a mapping, an OmegaConf node or None for its defaults), each
    key checked and named under ``prefix`` in any error."""
    raw = _plain(raw)
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise _fail(prefix, "a mapping", raw)
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise SPOConfigError(f"unknown setting(s) {[f'{prefix}.{k}' for k in unknown]}; {prefix} accepts {names}")
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        key = f"{prefix}.{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            values[f.name] = parse_section(type(default), raw[f.name], key)
        else:
            values[f.name] = f.metadata["check"](key, raw[f.name])
    return cls(**values)


def _check_tree_shape(tree: TreeSettings) -> None:
    if tree.branch_at == "turn":  # a turn is as long as it is: segment_tokens is unused
        return
    inner_depths = len(tree.branching) - 1
    if len(tree.segment_tokens) not in (1, inner_depths) and inner_depths > 0:
        raise SPOConfigError(
            f"{NAMESPACE}.tree.segment_tokens must be one number or {inner_depths} numbers (one per depth but the "
            f"last of branching {list(tree.branching)}), got {list(tree.segment_tokens)}"
        )


def parse_spo_settings(raw: Mapping | None) -> SPOSettings:
    """``algorithm.spo`` (a dict, an OmegaConf node or None for all defaults) to validated settings."""
    settings = parse_section(SPOSettings, raw, NAMESPACE)
    _check_tree_shape(settings.tree)
    if settings.chain.partition == "turn" and settings.turns.environment is None:
        raise SPOConfigError(f"{NAMESPACE}.chain.partition=turn needs {NAMESPACE}.turns.environment: the environment "
                             f"that answers the model's turns (a registered name or module:attribute)")
    if settings.tree.branch_at == "turn":
        if settings.turns.environment is None:
            raise SPOConfigError(f"{NAMESPACE}.tree.branch_at=turn needs {NAMESPACE}.turns.environment: the environment "
                                 f"that answers the model's turns (a registered name or module:attribute)")
        if len(settings.tree.branching) > settings.turns.max_turns:
            raise SPOConfigError(f"{NAMESPACE}.tree.branching={list(settings.tree.branching)} with branch_at=turn branches "
                                 f"after {len(settings.tree.branching) - 1} turns and plays at least one more: raise "
                                 f"{NAMESPACE}.turns.max_turns ({settings.turns.max_turns}) or use fewer depths")
    return settings

