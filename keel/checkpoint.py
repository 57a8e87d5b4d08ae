"""Checkpoints: atomic save and resume (keel/export.py writes one out for Hugging Face).

A checkpoint `global_step_<N>/` is written into a hidden temporary directory, completed with a
`COMPLETE` marker, then renamed into place: a crash mid-write leaves only a `.tmp` directory that
nothing mistakes for a checkpoint. `latest_checkpointed_iteration.txt` (verl's name) is replaced
atomically after the rename.

Layout of a checkpoint:
  actor/                Hugging Face model + tokenizer (loads with from_pretrained as it is)
  actor_optim/          optimiser state, sharded (torch.distributed.checkpoint: loads on any number
                        of workers)
  actor_scheduler.pt    LR-scheduler state
  critic/               critic weights and optimiser state, sharded, when there is a critic
  critic_scheduler.pt
  trainer_state.pt      step, sampler position, KL controller, RNG states
  COMPLETE              JSON: step and keel version
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

from keel.errors import RESUME_MISMATCH, RESUME_PATH, KeelError
from keel.errors.fixes import free_directory, overrides, setting
from keel.version import __version__

LATEST = "latest_checkpointed_iteration.txt"
MARKER = "COMPLETE"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"global_step_{step}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_checkpoint(
    run_dir: Path,
    step: int,
    write: Callable[[Path], None],
    max_to_keep: int | None = None,
    config_yaml: str | None = None,
) -> Path:
    """Call `write(tmp_dir)` to fill a checkpoint, then publish it atomically."""
    final = step_dir(run_dir, step)
    tmp = run_dir / f".global_step_{step}.tmp"
    if tmp.exists():
        # left by a crash during an earlier save
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
    # the config that made it, compared on resume
    if config_yaml is not None:
        (tmp / "config.yaml").write_text(config_yaml)
    (tmp / MARKER).write_text(json.dumps({"step": step, "keel_version": __version__}))
    _fsync_tree(tmp)
    # the same step saved again after a resume from an earlier one
    if final.exists():
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
    holds only a shard), config and tokenizer. A LoRA model writes its PEFT adapter directory
    (PeftModel.from_pretrained loads it over the base)."""
    if hasattr(model, "peft_config"):
        model.save_pretrained(directory, state_dict=state_dict)
        tokenizer.save_pretrained(directory)
        return
    model.save_pretrained(directory, state_dict=state_dict)
    # FSDP2 renames the module's class (FSDPQwen2ForCausalLM), and older transformers write that
    # name into config.json, which no loader (vLLM, transformers) then recognises.
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text())
    architecture = [
        next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    ]
    if config.get("architectures") != architecture:
        config_file.write_text(json.dumps({**config, "architectures": architecture}, indent=2))
    tokenizer.save_pretrained(directory)


def save_trainers(out: Path, actor, critic, rank: int, tokenizer, actor_sharded: bool) -> None:
    """A rank's part of the models' checkpoint: the policy as a Hugging Face model (written by rank
    0; gathered from the shards when sharded), optimiser state and the critic sharded. `actor`
    and `critic` are trainers (model, optimizer, scheduler), or None where this rank has none."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if actor is not None:
        # unsharded: the module's own state dict
        whole = None
        # every rank takes part; rank 0 receives it, in CPU memory
        if actor_sharded:
            # the adapters only: the base never changes
            lora = hasattr(actor.model, "peft_config")
            whole = get_model_state_dict(
                actor.model,
                options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora
                ),
            )
            whole = whole if lora else _untied(actor.model, whole)
        if rank == 0:
            write_policy(out / "actor", actor.model, tokenizer, whole)
            torch.save(actor.scheduler.state_dict(), out / "actor_scheduler.pt")
        _save_sharded(out / "actor_optim", {"optimizer": _optimizer_state(actor)})
    if critic is not None:
        _save_sharded(
            out / "critic",
            {"model": get_model_state_dict(critic.model), "optimizer": _optimizer_state(critic)},
        )
        if rank == 0:
            torch.save(critic.scheduler.state_dict(), out / "critic_scheduler.pt")


def load_trainers(path: Path, actor, critic) -> None:
    """Everything save_trainers wrote but the actor weights, loaded from the checkpoint at
    start-up."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if actor is not None:
        _load_optimizer(actor, path / "actor_optim", path / "actor_scheduler.pt")
    if critic is not None:
        state = {"model": get_model_state_dict(critic.model)}
        _load_sharded(path / "critic", state)
        set_model_state_dict(critic.model, state["model"])
        _load_optimizer(critic, path / "critic", path / "critic_scheduler.pt")


