"""Generated-token counting and the equal-cost stop (``algorithm.spo.budget.generated_tokens``)."""

import pytest

from spo_verl.core.config import SPOConfigError, parse_spo_settings
from spo_verl.adapters.trainer.token_budget import (
    GENERATED_TOKENS,
    GENERATED_TOKENS_CUMULATIVE,
    GeneratedTokenBudget,
    step_generated_tokens,
)


def test_a_tree_counts_each_node_once_not_its_leaf_rows():
    # Leaf rows repeat shared prefixes: 4 rows of 30 response tokens, but the tree generated 80.
    assert step_generated_tokens(120.0, {"spo/tree/generated_tokens": 80.0}) == 80.0


def test_a_chain_adds_its_monte_carlo_continuations():
    assert step_generated_tokens(120.0, {"spo/chain/mc_tokens": 45.0}) == 165.0


def test_other_algorithms_count_their_response_tokens():
    assert step_generated_tokens(120.0, {}) == 120.0


def test_the_step_expected_to_reach_the_budget_becomes_the_last():
    budget = GeneratedTokenBudget(250)
    metrics = {}
    # 100 so far; another 100 would make 200 < 250: the last step stays the 100th.
    assert budget.record(100.0, training_step=1, last_training_step=100, metrics=metrics) is None
    assert metrics == {GENERATED_TOKENS: 100.0, GENERATED_TOKENS_CUMULATIVE: 100.0}
    # 200 so far; the next step is expected to reach 300 >= 250.
    assert budget.record(100.0, training_step=2, last_training_step=100, metrics=metrics) == 3
    assert metrics[GENERATED_TOKENS_CUMULATIVE] == 200.0


def test_without_a_budget_nothing_changes_but_the_count():
    budget = GeneratedTokenBudget(None)
    metrics = {}
    assert budget.record(1e9, training_step=1, last_training_step=5, metrics=metrics) is None
    assert metrics[GENERATED_TOKENS_CUMULATIVE] == 1e9


def test_a_budget_never_extends_training():
    budget = GeneratedTokenBudget(10)
    # Step 3 is already the last.
    assert budget.record(50.0, training_step=3, last_training_step=3, metrics={}) is None


@pytest.mark.parametrize("value", [0, -5, 1.5, "many", True])
def test_a_bad_budget_is_refused_naming_the_setting(value):
    with pytest.raises(SPOConfigError, match="algorithm.spo.budget.generated_tokens must be a positive integer"):
        parse_spo_settings({"budget": {"generated_tokens": value}})


def test_the_budget_defaults_to_none():
    assert parse_spo_settings({}).budget.generated_tokens is None
    assert parse_spo_settings({"budget": {"generated_tokens": 5000}}).budget.generated_tokens == 5000
