"""Checkpoints are atomic: a crash mid-write never leaves one that looks complete."""

import pytest

from keel import checkpoint as ckpt
from keel.errors import EXPORT_TARGET, NOT_A_CHECKPOINT, RESUME_PATH, KeelError
from keel.export import export_checkpoint


def write_files(tmp):
    (tmp / "weights.bin").write_bytes(b"\x00" * 16)


def test_save_publishes_complete_checkpoint_and_latest(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 3, write_files)
    assert path == tmp_path / "global_step_3" and ckpt.is_complete(path)
    assert (tmp_path / ckpt.LATEST).read_text() == "3"
    assert ckpt.find_resume_checkpoint(tmp_path, "auto") == path
    assert ckpt.checkpoint_step(path) == 3


def test_crash_mid_write_leaves_previous_checkpoint_as_latest(tmp_path):
    ckpt.save_checkpoint(tmp_path, 2, write_files)

    def crash(tmp):
        write_files(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 4, crash)
    assert not (tmp_path / "global_step_4").exists()
    assert ckpt.find_resume_checkpoint(tmp_path, "auto") == tmp_path / "global_step_2"
    # the next save of step 4 cleans the leftover and succeeds
    ckpt.save_checkpoint(tmp_path, 4, write_files)
    assert ckpt.find_resume_checkpoint(tmp_path, "auto") == tmp_path / "global_step_4"


def test_auto_falls_back_to_newest_complete_when_latest_points_at_a_broken_one(tmp_path):
    ckpt.save_checkpoint(tmp_path, 2, write_files)
    # e.g. copied by hand, no COMPLETE marker
    (tmp_path / "global_step_5").mkdir()
    (tmp_path / ckpt.LATEST).write_text("5")
    assert ckpt.find_resume_checkpoint(tmp_path, "auto") == tmp_path / "global_step_2"


def test_resume_modes(tmp_path):
    # nothing there yet
    assert ckpt.find_resume_checkpoint(tmp_path, "auto") is None
    path = ckpt.save_checkpoint(tmp_path, 1, write_files)
    assert ckpt.find_resume_checkpoint(tmp_path, "disable") is None
    assert ckpt.find_resume_checkpoint(tmp_path, str(path)) == path
    with pytest.raises(KeelError) as info:
        ckpt.find_resume_checkpoint(tmp_path, str(tmp_path / "global_step_9"))
    assert info.value.code == RESUME_PATH


def test_keep_only_the_newest(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, write_files, max_to_keep=2)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [
        "global_step_2",
        "global_step_3",
    ]


def test_export_refuses_an_incomplete_checkpoint(tmp_path):
    (tmp_path / "global_step_1" / "actor").mkdir(parents=True)
    with pytest.raises(KeelError) as info:
        export_checkpoint(tmp_path / "global_step_1", tmp_path / "out")
    assert info.value.code == NOT_A_CHECKPOINT
    assert not (tmp_path / "out").exists()


def test_export_never_deletes_a_directory_it_did_not_write(tmp_path):
    path = ckpt.save_checkpoint(
        tmp_path / "run",
        1,
        lambda tmp: (tmp / "actor").mkdir() or (tmp / "actor" / "config.json").write_text("{}"),
    )
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(KeelError) as info:
        export_checkpoint(path, precious)
    assert info.value.code == EXPORT_TARGET
    assert (precious / "notes.txt").read_text() == "keep me"
    # an earlier export is replaced
    out = export_checkpoint(path, tmp_path / "exported")
    assert export_checkpoint(path, out) == out and (out / "config.json").exists()


def test_an_async_checkpoint_from_before_the_plan_resumes_and_a_changed_run_still_does_not(
    tmp_path,
):
    """keel once wrote its async decisions (bypass mode, reward workers) into the config and so
    into a checkpoint's config.yaml; the config now stays as written, and a resume still matches
    such a checkpoint through the plan's applied config, but not a run with another lr."""
    from keel.config.load import load_run, to_yaml
    from keel.errors import RESUME_MISMATCH

    written = ["trainer.mode=async"]
    base = {"data": {"train_files": ["t.jsonl"]}, "actor_rollout_ref": {"model": {"path": "m"}}}
    cfg, plan = load_run(base, written)
    assert plan.rollout_correction.bypass_mode and not cfg.algorithm.rollout_correction.bypass_mode
    old = tmp_path / "global_step_2"
    old.mkdir()
    (old / "config.yaml").write_text(to_yaml(plan.applied(cfg)))
    with pytest.raises(KeelError) as refused:
        ckpt.check_same_run(old, cfg)
    assert refused.value.code == RESUME_MISMATCH and "bypass_mode" in refused.value.message
    ckpt.check_same_run(old, cfg, plan.applied(cfg))

    other, other_plan = load_run(base, [*written, "actor_rollout_ref.actor.optim.lr=0.5"])
    with pytest.raises(KeelError) as changed:
        ckpt.check_same_run(old, other, other_plan.applied(other))
    assert changed.value.code == RESUME_MISMATCH and "optim.lr" in changed.value.message
