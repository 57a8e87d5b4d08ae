"""Rule scorers on hand-picked right, wrong and malformed answers; weighted combinations; DAPO's
overlong penalty worked out by hand."""

from types import SimpleNamespace

import pytest
import torch

from keel.config.reward import OverlongBufferConfig
from keel.errors import NO_SCORER, KeelError
from keel.rewards.reward_fn import RewardScorer, overlong_penalty
from keel.rewards.scorers import (
    extract_choice,
    gsm8k_flexible,
    last_boxed,
    math_equivalent,
    multiple_choice,
    regex_match,
    think_answer_format,
)


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        # boxed fraction vs decimal
        ("so x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        # unboxed, 'the answer is'
        ("The answer is 1/2.", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("Final answer: 6", "6", 1.0),
        # equal after simplification
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        # wrong
        ("\\boxed{3}", "4", 0.0),
        # no extractable final answer
        ("I think it is 4", "4", 0.0),
        # cut off mid-box: malformed
        ("\\boxed{\\frac{1}{2", "0.5", 0.0),
        ("", "4", 0.0),
    ],
)
def test_math_equivalent(response, truth, expected):
    assert math_equivalent("lighteval/MATH", response, truth) == expected


def test_verls_math_data_sources_score_as_verl_not_as_math_equivalent():
    """The issue's responses: verl's math_dapo rule for `math` (an `Answer:` line, +1 or -1), verl's
    boxed-only MATH rule for the MATH sets; keel's lenient scorer only where a config names it."""
    responses = [
        "Answer: 72",
        "Answer: 73",
        "the answer is 72",
        "so \\boxed{72}",
        "the answer is 1/2",
    ]
    truths = ["72", "72", "72", "72", "\\frac{1}{2}"]
    dapo = RewardScorer().score_batch([record("math", t) for t in truths], responses)
    assert dapo.scores.tolist() == [1.0, -1.0, -1.0, 1.0, -1.0]
    assert [extra["pred"] for extra in dapo.extras] == ["72", "73", "[INVALID]", "72", "[INVALID]"]
    boxed_only = RewardScorer().score(
        [record("HuggingFaceH4/MATH-500", t) for t in truths], responses
    )
    assert boxed_only.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    lenient = RewardScorer(by_source={"math": {"math_equivalent": 1.0}})
    # it reads boxed answers and "the answer is" (not `Answer:` lines), judged by math-verify: 1/2 =
    # \\frac{1}{2}
    assert lenient.score([record("math", t) for t in truths], responses).tolist() == [
        0.0,
        0.0,
        1.0,
        1.0,
        1.0,
    ]


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "response, expected",
    [
        ("she pays 1,200 dollars.", 1.0),
        ("#### 1200", 1.0),
        ("1200 then 1201", 0.0),
        ("no number", 0.0),
    ],
)
def test_gsm8k_flexible_takes_the_last_number(response, expected):
    assert gsm8k_flexible("gsm8k", response, "1200") == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is (B).", "B"),
        ("\\boxed{D}", "D"),
        ("c", "C"),
        ("(A) looks wrong, so (C)", "C"),
        ("I am not sure", None),
    ],
)
def test_extract_choice(response, expected):
    assert extract_choice(response) == expected


def test_multiple_choice():
    assert multiple_choice("mmlu", "The answer is (B).", "B") == 1.0
    assert multiple_choice("mmlu", "The answer is (B).", "(C)") == 0.0
    assert multiple_choice("mmlu", "no idea", "B") == 0.0


def test_regex_and_format():
    assert regex_match("x", " The result: 42\n", r"The result: \d+") == 1.0
    # the whole response
    assert regex_match("x", "The result: 42 apples", r"The result: \d+") == 0.0
    assert think_answer_format("x", "<think>2+2</think>\n<answer>4</answer>") == 1.0
    assert think_answer_format("x", "<answer>4</answer>") == 0.0
    assert think_answer_format("x", "<think>a</think><answer>4</answer> trailing") == 0.0


