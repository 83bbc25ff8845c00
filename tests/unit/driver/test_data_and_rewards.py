import contextlib
import io
import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from kuberl.api.types import RewardSpec, RLTrainingJobSpec
from kuberl.driver.data import (DataError, PromptStream, check_prompt_lengths, load_for_spec, load_prompts,
                              steps_for_epochs)
from kuberl.common.reward_values import MAX_ABS_REWARD, RewardError
from kuberl.driver.rewards import RewardInput, gsm8k_flexible, gsm8k_strict, load_reward, repeat_letter, score


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


def _inputs(responses, answers):
    return [RewardInput(prompt="", response=r, answer=a) for r, a in zip(responses, answers)]


def test_gsm8k_strict_reads_the_number_after_the_last_hashes():
    """lm-eval-harness's strict-match and verl's gsm8k reward: only '#### <number>' counts."""
    responses = ["#### 4 apples, 12 total", "5 then 4", "so #### 1,234.", "#### 3\n#### 8", "#### $18", "no idea"]
    # "#### $18" does not match the strict pattern (a number right after "#### "): 0, as in verl.
    answers = ["4", "4", "Natalia sold... #### 1234", 8, "18", "3"]
    assert gsm8k_strict(_inputs(responses, answers)) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_gsm8k_flexible_reads_the_last_number():
    responses = ["#### 4 apples, 12 total", "5 then 4", "the answer is 1,234.", "-3.0", "no idea", "."]
    answers = ["4", "4", "#### 1234", "-3", "3", "0"]
    assert gsm8k_flexible(_inputs(responses, answers)) == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_repeat_letter():
    assert repeat_letter(_inputs(["aaaa", "abab", "", " b "], ["a", "a", "a", "b"])) == [1.0, 0.5, 0.0, 1.0]


def test_reward_function_by_import_path():
    fn = load_reward(RewardSpec(function="kuberl.driver.rewards:repeat_letter"))
    assert fn is repeat_letter
    with pytest.raises(RewardError, match="cannot import 'no.such.module'"):
        load_reward(RewardSpec(function="no.such.module:fn"))
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_reward(RewardSpec(function="kuberl.driver.rewards:nope"))


@pytest.mark.parametrize("returned,needle", [
    ([1.0], r"^spec.reward.function m:f returned 1 rewards for 2 inputs \(samples 0-1\)$"),
    ([1.0, "high"], r"^spec.reward.function m:f: reward 1 is 'high' \(str\), not a number"),
    # A number as text is refused too, not read as 1000: parsing is the function's job.
    ([1.0, "1e3"], r"^spec.reward.function m:f: reward 1 is '1e3' \(str\), not a number"),
    # A bool is a predicate where a score was meant (and numpy's is no int): float(ok) says so.
    ([True, 0.0], r"reward 0 is True \(bool\), not a number: .*a bool needs float\(\.\.\.\)"),
    ([np.bool_(False), 0.0], r"reward 0 is False \(bool\)"),
    ([1.0, float("nan")], "reward 1 is nan, not finite"),
    ([float("-inf"), 1.0], "reward 0 is -inf, not finite"),
    # Beyond the magnitude bound: 1e308 made NaN advantages, 1e19 silently zero ones.
    ([1e308, 1.0], r"reward 0 is 1e\+308, beyond the bound \|reward\| <= 1e\+06"),
    ([1.0, -1e19], r"reward 1 is -1e\+19, beyond the bound"),
    ([10**400, 1.0], "reward 0 is an int past float's range, beyond the bound"),
])
def test_reward_results_are_checked(returned, needle):
    with pytest.raises(RewardError, match=needle):
        score(lambda batch: returned, _inputs(["r", "s"], [None, None]), name="spec.reward.function m:f")


def test_rewards_may_be_ints_and_numpy_or_torch_scalars_up_to_the_bound():
    import torch

    rewards = score(lambda batch: [1, np.float32(0.5), torch.tensor(-0.25), MAX_ABS_REWARD],
                    _inputs(["a", "b", "c", "d"], [None] * 4))
    assert rewards == [1.0, 0.5, -0.25, 1e6] and all(type(r) is float for r in rewards)


