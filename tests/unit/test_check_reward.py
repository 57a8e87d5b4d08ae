"""`keel check` scores every data_source of the train and validation files before training, says
which scorer serves each, and warns of a function that never rewards a right answer only when that
is true."""

import json

import pytest

from keel.check.findings import FAIL, PASS, WARN
from keel.check.preflight import run_checks
from keel.check.reward import candidate_answers, truth_texts
from keel.config.load import load_run

from conftest import digit_rows, write_jsonl


def rows(source: str, n: int, truth=lambda i: str(i), start: int = 0) -> list[dict]:
    return [
        {**row, "data_source": source, "reward_model": {"ground_truth": truth(i)}}
        for i, row in enumerate(digit_rows(n, start))
    ]


def check(
    tiny_config, tmp_path, train_rows: list[dict], reward_source: str | None = None, **overrides
):
    train = write_jsonl(tmp_path / "mixed.jsonl", train_rows)
    settings = {"data.train_files": [str(train)], "data.val_files": [], **overrides}
    if reward_source is not None:
        reward = tmp_path / "my_reward.py"
        reward.write_text(reward_source)
        settings["custom_reward_function.path"] = str(reward)
    return run_checks(*load_run(tiny_config, settings))


def reward_findings(report, level):
    return [f for f in report.findings if f.check == "reward" and f.level == level]


def test_a_mixed_file_whose_second_data_source_has_no_scorer_fails_naming_it(tiny_config, tmp_path):
    """The file starts with 8 gsm8k rows; its last rows come from a source no scorer serves."""
    data = rows("openai/gsm8k", 30) + rows("my_lab/puzzles", 2, start=50)
    report = check(tiny_config, tmp_path, data, **{"custom_reward_function.path": None})
    failures = reward_findings(report, FAIL)
    assert [f.code for f in failures] == ["KEEL-R002"]
    assert (
        "my_lab/puzzles" in failures[0].message
        and "openai/gsm8k" not in failures[0].message.split(";")[0]
    )


def test_a_function_that_breaks_on_one_data_source_fails_naming_it(tiny_config, tmp_path):
    """Only the first rows were probed before: a second data_source deep in the file crashed at step
    40."""
    source = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if data_source == 'geometry':\n"
        "        return float(solution_str.split('=')[1] == ground_truth)  # an IndexError on 'x'\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    data = rows("digits", 30) + rows("geometry", 2, start=40)
    report = check(tiny_config, tmp_path, data, source)
    failures = reward_findings(report, FAIL)
    assert [f.code for f in failures] == ["KEEL-R005"]
    assert "'geometry'" in failures[0].message and "IndexError" in failures[0].message


def test_the_report_names_the_scorer_of_each_data_source_in_train_and_val(tiny_config, tmp_path):
    val = write_jsonl(tmp_path / "val.jsonl", rows("openai/gsm8k", 4))
    report = check(
        tiny_config,
        tmp_path,
        rows("keel/arithmetic", 32),
        **{"custom_reward_function.path": None, "data.val_files": [str(val)]},
    )
    lines = [f.message for f in reward_findings(report, PASS)]
    assert any(
        m.startswith("data_source 'keel/arithmetic': scored by built-in `arithmetic`")
        for m in lines
    )
    assert any(
        m.startswith("data_source 'openai/gsm8k': scored by built-in `gsm8k`") for m in lines
    )
    assert not report.failures


def test_a_function_that_never_rewards_is_named_per_data_source(tiny_config, tmp_path):
    source = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if data_source == 'digits' and solution_str == ground_truth else 0.0\n"
    )
    report = check(tiny_config, tmp_path, rows("digits", 30) + rows("words", 2, start=40), source)
    warnings = [f.message for f in reward_findings(report, WARN)]
    assert len(warnings) == 1 and warnings[0].startswith(
        "data_source 'words': the reward function gave no positive"
    )
    # it says what it tried
    assert "#### x" in warnings[0] and "<think>" in warnings[0]


@pytest.mark.parametrize(
    "truth, source",
    [
        # searchR1's dict ground truth, read as verl's search function reads it
        (
            lambda i: {"target": [f"city {i}"]},
            "def compute_score(solution_str, ground_truth, **kw):\n"
            "    return float(any(t in solution_str for t in ground_truth['target']))\n",
        ),
        # a reasoning model's function: no think block, no reward
        (
            lambda i: str(i),
            "def compute_score(solution_str, ground_truth, **kw):\n    return "
            "float(solution_str.startswith('<think>') and "
            "solution_str.rstrip().endswith(ground_truth))\n",
        ),
        # DAPO's `Answer:` line
        (
            lambda i: str(i),
            "import re\n"
            "def compute_score(solution_str, ground_truth, **kw):\n"
            "    found = re.findall(r'Answer:\\s*(\\S+)', solution_str)\n"
            "    return 1.0 if found and found[-1] == ground_truth else -1.0\n",
        ),
    ],
)
def test_no_warning_for_functions_that_reward_right_answers(tiny_config, tmp_path, truth, source):
    report = check(tiny_config, tmp_path, rows("qa", 32, truth), source)
    assert reward_findings(report, WARN) == [] and not report.failures


def test_candidate_answers_read_dict_and_list_ground_truths():
    assert truth_texts({"target": ["Paris", "paris"]}) == ["Paris"]
    assert truth_texts([3, 4]) == ["3"] and truth_texts(72) == ["72"]
    answers = candidate_answers("72")
    assert {"72", "#### 72", "\\boxed{72}", "Answer: 72", "<answer>72</answer>"} <= set(answers)
    assert any(a.startswith("<think>") and a.endswith("#### 72") for a in answers)


def test_keel_check_prints_the_table_of_scorers(tiny_config, tmp_path, capsys):
    import yaml

    from keel.cli import main

    train = write_jsonl(tmp_path / "train.jsonl", rows("openai/gsm8k", 32))
    config = tmp_path / "cfg.yaml"
    tiny_config["data"]["train_files"] = [str(train)]
    tiny_config["data"]["val_files"] = []
    tiny_config["custom_reward_function"] = {"path": None}
    config.write_text(yaml.safe_dump(tiny_config))
    assert main(["check", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    messages = [f["message"] for f in report["findings"] if f["check"] == "reward"]
    assert any(
        "'openai/gsm8k': scored by built-in `gsm8k` (chosen by data_source" in m for m in messages
    )


@pytest.mark.parametrize("task_reward_coef, warned", [(0.0, False), (1.0, True)])
def test_a_reward_that_never_rewards_is_no_warning_where_only_the_teacher_teaches(
    tiny_config, tmp_path, task_reward_coef, warned
):
    """Distillation with task_reward_coef=0 scores and logs the rewards, and learns from the
    teacher alone: a function that never rewards is no reason to say training learns nothing."""
    never = "def compute_score(solution_str, ground_truth, **kw):\n    return 0.0\n"
    teacher = tiny_config["actor_rollout_ref"]["model"]["path"]
    report = check(
        tiny_config,
        tmp_path,
        rows("digits", 8),
        never,
        **{
            "distillation.enable": True,
            "distillation.teacher.path": teacher,
            "distillation.task_reward_coef": task_reward_coef,
        },
    )
    assert bool(reward_findings(report, WARN)) == warned and not report.failures
