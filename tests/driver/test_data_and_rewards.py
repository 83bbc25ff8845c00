import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kuberl.api.types import RewardSpec
from kuberl.train.data import DataError, PromptStream, load_prompts
from kuberl.train.rewards import RewardError, load_reward, math_exact_match, repeat_letter, score


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_order_depends_only_on_seed_and_step(tmp_path):
    prompts = load_prompts(_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(10)]))
    a, b = PromptStream(prompts, seed=3), PromptStream(prompts, seed=3)
    run = [[p.index for p in a.batch(step, 4)] for step in range(6)]
    # A resumed stream asked for step 4 directly gives what the uninterrupted one gave.
    assert [p.index for p in b.batch(4, 4)] == run[4]
    # Every epoch (10 prompts) is a permutation: steps 0-1 and half of 2 cover each prompt once.
    first_epoch = [i for step in run[:2] for i in step] + run[2][:2]
    assert sorted(first_epoch) == list(range(10))
    assert run != [[p.index for p in PromptStream(prompts, seed=4).batch(s, 4)] for s in range(6)]


def test_jsonl_directory_and_parquet(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"question": "1+1?", "solution": "2"}])
    pq.write_table(pa.table({"question": ["2+2?"], "solution": ["4"]}), tmp_path / "b.parquet")
    prompts = load_prompts(tmp_path, prompt_field="question", answer_field="solution")
    assert [(p.text, p.answer) for p in prompts] == [("1+1?", "2"), ("2+2?", "4")]


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "x"}\nnot json\n', "d.jsonl:2: not valid JSON"),
    ('{"text": "x"}\n', "no field 'prompt' (spec.data.promptField); fields are ['text']"),
    ('{"prompt": ""}\n', "must be a non-empty string"),
    ('[1, 2]\n', "expected a JSON object"),
    ("\n", "holds no prompts"),
])
def test_bad_data_names_file_line_and_field(tmp_path, content, needle):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError) as info:
        load_prompts(tmp_path / "d.jsonl")
    assert needle in str(info.value)


def test_missing_data_path(tmp_path):
    with pytest.raises(DataError, match="spec.data.uri: .* does not exist"):
        load_prompts(tmp_path / "nope")


def test_math_exact_match():
    responses = ["so \\boxed{42}", "the answer is 1,234.", "I think 7 then 8", "no idea", "\\boxed{41}"]
    answers = ["42", "#### 1234", 8, "3", "42"]
    assert math_exact_match([""] * 5, responses, answers) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_repeat_letter():
    assert repeat_letter([""] * 4, ["aaaa", "abab", "", " b "], ["a", "a", "a", "b"]) == [1.0, 0.5, 0.0, 1.0]


def test_reward_function_by_import_path():
    fn = load_reward(RewardSpec(function="kuberl.train.rewards:repeat_letter"))
    assert fn is repeat_letter
    with pytest.raises(RewardError, match="cannot import 'no.such.module'"):
        load_reward(RewardSpec(function="no.such.module:fn"))
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_reward(RewardSpec(function="kuberl.train.rewards:nope"))


@pytest.mark.parametrize("returned,needle", [
    ([1.0], "returned 1 rewards for 2 responses"),
    ([1.0, "high"], "reward 1 is 'high', not a number"),
    ([1.0, float("nan")], "reward 1 is nan, not finite"),
])
def test_reward_results_are_checked(returned, needle):
    with pytest.raises(RewardError, match=needle):
        score(lambda p, r, a: returned, ["p", "q"], ["r", "s"], [None, None])
