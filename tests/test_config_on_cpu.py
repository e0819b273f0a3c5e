"""algorithm.spo settings: defaults, validation messages, and composition with verl's real config tree."""


import pytest
from hydra.errors import InstantiationException
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

import spo_verl.register  # noqa: F401
from spo_verl.core.config import SPOConfigError, parse_spo_settings
from spo_verl.core.rollout.tree_shape import tree_segment_budgets
from spo_verl.adapters.policy_loss import SPOPolicyLossConfig, prob_mask_settings
from spo_workbench.testing.verl_harness import compose_ppo_trainer



def test_defaults_are_the_papers():
    settings = parse_spo_settings(None)
    assert settings.prob_mask.threshold == 0.9 and settings.prob_mask.normalization == "reference"
    assert settings.chain.partition == "cutpoint" and settings.chain.cutpoint_interval == 5
    assert settings.chain.mc_samples == 9
    assert settings.tree.branching == (6, 6, 6) and tree_segment_budgets(settings.tree) == (600, 600)
    assert settings.tree.std_normalize is False and settings.tree.drop_zero_advantage is True
    assert settings.tree.max_trained_segments_per_prompt is None
    assert settings.packing.enable is False and settings.packing.chunk_tokens == 4096
    assert settings.packing.max_token_ratio == 0.9 and settings.packing.check is False


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"prob_mask": {"normalization": "mean"}}, r"algorithm\.spo\.prob_mask\.normalization must be one of \['reference', 'verl'\], got 'mean'"),
        ({"chain": {"partition": "words"}}, r"algorithm\.spo\.chain\.partition must be one of \['cutpoint', 'fixed_count', 'delimiter', 'turn'\]"),
        ({"chain": {"cutpoint_interval": 0}}, r"algorithm\.spo\.chain\.cutpoint_interval must be a positive integer, got 0"),
        ({"chain": {"mc_samples": 2.5}}, r"algorithm\.spo\.chain\.mc_samples must be a positive integer"),
        ({"tree": {"branching": []}}, r"algorithm\.spo\.tree\.branching must be a non-empty list of positive integers"),
        ({"tree": {"branching": [6, 0, 6]}}, r"algorithm\.spo\.tree\.branching\[1\] must be a positive integer"),
        ({"tree": {"segment_tokens": [30, 30, 30]}}, r"algorithm\.spo\.tree\.segment_tokens must be one number or 2 numbers"),
        ({"tree": {"max_trained_segments_per_prompt": 0}}, r"max_trained_segments_per_prompt must be a positive integer, got 0"),
        ({"tree": {"branch": [2]}}, r"unknown setting\(s\) \['algorithm\.spo\.tree\.branch'\]; algorithm\.spo\.tree accepts"),
        ({"chian": {}}, r"unknown setting\(s\) \['algorithm\.spo\.chian'\]"),
        ({"packing": {"max_token_ratio": 1.5}}, r"packing\.max_token_ratio must be a number in \(0, 1\], got 1\.5"),
    ],
)
def test_invalid_values_name_the_key_and_allowed_values(raw, message):
    with pytest.raises(SPOConfigError, match=message):
        parse_spo_settings(raw)


def test_per_depth_segment_budgets():
    settings = parse_spo_settings({"tree": {"branching": [4, 5, 6], "segment_tokens": [30, 40]}})
    assert tree_segment_budgets(settings.tree) == (30, 40)
    assert tree_segment_budgets(parse_spo_settings({"tree": {"branching": [8], "segment_tokens": 30}}).tree) == ()


def compose_verl(overrides):
    return compose_ppo_trainer(*overrides)


SPO_LOSS_OVERRIDES = [
    "algorithm.adv_estimator=spo_tree",
    "actor_rollout_ref.actor.policy_loss.loss_mode=spo_prob_mask",
    "actor_rollout_ref.actor.policy_loss._target_=spo_verl.adapters.policy_loss.SPOPolicyLossConfig",
    "+actor_rollout_ref.actor.policy_loss.spo=${algorithm.spo}",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
]


def test_settings_compose_with_verls_ppo_trainer_and_reach_the_actor_config():
    config = compose_verl(SPO_LOSS_OVERRIDES + ["+algorithm.spo.prob_mask.threshold=0.8"])
    OmegaConf.resolve(config)  # what verl's TaskRunner does before building workers
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, SPOPolicyLossConfig)
    assert actor.policy_loss.loss_mode == "spo_prob_mask"
    assert prob_mask_settings(actor).threshold == 0.8  # what the loss reads on the actor
    assert parse_spo_settings(config.algorithm.spo).prob_mask.threshold == 0.8


def test_invalid_setting_fails_when_verl_builds_the_actor_config():
    config = compose_verl(SPO_LOSS_OVERRIDES + ["+algorithm.spo.prob_mask.normalization=token-mean"])
    # Hydra wraps the error; the message still names the key and the allowed values.
    with pytest.raises(InstantiationException, match=r"algorithm\.spo\.prob_mask\.normalization must be one of"):
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _flat_defaults(settings, prefix=""):
    """``algorithm.spo``'s keys with the schema's defaults, as YAML would write them (tuples as lists)."""
    import dataclasses

    flat = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            flat.update(_flat_defaults(value, f"{prefix}{f.name}."))
        else:
            flat[f"{prefix}{f.name}"] = list(value) if isinstance(value, tuple) else value
    return flat


def test_each_default_is_stated_once_in_the_schema_and_the_yaml_and_settings_page_agree_with_it():
    """The settings' defaults live in the schema (``spo_verl.core.config``); the recipe's base config
    (``spo_trainer.yaml``, before a setting or bundle changes anything) and docs/SETTINGS.md's table name
    exactly its keys, and the YAML exactly its defaults."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    defaults = _flat_defaults(parse_spo_settings(None))
    base = OmegaConf.load(repo / "recipe" / "spo" / "config" / "spo_trainer.yaml").algorithm.spo
    in_yaml = _flat_defaults_of_mapping(OmegaConf.to_container(base))
    # tree.branch_at is the bundle's (spo_tree: fixed, spo_tree_cutpoint: cutpoint), not the base's.
    assert in_yaml == {key: value for key, value in defaults.items() if key != "tree.branch_at"}
    bundle = OmegaConf.load(repo / "recipe" / "spo" / "config" / "spo_algorithm" / "spo_tree.yaml")
    assert OmegaConf.select(bundle, "algorithm.spo.tree.branch_at") == defaults["tree.branch_at"]
    table = re.findall(r"^\| `([a-z_.]+)` \| `", (repo / "docs" / "SETTINGS.md").read_text(), re.M)
    assert sorted(table) == sorted(defaults)


def _flat_defaults_of_mapping(mapping, prefix=""):
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(_flat_defaults_of_mapping(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
