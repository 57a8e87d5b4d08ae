"""keel check on on-policy distillation: the config's rules (a teacher, and no setting nothing
reads), the teacher's directory, tokenizer, embedding and weights, and its weights in the memory
estimate."""

import json
import shutil

import pytest

from keel.check.findings import FAIL, PASS
from keel.check.preflight import render, run_checks
from keel.config.load import load_run
from keel.errors import (
    DISTILLATION_OPTION,
    INCOMPATIBLE_OPTIONS,
    MODEL_PATH,
    TEACHER_VOCAB,
    TOKEN_BUDGET,
    VOCAB_MISMATCH,
    WEIGHTS_BROKEN,
    KeelError,
)

CPU = "trainer.device=cpu"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny teacher wider than the tiny student, saved with keel's tokenizer (the student's)."""
    from keel.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "teacher", hidden_size=48, seed=1)


def distilling(teacher_path, *overrides) -> list[str]:
    return [
        CPU,
        "distillation.enable=true",
        f"distillation.teacher.path={teacher_path}",
        *overrides,
    ]


def failures(report) -> list[str]:
    return [f.code for f in report.failures]


def teacher_copy(teacher, tmp_path, name="teacher"):
    copy = tmp_path / name
    shutil.copytree(teacher, copy)
    return copy


def parameters_of(path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


# --- the config's rules ---------------------------------------------------------------------------


def refused(tiny_config, overrides) -> KeelError:
    with pytest.raises(KeelError) as raised:
        load_run(tiny_config, overrides)
    assert raised.value.code == DISTILLATION_OPTION
    return raised.value


def test_distillation_without_a_teacher_is_refused(tiny_config):
    error = refused(tiny_config, [CPU, "distillation.enable=true"])
    assert "distillation.teacher.path is empty" in error.message
    assert "distillation.teacher.path" in error.fix and "`distillation.enable=false`" in error.fix


def test_a_gkd_setting_under_reverse_kl_is_refused_with_the_mode_that_reads_it(
    tiny_config, teacher
):
    error = refused(tiny_config, distilling(teacher, "distillation.gkd.top_k=8"))
    assert error.message.startswith("distillation.gkd.top_k=8: read by distillation.mode=gkd")
    assert error.fix.startswith("set `distillation.mode=gkd`")
    assert "remove `distillation.gkd.top_k`" in error.fix
    # the mode that reads it takes it
    cfg, _ = load_run(
        tiny_config, distilling(teacher, "distillation.gkd.top_k=8", "distillation.mode=gkd")
    )
    assert cfg.distillation.gkd.top_k == 8


def test_a_kl_estimator_under_gkd_is_refused(tiny_config, teacher):
    error = refused(
        tiny_config, distilling(teacher, "distillation.mode=gkd", "distillation.kl_estimator=k3")
    )
    assert "read by distillation.mode=reverse_kl only" in error.message
    assert error.fix.startswith("set `distillation.mode=reverse_kl`")


def test_a_reference_response_column_nothing_reads_is_refused(tiny_config, teacher):
    error = refused(tiny_config, distilling(teacher, "distillation.response_key=answer"))
    assert error.fix == "remove `distillation.response_key`"
    # gkd's steps on the data read it
    load_run(
        tiny_config,
        distilling(
            teacher,
            "distillation.response_key=answer",
            "distillation.mode=gkd",
            "distillation.gkd.lmbda=0.5",
        ),
    )


def test_distillation_settings_while_it_is_off_are_refused(tiny_config, teacher):
    error = refused(tiny_config, [CPU, f"distillation.teacher.path={teacher}"])
    assert "distillation.enable=false" in error.message
    # a teacher named: distilling from it is the first fix
    assert error.fix.startswith("set `distillation.enable=true`")
    error = refused(tiny_config, [CPU, "distillation.coef=2"])
    assert error.fix == "remove `distillation.coef`"


def test_a_teacher_pool_size_without_a_pool_is_refused_and_a_pool_on_the_cpu_is_not(
    tiny_config, teacher
):
    error = refused(tiny_config, distilling(teacher, "distillation.teacher.n_gpus_per_node=2"))
    assert error.fix.startswith("set `distillation.teacher.enable_resource_pool=true`")
    # Ray's CPU workers hold a pool on the CPU
    cfg, _ = load_run(
        tiny_config,
        distilling(
            teacher,
            "distillation.teacher.enable_resource_pool=true",
            "distillation.teacher.n_gpus_per_node=2",
        ),
    )
    assert cfg.pools == {"teacher": 2}


# --- the teacher's files --------------------------------------------------------------------------


def test_a_teacher_with_the_students_tokenizer_passes_and_its_weights_are_counted(
    tiny_config, teacher
):
    alone = run_checks(*load_run(tiny_config, [CPU]))
    report = run_checks(*load_run(tiny_config, distilling(teacher)))
    assert not report.failures
    line = next(f for f in report.findings if f.check == "teacher")
    assert line.level == PASS and "the student's tokenizer" in line.message
    assert "float32 (auto: the student's compute dtype)" in line.message
    # float32 on the CPU: 4 bytes a parameter, beside the policy, in its total
    expected = parameters_of(teacher) * 4 / 2**30
    assert report.memory_gb["teacher"] == pytest.approx(expected, rel=0.01)
    assert report.memory_gb["total"] - alone.memory_gb["total"] == pytest.approx(expected, rel=0.02)
    text = render(report)
    assert "teacher: its weights" in text and "counted in the total above" in text
    assert "teacher                    float32" in text
    half = run_checks(
        *load_run(tiny_config, distilling(teacher, "distillation.teacher.dtype=bfloat16"))
    )
    assert half.memory_gb["teacher"] == pytest.approx(expected / 2, rel=0.01)


def test_a_teacher_on_a_pool_of_its_own_is_estimated_there_sharded(tiny_config, teacher):
    beside = run_checks(*load_run(tiny_config, distilling(teacher))).memory_gb
    pooled = run_checks(
        *load_run(
            tiny_config,
            distilling(
                teacher,
                "distillation.teacher.enable_resource_pool=true",
                "distillation.teacher.n_gpus_per_node=2",
            ),
        )
    ).memory_gb
    assert "teacher" not in pooled
    assert pooled["teacher_pool"] == pytest.approx(beside["teacher"] / 2, rel=0.01)
    assert pooled["total"] == pytest.approx(beside["total"] - beside["teacher"], rel=0.01)


def test_a_missing_teacher_path_names_its_key_and_the_directory_meant(
    tiny_config, teacher, tmp_path
):
    teacher_copy(teacher, tmp_path)
    report = run_checks(*load_run(tiny_config, distilling(tmp_path / "teachr")))
    assert failures(report) == [MODEL_PATH]
    failure = report.failures[0]
    assert failure.check == "teacher"
    assert failure.message.startswith("distillation.teacher.path=")
    assert f"`distillation.teacher.path={tmp_path / 'teacher'}`" in failure.fix
    # the memory estimate does not leave the teacher out: it waits for it
    assert [f.level for f in report.findings if f.check == "memory"] == ["skip"]


def student_tokenizer(path):
    """keel's tokenizer, as the tiny student and teacher were saved with it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def rewrite_tokenizer(path, edit) -> None:
    file = path / "tokenizer.json"
    saved = json.loads(file.read_text())
    edit(saved)
    file.write_text(json.dumps(saved))


