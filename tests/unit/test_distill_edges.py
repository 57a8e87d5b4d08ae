"""A second reader's attacks on distillation (issue 48): each test shows a way the teacher's
scores or the settings around it could go wrong, as the user would see it."""

import pytest
import torch

from keel.config.load import load_run
from keel.models.load import load_causal_lm
from keel.models.tiny import make_tiny_model
from keel.training.batching import MicroBatching
from keel.training.teacher import Teacher
from keel.types import TrainBatch

from tests_helpers import padded_batch

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    return {
        "student": make_tiny_model(root / "student", hidden_size=16, num_layers=1, seed=0),
        "teacher": make_tiny_model(
            root / "teacher", hidden_size=32, num_layers=2, seed=1, initializer_range=0.3
        ),
        "train": _train_file(root),
    }


def _train_file(root):
    train = root / "train.jsonl"
    train.write_text('{"prompt": "a", "answer": "1"}\n')
    return train


def raw_config(models, **distillation) -> dict:
    return {
        "data": {
            "train_files": [str(models["train"])],
            "max_prompt_length": 8,
            "max_response_length": 6,
            "train_batch_size": 2,
        },
        "actor_rollout_ref": {
            "model": {"path": str(models["student"]), "dtype": "bfloat16"},
            "rollout": {"n": 2, "temperature": TEMPERATURE},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "distillation": {
            "enable": True,
            "teacher": {"path": str(models["teacher"])},
            **distillation,
        },
        "trainer": {"total_training_steps": 1, "logger": [], "device": "cpu"},
    }


def config(models, **distillation):
    return load_run(raw_config(models, **distillation)).config


def batch(vocab: int) -> TrainBatch:
    """Left-padded prompts and right-padded responses, random tokens."""
    return padded_batch(vocab, [4, 2, 3], [5, 3, 6], low=1)


def test_a_float32_teacher_scores_in_float32_under_a_bfloat16_student(models):
    """distillation.teacher.dtype=float32 beside a bfloat16 student: the worker's teacher pass
    equals the float32 teacher's own, not a bfloat16-autocast one (the setting would otherwise
    cost twice the memory for bfloat16's numbers)."""
    from keel.distributed.worker import RoleWorker, WorkerSpec

    cfg = config(models, teacher={"path": str(models["teacher"]), "dtype": "float32"})
    worker = RoleWorker(WorkerSpec.of(cfg, 1, roles=frozenset({"teacher"})))
    assert worker.compute_dtype == torch.bfloat16
    samples = batch(worker.teacher.model.config.vocab_size)
    (scored,) = worker.compute_frozen("teacher", samples)
    plain = Teacher(
        load_causal_lm(models["teacher"], torch.device("cpu")),
        MicroBatching.of(8, False, 0),
        TEMPERATURE,
        None,
    )
    expected = plain.score(samples).log_probs
    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("estimator", ["abs", "mse", "k2"])
def test_a_kl_estimator_with_no_reading_as_an_advantage_is_refused(models, estimator):
    """kl_penalty's abs and k2 are no estimate whose policy gradient the help can name: the
    advantage -|log s - log t| pushes down a token the teacher likes more than the student."""
    from keel.errors import KeelError

    with pytest.raises(KeelError) as refused:
        config(models, kl_estimator=estimator)
    assert refused.value.code == "KEEL-C002"
    assert "k1" in str(refused.value)


@pytest.mark.parametrize("estimator", ["k1", "k3", "kl", "low_var_kl"])
def test_k1_and_k3_by_either_name_are_accepted(models, estimator):
    assert config(models, kl_estimator=estimator).distillation.kl_estimator == estimator


def saved_run(models, tmp_path):
    """A checkpoint directory holding the config of a distillation run."""
    import yaml

    from keel.config.load import to_dict

    checkpoint = tmp_path / "global_step_1"
    checkpoint.mkdir()
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(to_dict(config(models))))
    return checkpoint


@pytest.mark.parametrize(
    "teacher",
    [
        {"log_prob_micro_batch_size_per_gpu": 2},
        {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 64},
        {"enable_resource_pool": True, "n_gpus_per_node": 2},
    ],
)
def test_a_resume_may_change_how_the_teacher_is_batched_and_placed(models, tmp_path, teacher):
    """The teacher's micro-batches and pool change no number (as the reference's and the critic's
    do not): a run whose teacher ran out of memory resumes with smaller ones."""
    from keel.checkpoint import check_same_run

    checkpoint = saved_run(models, tmp_path)
    check_same_run(checkpoint, config(models, teacher={"path": str(models["teacher"]), **teacher}))


def test_a_resume_with_another_teacher_is_refused(models, tmp_path):
    from keel.checkpoint import check_same_run
    from keel.errors import KeelError

    checkpoint = saved_run(models, tmp_path)
    with pytest.raises(KeelError, match="distillation.teacher.path"):
        check_same_run(checkpoint, config(models, teacher={"path": str(models["student"])}))


def test_a_gkd_teacher_with_more_rows_than_the_student_is_no_warning(tiny_config, tmp_path):
    """The teacher draws its top k among the student's ids (Teacher's student_vocab), so keel
    check has nothing to warn of when the teacher's embedding has rows past the student's (as
    Qwen2.5-7B's past 0.5B's)."""
    from transformers import AutoModelForCausalLM

    from keel.check.findings import WARN
    from keel.check.preflight import run_checks

    teacher = make_tiny_model(tmp_path / "teacher", hidden_size=48, seed=1)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(teacher)
    overrides = [
        "trainer.device=cpu",
        "distillation.enable=true",
        f"distillation.teacher.path={teacher}",
        "distillation.mode=gkd",
    ]
    report = run_checks(*load_run(tiny_config, overrides))
    teacher_findings = [f for f in report.findings if f.check == "teacher"]
    assert teacher_findings and not [f for f in teacher_findings if f.level == WARN]


