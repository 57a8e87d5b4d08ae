"""One SPMD rank of the colocated roles: actor, rollout, reference and (when enabled) critic.

This is verl's ActorRolloutRefWorker with the critic sharing its GPUs. The driver calls it with
this rank's part of each batch; with one worker it runs in the driver's own process. With more,
each worker is a torch.distributed rank whose models are sharded with FSDP2 (or, fsdp_size=1,
replicated), and its rollout engine generates from whole weights it takes after every update:
read from the unsharded module, or gathered from the shards.
With critic.enable_resource_pool the critic is a second group of these workers, built with
roles={"critic"} and ranks of its own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from keel.checkpoint import write_policy
from keel.config.schema import KeelConfig
from keel.errors import COMPILE_FAILED, KeelError
from keel.distributed.dist import average_gradients, init_process_group, memory_reading
from keel.distributed.faults import maybe_inject
from keel.distributed.fsdp import compile_blocks, full_parameters, make_mesh, shard_model, sharding_report
from keel.models.load import (autocast, can_compile, load_causal_lm, load_critic, load_tokenizer, quiet_transformers,
                              resolve_device, resolve_dtype)
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.select import make_rollout_engine
from keel.training.actor import ActorTrainer
from keel.training.critic import CriticTrainer
from keel.training.batching import MicroBatching, MiniBatch
from keel.training.reference import ReferencePolicy
from keel.types import RolloutBatch, SamplingParams

log = logging.getLogger("keel")


def is_compile_error(error: BaseException) -> bool:
    """An error raised by torch.compile: dynamo's own (a backend failure among them) or, on
    releases that raise it unwrapped, inductor's."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        from torch._inductor.exc import InductorError
    except ImportError:  # older torch: inductor failures arrive wrapped in dynamo's
        InductorError = TorchDynamoException
    return isinstance(error, (TorchDynamoException, InductorError))


def _first_lines(text: str, count: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:count])


def default_roles(cfg: KeelConfig) -> frozenset[str]:
    """What a policy worker builds: the actor with its rollout engine and reference, and the
    critic too unless it has a pool of its own."""
    colocated_critic = cfg.critic_enabled and "critic" not in cfg.pools
    return frozenset({"policy", "critic"} if colocated_critic else {"policy"})