def test_chat_prompts_nested_answers_template_and_system_prompt(tmp_path):
    rows = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
         "reward_model": {"ground_truth": "2"}, "data_source": "openai/gsm8k", "extra_info": {"split": "train"}},
        {"prompt": "2+2?", "reward_model": {"ground_truth": "4"}},
    ]
    prompts = load_prompts(_jsonl(tmp_path / "d.jsonl", rows), answer_field="reward_model.ground_truth",
                           system_prompt="You are a math tutor.", prompt_template="{prompt} Answer after ####.")
    first, second = prompts
    # The row's own system message wins; the template wraps the last user message.
    assert first.messages == ({"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "1+1? Answer after ####."})
    assert (first.answer, first.data_source, first.extra_info) == ("2", "openai/gsm8k", {"split": "train"})
    assert second.messages == ({"role": "system", "content": "You are a math tutor."},
                               {"role": "user", "content": "2+2? Answer after ####."})
    assert (second.text, second.answer, second.data_source, second.extra_info) == (
        "2+2? Answer after ####.", "4", "", {})


def test_parquet_chat_prompts(tmp_path):
    messages = [{"role": "user", "content": "3+3?"}]
    pq.write_table(pa.table({"prompt": [messages], "extra_info": [{"answer": "6"}]}), tmp_path / "d.parquet")
    (prompt,) = load_prompts(tmp_path / "d.parquet", answer_field="extra_info.answer")
    assert prompt.messages == tuple(messages) and prompt.answer == "6"


@pytest.mark.parametrize("row,needle", [
    ({"prompt": [{"role": "user", "content": 3}]}, "d.jsonl:1: prompt[0] must be {role: system|user|assistant"),
    ({"prompt": [{"role": "bot", "content": "x"}]}, "prompt[0] must be"),
    ({"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "the last message must be the user's"),
    ({"prompt": []}, "must be a non-empty string or a chat-message list"),
    ({"prompt": {"text": "x"}}, "got dict"),
    ({"prompt": "x", "extra_info": "oops"}, "field 'extra_info' (spec.data.extraInfoField) must be an object"),
])
def test_bad_chat_rows_name_the_row_and_field(tmp_path, row, needle):
    with pytest.raises(DataError) as info:
        load_prompts(_jsonl(tmp_path / "d.jsonl", [row]))
    assert needle in str(info.value)


def test_overlong_prompts_error_or_filter_never_truncate(tmp_path):
    prompts = load_prompts(_jsonl(tmp_path / "d.jsonl", [{"prompt": p} for p in ("a", "bb", "ccc")]))
    lengths = [1, 5, 2]
    with pytest.raises(DataError, match="prompt 1 is 5 tokens, longer than rollout.maxPromptLength 3 .*"
                                        "set data.overlongPrompts: filter"):
        check_prompt_lengths(prompts, lengths, 3, "error")
    assert [p.text for p in check_prompt_lengths(prompts, lengths, 3, "filter")] == ["a", "ccc"]
    with pytest.raises(DataError, match="every prompt is longer"):
        check_prompt_lengths(prompts, lengths, 0, "filter")


def test_epochs_become_steps():
    assert steps_for_epochs(1, 7473, 32) == 234  # GSM8K train, 32 prompts a step
    assert steps_for_epochs(3, 10, 4) == 8


def test_check_data_command_fails_in_the_init_container_naming_row_and_field(tmp_path, capsys):
    import yaml

    from kuberl.cli import main

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kuberl.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "j"},
        "spec": {"image": "i", "model": {"uri": "/m"},
                 "data": {"uri": "s3://bucket/d", "answerField": "reward_model.ground_truth"}}}))
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                             "reward_model": {"ground_truth": "1"}}])
    assert main(["check-data", "--config", str(config), str(good)]) == 0
    assert "1 prompts usable for spec.data" in capsys.readouterr().out
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"question": "no prompt"}])
    assert main(["check-data", "--config", str(config), str(bad)]) == 1
    assert "bad.jsonl:2: no field 'prompt' (spec.data.promptField)" in capsys.readouterr().err


# --- hostile and mistaken data files: the loader and `kuberl check-data` (as the init container runs
# it; its entry point as a subprocess: tests/engine/driver/test_check_data_cli.py) both end in one
# message naming the file and line, never a traceback ------------------------------------------------


def _spec(data: dict | None = None, **rest):
    return RLTrainingJobSpec.model_validate({"image": "i", "model": {"uri": "/m"},
                                             "data": {"uri": "s3://bucket/d", **(data or {})}, **rest})


