"""keel report: curves from metrics.jsonl, and a clear error when there are none."""

import json

import pytest

from keel.cli import main
from keel.errors import NO_METRICS, KeelError
from keel.observe.report import panel_lines, series, write_report


def write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "cut'
    )


def test_report_draws_the_panels_a_user_looks_at_first(tmp_path):
    records = [{"step": 0, "val/gsm8k/acc": 0.1}] + [
        {
            "step": s,
            "critic/score/mean": s / 10,
            "actor/entropy": 2 - s / 10,
            "actor/pg_loss": 0.01,
            "actor/ppo_kl": 0.001,
            "actor/grad_norm": 1.0,
            "response_length/mean": 20 + s,
            "timing_s/step": 1.5,
            "val/gsm8k/acc": 0.1 + s / 20,
        }
        for s in range(1, 6)
    ]
    write_metrics(tmp_path, records)
    png, page = write_report(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = page.read_text()
    # self-contained
    assert "data:image/png;base64," in text
    for panel in (
        "reward",
        "held-out accuracy",
        "response length",
        "entropy",
        "PPO KL",
        "policy loss",
        "gradient norm",
        "step time",
    ):
        assert panel in text
    assert series(records, "val/*/acc")["val/gsm8k/acc"][0] == [0, 1, 2, 3, 4, 5]


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(KeelError) as info:
        write_report(tmp_path / "nope")
    assert info.value.code == NO_METRICS
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["report", str(tmp_path)]) == 2


def test_report_shows_the_last_evaluations_conversations_turn_by_turn(tmp_path):
    write_metrics(tmp_path, [{"step": s, "critic/score/mean": 0.5} for s in range(1, 4)])
    conversation = [
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "content": "408 <script>alert(1)</script>"},
        {"role": "assistant", "content": "408"},
    ]
    rows = [
        # training's sample
        {"step": 2, "prompt": "12*34=", "response": "ignored", "score": 0.0},
        {
            "step": 3,
            "split": "val",
            "prompt": "12*34=",
            "response": "408",
            "score": 1.0,
            "conversation": conversation,
        },
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path)[1].read_text()
    assert "samples (evaluation)" in text and "<b>tool</b>" in text and "ignored" not in text
    # the model's and the tool's text, escaped
    assert "&lt;tool_call&gt;" in text and "<script>" not in text


def test_a_curve_equal_to_another_is_dashed_and_named_not_hidden():
    records = [
        {"step": s, "critic/score/mean": s / 10, "critic/rewards/mean": s / 10} for s in range(1, 4)
    ]
    ((title, lines),) = panel_lines(records)
    assert title == "reward"
    assert [(label, style) for label, _, _, style in lines] == [
        ("critic/score/mean", "-"),
        ("critic/rewards/mean (= critic/score/mean)", "--"),
    ]
    # a KL penalty: two curves, both solid
    records[1]["critic/rewards/mean"] = 0.1
    assert [style for *_, style in panel_lines(records)[0][1]] == ["-", "-"]


def test_the_ppo_kl_and_the_reference_kl_are_separate_panels_each_named_for_what_it_is():
    records = [{"step": s, "actor/ppo_kl": 0.01, "actor/entropy": 1.0} for s in range(1, 4)]
    titles = [title for title, _ in panel_lines(records)]
    assert "PPO KL (update vs rollout policy)" in titles and not any(
        "reference" in t for t in titles
    )
    # a run with a reference model (use_kl_loss)
    for record in records:
        record.update({"actor/ref_kl": 0.02, "actor/kl_loss": 0.02})
    panels = dict(panel_lines(records))
    assert [line[0] for line in panels["KL to the reference model"]] == [
        "actor/ref_kl",
        "actor/kl_loss (= actor/ref_kl)",
    ]
    assert [line[0] for line in panels["PPO KL (update vs rollout policy)"]] == ["actor/ppo_kl"]


def test_the_tools_demos_correct_calculator_calls_get_a_panel():
    from keel.demo_tools import TOOLS, ToolDemoSettings

    # the metric the demo's table reports
    key = TOOLS.calls_key(ToolDemoSettings())
    panels = dict(panel_lines([{"step": 0, key: 0.47}, {"step": 10, key: 0.57}]))
    assert [line[0] for line in panels["correct tool calls (held-out)"]] == [key]


def test_the_report_names_the_run_as_the_user_did_never_by_a_temporary_path(tmp_path, monkeypatch):
    run = tmp_path / "demo" / "grpo"
    write_metrics(run, [{"step": 1, "critic/score/mean": 0.5}])
    page = write_report(run)[1].read_text()
    assert "<title>keel report: .../demo/grpo</title>" in page and str(tmp_path) not in page
    monkeypatch.chdir(tmp_path)
    assert "<title>keel report: demo/grpo</title>" in write_report("demo/grpo")[1].read_text()
    # inside the cwd
    assert "<title>keel report: demo/grpo</title>" in write_report(run)[1].read_text()


def test_a_dpo_run_gets_the_panels_of_preference_training():
    records = [
        {
            "step": s,
            "train/loss": 0.69 / s,
            "rewards/accuracies": 0.3 * s,
            "rewards/margins": 0.5 * s,
            "logps/chosen": -40.0 + s,
            "logps/rejected": -140.0 - s,
            "train/grad_norm": 1.0,
            "timing_s/step": 0.1,
        }
        for s in range(1, 4)
    ]
    records[-1]["val/rewards/accuracies"] = 0.9
    panels = dict(panel_lines(records))
    assert [line[0] for line in panels["pairs ranked right"]] == [
        "rewards/accuracies",
        "val/rewards/accuracies",
    ]
    assert [line[0] for line in panels["completion log-probs"]] == [
        "logps/chosen",
        "logps/rejected",
    ]
    assert "reward margin (chosen - rejected)" in panels and "loss" in panels
    # nothing of RL's drawn empty
    assert "reward" not in panels and "entropy" not in panels
