"""`keel check` on what the run needs of the machine: memory on each device, and the workers (Ray,
the devices they are placed on, the rendezvous port)."""

from __future__ import annotations

import os

import torch

from keel.check.findings import PASS, WARN, Finding, need
from keel.check.model import compute_dtype
from keel.check.teacher import count
from keel.config.memory import estimate_memory_gb
from keel.config.schema import KeelConfig
from keel.errors import MEMORY_ESTIMATE, NOT_ENOUGH_DEVICES, RAY_MISSING, KeelError
from keel.errors.fixes import overrides, setting
from keel.openmp import how_threads_wait
from keel.rollout.native.models import unsupported_reason
from keel.training.forward import LOGITS_CHUNK_TOKENS


def check_memory(cfg: KeelConfig, context: dict) -> list[Finding]:
    model_cfg = need(context, "model_config")
    plan = context["plan"]
    # a teacher its check could not read skips the estimate: one without it would be too low
    teacher = need(context, "teacher") if cfg.teacher_enabled else None

    def estimate_for(config: KeelConfig) -> dict[str, float]:
        return estimate_memory_gb(
            config,
            model_cfg,
            context.get("parameters") or architecture_parameters(model_cfg),
            compute_bytes=compute_dtype(config).itemsize,
            native_rollout=unsupported_reason(model_cfg) is None,
            logits_chunk_tokens=LOGITS_CHUNK_TOKENS,
            lora_trainable=context.get("lora_trainable", {}),
            actor_fsdp=plan.actor_fsdp(config),
            teacher=teacher and (teacher.parameters, teacher.dtype.itemsize),
        )

    context["memory_gb"] = estimate = estimate_for(cfg)
    total, available, where = device_memory_gb(cfg)
    required = max(
        estimate["total"],
        *(estimate.get(f"{role}_pool", 0.0) for role in ("critic", "rollout", "teacher")),
    )
    message = (
        f"about {required:.2f} GB needed on {where}, {available:.1f} GB free of {total:.1f} GB"
    )
    if required > available:
        raise KeelError(
            MEMORY_ESTIMATE, message, _memory_fix(cfg, estimate, available, estimate_for)
        )
    # verl honours param_offload on one GPU; keel uses FSDP (whose offload it is) only across ranks
    idle = [
        f"{key}.fsdp_config.param_offload=true has no effect on one worker (FSDP shards and "
        "offloads across 2 or more); the estimate counts those weights on the device"
        for key, fsdp, ranks in cfg.fsdp_roles
        if fsdp.param_offload and ranks == 1
    ]
    return (
        [Finding(WARN if required > 0.9 * available else PASS, "memory", message)]
        + _teacher_memory(cfg, estimate, teacher)
        + [Finding(WARN, "memory", text) for text in idle]
    )


def _teacher_memory(cfg: KeelConfig, estimate: dict, teacher) -> list[Finding]:
    """The teacher's line of the estimate: its weights, where they are."""
    if teacher is None:
        return []
    dtype = str(teacher.dtype).removeprefix("torch.")
    if "teacher_pool" in estimate:
        where = f"each of its own pool's {cfg.pools['teacher']} devices, outside the total above"
        size = estimate["teacher_pool"]
    else:
        where = f"each of the policy's {cfg.world_size} devices, counted in the total above"
        size = estimate["teacher"]
    return [
        Finding(
            PASS,
            "memory",
            f"teacher: its weights, {count(teacher.parameters)} parameters in {dtype} "
            f"({teacher.dtype.itemsize} B each), about {size:.4g} GB on {where}",
        )
    ]


def _memory_fix(cfg: KeelConfig, estimate: dict, available: float, estimate_for) -> str | None:
    """One setting that brings the estimate under what is free, for the larger of the two terms a
    setting scales: the KV cache (sequences generated at once) and one micro-batch's activations."""
    from keel.config.load import load_config, to_dict
    from keel.config.rules import largest_divisor_at_most
    from keel.config.values import value_at

    policy = cfg.actor_rollout_ref
    samples = policy.actor.ppo_mini_batch_size * policy.rollout.n
    terms = {
        "actor_rollout_ref.rollout.max_num_seqs": ("kv_cache", policy.rollout.max_num_seqs),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
            "activations",
            policy.actor.ppo_micro_batch_size_per_gpu,
        ),
    }
    for key, (term, value) in sorted(
        terms.items(), key=lambda item: -estimate.get(item[1][0], 0.0)
    ):
        rest = estimate["total"] - estimate.get(term, 0.0)
        if value <= 1 or rest >= 0.9 * available or not estimate.get(term):
            continue
        # both terms grow linearly
        new = max(1, int(value * (0.9 * available - rest) / estimate[term]))
        default = value_at(type(cfg)(), key)
        new = (
            largest_divisor_at_most(samples, new)
            if term == "activations"
            else min(new, max(default, 1))
        )
        after = estimate_for(load_config(to_dict(cfg), {key: new}))["total"]
        if new < value and after <= available:
            return f"set {setting(key, new)} (about {after:.2f} GB then)"
    return None


