"""Random SPO trees given as per-leaf rows (prompt, response, path of node ids, segment ends), as
the tree agent loop emits them: for the packed-training tests and benchmarks."""

from __future__ import annotations

import random

__all__ = ["Tree", "tree_2_2", "tree_3_3_early", "tree_2_2_2", "tree_one_leaf", "TREES"]


class Tree:
    """A random tree given as leaf rows in slot order: prompt, rows (response, path, segment ends)."""

    def __init__(self, rng: random.Random, branching, seg_len, prompt_len=5, early_stop=(), first_id=100, vocab=61):
        self.prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        self.segments: dict[int, list[int]] = {}
        self.responses, self.paths, self.ends = [], [], []
        next_id = [first_id]

        def expand(depth, where, path, ends, tokens):
            for child in range(branching[depth]):
                node_id = next_id[0]
                next_id[0] += 3  # ids are arbitrary labels, not indices
                segment = [rng.randrange(vocab) for _ in range(seg_len(depth, rng))]
                self.segments[node_id] = segment
                here = where + (child,)
                new_path, new_ends = path + [node_id], ends + [(ends[-1] if ends else 0) + len(segment)]
                if depth + 1 == len(branching) or here in early_stop:
                    self.responses.append(tokens + segment)
                    self.paths.append(new_path)
                    self.ends.append(new_ends)
                else:
                    expand(depth + 1, here, new_path, new_ends, tokens + segment)

        expand(0, (), [], [], [])

    @property
    def unique_tokens(self) -> int:
        return len(self.prompt) + sum(len(s) for s in self.segments.values())


def tree_2_2(rng, **kwargs):
    return Tree(rng, (2, 2), lambda d, r: 3 + d, **kwargs)


def tree_3_3_early(rng, **kwargs):
    """Early EOS at depth 1: the first and third depth-1 nodes are leaves."""
    return Tree(rng, (3, 3), lambda d, r: r.randint(2, 5), early_stop={(0,), (2,)}, **kwargs)


def tree_2_2_2(rng, **kwargs):
    return Tree(rng, (2, 2, 2), lambda d, r: r.randint(1, 6), **kwargs)


def tree_one_leaf(rng, **kwargs):
    return Tree(rng, (1,), lambda d, r: 7, **kwargs)


TREES = {"2-2": tree_2_2, "3-3 early EOS": tree_3_3_early, "2-2-2 variable": tree_2_2_2, "one leaf": tree_one_leaf}