def swap_two(saved) -> None:
    vocab = saved["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


def test_a_teacher_whose_tokenizer_has_an_extra_token_is_refused(tiny_config, teacher, tmp_path):
    from transformers import AutoTokenizer

    other = teacher_copy(teacher, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<think>"])
    tokenizer.save_pretrained(other)
    report = run_checks(*load_run(tiny_config, distilling(other)))
    assert failures(report) == [TEACHER_VOCAB]
    # the first id past the student's tokens
    added = len(student_tokenizer(teacher))
    assert f"the teacher has a token the student lacks (first: '<think>' ({added}))" in (
        report.failures[0].message
    )
    assert "the student's family" in report.failures[0].fix


def test_a_teacher_whose_tokenizer_orders_tokens_otherwise_is_refused(
    tiny_config, teacher, tmp_path
):
    other = teacher_copy(teacher, tmp_path)
    rewrite_tokenizer(other, swap_two)
    report = run_checks(*load_run(tiny_config, distilling(other)))
    assert failures(report) == [TEACHER_VOCAB]
    message = report.failures[0].message
    vocab = student_tokenizer(teacher).get_vocab()
    assert f"2 of the student's {len(vocab)} tokens have another id" in message
    assert f"'a' is {vocab['a']} in the student's, {vocab['b']} in the teacher's" in message


def test_a_teacher_that_ends_turns_with_another_token_is_refused(tiny_config, teacher, tmp_path):
    other = teacher_copy(teacher, tmp_path)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    report = run_checks(*load_run(tiny_config, distilling(other)))
    assert failures(report) == [TEACHER_VOCAB]
    vocab = student_tokenizer(teacher).get_vocab()
    assert (
        f"its EOS is {vocab['<|endoftext|>']} ('<|endoftext|>'), the student's "
        f"{vocab['<|im_end|>']} ('<|im_end|>')"
    ) in report.failures[0].message


def test_a_teacher_embedding_smaller_than_the_students_tokens_is_refused(
    tiny_config, teacher, tmp_path
):
    other = teacher_copy(teacher, tmp_path)
    config = json.loads((other / "config.json").read_text())
    # fewer rows than the tokenizer's tokens
    config["vocab_size"] = len(student_tokenizer(teacher)) - 60
    (other / "config.json").write_text(json.dumps(config))
    report = run_checks(*load_run(tiny_config, distilling(other)))
    assert failures(report) == [VOCAB_MISMATCH]
    assert f"the teacher's embedding has {config['vocab_size']} rows" in report.failures[0].message
    assert "set `distillation.teacher.path=" in report.failures[0].fix


def test_a_teacher_that_reads_fewer_positions_than_a_sample_is_refused(tiny_config, tmp_path):
    from keel.models.tiny import make_tiny_model

    # prompt 48 + response 8 tokens
    short = make_tiny_model(tmp_path / "short", hidden_size=32, max_position_embeddings=32)
    report = run_checks(*load_run(tiny_config, distilling(short)))
    assert failures(report) == [TOKEN_BUDGET]
    assert "teacher's max_position_embeddings=32" in report.failures[0].message


def test_a_teacher_whose_weight_file_is_truncated_is_refused(tiny_config, teacher, tmp_path):
    other = teacher_copy(teacher, tmp_path)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    report = run_checks(*load_run(tiny_config, distilling(other)))
    assert failures(report) == [WEIGHTS_BROKEN]
    assert str(other) in report.failures[0].message


def test_no_teacher_check_without_distillation(tiny_config):
    report = run_checks(*load_run(tiny_config, [CPU]))
    assert not [f for f in report.findings if f.check == "teacher"]
    assert "teacher" not in report.memory_gb and "teacher" not in report.audit
    assert FAIL not in {f.level for f in report.findings}


def test_a_teacher_with_its_own_code_needs_its_trust_remote_code(tiny_config, teacher, tmp_path):
    other = teacher_copy(teacher, tmp_path)
    config = json.loads((other / "config.json").read_text())
    # an architecture transformers does not have, whose code the directory brings
    config["model_type"] = "keel_custom"
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (other / "config.json").write_text(json.dumps(config))
    report = run_checks(*load_run(tiny_config, distilling(other)))
    assert failures(report) == [INCOMPATIBLE_OPTIONS]
    assert report.failures[0].fix.startswith("set `distillation.teacher.trust_remote_code=true`")


# --- a float8 teacher -----------------------------------------------------------------------------


def test_a_float8_teacher_on_the_cpu_is_refused_by_check_and_by_the_run(tiny_config, teacher):
    """float8 matmuls need float8 tensor cores: on the CPU keel check fails with KEEL-M011, and so
    does a run started anyway, before any step."""
    from keel.api import train
    from keel.errors import TEACHER_FLOAT8

    float8 = distilling(teacher, "distillation.teacher.dtype=float8")
    report = run_checks(*load_run(tiny_config, float8))
    assert failures(report) == [TEACHER_FLOAT8]
    message = next(f.message for f in report.findings if f.code == TEACHER_FLOAT8)
    assert "distillation.teacher.dtype=float8" in message
    assert "float8 matmuls need a CUDA GPU, and this run computes on cpu" in message
    with pytest.raises(KeelError) as raised:
        train(tiny_config, float8 + ["trainer.total_training_steps=1"])
    assert raised.value.code == TEACHER_FLOAT8
    assert "distillation.teacher.dtype=auto" in raised.value.fix
