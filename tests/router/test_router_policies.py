"""Load-balancing policies on in-memory instance states (no HTTP)."""

from __future__ import annotations

from collections import Counter

import pytest

from fastdeploy.router.instance import InstanceInfo, InstanceRole, InstanceState
from fastdeploy.router.policies import (
    CacheAwarePolicy,
    PowerOfTwoPolicy,
    RequestFeatures,
    make_policy,
)


def states(n: int) -> list[InstanceState]:
    return [InstanceState(InstanceInfo(InstanceRole.MIXED, "127.0.0.1", 8000 + i)) for i in range(n)]


def route(policy, candidates, prompt: str = "hello", times: int = 1) -> Counter:
    """Select ``times`` times (without load changes); count picks per instance id."""
    picks = Counter()
    for _ in range(times):
        features = RequestFeatures.from_body({"prompt": prompt})
        chosen = policy.select(candidates, features)
        policy.on_routed(chosen, features)
        picks[chosen.id] += 1
    return picks


def test_round_robin_is_even_and_in_order():
    candidates = states(3)
    policy = make_policy("round_robin")
    order = [policy.select(candidates, RequestFeatures()).id for _ in range(6)]
    assert order == [c.id for c in candidates] * 2


def test_random_uses_every_instance():
    picks = route(make_policy("random"), states(2), times=200)
    assert len(picks) == 2 and min(picks.values()) > 60


def test_request_num_prefers_idle_and_rotates_ties():
    candidates = states(3)
    candidates[0].in_flight, candidates[1].in_flight, candidates[2].in_flight = 2, 0, 1
    policy = make_policy("request_num")
    assert policy.select(candidates, RequestFeatures()).id == candidates[1].id
    for c in candidates:
        c.in_flight = 0
    assert route(policy, candidates, times=9) == Counter({c.id: 3 for c in candidates})


def test_process_tokens_weighs_prompt_length_not_request_count():
    a, b = states(2)
    a.in_flight, a.in_flight_tokens = 3, 30     # three short prompts
    b.in_flight, b.in_flight_tokens = 1, 4000   # one long prompt
    assert make_policy("process_tokens").select([a, b], RequestFeatures()).id == a.id
    assert make_policy("request_num").select([a, b], RequestFeatures()).id == b.id


def test_power_of_two_never_picks_the_busier_of_its_pair():
    a, b, c = states(3)
    a.in_flight, b.in_flight, c.in_flight = 0, 5, 7
    policy = PowerOfTwoPolicy(seed=0)
    picks = route(policy, [a, b, c], times=300)
    # c is the busiest: it loses every pair it is in. a wins every pair it is in (2/3 of them).
    assert picks[c.id] == 0
    assert 150 < picks[a.id] < 250
    assert policy.select([b, a], RequestFeatures()).id == a.id


def test_cache_aware_same_prefix_same_instance_and_spreads_new_prefixes():
    candidates = states(3)
    policy = CacheAwarePolicy(block_chars=16)
    owners = {}
    for round_ in range(4):
        for topic in ("alpha", "beta", "gamma"):
            prompt = f"System prompt about {topic} " * 4 + f"question {round_}"
            chosen = route(policy, candidates, prompt)
            owners.setdefault(topic, set()).update(chosen)
    assert all(len(ids) == 1 for ids in owners.values()), owners
    # With no load, a new prefix goes to the least loaded instance by rotation: all three are used.
    assert len({next(iter(ids)) for ids in owners.values()}) == 3
    assert policy.hits == 9 and policy.misses == 3


def test_cache_aware_matches_the_longest_shared_prefix():
    a, b = states(2)
    policy = CacheAwarePolicy(block_chars=8)
    policy.on_routed(a, RequestFeatures(prefix_text="shared system prompt, then A-specific text"))
    policy.on_routed(b, RequestFeatures(prefix_text="shared system prompt, then B-specific text"))
    # b wrote the shared blocks last, but a longer match (the "A" branch) points at a.
    chosen = policy.select([a, b], RequestFeatures(prefix_text="shared system prompt, then A-specific text 2"))
    assert chosen.id == a.id


def test_cache_aware_yields_to_load_when_imbalanced():
    a, b = states(2)
    policy = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    features = RequestFeatures(prefix_text="the same prompt")
    policy.on_routed(a, features)
    a.in_flight = 4
    assert policy.select([a, b], features).id == a.id   # gap 4 is not above the threshold
    a.in_flight = 10
    assert policy.select([a, b], features).id == b.id   # imbalanced: least loaded wins


def test_cache_aware_forgets_an_instance():
    a, b = states(2)
    policy = CacheAwarePolicy()
    features = RequestFeatures(prefix_text="prompt")
    policy.on_routed(b, features)
    policy.forget(b.id)
    assert policy.select([a, b], features).id == a.id  # no match left: least loaded, first tie


def test_request_features():
    chat = RequestFeatures.from_body({"messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert chat.prefix_text == "<system>Be brief.<user>Hi"
    tokens = RequestFeatures.from_body({"prompt": [1, 2, 3, 4]})
    assert tokens.num_prompt_tokens == 4 and tokens.prefix_text == "1,2,3,4"
    assert RequestFeatures.from_body({"prompt": "x" * 400}).num_prompt_tokens == 100
    assert RequestFeatures.from_body({"prompt": ["aaaa", "bbbbbbbb"]}).num_prompt_tokens == 3


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown load-balancing policy 'fastest'"):
        make_policy("fastest")


def test_instance_info_accepts_fastdeploy_fields():
    info = InstanceInfo.from_dict({"role": "PREFILL", "host_ip": "10.0.0.2", "port": "8000",
                                   "pd_comm_port": [8201, 8202], "transfer_protocol": "ipc,rdma", "tp_size": 1,
                                   "rdma_ports": [7000]})
    assert info.role is InstanceRole.PREFILL and info.id == "10.0.0.2:8000"
    assert info.connector_port == 8201 and info.transfer_protocol == ["shm", "tcp"]
    assert info.extra == {"rdma_ports": [7000]}
    assert InstanceInfo.from_dict({"role": "kv_consumer", "host": "h", "port": 1}).role is InstanceRole.DECODE
    with pytest.raises(ValueError, match="Invalid instance role"):
        InstanceInfo.from_dict({"role": "teacher", "host": "h", "port": 1})
    with pytest.raises(ValueError, match="'port'"):
        InstanceInfo.from_dict({"role": "mixed", "host": "h"})
