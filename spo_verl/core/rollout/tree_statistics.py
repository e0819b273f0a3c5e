"""The shape and cost of one sampled tree, for the ``spo/tree/*`` metrics (fixed, cutpoint and turn trees)."""

from __future__ import annotations

from spo_verl.core.metadata import CutpointTreeStatistics, TreeStatistics
from spo_verl.core.rollout.cutpoint_tree import CutpointTree
from spo_verl.core.rollout.tree import SampledTree


def tree_statistics(tree: SampledTree) -> TreeStatistics:
    """Shape and cost of one tree. A fixed tree counts the leaves that stopped above its last depth; a
    cutpoint tree also its forks and where they fall. Its cost is the tokens the model generated: a tree
    over turns leaves the environment's replies out, as the response mask does (the token budget
    compares algorithms by the model's tokens)."""
    depth = len(tree.branching)
    segments = tree.nodes[1:]
    leaves = tree.leaves()
    early_stops = [0] * depth
    for leaf in leaves:
        if tree.nodes[leaf].depth < depth:
            early_stops[tree.nodes[leaf].depth - 1] += 1
    shape = dict(
        nodes=len(segments),
        leaves=len(leaves),
        early_stops_per_depth=early_stops,
        generated_tokens=sum(sum(node.token_mask())
                             for node in segments),
        independent_sample_tokens=sum(sum(tree.response_mask(leaf)) for leaf in leaves),
    )
    if isinstance(tree, CutpointTree):
        return CutpointTreeStatistics(
            **shape,
            paths=tree.paths,
            forks=len(tree.forks),
            fork_positions=[fork.position / fork.response_tokens for fork in tree.forks],
            cutpoint_requests=tree.cutpoint_requests,
        )
    return TreeStatistics(**shape)
