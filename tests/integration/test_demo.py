"""The demo a new user runs first: GRPO must visibly raise held-out accuracy, and reruns are safe."""

import pytest

from keel.demo import DemoSettings, run_demo
from keel.errors import DEMO_DIR, KeelError

# The full demo with a shorter GRPO stage (the SFT stage must reach partial competence as in the
# real demo, or there is nothing for GRPO to amplify).
SHORT = DemoSettings(grpo_steps=40, grpo_prompts=32, grpo_mini_batches=2, test_freq=40)


def test_shortened_demo_raises_heldout_accuracy_and_reruns_cleanly(tmp_path):
    out = tmp_path / "demo"
    first = run_demo(out, SHORT, console=False)
    # measured on 2 CPU cores: 22.0% -> 53.8%; the margin absorbs noise on 400 held-out problems
    assert first.acc_after >= first.acc_before + 0.05, (first.acc_before, first.acc_after)
    assert (out / "grpo" / "report.png").stat().st_size > 10_000

    again = run_demo(out, SHORT, console=False)  # resumes the finished run: same numbers, no crash
    assert (again.acc_before, again.acc_after, again.sft_steps) == (first.acc_before, first.acc_after, first.sft_steps)

    other = run_demo(out, DemoSettings(sft_chunk=5, sft_max_steps=5, grpo_steps=1, grpo_prompts=8,
                                       grpo_mini_batches=1, n_sft=64, n_rl=16, n_dev=8, n_heldout=8, test_freq=1),
                     console=False)
    assert other.sft_steps == 5  # other settings: the old demo was cleared, not mixed in


def test_demo_never_touches_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(KeelError) as info:
        run_demo(tmp_path, SHORT, console=False)
    assert info.value.code == DEMO_DIR
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_the_tools_demo_teaches_calculator_calls_and_grpo_raises_sampled_accuracy(tmp_path):
    """keel demo --task tools, shortened: SFT on tool-use chats until greedy dev accuracy shows the
    call is learnt; multi-turn GRPO (the calculator answering) then raises held-out accuracy."""
    from keel.demo_tools import ToolDemoSettings, run_tools_demo

    short = ToolDemoSettings(grpo_steps=20, test_freq=20)  # the demo's data and SFT, half its GRPO steps
    result = run_tools_demo(tmp_path / "tools", short, console=False)
    # measured on 2 CPU cores, the full demo: 14.8% -> 29.7% at step 20, calls 47% -> 59%
    assert result.acc_after >= result.acc_before + 0.05, (result.acc_before, result.acc_after)
    assert result.calls_after > result.calls_before, (result.calls_before, result.calls_after)
    samples = (tmp_path / "tools" / "grpo" / "samples.jsonl").read_text()
    assert "<tool_call>" in samples and "calculator" in samples
