"""The SPO metadata contract: what an agent loop writes into extra_fields["spo"] reads back as the same
row; incomplete or mismatched metadata fails with the field or setting to fix."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.adapters.estimators import compute_spo_chain_advantage
from spo_verl.core.metadata import (
    ChainRow,
    ChainStatistics,
    CutpointTreeStatistics,
    SPOMetadataMissingError,
    TreeLeafRow,
    TreeStatistics,
    from_extra_field,
    to_extra_field,
)

TREE = TreeStatistics(nodes=6, leaves=4, early_stops_per_depth=[0, 1], generated_tokens=30, independent_sample_tokens=52)


def test_rows_survive_the_trip_through_extra_fields():
    leaf = TreeLeafRow(path=[1, 4], segment_ends=[3, 7], tree_id="t0", trains=False, truncated=True, tree=TREE)
    cutpoint_leaf = TreeLeafRow(path=[2], segment_ends=[9], tree=CutpointTreeStatistics(
        **vars(TREE), paths=2, forks=1, fork_positions=[0.25], cutpoint_requests=3))
    chain = ChainRow(segment_starts=[0, 5], boundary_values=[0.25, 0.5], chain=ChainStatistics(
        boundaries=2, mc_continuations=8, mc_tokens=40, mc_truncated=1, cutpoint_requests=1, no_cutpoint=False,
        capped=False))
    for row in (leaf, cutpoint_leaf, chain):
        written = to_extra_field(row)
        # Plain dicts all the way down: what verl carries through Ray and TransferQueue.
        assert isinstance(written, dict) and written["kind"] in ("tree_leaf", "chain")
        assert isinstance(written.get("tree", written.get("chain")), dict)
        read = from_extra_field(written)
        assert read == row and type(getattr(read, "tree", None) or read.chain) is type(getattr(row, "tree", None) or row.chain)
    assert from_extra_field(None) is None and from_extra_field(leaf) is leaf
    # A dict without a kind (written by hand) is recognised by its fields; defaults fill the rest.
    assert from_extra_field({"path": [2], "segment_ends": [4]}) == TreeLeafRow(path=[2], segment_ends=[4])
    assert from_extra_field({"segment_starts": [0], "boundary_values": [0.5], "other": 1}) == ChainRow([0], [0.5])


@pytest.mark.parametrize("value, message", [
    ({"path": [1]}, r"spo_tree: a row's SPO metadata has no 'segment_ends'"),
    ({"segment_starts": [0]}, r"spo_chain: a row's SPO metadata has no 'boundary_values'"),
    ({"trains": True}, r"neither a tree leaf's 'path'/'segment_ends' nor a chain's"),
    ({"kind": "graph", "path": [1]}, r"unknown kind 'graph' \(known: \['chain', 'tree_leaf'\]\)"),
    ([1, 2], r"is a list, not a mapping"),
    ({"path": [1], "segment_ends": [2], "tree": {"nodes": 6, "leaves": 4}},
     r"a row's TreeStatistics has no \['early_stops_per_depth', 'generated_tokens', 'independent_sample_tokens'\]"),
    ({"segment_starts": [0], "boundary_values": [0.5], "chain": {"mc_tokens": 40}},
     r"a row's ChainStatistics has no \['boundaries', "),
])
def test_incomplete_metadata_names_what_is_missing(value, message):
    with pytest.raises(SPOMetadataMissingError, match=message):
        from_extra_field(value)


def test_an_estimator_refuses_the_other_algorithms_rows():
    rewards, mask = torch.zeros(1, 4), torch.ones(1, 4)
    config = OmegaConf.create({"adv_estimator": "spo_chain", "spo": {}})
    with provide_spo_rows([to_extra_field(TreeLeafRow(path=[1], segment_ends=[4]))]):
        with pytest.raises(SPOMetadataMissingError, match="spo_chain: row 0 carries TreeLeafRow metadata"):
            compute_spo_chain_advantage(rewards, mask, index=np.array(["u"]), config=config)