def _check_data(tmp_path, path, data: dict | None = None, **rest) -> subprocess.CompletedProcess:
    """``kuberl check-data --config job.yaml PATH`` as the head pod's init container runs it, in this
    process: an exception it let out would fail the test here as a traceback would fail it there.
    Its logging is set up as in a fresh process (basicConfig finds no root handler), then put back."""
    from kuberl.cli import main

    config = tmp_path / "job.yaml"
    spec = _spec(data, **rest).model_dump(mode="json", by_alias=True, exclude_none=True)
    config.write_text(yaml.safe_dump({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLTrainingJob",
                                      "metadata": {"name": "j"}, "spec": spec}))
    args = ["check-data", "--config", str(config), str(path)]
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _refused_everywhere(tmp_path, path, needles: list[str], data: dict | None = None, **rest):
    with pytest.raises(DataError) as info:
        load_for_spec(path, _spec(data, **rest))
    assert all(needle in str(info.value) for needle in needles), str(info.value)
    result = _check_data(tmp_path, path, data, **rest)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert all(needle in result.stderr for needle in needles), result.stderr


def _parquet(path, rows=3):
    pq.write_table(pa.table({"prompt": ["q"] * rows, "answer": ["a"] * rows}), path)
    return path


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "q", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n',
     "d.jsonl:2: not valid UTF-8 (byte 0xe9 at column 16)"),
    ('{"prompt": "q", "answer": "1"}\n'.encode("utf-16"), "d.jsonl:1: the file is UTF-16"),
    ('{"prompt": "q", "answer": "1"}\n{"prompt": "r", "answer": "2"}\n'.encode("utf-16-le"),
     "d.jsonl:1: holds NUL bytes (UTF-16 text without a byte-order mark?)"),
    (b'{"prompt": "q", "answer": "1"}\n{"prompt": "q", "answer": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
     "d.jsonl:2: nested too deeply to parse"),
    (b'{"prompt": "q", "answer": ' + b"[" * 200 + b"]" * 200 + b"}\n",
     "d.jsonl:1: field 'answer' (spec.data.answerField) nests more than 100 levels deep"),
    (b'{"prompt": "q", "answer": ' + b"9" * 5000 + b"}\n", "d.jsonl:1: not valid JSON (Exceeds the limit"),
], ids=["invalid-utf8", "utf16-bom", "utf16-no-bom", "nested-100000", "nested-200", "huge-integer"])
def test_undecodable_or_too_deep_rows_name_file_and_line(tmp_path, content, needle):
    (tmp_path / "d.jsonl").write_bytes(content)
    _refused_everywhere(tmp_path, tmp_path / "d.jsonl", [needle])


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "q", "answer": "1"}\n')
    assert [p.text for p in load_prompts(tmp_path / "d.jsonl")] == ["q"]


@pytest.mark.parametrize("name, content, fmt, needles", [
    ("d.jsonl", "jsonl", "parquet", ["d.jsonl: cannot be read as Parquet: it holds JSON lines; "
                                     "set spec.data.format: jsonl"]),
    ("d.parquet", "jsonl", "auto", ["d.parquet: cannot be read as Parquet: it holds JSON lines; name it .jsonl"]),
    ("d.parquet", "parquet", "jsonl", ["d.parquet:1: this is a Parquet file, read as JSON lines: "
                                       "set spec.data.format: parquet"]),
    ("d.jsonl", "parquet", "auto", ["d.jsonl:1: this is a Parquet file, read as JSON lines: name it .parquet"]),
    ("d.parquet", "truncated", "auto", ["d.parquet: cannot be read as Parquet: it is truncated or corrupt"]),
    ("dir", "jsonl-dir", "parquet", ["no .parquet files under", "it holds .jsonl files"]),
], ids=["parquet-on-jsonl", "auto-parquet-name-jsonl-bytes", "jsonl-on-parquet", "auto-jsonl-name-parquet-bytes",
        "truncated-parquet", "dir-of-the-other-format"])