class PolicyWorker:
    def __init__(self, cfg: KeelConfig, total_steps: int, actor_weights: str | None = None, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None, tokenizer=None,
                 roles: frozenset[str] | None = None):
        quiet_transformers()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.phase = "setup"
        self.device = resolve_device(cfg.trainer.device)
        if self.device.type == "cuda":  # NCCL wants an index; a Ray worker sees only its own GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute_dtype = resolve_dtype(cfg.actor_rollout_ref.model.dtype, self.device)
        if world_size > 1:
            init_process_group(rank, world_size, *master, self.device, cfg.trainer.collective_timeout_s)
        self.sharding: dict[str, float] = {}
        policy = cfg.actor_rollout_ref
        self.tokenizer = tokenizer or load_tokenizer(policy.model.path, policy.model.trust_remote_code)
        roles = roles or default_roles(cfg)
        self.rollout = self.actor = self.ref = None
        if "policy" in roles:
            self._build_policy(actor_weights, total_steps)
        self.critic = self._build_critic(total_steps) if "critic" in roles else None

    def _build_policy(self, actor_weights: str | None, total_steps: int) -> None:
        """The actor, its rollout engine and the reference (when a KL term needs one)."""
        cfg, policy, rank, world_size = self.cfg, self.cfg.actor_rollout_ref, self.rank, self.world_size
        torch.manual_seed(cfg.trainer.seed)  # every rank starts from identical weights
        model = load_causal_lm(actor_weights or policy.model.path, self.device, policy.model.trust_remote_code,
                               policy.model.enable_gradient_checkpointing)
        # Built before the actor is sharded: it reads the whole weights once. After each update it
        # takes them from the actor module (unsharded) or gathered from the shards.
        self.rollout = make_rollout_engine(policy.rollout, model, self.tokenizer, self.device, self.compute_dtype,
                                           log_choice=rank == 0, will_be_sharded=self._actor_sharded)
        self.actor = ActorTrainer(self._prepare_model(model, policy.actor.fsdp_config, "actor"), policy.actor,
                                  policy.rollout.temperature, total_steps,
                                  _log_prob_batching(policy.rollout),
                                  cfg.data.max_response_length)
        self.actor.data_parallel_size = world_size
        self.actor.reduce_gradients = self._gradient_averaging(policy.actor.fsdp_config)
        if cfg.ref_enabled:  # the reference is always the starting policy, even on resume
            ref_model = load_causal_lm(policy.model.path, self.device, policy.model.trust_remote_code)
            self.ref = ReferencePolicy(self._prepare_model(ref_model, policy.ref.fsdp_config, "ref"),
                                       _log_prob_batching(policy.ref),
                                       policy.rollout.temperature)

    @property
    def _actor_sharded(self) -> bool:
        return self.world_size > 1 and self.cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size != 1

    def _prepare_model(self, model, fsdp_cfg, role: str):
        """The role's model made ready to train: compiled (GPU), then sharded (several workers)."""
        compiled = self.cfg.actor_rollout_ref.actor.use_torch_compile and can_compile(self.device)
        # The hf engine generates with this very module when unsharded; its growing KV cache would
        # recompile the layers at every length, so they stay eager.
        if compiled and not (isinstance(self.rollout, HFRolloutEngine) and self.rollout.model is model):
            compile_blocks(model)
        model.keel_compile = compiled  # read by keel.training.forward: fuse the vocabulary arithmetic
        if self.world_size == 1:
            return model
        if fsdp_cfg.fsdp_size == 1:  # replicated: every rank holds the whole model (DDP)
            return model
        mesh = make_mesh(self.device.type, self.world_size, fsdp_cfg.fsdp_size)
        model = shard_model(model, mesh, self.compute_dtype, fsdp_cfg)
        model.keel_compute_device = self.device
        self.sharding.update(sharding_report(model, role))
        return model

    def _build_critic(self, total_steps: int) -> CriticTrainer:
        cfg, c = self.cfg, self.cfg.critic
        _, micro_size, _ = cfg.critic_batching
        torch.manual_seed(cfg.trainer.seed)  # the value head's initialisation, identical on every rank
        model = load_critic(c.model.path or cfg.actor_rollout_ref.model.path, self.device,
                            cfg.actor_rollout_ref.model.trust_remote_code)
        critic = CriticTrainer(self._prepare_model(model, c.model.fsdp_config, "critic"), c, micro_size, total_steps)
        critic.data_parallel_size = self.world_size
        critic.reduce_gradients = self._gradient_averaging(c.model.fsdp_config)
        return critic

    def _gradient_averaging(self, fsdp_cfg):
        """Whole models on several ranks (fsdp_size=1) average their gradients with keel's bucketed
        all-reduce; FSDP reduces its own, and one rank has nothing to average."""
        return average_gradients if self.world_size > 1 and fsdp_cfg.fsdp_size == 1 else None

    # --- what the driver calls -----------------------------------------------------------------
    def run(self, method: str, *args):
        """Every call from the driver: the phase is recorded (for stack dumps), faults can be
        injected for tests, and the result comes back with a memory reading whose GPU peak is
        this call's."""
        self.phase = method
        self.phase_thread = threading.get_ident()  # Ray runs calls on a thread of its own, not main
        maybe_inject(method, self.rank)
        if self.device.type == "cuda":  # the reading's peak is this call's
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            result = getattr(self, method)(*args)
        except Exception as error:
            if is_compile_error(error):
                raise KeelError(COMPILE_FAILED, f"torch.compile failed in {method}: "
                                f"{_first_lines(str(error))}") from error
            raise
        self.phase = "idle"
        return result, memory_reading(self.device)

    def start_profile(self) -> None:
        """`keel bench --profile`: this rank's work under torch.profiler until stop_profile."""
        from torch.profiler import ProfilerActivity, profile

        cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        self._profiler = profile(activities=[ProfilerActivity.CPU] + cuda)
        self._profiler.__enter__()

    def stop_profile(self, path: str | None) -> None:
        """Ends the profile; rank 0 writes its kernel and phase table to `path`."""
        self._profiler.__exit__(None, None, None)
        if path and self.rank == 0:
            sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
            Path(path).write_text(self._profiler.key_averages().table(sort_by=sort, row_limit=60,
                                                                      max_name_column_width=90))
        self._profiler = None

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "threads": torch.get_num_threads(),
                "rollout_engine": type(self.rollout).__name__ if self.rollout else None,
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "all"), **self.sharding}

    def generate(self, prompts, sampling: SamplingParams, seed: int) -> tuple[RolloutBatch | None, dict]:
        """This rank's samples, and the engine's own timing of its parts (prefill, decode, ...)."""
        if prompts is None:  # fewer prompts than ranks
            return None, {}
        torch.manual_seed(seed)  # per step and rank: a resumed run samples what an uninterrupted one would
        start = time.perf_counter()
        batch = self.rollout.generate(prompts, sampling)  # the engine applies the compute dtype itself
        timing = {f"gen_{part}": seconds for part, seconds in self.rollout.timing.items()}
        timing["gen_engine"] = time.perf_counter() - start
        return batch, timing

    def compute_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            return self.actor.compute_log_probs(batch)

    def compute_ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            return self.ref.compute_log_probs(batch)

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            return self.critic.compute_values(batch)

    def update_actor(self, minis: list[MiniBatch]) -> dict[str, float]:
        with autocast(self.device, self.compute_dtype), self._optimizer_state_on_device(
                self.actor.optimizer, self.cfg.actor_rollout_ref.actor.fsdp_config):
            metrics = self.actor.update(minis)
        start = time.perf_counter()
        self._sync_rollout()
        metrics["timing_s/sync_rollout_weights"] = time.perf_counter() - start
        return metrics

    def update_critic(self, minis: list[MiniBatch]) -> dict[str, float]:
        with autocast(self.device, self.compute_dtype), self._optimizer_state_on_device(
                self.critic.optimizer, self.cfg.critic.model.fsdp_config):
            return self.critic.update(minis)

    def _sync_rollout(self) -> None:
        """The engine sees the updated weights: sharded, gathered a bucket of parameters per
        collective straight into the engine's own weights."""
        if self._actor_sharded:
            self.rollout.load_weights(full_parameters(self.actor.model, self.device))
        else:
            self.rollout.sync_weights(self.actor.model)

    @contextmanager
    def _optimizer_state_on_device(self, optimizer, fsdp_cfg):
        """fsdp_config.optimizer_offload: Adam's two moments wait in CPU memory, away from the KV
        cache and activations, and come back to the GPU only for the update. With param_offload
        (sharded: FSDP's, so not on one worker) the update itself runs on CPU, where the state is."""
        params_on_cpu = fsdp_cfg.param_offload and self.world_size > 1
        moves = fsdp_cfg.optimizer_offload and not params_on_cpu and self.device.type == "cuda"
        if moves:
            _move_optimizer_state(optimizer, self.device)
        try:
            yield
        finally:
            if moves:
                _move_optimizer_state(optimizer, torch.device("cpu"))

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, directory: str) -> None:
        """The policy as a Hugging Face model (written by rank 0; gathered from the shards when
        sharded); optimiser state and the critic sharded with torch.distributed.checkpoint, which
        can be loaded back on any number of workers."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        out = Path(directory)
        if self.actor is not None:
            whole = None  # unsharded: the module's own state dict
            if self._actor_sharded:  # every rank takes part; rank 0 receives it, in CPU memory
                whole = _untied(self.actor.model, get_model_state_dict(
                    self.actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
            if self.rank == 0:
                write_policy(out / "actor", self.actor.model, self.tokenizer, whole)
                torch.save(self.actor.scheduler.state_dict(), out / "actor_scheduler.pt")
            _save_sharded(out / "actor_optim", {"optimizer": _optimizer_state(self.actor)})
        if self.critic is not None:
            _save_sharded(out / "critic", {"model": get_model_state_dict(self.critic.model),
                                           "optimizer": _optimizer_state(self.critic)})
            if self.rank == 0:
                torch.save(self.critic.scheduler.state_dict(), out / "critic_scheduler.pt")

    def load(self, directory: str) -> None:
        """Everything but the actor weights, which were loaded from the checkpoint at start-up."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        path = Path(directory)
        if self.actor is not None:
            _load_into(self.actor, path / "actor_optim", path / "actor_scheduler.pt")
        if self.critic is not None:
            state = {"model": get_model_state_dict(self.critic.model)}
            _load_sharded(path / "critic", state)
            set_model_state_dict(self.critic.model, state["model"])
            _load_into(self.critic, path / "critic", path / "critic_scheduler.pt")

    def stacks(self) -> dict:
        """Every thread's stack, and whether the thread running the phase waits in a collective."""
        busy = getattr(self, "phase_thread", threading.main_thread().ident)
        text, in_collective = [], False
        for ident, frame in sys._current_frames().items():
            stack = "".join(traceback.format_stack(frame))
            if ident == busy:
                in_collective = "torch/distributed" in stack
            text.append(f"--- thread {ident}{' (phase ' + self.phase + ')' if ident == busy else ''} ---\n{stack}")
        return {"phase": self.phase, "in_collective": in_collective, "text": "\n".join(text)}


def _untied(model, state: dict) -> dict:
    """The state dict without the second name of a tied parameter (lm_head of tied embeddings):
    gathered, the two are separate tensors, and the checkpoint would store the matrix twice."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return {name: value for name, value in state.items() if name not in aliases}


def _log_prob_batching(role_cfg) -> MicroBatching:
    """Forward-only log-prob passes of the rollout (old log-probs) or the reference."""
    return MicroBatching.of(role_cfg.log_prob_micro_batch_size_per_gpu, role_cfg.log_prob_use_dynamic_bsz,
                            role_cfg.log_prob_max_token_len_per_gpu)


def _optimizer_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(trainer.model, trainer.optimizer)


def _load_into(trainer, optim_dir: Path, scheduler_file: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = {"optimizer": _optimizer_state(trainer)}
    _load_sharded(optim_dir, state)
    set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(torch.load(scheduler_file, weights_only=False))


def _save_sharded(path: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # one worker writes without a process group, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path))


def _load_sharded(path: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
