"""keel bench: a real (tiny) GRPO run timed per phase, one JSON record appended per run."""

import json
import math
import subprocess
import sys

import pytest

from keel.bench import run
from keel.bench.distill import DISTILL_WORKLOADS, distill_settings, teacher_config
from keel.bench.record import busy_unprofiled
from keel.bench.workloads import WORKLOADS, shape_config
from keel.cli import main
from keel.config.load import load_config

REQUIRED = (
    "workload",
    "date",
    "commit",
    "device",
    "step_time_s",
    "gen_tokens_per_s",
    "update_tokens_per_s",
    "update_mfu",
    "throughput_tokens_per_s_per_gpu",
    "peak_memory_gb",
    "log_prob_gap",
    "decode_tokens_per_s",
    "decode_bandwidth_utilisation",
    "update_mfu_datasheet",
    "datasheet",
    "peak_tflops_measured",
    "logprob_tokens_per_s",
    "peak_memory_gb_per_phase",
)


def test_bench_appends_a_record_with_the_required_fields(tmp_path, capsys, monkeypatch):
    # what a copy of the tree without git history reports
    monkeypatch.setenv("KEEL_COMMIT", "abc1234")
    out = tmp_path / "results.jsonl"
    assert (
        main(
            [
                "bench",
                "tiny,tiny",
                "trainer.device=cpu",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--out",
                str(out),
                "--profile",
                str(tmp_path / "profile"),
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(set(REQUIRED) <= set(r) for r in records)
    r = records[0]
    assert r["workload"] == "tiny" and r["engine"] == "NativeRolloutEngine" and r["n_gpus"] == 1
    assert r["commit"] == "abc1234"
    # one worker: the actor's weights go into its engine device to device; on CPU no graphs, so
    # no cache is kept (free_cache_engine unset)
    assert r["weight_sync"]["path"] == "in place on the device" and r["weight_sync"]["seconds"] > 0
    assert r["kv_cache"]["kept"] is False
    # what differed from the workload
    assert r["overrides"] == ["trainer.device=cpu"]
    assert (
        r["step_time_s"] > r["timing_s"]["gen"] > 0
        and r["gen_tokens_per_s"] > 0
        and r["update_tokens_per_s"] > 0
    )
    # fixed-length responses: every sample generated 16 tokens
    assert r["gen_tokens_per_s"] == 4 * 4 * 16 / r["timing_s"]["gen"]
    # (decode's rate against the whole generation's is a race on a busy machine: not asserted)
    assert r["decode_tokens_per_s"] == 4 * 4 * 15 / r["timing_s"]["gen_decode"]
    # no GPU: no peak, no datasheet to read against
    assert r["update_mfu"] is None and r["datasheet"] is None
    assert r["logprob_tokens_per_s"] > 0
    # float32 on CPU: sampler and trainer agree
    assert 0 <= r["log_prob_gap"] < 1e-3
    # and printed
    assert capsys.readouterr().out.count('"workload": "tiny"') == 2
    # --profile: one more step's operators, with keel's phases as named ranges
    table = (tmp_path / "profile" / "profile_tiny_1gpu.txt").read_text()
    assert "update_actor" in table and "aten::mm" in table


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_config_is_valid(name, gpus, tmp_path, monkeypatch):
    """Each workload's generated config passes keel's checks on 1 and 2 GPUs (w2's first version
    asked for micro-batches of 7 samples in mini-batches of 64: KEEL-C004 on the GPU machine)."""
    monkeypatch.setattr(run, "make_model", lambda shape, out_dir, mean_response=None: out_dir)
    cfg = load_config(run.bench_config(name, WORKLOADS[name], tmp_path, 2, gpus))
    per_gpu = (
        cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n // gpus
    )
    assert per_gpu % cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 0


def test_the_multi_turn_workload_counts_the_models_tokens_only(tmp_path):
    """tinym (m1's shape on the tiny model): 4 assistant turns of 8 tokens with an environment
    answering between them; the record counts the 32 tokens the model generated, not the
    template's."""
    out = tmp_path / "m.jsonl"
    assert (
        main(
            [
                "bench",
                "tinym",
                "trainer.device=cpu",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["gen_tokens_per_s"] == pytest.approx(4 * 4 * 32 / r["timing_s"]["gen"])
    # the environment's steps
    assert r["timing_s"]["gen_tools"] > 0


def test_the_agent_workload_drives_the_same_episodes_through_the_endpoint(tmp_path):
    """tinyma (m1a's shape on the tiny model): tinym's episodes by an OpenAI-client agent through
    keel's endpoint, every sample's 4 requests answered, none failed or dropped."""
    pytest.importorskip("openai")
    out = tmp_path / "ma.jsonl"
    assert (
        main(
            [
                "bench",
                "tinyma",
                "trainer.device=cpu",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["agent"]["requests_per_sample"] == 4
    assert r["agent"]["errors"] == r["agent"]["dropped"] == r["agent"]["prefix_breaks"] == 0


def test_gpu_busy_without_the_profiler_is_the_profiled_gpu_time_over_the_measured_wall_time():
    """The profiler slows the host, not the GPU: a phase's GPU seconds from the profiled step over
    its mean unprofiled wall time, capped at 1; phases without a timer are left out."""
    steps = [
        {"timing_s/gen": 0.4, "timing_s/update_actor": 0.5},
        {"timing_s/gen": 0.5, "timing_s/update_actor": 0.5},
    ]
    shares = busy_unprofiled({"gen": 0.36, "update_actor": 0.6, "worker/generate": 0.3}, steps)
    assert shares == {"gen": 0.8, "update_actor": 1.0}


def test_the_profiled_step_is_one_more_and_left_out_of_the_timings(tmp_path, monkeypatch):
    """--profile runs under torch.profiler, which slows the host: it profiles a step after the
    measured ones, and the record's timings are the measured steps' alone."""
    from keel.trainer.rl import RLTrainer

    steps, guarded_step = [], RLTrainer.guarded_step

    # each step's metrics, as the bench sees them
    def recorded_step(trainer, logger):
        steps.append(guarded_step(trainer, logger))
        return steps[-1]

    monkeypatch.setattr(RLTrainer, "guarded_step", recorded_step)
    record = run.run_bench(
        "tiny",
        steps=1,
        warmup=1,
        overrides=["trainer.device=cpu"],
        workdir=tmp_path,
        profile_dir=tmp_path / "profile",
    )
    # warm-up, measured, profiled
    assert len(steps) == 3
    assert record["step_time_s"] == steps[1]["timing_s/step"]
    assert (tmp_path / "profile" / "profile_tiny_1gpu.txt").exists()


def test_the_variable_length_workload_ends_responses_by_eos_and_records_partial_rollouts(tmp_path):
    """tinyv (v2's shape on the tiny model): the generation config's stop tokens end responses at
    lengths that differ; with partial rollouts the record says how many trained samples spanned two
    policies."""
    out = tmp_path / "v.jsonl"
    settings = ["trainer.mode=async", "trainer.partial_rollout=true", "trainer.device=cpu"]
    assert (
        main(["bench", "tinyv", *settings, "--steps", "3", "--warmup", "0", "--out", str(out)]) == 0
    )
    r = json.loads(out.read_text())
    # ended by stop tokens, not all at the limit
    assert 1 < r["response_length_mean"] < 64
    assert set(r["async"]) >= {"partial", "dropped", "staleness/max", "in_flight"}
    assert r["async"]["staleness/max"] <= 1


def test_the_distillation_workload_times_the_teachers_pass_against_the_students(tmp_path):
    """tinyo (o1's harness on tiny shapes, the teacher twice the student's width): the record has
    the teacher's pass over the student's old-log-prob pass and update (teacher_share), says which
    passes those were, and carries distill/reverse_kl of every step; gkd on one mini-batch too,
    where the update's own forward stands in for the old-log-prob pass."""
    out = tmp_path / "o.jsonl"
    on_policy_gkd = ["distillation.mode=gkd", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    for settings in ([], on_policy_gkd):
        command = ["bench", "tinyo", "trainer.device=cpu", *settings, "--steps", "1"]
        assert main([*command, "--warmup", "1", "--out", str(out)]) == 0
    reverse_kl, gkd = [json.loads(line) for line in out.read_text().splitlines()]
    for r in (reverse_kl, gkd):
        assert set(REQUIRED) <= set(r) and r["workload"] == "tinyo"
        assert r["teacher"] == "tiny-wide" and r["teacher_parameters"] > r["parameters"]
        assert r["timing_s"]["teacher"] > 0 and r["teacher_share_target"] == 0.5
        # warm-up and measured step
        assert len(r["distill_reverse_kl_per_step"]) == 2
        assert all(math.isfinite(kl) for kl in r["distill_reverse_kl_per_step"])
    # tiny: 4 prompts x 4 samples in 4 mini-batches; the first mini-batch's forward is its own
    t = reverse_kl["timing_s"]
    assert reverse_kl["distill_mode"] == "reverse_kl" and reverse_kl["gkd_top_k"] is None
    assert reverse_kl["old_log_prob_pass"].startswith("recomputed for 12 of 16 samples")
    assert reverse_kl["teacher_share_of"] == "old_log_prob + update_actor"
    assert reverse_kl["teacher_share"] == t["teacher"] / (t["old_log_prob"] + t["update_actor"])
    assert (
        gkd["distill_mode"] == "gkd" and gkd["gkd_top_k"] == 64 and gkd["distill"]["gkd_loss"] > 0
    )
    assert gkd["overrides"] == ["trainer.device=cpu", *on_policy_gkd]
    assert gkd["old_log_prob_pass"].startswith("none: on-policy")
    assert "old_log_prob" not in gkd["timing_s"] and gkd["teacher_share_of"] == "update_actor"
    assert gkd["teacher_share"] == gkd["timing_s"]["teacher"] / gkd["timing_s"]["update_actor"]


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("name", sorted(DISTILL_WORKLOADS))
def test_every_distillation_workload_config_is_valid(name, gpus, tmp_path, monkeypatch):
    """The student's config with the distillation settings passes keel's checks, and the teacher's
    vocabulary is the student's (one tokenizer)."""
    monkeypatch.setattr(run, "make_model", lambda shape, out_dir, mean_response=None: out_dir)
    w = DISTILL_WORKLOADS[name]
    student = WORKLOADS[w.student]
    config = run.bench_config(name, student, tmp_path, 2, gpus)
    cfg = load_config(config, distill_settings(w, tmp_path / "teacher", gpus))
    assert cfg.distillation.enable and cfg.distillation.mode == "reverse_kl"
    teacher, student_shape = teacher_config(w.teacher), shape_config(student.model)
    assert teacher.vocab_size == student_shape.vocab_size
    assert teacher.hidden_size > student_shape.hidden_size


def test_an_async_run_with_a_batch_still_scoring_at_its_end_exits_at_once(tmp_path):
    """s1 in async mode did not finish on a fresh GPU machine: the bench ends with the batch it
    generated ahead still in the scoring workers, and the wait for those terminated workers ran to
    the batch deadline (reward.timeout_s per wave) before the process could exit. tinys is s1's slow
    scorer on the tiny model; with an hour's reward.timeout_s, that wait would outlast the limit
    here, and no sample of the dropped batch is reported as not scored."""
    out = tmp_path / "s.jsonl"
    args = ["bench", "tinys", "trainer.mode=async", "reward.timeout_s=3600", "trainer.device=cpu"]
    done = subprocess.run(
        [sys.executable, "-m", "keel", *args, "--steps", "2", "--warmup", "0", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # batches were generated ahead, a policy version old
    assert json.loads(out.read_text())["async"]["staleness/max"] > 0
    assert "not scored" not in done.stderr + done.stdout
    assert "leaked" not in done.stderr
