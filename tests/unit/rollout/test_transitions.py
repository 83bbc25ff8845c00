"""Agent transitions -> Samples: multi-turn splicing, masks, and the robustness rules."""

from __future__ import annotations

import pytest

from kuberl.common.samples import SampleError
from kuberl.rollout.transitions import Transition, episode_to_sample, transitions_to_samples


def test_single_turn_keeps_tokens_and_logprobs():
    s = episode_to_sample([{"prompt_ids": [1, 2], "response_ids": [3, 4], "response_logprobs": [-0.5, -1.0]}],
                          group=3, reward=1.0)
    assert (s.prompt_ids, s.response_ids, s.response_logprobs, s.loss_mask) == ([1, 2], [3, 4], [-0.5, -1.0], [1, 1])
    assert s.group == 3 and s.reward == 1.0 and s.metadata["repairs"] == []


def test_multi_turn_splices_observations_with_mask_zero():
    turns = [Transition([1, 2], [3, 4], [-0.1, -0.2]),
             Transition([1, 2, 3, 4, 9, 9], [5], [-0.3])]
    s = episode_to_sample(turns)
    assert s.prompt_ids == [1, 2]
    assert s.response_ids == [3, 4, 9, 9, 5]
    assert s.loss_mask == [1, 1, 0, 0, 1]
    assert s.response_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]


def test_mismatched_or_missing_logprobs_are_dropped_not_misaligned():
    short = episode_to_sample([{"prompt_ids": [1], "response_ids": [2, 3], "response_logprobs": [-0.1]}])
    assert short.response_logprobs is None and "1 values for 2 tokens" in short.metadata["repairs"][0]
    missing = episode_to_sample([Transition([1], [2], [-0.1]), Transition([1, 2, 7], [3], None)])
    assert missing.response_logprobs is None and missing.response_ids == [2, 7, 3]
    nan = episode_to_sample([Transition([1], [2], [float("nan")])])
    assert nan.response_logprobs is None


def test_empty_responses_are_dropped_and_reported():
    samples, skipped = transitions_to_samples([[Transition([1], [])], [Transition([1], [2], [-1.0])]])
    assert skipped == [0] and len(samples) == 1 and samples[0].group == 1
    s = episode_to_sample([Transition([1], [2]), Transition([1, 2, 5], [])])
    assert s.response_ids == [2] and s.loss_mask == [1]  # trailing observation trimmed
    assert "turn 1: empty response dropped" in s.metadata["repairs"]


@pytest.mark.parametrize("turns,message", [
    ([], "no transitions"),
    ([{"prompt_ids": [], "response_ids": [1]}], "turn 0: empty prompt_ids"),
    ([{"prompt_ids": "hello", "response_ids": [1]}], "expected a list of token ids"),
    ([{"prompt_ids": [1], "response_ids": [2, -1]}], r"response_ids\[1\]"),
    ([{"prompt_ids": [1], "response_ids": [2], "loss_mask": [1, 1]}], "loss_mask needs one 0/1"),
    ([Transition([1], [2]), Transition([9, 9], [3])], "turn 1: prompt_ids do not start"),
    ([{"prompt_ids": [1], "response_ids": [2], "reward": 1}], "unknown fields"),
])
def test_malformed_input_raises_sample_error_naming_the_turn(turns, message):
    with pytest.raises(SampleError, match=message):
        episode_to_sample(turns)


def test_counts_must_match_episodes():
    with pytest.raises(SampleError, match="1 rewards for 2 episodes"):
        transitions_to_samples([[Transition([1], [2])]] * 2, rewards=[1.0])


def test_sticky_router_keeps_sessions_on_one_engine():
    from kuberl.rollout.server import StickyRouter

    router = StickyRouter(3, max_sessions=2)
    a, b = router.route("a"), router.route("b")
    assert router.route("a") == a and router.route("b") == b and a != b
    assert {router.route(None) for _ in range(3)} == {0, 1, 2}
    router.route("c")  # over max_sessions: the least recently used session is forgotten
    assert len(router._sessions) == 2
