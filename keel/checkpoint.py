"""Checkpoints: atomic save, resume, and export to a Hugging Face directory.

A checkpoint `global_step_<N>/` is written into a hidden temporary directory, completed with a
`COMPLETE` marker, then renamed into place: a crash mid-write leaves only a `.tmp` directory that
nothing mistakes for a checkpoint. `latest_checkpointed_iteration.txt` (verl's name) is replaced
atomically after the rename.

Layout of a checkpoint:
  actor/             Hugging Face model + tokenizer (loads with from_pretrained as it is)
  actor_optim.pt     optimiser and LR-scheduler state
  critic/            critic weights (safetensors) and critic_optim.pt, when there is a critic
  trainer_state.pt   step, sampler position, KL controller, RNG states
  COMPLETE           JSON: step and keel version
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from keel.errors import EXPORT_TARGET, NOT_A_CHECKPOINT, RESUME_MISMATCH, RESUME_PATH, KeelError

LATEST = "latest_checkpointed_iteration.txt"
MARKER = "COMPLETE"
EXPORT_MARKER = "keel_export.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"global_step_{step}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None],
                    max_to_keep: int | None = None, config_yaml: str | None = None) -> Path:
    """Call `write(tmp_dir)` to fill a checkpoint, then publish it atomically."""
    from keel import __version__

    final = step_dir(run_dir, step)
    tmp = run_dir / f".global_step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a crash during an earlier save
    tmp.mkdir(parents=True)
    write(tmp)
    if config_yaml is not None:  # the config that made it, compared on resume
        (tmp / "config.yaml").write_text(config_yaml)
    (tmp / MARKER).write_text(json.dumps({"step": step, "keel_version": __version__}))
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again after a resume from an earlier one
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(run_dir / LATEST, str(step))
    if max_to_keep:
        _prune(run_dir, max_to_keep, newest=step)
    return final


def existing_checkpoints(run_dir: Path) -> list[Path]:
    return _checkpoints(run_dir) if run_dir.is_dir() else []


def write_policy(directory: Path, model, tokenizer, state_dict: dict | None = None) -> None:
    """A Hugging Face model directory: weights (the module's, or `state_dict`'s when the module
    holds only a shard), config and tokenizer."""
    model.save_pretrained(directory, state_dict=state_dict)
    # FSDP2 renames the module's class (FSDPQwen2ForCausalLM), and older transformers write that
    # name into config.json, which no loader (vLLM, transformers) then recognises.
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text())
    architecture = [next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))]
    if config.get("architectures") != architecture:
        config_file.write_text(json.dumps({**config, "architectures": architecture}, indent=2))
    tokenizer.save_pretrained(directory)


def init_run_dir(run_dir: Path, config_yaml: str, resumed_step: int | None) -> None:
    """Write the resolved config; keep the logs of the steps a resumed run will not redo.

    A fresh run (`resumed_step` None) starts empty logs; a resumed one drops the records after its
    checkpoint, which it is about to redo.
    """
    from keel.observe.metrics import truncate_jsonl

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    for name in ("metrics.jsonl", "samples.jsonl"):
        truncate_jsonl(run_dir / name, -1 if resumed_step is None else resumed_step)


def resolve_resume(run_dir: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from; refuses to start a fresh run over an old run's checkpoints."""
    found = find_resume_checkpoint(run_dir, resume_mode)
    old = existing_checkpoints(run_dir)
    if found is None and old:
        raise KeelError(RESUME_MISMATCH, f"{run_dir} already holds checkpoints ({old[0].name} .. {old[-1].name}) "
                        f"and trainer.resume_mode={resume_mode} starts a new run: the two runs' checkpoints "
                        "and logs would mix",
                        "use a new trainer.experiment_name (or trainer.default_local_dir), delete the old "
                        "run directory, or continue it with trainer.resume_mode=auto")
    return found


def check_same_run(checkpoint: Path, cfg) -> None:
    """Refuse to resume with settings that would make a different run (a new lr, dataset, model)."""
    from keel.config.load import changed_keys, to_dict

    saved = checkpoint / "config.yaml"
    if not saved.is_file():
        return
    changes = changed_keys(yaml.safe_load(saved.read_text()), to_dict(cfg), cfg.RESUME_MAY_CHANGE,
                           defaults=to_dict(type(cfg)()))
    if changes:
        raise KeelError(RESUME_MISMATCH, f"resuming from {checkpoint} with different settings: "
                        + "; ".join(changes[:6]) + (" ..." if len(changes) > 6 else ""))


def find_resume_checkpoint(run_dir: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from: None to start fresh."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        latest = run_dir / LATEST
        step = latest.read_text().strip() if latest.is_file() else ""
        path = step_dir(run_dir, int(step)) if step.isdigit() else None
        return path if path is not None and is_complete(path) else _newest_complete(run_dir)
    path = Path(resume_mode)
    if not is_complete(path):
        state = "does not exist" if not path.exists() else "is incomplete (no COMPLETE marker)"
        raise KeelError(RESUME_PATH, f"trainer.resume_mode={resume_mode!r}: the checkpoint {state}")
    return path


def checkpoint_step(path: Path) -> int:
    return json.loads((path / MARKER).read_text())["step"]


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's policy as a Hugging Face directory (from_pretrained loads it).

    `out_dir` must be new, empty, or an earlier export (it holds EXPORT_MARKER): nothing else is
    ever deleted.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_complete(checkpoint):
        state = "does not exist" if not checkpoint.exists() else "has no COMPLETE marker"
        raise KeelError(NOT_A_CHECKPOINT, f"{checkpoint} {state}")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / EXPORT_MARKER).exists():
        raise KeelError(EXPORT_TARGET, f"{out_dir} exists, is not empty and is not an earlier keel export")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(checkpoint / "actor", tmp)
    (tmp / EXPORT_MARKER).write_text(json.dumps({"source": str(checkpoint.resolve())}))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _checkpoints(run_dir: Path) -> list[Path]:
    """`global_step_<N>` directories, oldest first."""
    found = [p for p in run_dir.glob("global_step_*") if p.name.rsplit("_", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def _newest_complete(run_dir: Path) -> Path | None:
    complete = [p for p in _checkpoints(run_dir) if is_complete(p)]
    return complete[-1] if complete else None


def _prune(run_dir: Path, keep: int, newest: int) -> None:
    """Keep the `keep` newest checkpoints up to step `newest`, the one just written among them."""
    ours = [p for p in _checkpoints(run_dir) if int(p.name.rsplit("_", 1)[1]) <= newest]
    for path in ours[:-keep]:
        shutil.rmtree(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