def record(source, truth):
    return SimpleNamespace(data_source=source, ground_truth=truth, extra_info={}, index=0)


def test_weighted_scorers_with_breakdown():
    scorer = RewardScorer(by_source={"gsm8k": {"gsm8k_flexible": 0.9, "think_answer_format": 0.1}})
    responses = [
        "<think>6*7</think><answer>42</answer>",
        "42",
        "<think>x</think><answer>41</answer>",
    ]
    result = scorer.score_batch([record("gsm8k", "42")] * 3, responses)
    scores, metrics = result.scores, result.metrics
    # 0.9*1 + 0.1*1 = 1.0; 0.9*1 + 0.1*0 = 0.9; 0.9*0 + 0.1*1 = 0.1
    assert scores.tolist() == pytest.approx([1.0, 0.9, 0.1])
    assert metrics["reward/gsm8k_flexible/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/think_answer_format/mean"] == pytest.approx(2 / 3)


def test_unknown_scorer_name_is_refused():
    with pytest.raises(KeelError) as info:
        RewardScorer(by_source={"gsm8k": {"gsm8k_strict": 1.0}})
    assert info.value.code == NO_SCORER and "gsm8k_strict" in info.value.message


def test_overlong_penalty():
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    # max 10, buffer 4: no penalty up to 6 tokens; 8 tokens exceed by 2 -> -2/4 = -0.5; 10 -> -1
    penalty = overlong_penalty(torch.tensor([3, 6, 8, 10]), 10, cfg)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    scorer = RewardScorer(lambda *a: 1.0, overlong=cfg, max_response_length=10)
    result = scorer.score_batch([record("x", "1")] * 2, ["a", "b"], torch.tensor([5, 9]))
    scores, metrics = result.scores, result.metrics
    # 9 tokens: -3/4
    assert scores.tolist() == pytest.approx([1.0, 0.25])
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.375)


def test_running_normalizer_by_hand_and_its_state():
    from keel.rewards.normalize import RunningNormalizer

    norm = RunningNormalizer(window_size=4, eps=0.0, clip=None)
    z, metrics = norm(torch.tensor([1.0, 3.0]))
    # window [1, 3]: mean 2, std (unbiased) sqrt(2) = 1.41421 -> [-0.70711, 0.70711]
    assert z.tolist() == pytest.approx([-0.70711, 0.70711], abs=1e-5)
    assert metrics["reward/norm_mean"] == pytest.approx(2.0)
    # window keeps the last 4: [3, 5, 7, 9], mean 6, std 2.58199
    z, _ = norm(torch.tensor([5.0, 7.0, 9.0]))
    assert z.tolist() == pytest.approx([-0.38730, 0.38730, 1.16190], abs=1e-5)
    restored = RunningNormalizer(4, 0.0, None)
    restored.load_state_dict(norm.state_dict())
    assert restored(torch.tensor([6.0]))[0].tolist() == norm(torch.tensor([6.0]))[0].tolist()
    clipped = RunningNormalizer(8, 0.0, clip=0.5)(torch.tensor([0.0, 10.0]))[0]
    assert clipped.tolist() == pytest.approx([-0.5, 0.5])


def test_the_tools_demo_scores_the_final_answer_not_the_tools_output():
    from keel.rewards.scorers import tool_arithmetic

    info = {"last_turn": "281764", "tool_outputs": ["281764"]}
    assert tool_arithmetic(
        "keel/tool_arithmetic", "...tool\n281764\nassistant\n281764", "281764", info
    ) == {
        "score": 1.0,
        "correct_call": 1.0,
    }
    # right call, final answer mangled
    copied_wrong = {"last_turn": "28176", "tool_outputs": ["281764"]}
    assert tool_arithmetic("keel/tool_arithmetic", "...281764...", "281764", copied_wrong) == {
        "score": 0.0,
        "correct_call": 1.0,
    }
