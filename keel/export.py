"""`keel export`: a checkpoint's policy as a Hugging Face directory (from_pretrained loads it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from keel.checkpoint import is_complete, newest_complete
from keel.errors import EXPORT_TARGET, NOT_A_CHECKPOINT, KeelError
from keel.errors.fixes import free_directory

EXPORT_MARKER = "keel_export.json"


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, merged: bool = False) -> Path:
    """Write the checkpoint's policy as a Hugging Face directory (from_pretrained loads it); a
    LoRA run's is its PEFT adapter directory, or with `merged` the base with the adapters merged in.

    `out_dir` must be new, empty, or an earlier export (it holds EXPORT_MARKER): nothing else is
    ever deleted.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    command = f"keel export {{}} {{}}{' --merged' if merged else ''}"
    if not is_complete(checkpoint):
        state = "does not exist" if not checkpoint.exists() else "has no COMPLETE marker"
        found = newest_complete(checkpoint) or newest_complete(checkpoint.parent)
        raise KeelError(
            NOT_A_CHECKPOINT,
            f"{checkpoint} {state}",
            f"run `{command.format(found, out_dir)}` (the newest complete checkpoint there)"
            if found
            else None,
        )
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / EXPORT_MARKER).exists():
        raise KeelError(
            EXPORT_TARGET,
            f"{out_dir} exists, is not empty and is not an earlier keel export",
            f"run `{command.format(checkpoint, free_directory(out_dir))}` (a directory that "
            "does not exist yet)",
        )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if merged and (checkpoint / "actor" / "adapter_config.json").exists():
        _write_merged(checkpoint, tmp)
    else:
        shutil.copytree(checkpoint / "actor", tmp)
    (tmp / EXPORT_MARKER).write_text(json.dumps({"source": str(checkpoint.resolve())}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _write_merged(checkpoint: Path, out: Path) -> None:
    """The base model (the run's actor_rollout_ref.model.path) with the checkpoint's adapters
    merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from keel.models.load import check_model_dir

    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    base_path = saved["actor_rollout_ref"]["model"]["path"]
    base = AutoModelForCausalLM.from_pretrained(check_model_dir(base_path), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, checkpoint / "actor").merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint / "actor").save_pretrained(out)
