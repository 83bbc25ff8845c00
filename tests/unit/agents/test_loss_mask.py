"""A two-turn episode becomes one sample whose loss mask is 1 on the model's tokens only, and the
trainer's grids and policy loss leave the tool's tokens out; checked on concrete token ids."""

from __future__ import annotations

import copy

import pytest
import torch

from kuberl.common.samples import TrainBatch
from kuberl.rollout.continuation import ContinuationError, continuation_ids
from kuberl.rollout.transitions import Transition, episode_to_sample

TOOL_OUTPUT = "calculator: 3"


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def episode(tokenizer):
    """Turn 1 calls the tool and closes its turn with EOS; turn 2 answers "3" and stops at length."""
    eos = tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2? Use the calculator (=)."}],
                                           tokenize=True, add_generation_prompt=True, return_dict=False)
    call = ids(tokenizer, "=") + [eos]
    tool = continuation_ids(tokenizer, [{"role": "user", "content": TOOL_OUTPUT}], prompt + call)
    answer = ids(tokenizer, "33")
    turns = [Transition(prompt, call, [-0.1, -0.2]), Transition(prompt + call + tool, answer, [-0.3, -0.4])]
    return prompt, call, tool, answer, turns


def test_the_tool_output_is_spliced_in_with_the_template_markers(tokenizer, episode):
    _, _, tool, _, _ = episode
    # The model closed its turn with EOS: the continuation adds the rest of the template's closing.
    assert tokenizer.decode(tool) == f"\n<|im_start|>user\n{TOOL_OUTPUT}<|im_end|>\n<|im_start|>assistant\n"


def test_the_episode_sample_masks_exactly_the_tool_tokens(tokenizer, episode):
    prompt, call, tool, answer, turns = episode
    sample = episode_to_sample(turns, group=2, reward=0.8)
    assert sample.prompt_ids == prompt
    assert sample.response_ids == call + tool + answer
    assert sample.loss_mask == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert trained == ids(tokenizer, "=") + [tokenizer.eos_token_id] + ids(tokenizer, "33")
    untrained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if not m]
    assert untrained == tool and ids(tokenizer, TOOL_OUTPUT)[0] in untrained
    assert sample.response_logprobs == [-0.1, -0.2] + [0.0] * len(tool) + [-0.3, -0.4]
    assert (sample.group, sample.reward) == (2, 0.8)


def test_a_reply_cut_at_max_tokens_gets_its_closing_as_untrained_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    prompt = [2, 4, 5]
    tool = continuation_ids(tokenizer, [{"role": "user", "content": "x"}], prompt + [10, 11])
    assert tool[0] == eos  # the template's end of turn, which the model did not write
    sample = episode_to_sample([Transition(prompt, [10, 11]), Transition(prompt + [10, 11] + tool, [12])])
    assert sample.loss_mask == [1, 1] + [0] * len(tool) + [1]


# Qwen3's shape: the reply being generated opens with an empty reasoning block, which the
# template leaves out of earlier replies in the history.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_replies_still_continues_from_the_ids(tokenizer):
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    tool = continuation_ids(thinking, [{"role": "user", "content": "x"}], [7, tokenizer.eos_token_id])
    assert thinking.decode(tool) == "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_template_that_moves_earlier_replies_cannot_continue(tokenizer):
    moving = copy.deepcopy(tokenizer)
    # Replies rendered before the question: nothing follows the generation prompt's position.
    moving.chat_template = ("{% for m in messages|reverse %}{{ m['content'] }}|{% endfor %}"
                            "{% if add_generation_prompt %}>{% endif %}")
    with pytest.raises(ContinuationError, match="cannot continue token by token"):
        continuation_ids(moving, [{"role": "user", "content": "x"}], [1])


def test_the_trainer_grids_and_loss_exclude_the_tool_tokens(episode):
    from kuberl.train.algorithms import registry
    from kuberl.train.algorithms.base import UpdateTotals
    from kuberl.train.packing import packed_fields
    from kuberl.train.worker import make_micro_batch, sequence_index

    prompt, call, tool, answer, turns = episode
    sample = episode_to_sample(turns)
    sample.advantage = 1.5
    start = len(prompt) - 1  # grid position t predicts token t+1
    tool_positions = range(start + len(call), start + len(call) + len(tool))
    model_positions = [*range(start, start + len(call)),
                       *range(start + len(call) + len(tool), start + len(sample.response_ids))]
    padded = make_micro_batch(TrainBatch([sample]), torch.device("cpu"))
    packed = packed_fields([sample], None, None, torch.device("cpu"))
    for mask, targets in ((padded.mask, padded.targets), (packed["mask"], packed["targets"])):
        assert mask[0, list(tool_positions)].eq(0).all() and mask[0, model_positions].eq(1).all()
        assert mask.sum() == len(call) + len(answer)
        assert targets[0, list(tool_positions)].tolist() == tool
    # The policy loss has no gradient on the tool tokens' log-probs, whatever they are.
    logprobs = torch.randn(padded.mask.shape, requires_grad=True)
    totals = UpdateTotals(tokens=padded.mask.sum(), sequences=torch.tensor(1.0))
    loss, _ = registry.get("grpo").policy_loss(logprobs, logprobs.detach(), padded.advantages, padded.mask,
                                               sequence_index(padded), totals, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert logprobs.grad[0, list(tool_positions)].eq(0).all()
    assert logprobs.grad[0, model_positions].ne(0).all()