def _untied(model, state: dict) -> dict:
    """The state dict without the second name of a tied parameter (lm_head of tied embeddings):
    gathered, the two are separate tensors, and the checkpoint would store the matrix twice."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return {name: value for name, value in state.items() if name not in aliases}


def _optimizer_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(trainer.model, trainer.optimizer)


def _load_optimizer(trainer, optim_dir: Path, scheduler_file: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = {"optimizer": _optimizer_state(trainer)}
    _load_sharded(optim_dir, state)
    set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(torch.load(scheduler_file, weights_only=False))


def _save_sharded(path: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    # one worker writes without a process group, on purpose
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path))


def _load_sharded(path: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))


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


def resolve_resume(run_dir: Path, resume_mode: str, cfg=None) -> Path | None:
    """The checkpoint to resume from; refuses to start a fresh run over an old run's checkpoints."""
    found = find_resume_checkpoint(run_dir, resume_mode)
    old = existing_checkpoints(run_dir)
    if found is None and old:
        raise KeelError(
            RESUME_MISMATCH,
            f"{run_dir} already holds checkpoints ({old[0].name} .. {old[-1].name}) "
            f"and trainer.resume_mode={resume_mode} starts a new run: the two runs' checkpoints "
            "and logs would mix",
            f"{new_run_fix(run_dir, cfg)}, or {setting('trainer.resume_mode', 'auto')} to "
            "continue the run there",
        )
    return found


def new_run_fix(run_dir: Path, cfg) -> str:
    """The fix that always works for a run directory holding another run: one that does not exist
    yet."""
    new = free_directory(run_dir)
    # the directory is given outright, not made of the names
    if cfg is None or cfg.trainer.default_local_dir:
        return (
            f"set {setting('trainer.default_local_dir', str(new))} (a run directory that does not "
            "exist yet)"
        )
    return f"set {setting('trainer.experiment_name', new.name)} (a new run directory, {new})"


def mismatch_error(checkpoint: Path, cfg, message: str, old: dict | None = None) -> KeelError:
    """C008 for a checkpoint another run made: a new run directory first, then (when the settings
    that differ are known, `old`: key -> the checkpoint's value) resuming with the checkpoint's
    settings."""
    back = f", or resume with the checkpoint's settings: {overrides(old)}" if old else ""
    return KeelError(RESUME_MISMATCH, message, new_run_fix(Path(cfg.run_dir), cfg) + back)


def resume_point(run_dir: Path, cfg, applied=None) -> Path | None:
    """The checkpoint a run resumes from (trainer.resume_mode), once it is known to be this run's:
    None to start fresh. `applied`: the config with keel's decisions in place (`Plan.applied`)."""
    found = resolve_resume(run_dir, cfg.trainer.resume_mode, cfg)
    if found is not None:
        check_same_run(found, cfg, applied)
    return found


def check_same_run(checkpoint: Path, cfg, applied=None) -> None:
    """Refuse to resume with settings that would make a different run (a new lr, dataset, model).
    A checkpoint saved before keel kept its decisions out of the config holds them in its
    config.yaml: it matches `applied`, the config with those decisions in place."""
    from keel.config.load import changed_keys, flatten, to_dict

    saved = checkpoint / "config.yaml"
    if not saved.is_file():
        return
    old = yaml.safe_load(saved.read_text())
    defaults = to_dict(type(cfg)())
    changes = changed_keys(old, to_dict(cfg), cfg.RESUME_MAY_CHANGE, defaults=defaults)
    if changes and applied is not None:
        as_applied = changed_keys(old, to_dict(applied), cfg.RESUME_MAY_CHANGE, defaults=defaults)
        changes = changes if as_applied else []
    if changes:
        old_values = {**flatten(to_dict(type(cfg)())), **flatten(old)}
        raise mismatch_error(
            checkpoint,
            cfg,
            f"resuming from {checkpoint} with different settings: "
            + "; ".join(changes[:6])
            + (" ..." if len(changes) > 6 else ""),
            {key: old_values.get(key) for key in (c.split(":")[0] for c in changes)},
        )


def find_resume_checkpoint(run_dir: Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from: None to start fresh."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        latest = run_dir / LATEST
        step = latest.read_text().strip() if latest.is_file() else ""
        path = step_dir(run_dir, int(step)) if step.isdigit() else None
        return path if path is not None and is_complete(path) else newest_complete(run_dir)
    path = Path(resume_mode)
    if not is_complete(path):
        state = "does not exist" if not path.exists() else "is incomplete (no COMPLETE marker)"
        found = newest_complete(path.parent) or newest_complete(run_dir)
        fix = (
            f"set {setting('trainer.resume_mode', str(found))} (the newest complete "
            "checkpoint there)"
            if found
            else f"set {setting('trainer.resume_mode', 'auto')} (the newest complete checkpoint "
            "of the run, or a fresh start when there is none)"
        )
        raise KeelError(
            RESUME_PATH, f"trainer.resume_mode={resume_mode!r}: the checkpoint {state}", fix
        )
    return path


def checkpoint_step(path: Path) -> int:
    return json.loads((path / MARKER).read_text())["step"]


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints(run_dir: Path) -> list[Path]:
    """`global_step_<N>` directories, oldest first."""
    found = [p for p in run_dir.glob("global_step_*") if p.name.rsplit("_", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def newest_complete(run_dir: Path) -> Path | None:
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