def test_a_teacher_that_is_no_causal_lm_is_refused_by_keel_check(tiny_config, tmp_path):
    """A teacher directory transformers maps to no causal LM (here a T5 config beside the student's
    tokenizer) passed keel check and ended in transformers' ValueError once training began."""
    import json

    from keel.check.preflight import run_checks

    teacher = make_tiny_model(tmp_path / "teacher", hidden_size=48, seed=1)
    config_file = teacher / "config.json"
    saved = json.loads(config_file.read_text())
    saved.update(model_type="t5", architectures=["T5ForConditionalGeneration"])
    config_file.write_text(json.dumps(saved))
    overrides = [
        "trainer.device=cpu",
        "distillation.enable=true",
        f"distillation.teacher.path={teacher}",
    ]
    report = run_checks(*load_run(tiny_config, overrides))
    assert [f.code for f in report.failures] == ["KEEL-M001"]
    assert "causal" in report.failures[0].message
    assert "distillation.teacher.path" in report.failures[0].fix


class _Readings(list):
    memory = [{"rss_gb": 0.1, "gpu_peak_gb": 2.0}]


class _OneRank:
    """A worker group of one rank whose every pass gives zeros of the batch's shape."""

    world_size = 1

    def call(self, method, per_rank_args):
        batch = per_rank_args[0][-1]
        return _Readings([torch.zeros(batch.response_ids.shape)])


def test_the_reference_pass_keeps_its_memory_metric_name_beside_the_teacher(models):
    """perf/peak_memory_gb/compute_ref_log_probs is the name bench records and dashboards have
    (benchmarks/results); routing the reference through compute_frozen must not rename it."""
    from keel.trainer.roles import UpdateSchedule, WorkerRoles

    roles = WorkerRoles(_OneRank(), 0, UpdateSchedule(2, 1, False, 8))
    roles.ref_log_probs(batch(50))
    roles.teacher_scores(batch(50))
    assert set(roles.memory.metrics()) >= {
        "perf/peak_memory_gb/compute_ref_log_probs",
        "perf/peak_memory_gb/compute_teacher",
    }


def test_a_kl_penalty_in_the_reward_the_distilled_advantage_drops_is_refused(models):
    """algorithm.use_kl_in_reward puts the KL to the reference in the task's rewards, and
    distillation weighs the task's advantage by task_reward_coef: at 0 the penalty was computed
    (a reference model loaded for it) and dropped in silence."""
    from keel.errors import KeelError

    raw = raw_config(models)
    raw["algorithm"] = {"use_kl_in_reward": True}
    with pytest.raises(KeelError) as refused:
        load_run(raw)
    assert refused.value.code == "KEEL-C028"
    assert "use_kl_loss" in refused.value.fix
    # with the task's advantage in the signal, its KL penalty counts with it
    raw["distillation"]["task_reward_coef"] = 0.5
    assert load_run(raw).config.algorithm.use_kl_in_reward


def test_a_data_response_that_ends_with_eos_ends_with_it_once():
    """A data row's response saved with its end-of-turn token (SFT-style text): generation stops
    at the first EOS, so the data step trains on one EOS, not that one and another after it."""
    from keel.data.prompts import PromptRecord, collate_prompts
    from keel.data.responses import data_batch
    from keel.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    prompt = tokenizer("Say 12", add_special_tokens=False)["input_ids"]
    prompts = collate_prompts(
        [PromptRecord(0, prompt, "Say 12", "d", None)], tokenizer.pad_token_id
    )
    with_eos = data_batch(prompts, ["12" + tokenizer.eos_token], tokenizer, 8)
    plain = data_batch(prompts, ["12"], tokenizer, 8)
    assert with_eos.response_ids.tolist() == plain.response_ids.tolist()
    assert with_eos.response_mask.tolist() == plain.response_mask.tolist()


def test_dynamic_sampling_by_a_reward_that_teaches_nothing_is_refused(models):
    """algorithm.filter_groups drops the groups whose rewards are all alike; with
    task_reward_coef=0 the teacher teaches every group, so it threw away samples the teacher would
    have taught (all of them, with a constant reward, until KEEL-T005)."""
    from keel.errors import KeelError

    raw = raw_config(models)
    raw["algorithm"] = {"adv_estimator": "grpo", "filter_groups": {"enable": True}}
    with pytest.raises(KeelError) as refused:
        load_run(raw)
    assert refused.value.code == "KEEL-C028"
    assert "filter_groups" in refused.value.message
    raw["distillation"]["task_reward_coef"] = 0.5
    assert load_run(raw).config.algorithm.filter_groups.enable


def test_no_critic_trains_for_a_task_advantage_left_out(models):
    """gae trains a critic whose values enter only the task's advantage; task_reward_coef=0
    leaves that advantage out, so keel builds no critic for it (the default adv_estimator is gae:
    a distillation config naming none would otherwise train one for nothing)."""
    raw = raw_config(models)
    raw["algorithm"] = {"adv_estimator": "gae"}
    assert not load_run(raw).config.critic_enabled
    raw["distillation"]["task_reward_coef"] = 0.5
    assert load_run(raw).config.critic_enabled