def check_sharding(cfg: KeelConfig, context: dict) -> list[Finding]:
    """DDP or FSDP for the policy, when the config leaves it to keel (before the memory estimate,
    which depends on it)."""
    from keel.trainer.sharding import choose_sharding, gpu_bytes

    model_cfg = need(context, "model_config")
    plan = context["plan"]
    sharding = choose_sharding(
        cfg,
        plan,
        model_cfg,
        context.get("parameters") or architecture_parameters(model_cfg),
        gpu_bytes(cfg),
        context.get("lora_trainable"),
    )
    # the plan the trainer takes on, with the choice made here
    context["plan"] = plan.with_sharding(sharding)
    return [Finding(PASS, "sharding", sharding.why)] if sharding else []


def check_workers(cfg: KeelConfig, context: dict) -> list[Finding]:
    """Workers against what this machine has, and Ray itself. A cluster in RAY_ADDRESS must
    answer; its resources are checked when the workers are placed."""
    from keel.distributed.dist import port_from_environment
    from keel.distributed.ray_cluster import require_reachable

    world = cfg.world_size
    if world == 1 and not cfg.pools:
        return _one_worker(cfg)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise KeelError(
            RAY_MISSING,
            f"{world} workers need Ray, which is not installed",
            "run `pip install ray` (keel's install has it), or "
            f"{setting('trainer.n_gpus_per_node', 1)} to train in this process",
        ) from None
    port = port_from_environment()
    if os.environ.get("RAY_ADDRESS"):
        require_reachable(os.environ["RAY_ADDRESS"])
        return [
            Finding(
                PASS,
                "workers",
                f"{world} workers on the Ray cluster at {os.environ['RAY_ADDRESS']}",
            )
        ]
    if cfg.trainer.nnodes > 1:
        one_node = overrides({"trainer.nnodes": 1, "trainer.n_gpus_per_node": world})
        raise KeelError(
            NOT_ENOUGH_DEVICES,
            f"trainer.nnodes={cfg.trainer.nnodes} but RAY_ADDRESS is not set: a local Ray "
            "instance has one node",
            f"set {one_node} (the same {world} workers on this machine), or start the cluster "
            "(`ray start --head`, then `ray start --address=HEAD:6379` on each node) and set "
            "RAY_ADDRESS",
        )
    return _on_this_machine(cfg, port)


def _one_worker(cfg: KeelConfig) -> list[Finding]:
    """One worker, in this process: on the CPU, torch's threads must not spin."""
    from keel.models.load import resolve_device

    as_meant, how = how_threads_wait()
    on_cpu_spinning = not as_meant and resolve_device(cfg.trainer.device).type == "cpu"
    return [Finding(PASS, "workers", "1 worker in this process")] + (
        [Finding(WARN, "workers", f"torch's CPU threads: {how}")] if on_cpu_spinning else []
    )


def _on_this_machine(cfg: KeelConfig, port: int | None) -> list[Finding]:
    """Every worker, and every pool's, on a Ray instance keel starts here: enough devices."""
    from keel.distributed.dist import rendezvous_port
    from keel.distributed.ray_cluster import Devices
    from keel.models.load import resolve_device

    world = cfg.world_size
    device = resolve_device(cfg.trainer.device)
    have = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
    what = "GPUs" if device.type == "cuda" else "CPU cores"
    needed = Devices.of(cfg).total
    placed = f"{world} workers" + "".join(
        f" + {count} for the {role} pool" for role, count in cfg.pools.items()
    )
    if device.type == "cuda" and have < needed:
        raise KeelError(
            NOT_ENOUGH_DEVICES,
            f"{placed} need {needed} {what}, and this machine has {have}",
            f"set {setting('trainer.n_gpus_per_node', have)} (this machine's {what})"
            if not cfg.pools and cfg.trainer.nnodes == 1 and have
            else None,
        )
    level = WARN if have < needed else PASS
    meeting = f"; rank 0 listens on MASTER_PORT={rendezvous_port(port)}" if port else ""
    return [
        Finding(
            level,
            "workers",
            f"{placed} on this machine ({have} {what}), Ray started by keel{meeting}",
        )
    ]


def architecture_parameters(model_cfg) -> int:
    """Exact count from the architecture, built on the meta device (no memory, no weights)."""
    from keel.models.load import meta_model

    return sum(p.numel() for p in meta_model(model_cfg).parameters())


def device_memory_gb(cfg: KeelConfig) -> tuple[float, float, str]:
    """(total, free, device name) of the device the run will use."""
    from keel.models.load import resolve_device

    device = resolve_device(cfg.trainer.device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total / 2**30, free / 2**30, torch.cuda.get_device_name(device)
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES") / 2**30
    available = page * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    return total, available, "cpu"
