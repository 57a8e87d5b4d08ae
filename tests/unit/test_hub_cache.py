"""A model named by its Hub id, as verl's scripts name it, loads from this machine's Hugging Face
cache (nothing is downloaded), and one that is not cached is a coded error that says so."""

import shutil

import pytest

from keel.errors import MODEL_PATH, KeelError


def build_cache(root, repo_id, model_dir):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_hub_id_in_the_local_cache_loads_offline(tiny_assets, tiny_config, tmp_path, monkeypatch):
    from keel.check.preflight import run_checks
    from keel.config.load import load_run
    from keel.models.load import check_model_dir, load_tokenizer

    snapshot = build_cache(tmp_path / "hub", "Qwen/Qwen2.5-0.5B-Instruct", tiny_assets["model"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_model_dir("Qwen/Qwen2.5-0.5B-Instruct") == snapshot
    assert load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct").pad_token_id is not None
    report = run_checks(
        *load_run(tiny_config, {"actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct"})
    )
    assert not report.failures, report.failures


def test_a_hub_id_that_is_not_cached_says_nothing_is_downloaded(tmp_path, monkeypatch):
    from keel.models.load import check_model_dir

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(KeelError) as error:
        check_model_dir("Qwen/Qwen2-7B-Instruct")
    assert (
        error.value.code == MODEL_PATH
        and "not in" in error.value.message
        and "downloads nothing" in error.value.message
    )
    assert "huggingface-cli download Qwen/Qwen2-7B-Instruct" in error.value.fix
