"""Per-response caps of SPO-chain's Monte Carlo cost."""

from spo_verl.core.config import parse_spo_settings
from spo_verl.core.rollout.chain import cap_boundaries


def chain(**settings):
    return parse_spo_settings({"chain": {"mc_samples": 2, **settings}}).chain


def test_no_cap_keeps_every_boundary():
    assert cap_boundaries(chain(), [1, 5, 9], 20) == ([1, 5, 9], False)
    assert cap_boundaries(chain(), [], 20) == ([], False)


def test_boundary_cap():
    assert cap_boundaries(chain(max_boundaries=2), [1, 5, 9], 20) == ([1, 5], True)
    assert cap_boundaries(chain(max_boundaries=3), [1, 5, 9], 20) == ([1, 5, 9], False)


def test_token_cap_counts_worst_case_continuations_in_order():
    # worst cases: 2*(20-1)=38, 2*(20-5)=30, 2*(20-9)=22
    assert cap_boundaries(chain(max_mc_tokens_per_response=68), [1, 5, 9], 20) == ([1, 5], True)
    assert cap_boundaries(chain(max_mc_tokens_per_response=90), [1, 5, 9], 20) == ([1, 5, 9], False)
    assert cap_boundaries(chain(max_mc_tokens_per_response=10), [1, 5, 9], 20) == ([], True)
    assert cap_boundaries(chain(max_boundaries=1, max_mc_tokens_per_response=90), [1, 5, 9], 20) == ([1], True)
