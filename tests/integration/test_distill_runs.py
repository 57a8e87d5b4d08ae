"""On-policy distillation on CPU: the quick-start's path (the student learns from the SFT teacher,
by reverse KL and by GKD), a LoRA student whose teacher is its own base, the teacher on its own
pool, exact resume, the task reward mixed in, and async training."""

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keel.api import train
from keel.cli import main

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart"
LORA = {"lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def distill_steps(run_dir: Path) -> list[dict]:
    """The training steps' records (not step 0's validation)."""
    return [m for m in read_metrics(run_dir) if "distill/reverse_kl" in m]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def with_teacher(tiny_config: dict, teacher: Path, **distillation) -> dict:
    """tiny_config distilled from `teacher` (same tokenizer), without validation."""
    tiny_config["distillation"] = {"enable": True, "teacher": {"path": str(teacher)}}
    tiny_config["distillation"].update(distillation)
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    return tiny_config


@pytest.fixture(scope="module")
def quickstart_dir(quickstart_data, tmp_path_factory) -> Path:
    """A directory laid out as the README reader's checkout after `python
    examples/quickstart/prepare.py && keel sft examples/quickstart/sft.yaml`."""
    root = tmp_path_factory.mktemp("reader")
    shutil.copytree(QUICKSTART, root / "examples" / "quickstart")
    (root / "examples" / "data").symlink_to(quickstart_data)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert main(["sft", "examples/quickstart/sft.yaml"]) == 0
    assert (root / "checkpoints" / "quickstart" / "sft_digits" / "config.json").is_file()
    return root


@pytest.mark.parametrize("mode", ["reverse_kl", "gkd"])
def test_the_quickstart_student_learns_from_its_sft_teacher(quickstart_dir, monkeypatch, mode):
    """`keel train examples/quickstart/distill.yaml` (and its gkd line) as the README has it: the
    student's samples move toward what the teacher would write."""
    monkeypatch.chdir(quickstart_dir)
    overrides = [f"distillation.mode={mode}", f"trainer.experiment_name={mode}"]
    assert main(["train", "examples/quickstart/distill.yaml", *overrides]) == 0
    steps = distill_steps(quickstart_dir / "checkpoints" / "quickstart" / mode)
    assert [m["step"] for m in steps] == list(range(1, 31))

    def first_and_last(key: str) -> tuple[float, float]:
        return mean([m[key] for m in steps[:5]]), mean([m[key] for m in steps[-5:]])

    # the teacher finds the student's samples likelier as it learns
    kl_start, kl_end = first_and_last("distill/reverse_kl")
    teacher_start, teacher_end = first_and_last("distill/teacher_log_prob")
    assert kl_end < kl_start and teacher_end > teacher_start
    if mode == "gkd":
        loss_start, loss_end = first_and_last("distill/gkd_loss")
        assert loss_end < loss_start
        # the teacher is in the loss alone: no advantage (task_reward_coef=0)
        assert all(m["critic/advantages/max"] == m["critic/advantages/min"] == 0 for m in steps)


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_a_lora_student_s_teacher_at_its_own_path_is_never_its_base(
    tiny_config, tiny_assets, engine
):
    """Self-distillation's setup: LoRA on the student, the teacher at the student's model.path.
    The teacher is a model of its own: the updates (and the engine's sync of them) leave its scores
    of a fixed batch as a freshly loaded model's, while the student moves away from it."""
    from keel.config.load import load_config
    from keel.data.prompts import collate_prompts
    from keel.distributed.group import LocalGroup
    from keel.distributed.roles import log_prob_batching
    from keel.distributed.worker import RoleWorker, WorkerSpec
    from keel.models.load import load_causal_lm
    from keel.trainer.roles import WorkerRoles
    from keel.trainer.setup import load_prompts
    from keel.training.teacher import Teacher
    from keel.types import SamplingParams, TrainBatch

    tiny_config["actor_rollout_ref"]["model"].update(LORA)
    tiny_config["actor_rollout_ref"]["rollout"]["name"] = engine
    cfg = load_config(
        with_teacher(tiny_config, tiny_assets["model"]),
        ["trainer.device=cpu", "actor_rollout_ref.actor.optim.lr=5e-2"],
    )
    worker = RoleWorker(WorkerSpec.of(cfg, total_steps=3))
    roles = WorkerRoles.of(LocalGroup(worker), cfg, pad_token_id=worker.tokenizer.pad_token_id)
    prompts = collate_prompts(
        load_prompts(cfg.data.train_files, worker.tokenizer, cfg, "train")[:4],
        worker.tokenizer.pad_token_id,
    ).repeat_interleave(4)
    generated, _ = roles.generation.generate(prompts, SamplingParams(n=4, max_new_tokens=8), 0)
    zeros = torch.zeros(generated.response_mask.shape)
    torch.manual_seed(0)
    batch = TrainBatch.of(
        generated,
        scores=torch.zeros(len(generated)),
        token_level_rewards=zeros,
        advantages=torch.randn(zeros.shape) * generated.response_mask,
        returns=zeros,
    )
    before = roles.teacher_scores(batch).log_probs
    # B starts at 0: the student starts as its teacher
    torch.testing.assert_close(roles.actor_log_probs(batch), before, atol=1e-5, rtol=1e-5)
    for seed in range(3):
        batch = replace(batch, old_log_probs=roles.actor_log_probs(batch))
        assert roles.update_actor(batch, seed=seed)["actor/grad_norm"] > 0
    # a generation after the updates (the engine took the adapters): the teacher scores as before
    roles.generation.generate(prompts, SamplingParams(n=4, max_new_tokens=8), 1)
    after = roles.teacher_scores(batch).log_probs
    assert torch.equal(after, before)
    fresh = Teacher(
        load_causal_lm(tiny_assets["model"], torch.device("cpu")),
        log_prob_batching(cfg.distillation.teacher),
        cfg.actor_rollout_ref.rollout.temperature,
        top_k=None,
    )
    torch.testing.assert_close(after, fresh.score(batch).log_probs, atol=1e-6, rtol=1e-6)
    # while the student moved away from it
    moved = (roles.actor_log_probs(batch) - after).abs().max()
    assert moved > 1e-2
    merged = worker.actor.model.merge_and_unload().state_dict()
    teacher = worker.teacher.model.state_dict()
    assert any(not torch.equal(merged[name], teacher[name]) for name in teacher)


def test_a_teacher_on_workers_of_its_own(tiny_config, ending_model, tmp_path):
    """distillation.teacher.enable_resource_pool: the teacher in a Ray worker of its own, the
    policy in another; the run completes and learns from it. gkd: every score the teacher gives
    (the sampled tokens' log-probs, and the top-k) travels from its pool."""
    import subprocess
    import sys

    import yaml

    pytest.importorskip("ray")
    config = tmp_path / "distill.yaml"
    config.write_text(yaml.safe_dump(with_teacher(tiny_config, ending_model, mode="gkd")))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "train",
            str(config),
            "trainer.device=cpu",
            "distillation.teacher.enable_resource_pool=true",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 1 teacher workers" in proc.stderr
    steps = distill_steps(Path(tiny_config["trainer"]["default_local_dir"]))
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["timing_s/teacher"] > 0 for m in steps)
    # the pool's teacher scores as the colocated one: the same samples, the same distill/*
    tiny_config["trainer"]["default_local_dir"] = str(tmp_path / "colocated")
    colocated = distill_steps(train(tiny_config, ["trainer.device=cpu"]).run_dir)
    for pooled, local in zip(steps, colocated):
        assert "distill/gkd_loss" in pooled
        for key in [k for k in local if k.startswith("distill/")]:
            assert pooled[key] == pytest.approx(local[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["reverse_kl", "gkd"])
def test_a_resumed_distillation_run_continues_as_an_uninterrupted_one(
    tiny_config, ending_model, tmp_path, monkeypatch, mode
):
    """Stopped after 2 steps (a checkpoint each step), resumed to 4: the teacher is built again from
    its path (no part of it is in the checkpoint), and steps 3 and 4 are the uninterrupted run's."""
    with_teacher(tiny_config, ending_model, mode=mode)
    tiny_config["trainer"].update({"save_freq": 1, "total_training_steps": 4})

    def run(name: str, steps: int) -> Path:
        trainer = {**tiny_config["trainer"], "default_local_dir": str(tmp_path / name)}
        return train({**tiny_config, "trainer": trainer}, [f"trainer.total_training_steps={steps}"])

    straight = run("straight", 4).run_dir
    assert run("stopped", 2).last_step == 2
    checkpoint = tmp_path / "stopped" / "global_step_2"
    saved = [p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()]
    assert saved and not any("teacher" in name for name in saved)
    from keel.distributed.roles import RoleBuilder

    built_from, build_teacher = [], RoleBuilder.teacher

    def teacher(builder):
        built_from.append(builder.spec.distillation.teacher.path)
        return build_teacher(builder)

    monkeypatch.setattr(RoleBuilder, "teacher", teacher)
    resumed = run("stopped", 4)
    assert built_from == [str(ending_model)]
    assert resumed.last_step == 4
    steps = distill_steps(resumed.run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]

    def numerics(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}

    assert [numerics(m) for m in steps[2:]] == [numerics(m) for m in distill_steps(straight)[2:]]


def reward_file(path: Path, score: str) -> Path:
    path.write_text(
        "import random\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    return {score}\n"
    )
    return path


def test_the_task_reward_counts_by_its_coefficient_alone(tiny_config, ending_model, tmp_path):
    """task_reward_coef=1: the reward's advantage beside the teacher's, both logged. At 0 (the
    default) the reward function changes nothing the update sees: a constant and a random one
    train the same weights (the scores are still logged)."""
    from safetensors.torch import load_file

    with_teacher(tiny_config, ending_model)
    tiny_config["trainer"]["save_freq"] = 2

    def run(name: str, score: str, coef: float) -> Path:
        cfg = {
            **tiny_config,
            "custom_reward_function": {"path": str(reward_file(tmp_path / f"{name}.py", score))},
            "trainer": {**tiny_config["trainer"], "default_local_dir": str(tmp_path / name)},
        }
        return train(cfg, [f"distillation.task_reward_coef={coef}"]).run_dir

    # a fresh draw every call, whatever seeds the run sets
    random_score = "random.SystemRandom().random()"
    mixed, alone = run("mixed", random_score, 1.0), run("random", random_score, 0.0)
    constant = run("constant", "0.5", 0.0)
    for run_dir in (mixed, alone, constant):
        steps = distill_steps(run_dir)
        assert len(steps) == 2 and all("critic/score/mean" in m for m in steps)
        assert all(m["actor/grad_norm"] > 0 for m in steps)
    # the scores differ within groups: with coef 1 the advantages hold them
    assert (
        distill_steps(mixed)[0]["critic/advantages/max"]
        != distill_steps(alone)[0]["critic/advantages/max"]
    )
    assert all(m["critic/score/max"] > m["critic/score/min"] for m in distill_steps(alone))
    weights = [
        load_file(d / "global_step_2" / "actor" / "model.safetensors") for d in (alone, constant)
    ]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    for key in ("actor/pg_loss", "actor/grad_norm", "distill/reverse_kl"):
        assert [m[key] for m in distill_steps(alone)] == [m[key] for m in distill_steps(constant)]


def test_a_constant_reward_is_no_missing_signal_while_the_teacher_teaches(
    tiny_config, ending_model, tmp_path
):
    with_teacher(tiny_config, ending_model)
    tiny_config["custom_reward_function"] = {
        "path": str(reward_file(tmp_path / "constant.py", "0.5"))
    }
    tiny_config["trainer"].update({"total_training_steps": 3, "guards": {"zero_signal_steps": 2}})
    steps = distill_steps(train(tiny_config).run_dir)
    # the student learns from its teacher ...
    assert all(m["actor/grad_norm"] > 0 for m in steps)
    # ... so no warning that it learns nothing
    assert not any("guards/warned_steps/no_signal" in m for m in steps)


def async_run(tiny_config, ending_model, *overrides: str, mode: str = "reverse_kl") -> Path:
    """The run directory of 3 async steps (bound 1) distilled from `ending_model`."""
    with_teacher(tiny_config, ending_model, mode=mode)
    tiny_config["trainer"].update({"mode": "async", "total_training_steps": 3})
    return train(tiny_config, list(overrides)).run_dir


@pytest.mark.parametrize("mode", ["reverse_kl", "gkd"])
def test_async_distillation_trains_samples_a_version_old(tiny_config, ending_model, mode):
    """trainer.mode=async (bound 1): the teacher scores each batch as it is trained."""
    steps = distill_steps(async_run(tiny_config, ending_model, mode=mode))
    assert [m["step"] for m in steps] == [1, 2, 3]
    # off-policy from step 2 on
    assert [m["async/staleness/max"] for m in steps] == [0, 1, 1]
    keys = ["distill/teacher_log_prob", "distill/student_log_prob"]
    keys += ["distill/gkd_loss"] if mode == "gkd" else []
    assert all(math.isfinite(m[key]) and m["actor/grad_norm"] > 0 for m in steps for key in keys)


@pytest.mark.parametrize(
    "correction, judged_by",
    [
        # verl's bypass mode: the sampler's policy is the old one, so its log-probs stand in (the
        # README says so): no old-log-prob pass runs
        ([], "sampler"),
        (["algorithm.rollout_correction.rollout_is=token"], "trainer"),
    ],
    ids=["bypass", "decoupled"],
)
def test_async_distillation_judges_the_student_by_the_old_policy_the_update_uses(
    tiny_config, ending_model, monkeypatch, correction, judged_by
):
    """The reverse-KL advantage and distill/* compare the teacher with the update's old policy:
    the student's log-probs before the update where the pass runs (decoupled), the sampler's in
    bypass mode."""
    from keel.trainer import train_batch

    seen, real = [], train_batch.TrainBatchBuilder._teacher_scores

    def recording(self, scored, old, at):
        current = self.components.workers.actor_log_probs(scored)
        expected = scored.sampling_log_probs if judged_by == "sampler" else current
        student = train_batch.student_log_probs(scored, old)
        seen.append((at.step, ((student - expected) * scored.response_mask).abs().max().item()))
        return real(self, scored, old, at)

    monkeypatch.setattr(train_batch.TrainBatchBuilder, "_teacher_scores", recording)
    async_run(tiny_config, ending_model, *correction)
    assert [step for step, _ in seen] == [1, 2, 3]
    assert all(gap < 1e-4 for _, gap in seen), seen