def test_the_wrong_format_is_named(tmp_path, name, content, fmt, needles):
    path = tmp_path / name
    if content == "jsonl":
        _jsonl(path, [{"prompt": "q", "answer": "1"}])
    elif content == "parquet":
        path.write_bytes(_parquet(tmp_path / "p.parquet").read_bytes())
    elif content == "truncated":
        whole = _parquet(tmp_path / "p.parquet", rows=100).read_bytes()
        path.write_bytes(whole[:len(whole) // 2])
    else:
        path.mkdir()
        _jsonl(path / "a.jsonl", [{"prompt": "q", "answer": "1"}])
    _refused_everywhere(tmp_path, path, needles, {"format": fmt})


@pytest.mark.parametrize("row, data, needle", [
    ({"prompt": "q", "reward_model": {"ground_truth": "1"}}, {"answerField": "reward_model.ground_truht"},
     "no row has field 'reward_model.ground_truht' (spec.data.answerField); the rows' fields are "
     "['prompt', 'reward_model']"),
    ({"prompt": "q", "solution": "1"}, {},  # the default name, while the built-in reward scores answers
     "no row has field 'answer' (spec.data.answerField); the rows' fields are ['prompt', 'solution']"),
    ({"prompt": "q", "answer": "1"}, {"dataSourceField": "source"},
     "no row has field 'source' (spec.data.dataSourceField)"),
    ({"prompt": "q", "answer": "1"}, {"extraInfoField": "info"}, "no row has field 'info' (spec.data.extraInfoField)"),
    ({"prompt": "q", "answer": "1"}, {"promptField": "promt"},
     "d.jsonl:1: no field 'promt' (spec.data.promptField); fields are ['answer', 'prompt']"),
], ids=["answer-typo", "answer-default-absent", "data-source-typo", "extra-info-typo", "prompt-typo"])
def test_a_field_in_no_row_is_an_error_naming_it(tmp_path, row, data, needle):
    _refused_everywhere(tmp_path, _jsonl(tmp_path / "d.jsonl", [row, row]), [needle], data)


def test_rows_without_an_answer_are_counted_not_refused(tmp_path, caplog):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"}, {"prompt": "r"}])
    prompts = load_for_spec(path, _spec())
    assert [p.answer for p in prompts] == ["1", None]
    assert "1 of 2 rows have no field 'answer' (spec.data.answerField)" in caplog.text
    result = _check_data(tmp_path, path)
    assert result.returncode == 0, result.stderr
    assert "warning: spec.data.uri" in result.stderr and "1 of 2 rows have no field 'answer'" in result.stderr
    assert "2 prompts usable" in result.stdout


def test_answerless_data_passes_when_no_builtin_reward_scores_answers(tmp_path):
    """A job's own reward function (or agent) may not need answers: the default field may be absent."""
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q"}])
    result = _check_data(tmp_path, path, reward={"function": "kuberl.driver.rewards:repeat_letter"})
    assert result.returncode == 0, result.stderr
    assert "1 of 1 rows have no field 'answer'" in result.stderr


def test_a_data_symlink_leading_out_is_refused(tmp_path):
    """A data directory read where it lies (a mounted path or claim) links only within itself."""
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "a.jsonl", [{"prompt": "q", "answer": "1"}])
    _jsonl(tmp_path / "secret.jsonl", [{"prompt": "token", "answer": "x"}])
    (data / "b.jsonl").symlink_to("../secret.jsonl")
    _refused_everywhere(tmp_path, data, [f"refusing {data / 'b.jsonl'}: it is a symlink", "leading out of the source"])


def _documented_rewards(**provided) -> dict:
    """The Python blocks of docs/rewards.md, run as written (``provided`` stands in for what a
    block calls but does not define, as a job's own module would)."""
    import re
    import textwrap
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "rewards.md").read_text()
    namespace = dict(provided)
    for indent, code in re.findall(r"^( *)```python\n(.*?)^\1```", doc, flags=re.M | re.S):
        exec(compile(textwrap.dedent(code), "docs/rewards.md", "exec"), namespace)
    return namespace


def test_the_documented_reward_functions_score_as_the_page_says():
    # A judge's verdicts, in place of the judge model the example calls.
    verdicts = {"good": "7/10", "bad": "none"}
    documented = _documented_rewards(ask_judge=lambda prompt, response: verdicts[response])
    batch = _inputs(["Answer: 42", "I think 41. Answer: 42", "Answer: 41"], ["42", 42, "42"])
    assert score(documented["exact_answer"], batch) == [1.0, 1.0, 0.0]
    graded = [RewardInput(prompt="", response="it is 42", answer=42),
              RewardInput(prompt="", response="it is 4", answer=42, finish_reason="length"),
              RewardInput(prompt="", response="42", answer="42", data_source="bonus")]
    assert score(documented["graded"], graded) == [1.0, -0.5, 2.0]
    assert score(documented["judged"], _inputs(["good", "bad"], [None, None])) == [0.7, 0.0]


def test_the_documented_error_is_the_one_a_string_reward_gets():
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "rewards.md").read_text()
    with pytest.raises(RewardError) as error:
        score(lambda batch: [0.0] * 5 + ["1e3"], _inputs(["r"] * 6, [None] * 6),
              name="spec.reward.function my_rewards:exact_answer")
    assert f"```\n{error.value}\n```" in doc
