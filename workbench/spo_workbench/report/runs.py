"""Reading runs: verl's file-logger metrics and the sample log, and the numbers the report plots.

Per step (``StepRow``):
* training reward: ``critic/score/mean`` (verl's mean reward-function score of the step's responses);
* held-out accuracy: ``val-core/<data_source>/acc/mean@1`` (the first data source in sorted order
  when there are several; ``mean@N`` when validation samples N answers per prompt);
* generated tokens: everything the rollout generated for the step: ``spo/generated_tokens`` when the
  run logs it (``spo_verl.adapters.trainer.token_budget``, same definition), else from the metrics below.
  ``spo_tree``: ``spo/tree/generated_tokens`` (each tree's nodes, shared prefixes counted once);
  otherwise the step's response tokens, plus ``spo/chain/mc_tokens`` (the Monte Carlo continuations)
  for ``spo_chain``. verl logs no sum of response tokens; it is recovered exactly from three of its
  metrics over the same rows: rows = ``perf/total_num_tokens`` / (``prompt_length/mean`` +
  ``response_length/mean``) (rounded), response tokens = rows x ``response_length/mean``. (verl counts
  padding rows it adds for data-parallel balancing in ``perf/total_num_tokens`` but not in the means;
  the recipe's baselines never need any.)
* trained tokens: ``spo/trained_tokens`` (response tokens whose segment the step trains: non-zero
  advantage, each tree segment once), logged by the SPO estimators only; empty for verl's baselines;
* actor tokens per update: ``spo/packing/packed_tokens`` as verl logs it, with packed training only:
  the tokens the actor's forward and backward computed in one optimizer update (verl averages the
  packed engine's per-update sums over the step's updates and data-parallel ranks). Rows that train
  nothing are not computed and a prefix shared by several rows is computed once, so this is the
  actor's cost for every algorithm alike where they share the number of updates a step;
* multi-turn episodes: every ``spo/turns/*`` metric the step logged (turns and environment-reply tokens
  an episode, how episodes ended, SPO's values before each turn), by name without the prefix;
* wall time: ``timing_s/step``, and by phase verl's other ``timing_s/*`` timers (``PHASES``: generation,
  reward, old log-probs, advantages, actor update, weight sync, validation, checkpoint).
The algorithm is recognised from the metrics themselves (``spo/tree/*``, ``spo/chain/*``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from recipe.spo.metrics_log import merged_by_step
from spo_verl.adapters.trainer.sample_log import read_records

REWARD_KEY = "critic/score/mean"
WALL_TIME_KEY = "timing_s/step"
TIMING_PREFIX = "timing_s/"
# verl's step timers, in the order a step runs them; the step's other time is what none of them covers.
# Where each step's advantages put a wrong answer's blame (algorithm.spo.diagnostics.credit_metrics), by StepRow field.
CREDIT_KEYS = {"blame_on_error": "spo/credit/blame_on_error", "blame_on_error_masked": "spo/credit/blame_on_error_masked",
               "blame_on_error_net": "spo/credit/blame_on_error_net"}
PHASES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "testing", "save_checkpoint")
GENERATED_TOKENS_KEY = "spo/generated_tokens"  # spo_verl.adapters.trainer.token_budget, when the run logs it
TRAINED_TOKENS_KEY = "spo/trained_tokens"
ACTOR_TOKENS_KEY = "spo/packing/packed_tokens"
TURNS_PREFIX = "spo/turns/"
TREE_TOKENS_KEY = "spo/tree/generated_tokens"
CHAIN_MC_TOKENS_KEY = "spo/chain/mc_tokens"
ACCURACY_PREFIX, ACCURACY_SUFFIX = "val-core/", "/acc/mean@1"
_ANY_ACCURACY = re.compile(r"^val-core/.+/acc/mean@\d+$")


@dataclass
class StepRow:
    step: int
    generated_tokens: float | None
    cumulative_generated_tokens: float
    training_reward: float | None
    heldout_accuracy: float | None
    trained_tokens: float | None
    actor_tokens_per_update: float | None
    wall_time_s: float | None
    cumulative_wall_time_s: float
    monte_carlo_tokens: float | None = None  # SPO-chain's continuations, part of generated_tokens
    phase_s: dict[str, float] = field(default_factory=dict)  # PHASES that ran this step: seconds
    blame_on_error: float | None = None  # CREDIT_KEYS, where the step logged them
    blame_on_error_masked: float | None = None
    blame_on_error_net: float | None = None
    turns: dict[str, float] = field(default_factory=dict)  # spo/turns/<name>: value, where the step logged them


@dataclass
class Run:
    label: str
    metrics_path: Path
    samples_path: Path | None
    algorithm: str
    accuracy_key: str | None
    steps: list[StepRow]
    samples: list[dict] = field(default_factory=list)

    @property
    def group(self) -> str:
        """Runs labelled ``NAME/seed<k>`` are seeds of one group ``NAME``; any other label is its own."""
        return split_seed(self.label)[0]

    @property
    def seed(self) -> int | None:
        return split_seed(self.label)[1]


_SEEDED_LABEL = re.compile(r"^(?P<group>.+)/seed(?P<seed>\d+)$")


def split_seed(label: str) -> tuple[str, int | None]:
    match = _SEEDED_LABEL.match(label)
    return (match["group"], int(match["seed"])) if match else (label, None)




def accuracy_key(steps: dict[int, dict]) -> str | None:
    keys = sorted({k for data in steps.values() for k in data if k.startswith(ACCURACY_PREFIX)})
    exact = [k for k in keys if k.endswith(ACCURACY_SUFFIX)]
    others = [k for k in keys if _ANY_ACCURACY.match(k)]
    return (exact or others or [None])[0]


def response_tokens(data: dict) -> float | None:
    """The step's response tokens from verl's metrics (module docstring)."""
    total, prompt, response = (data.get(k) for k in ("perf/total_num_tokens", "prompt_length/mean", "response_length/mean"))
    if total is None or prompt is None or response is None or prompt + response <= 0:
        return None
    rows = round(total / (prompt + response))
    return float(round(rows * response))


def generated_tokens(data: dict) -> float | None:
    if GENERATED_TOKENS_KEY in data:
        return float(data[GENERATED_TOKENS_KEY])
    if TREE_TOKENS_KEY in data:
        return float(data[TREE_TOKENS_KEY])
    tokens = response_tokens(data)
    if tokens is not None and CHAIN_MC_TOKENS_KEY in data:
        tokens += float(data[CHAIN_MC_TOKENS_KEY])
    return tokens


#: Logged by trees that fork at cutpoints only (spo_verl.adapters.trainer.step_metrics.tree_metrics).
CUTPOINT_TREE_KEY = "spo/tree/paths_per_tree"


def algorithm_of(steps: dict[int, dict], samples: list[dict]) -> str:
    """The recipe's algorithm name: from the sample log when there is one, else from the metrics. A
    tree that forks at cutpoints is told apart by its fork metrics."""
    keys = {k for data in steps.values() for k in data}
    if samples:
        estimator, loss_mode = samples[-1].get("algorithm", "unknown"), samples[-1].get("loss_mode")
        name = "grpo_prob_mask" if estimator == "grpo" and loss_mode == "spo_prob_mask" else estimator
    elif any(k.startswith("spo/tree/") for k in keys):
        name = "spo_tree"
    elif any(k.startswith("spo/chain/") for k in keys):
        name = "spo_chain"
    elif any(k.startswith("spo/prob_mask/") for k in keys):
        name = "grpo_prob_mask"
    else:
        name = "ppo" if any(k.startswith("critic/vf_") for k in keys) else "grpo"
    return "spo_tree_cutpoint" if name == "spo_tree" and CUTPOINT_TREE_KEY in keys else name


def step_rows(steps: dict[int, dict], key: str | None) -> list[StepRow]:
    rows, tokens_so_far, time_so_far = [], 0.0, 0.0
    for step, data in steps.items():
        tokens = generated_tokens(data)
        wall = data.get(WALL_TIME_KEY)
        tokens_so_far += tokens or 0.0
        time_so_far += wall or 0.0
        rows.append(StepRow(
            step=step, generated_tokens=tokens, cumulative_generated_tokens=tokens_so_far,
            training_reward=data.get(REWARD_KEY), heldout_accuracy=data.get(key) if key else None,
            trained_tokens=data.get(TRAINED_TOKENS_KEY),
            actor_tokens_per_update=data.get(ACTOR_TOKENS_KEY),
            wall_time_s=wall, cumulative_wall_time_s=time_so_far,
            monte_carlo_tokens=data.get(CHAIN_MC_TOKENS_KEY),
            phase_s={phase: data[TIMING_PREFIX + phase] for phase in PHASES if TIMING_PREFIX + phase in data},
            **{name: data.get(key) for name, key in CREDIT_KEYS.items()},
            turns={k.removeprefix(TURNS_PREFIX): v for k, v in data.items() if k.startswith(TURNS_PREFIX)},
        ))
    return rows


def read_samples(path: str | Path | None) -> list[dict]:
    """One record per step, in step order, of the run's final attempt: a run resumed from a checkpoint
    logs again the steps its stopped attempt had logged after that checkpoint, a run started again from
    step 0 logs every step again, and the final attempt's records are the ones the run kept (the turns
    command reads the same, :func:`spo_workbench.credit.turns.final_attempt`)."""
    from spo_workbench.credit.turns import final_attempt

    if path is None:
        return []
    return final_attempt(read_records(path))


def load_run(label: str, metrics_path: str | Path, samples_path: str | Path | None = None) -> Run:
    steps = merged_by_step(metrics_path)
    samples = read_samples(samples_path)
    key = accuracy_key(steps)
    return Run(label=label, metrics_path=Path(metrics_path), samples_path=Path(samples_path) if samples_path else None,
               algorithm=algorithm_of(steps, samples), accuracy_key=key, steps=step_rows(steps, key), samples=samples)


def parse_run_argument(text: str) -> tuple[str, str, str | None]:
    """``LABEL=METRICS_JSONL[,SAMPLES_JSONL]``."""
    label, sep, paths = text.partition("=")
    if not sep or not label or not paths:
        raise ValueError(f"--run expects LABEL=METRICS_JSONL[,SAMPLES_JSONL], got {text!r}")
    metrics, _, samples = paths.partition(",")
    return label, metrics, samples or None
