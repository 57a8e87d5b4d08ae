"""verl's reward contract: functions are called by keyword as verl calls them, told what verl tells
them, and their dict results' extra keys are kept; the gsm8k scorer scores as verl's does."""

import re
from types import SimpleNamespace

import pytest

from keel.errors import KeelError
from keel.rewards.custom_fn import load_custom_reward_fn
from keel.rewards.reward_fn import RewardScorer
from keel.rewards.scorers import gsm8k, gsm8k_lenient
from keel.rewards.worker import file_spec


def verl_gsm8k(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl/utils/reward_score/gsm8k.py (Apache-2.0, Bytedance), its strict method, as data for
    the comparison below."""
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
    if len(solutions) == 0:
        return 0
    answer = solutions[-1].replace(",", "").replace("$", "")
    return score if answer == ground_truth else format_score


GSM8K_CASES = [
    ("#### 72", "72"),
    ("She sold 72 clips.\n#### 72", "72"),
    ("#### 72.", "72"),
    ("#### 72.0", "72"),
    ("#### 1,250", "1250"),
    ("#### 1,250", "1,250"),
    ("#### $72", "72"),
    ("#### -5", "-5"),
    ("#### - 5", "-5"),
    ("####72", "72"),
    ("#### 72 #### 73", "73"),
    ("#### 73 #### 72", "73"),
    ("The answer is 72", "72"),
    ("", "72"),
    ("#### ", "72"),
    ("#### .5", ".5"),
    ("#### 0.5", ".5"),
    ("#### 3.14", "3.14"),
    ("#### 072", "72"),
    ("#### 72\n", "72"),
    ("#### 72 dollars", "72"),
    ("answer: #### 1,000,000", "1000000"),
    ("#### 1.000", "1000"),
    ("#### 12,34", "1234"),
    ("x" * 400 + "#### 72", "72"),
    ("#### 72" + "x" * 400, "72"),
    ("#### 72" + "x" * 290, "72"),
    ("#### 72" + "x" * 294, "72"),
    ("#### 72" + "x" * 293, "72"),
    ("#### -0", "0"),
    ("#### 5", "5.0"),
    ("**#### 18**", "18"),
    ("#### 18\n#### 19", "19"),
    ("$#### 4$", "4"),
    ("#### 1e3", "1000"),
    ("#### 42", " 42"),
]


@pytest.mark.parametrize("response, truth", GSM8K_CASES)
def test_gsm8k_scores_as_verl_does(response, truth):
    assert gsm8k("openai/gsm8k", response, truth) == float(verl_gsm8k(response, truth))


def test_the_cases_cover_where_the_lenient_scorer_differs():
    differ = [
        (r, t)
        for r, t in GSM8K_CASES
        if gsm8k("openai/gsm8k", r, t) != gsm8k_lenient("openai/gsm8k", r, t)
    ]
    # `#### 72.`, `1,250` vs `1,250`, the 300-character window
    assert len(GSM8K_CASES) >= 30 and len(differ) >= 4


def record(ground_truth="72", extra_info=None):
    return SimpleNamespace(
        data_source="openai/gsm8k",
        ground_truth=ground_truth,
        extra_info=extra_info or {},
        index=0,
        raw_prompt="q",
    )


def write(tmp_path, source: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(source)
    return str(path)


KEYWORD_ONLY = (
    "def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):\n"
    "    assert data_source == 'openai/gsm8k' and extra_info['num_turns'] == 2\n"
    "    return float(solution_str.strip() == ground_truth)\n"
)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_function_declared_as_verl_declares_it_scores_correctly(tmp_path, num_workers):
    """solution_str first, data_source as a keyword: called by position it would compare the
    data_source with the answer and score every sample 0."""
    path = write(tmp_path, KEYWORD_ONLY)
    custom = (
        load_custom_reward_fn(path, "compute_score")
        if num_workers == 0
        else file_spec(path, "compute_score")
    )
    scorer = RewardScorer(custom, num_workers=num_workers)
    try:
        result = scorer.score_batch([record(), record()], ["72", "71"], on_error="raise")
    finally:
        scorer.shutdown()
    assert result.scores.tolist() == [1.0, 0.0]


def test_kwargs_signatures_get_every_name_verl_passes_and_the_reward_kwargs(tmp_path):
    path = write(
        tmp_path,
        "def compute_score(solution_str, ground_truth, **kwargs):\n"
        "    assert set(kwargs) >= {'data_source', 'extra_info', 'bonus'}\n"
        "    return float(solution_str == ground_truth) + kwargs['bonus']\n",
    )
    scorer = RewardScorer(load_custom_reward_fn(path, "compute_score", {"bonus": 0.5}))
    assert scorer.score_batch([record()], ["72"], on_error="raise").scores.tolist() == [1.5]


def test_extra_info_carries_what_verl_adds_without_changing_the_dataset(tmp_path):
    path = write(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return "
        "float(extra_info['num_turns'] == 2 and extra_info['rollout_reward_scores'] == {}\n       "
        "          and extra_info['split'] == 'train')\n",
    )
    row = record(extra_info={"split": "train"})
    result = RewardScorer(load_custom_reward_fn(path, "compute_score")).score_batch(
        [row], ["x"], on_error="raise"
    )
    assert result.scores.tolist() == [1.0] and row.extra_info == {"split": "train"}


def test_extra_keys_of_dict_results_are_logged_and_kept_per_sample(tmp_path):
    path = write(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = solution_str == ground_truth\n"
        "    return {'score': 1.0 if right else -1.0, 'acc': right, 'pred': solution_str}\n",
    )
    result = RewardScorer(load_custom_reward_fn(path, "compute_score")).score_batch(
        [record(), record(), record()], ["72", "1", "72"], on_error="raise"
    )
    assert result.scores.tolist() == [1.0, -1.0, 1.0]
    assert result.metrics["reward_extra/acc/mean"] == pytest.approx(2 / 3)
    assert result.extras[1] == {"acc": False, "pred": "1"}


def test_a_batched_function_is_called_with_verls_keywords(tmp_path):
    path = write(
        tmp_path,
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1):\n"
        "    return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]\n",
    )
    scorer = RewardScorer(
        load_custom_reward_fn(path, "compute_score", {"scale": 2}, batched=True), batched=True
    )
    assert scorer.score_batch(
        [record(), record()], ["72", "0"], on_error="raise"
    ).scores.tolist() == [2.0, 0.0]


@pytest.mark.parametrize(
    "source, needs",
    [
        (
            "def compute_score(ds, s, gt, ei=None):\n    return float(s == gt)\n",
            "['ds', 's', 'gt']",
        ),
        (
            "def compute_score(ds, s, gt, ei, **kwargs):\n    return float(s == gt)\n",
            "['ds', 's', 'gt', 'ei']",
        ),
        ("compute_score = lambda d, s, g, e: float(s == g)\n", "['d', 's', 'g', 'e']"),
        (
            "def compute_score(solution, ground_truth, extra_info=None):\n    return 1.0\n",
            "['solution']",
        ),
        (
            "def compute_score(data_source, solution_str, ground_truth, /):\n    return 1.0\n",
            "['data_source', 'solution_str', 'ground_truth']",
        ),
    ],
)
def test_functions_verl_could_not_call_by_keyword_are_refused_naming_the_parameters(
    tmp_path, source, needs
):
    """verl's call binds by keyword: a parameter of another name would get nothing, and binding by
    position instead (keel's old fallback) handed `ei` the ground truth of a `(s, gt, ei)`
    function."""
    with pytest.raises(KeelError) as caught:
        load_custom_reward_fn(write(tmp_path, source), "compute_score")
    assert caught.value.code == "KEEL-R010"
    assert needs in caught.value.message and "solution_str=..." in caught.value.message


def test_reward_kwargs_can_supply_a_parameter_verl_does_not(tmp_path):
    path = write(
        tmp_path,
        "def compute_score(solution_str, ground_truth, scale):\n"
        "    return scale * float(solution_str == ground_truth)\n",
    )
    scorer = RewardScorer(load_custom_reward_fn(path, "compute_score", {"scale": 3.0}))
    assert scorer.score_batch(
        [record(), record()], ["72", "7"], on_error="raise"
    ).scores.tolist() == [3.0, 0.0]


def test_a_function_taking_only_some_of_verls_names_gets_each_by_its_name(tmp_path):
    """`(ground_truth, solution_str)`: by position the response would be compared as the truth."""
    path = write(
        tmp_path,
        "def compute_score(ground_truth, solution_str):\n"
        "    return float(solution_str.startswith('answer') and ground_truth == '72')\n",
    )
    scorer = RewardScorer(load_custom_reward_fn(path, "compute_score"))
    assert scorer.score_batch(
        [record(), record()], ["answer 72", "72"], on_error="raise"
    ).scores.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("form", ["pkg://{module}", "pkg://{module_path}", "file://{file}"])
def test_verls_pkg_and_file_forms_of_the_reward_path_load(tmp_path, monkeypatch, form):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "gsm8k_score.py").write_text(KEYWORD_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = form.format(
        module="my_rewards.gsm8k_score",
        module_path="my_rewards/gsm8k_score",
        file=package / "gsm8k_score.py",
    )
    scorer = RewardScorer(load_custom_reward_fn(path, "compute_score"))
    assert scorer.score_batch(
        [record(), record()], ["72", "71"], on_error="raise"
    ).scores.tolist() == [1.0, 0.0]


def test_a_pkg_path_that_does_not_import_says_so():
    with pytest.raises(KeelError) as caught:
        load_custom_reward_fn("pkg://no_such_package.rewards", "compute_score")
    assert caught.value.code == "KEEL-R001" and "no_such_package" in caught.value.message
    assert "PYTHONPATH" in caught.value.fix


def test_keel_check_warns_when_no_right_answer_is_ever_rewarded(tiny_config, tmp_path):
    """The seed's "no-reward training": a function that scores every answer 0 without an error."""
    from keel.check.findings import WARN
    from keel.check.preflight import run_checks
    from keel.config.load import load_run

    def reward_warnings(source):
        overrides = {"custom_reward_function.path": write(tmp_path, source)}
        report = run_checks(*load_run(tiny_config, overrides))
        return [f.message for f in report.findings if f.check == "reward" and f.level == WARN]

    never = (
        "def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):\n    "
        "return 0.0\n"
    )
    assert any("no positive score" in message for message in reward_warnings(never))
    assert reward_warnings(KEYWORD_ONLY.replace("'openai/gsm8k'", "'digits'")) == []


def test_the_first_batch_scored_all_zero_with_real_answers_is_a_warning():
    from keel.config.trainer import GuardsConfig
    from keel.observe.guards import LearningSignalGuard

    guard = LearningSignalGuard(GuardsConfig(), group_based=True)
    zero = {"critic/score/max": 0.0, "critic/score/min": 0.0, "response_length/mean": 40.0}
    assert any("every score of this batch is 0" in w for w in guard(1, zero))
    # said once
    assert not any("every score of this batch is 0" in w for w in guard(2, zero))
    fresh = LearningSignalGuard(GuardsConfig(), group_based=True)
    assert fresh(1, {**zero, "critic/score/max": 1.0}) == []
