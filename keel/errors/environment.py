"""Error codes KEEL-E: environment."""

from keel.errors.base import register

# The oldest torch keel runs on: FSDP2's fully_shard (pyproject.toml requires the same; a test
# checks).
MIN_TORCH = "2.6"

DEVICE_UNAVAILABLE = register(
    "KEEL-E001",
    "Requested device is not available",
    "`trainer.device` names a device this machine does not have (e.g. cuda without a GPU).",
    "Set `trainer.device=cpu` (or `auto`), or run where torch sees a GPU (a CUDA build of torch, "
    "CUDA_VISIBLE_DEVICES).",
    ("trainer.device",),
)
MEMORY_ESTIMATE = register(
    "KEEL-E002",
    "The run will not fit in the device's memory",
    "keel's estimate (float32 weights, gradients and AdamW state of each trained model, the "
    "reference, one micro-batch's activations and logits, the generation KV cache) exceeds the "
    "free memory of the device.",
    "Set the smaller value the fix line gives (actor_rollout_ref.rollout.max_num_seqs or "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, for the larger of their terms), or "
    "lower the sequence lengths, turn on model.enable_gradient_checkpointing, or use a smaller "
    "model.",
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.max_num_seqs",
    ),
)
TORCH_UNSUPPORTED = register(
    "KEEL-E004",
    "Unsupported torch release",
    f"keel needs torch >= {MIN_TORCH}: it shards with FSDP2 (torch.distributed.fsdp.fully_shard), "
    "and torch 2.3.x also has an FSDP bug that can leave gradients None after backward, so the "
    "loss moves and the model learns nothing.",
    f"`pip install 'torch>={MIN_TORCH}'` (a build matching your CUDA driver: `keel doctor` "
    "shows it).",
)
CUDA_DRIVER_TOO_OLD = register(
    "KEEL-E005",
    "The NVIDIA driver is older than torch's CUDA",
    "torch was built for a CUDA major version the installed driver does not support; torch then "
    "sees no GPU, or fails at the first kernel.",
    "Update the NVIDIA driver, or install a torch build for the CUDA version the driver supports.",
)
GPU_ARCH_UNSUPPORTED = register(
    "KEEL-E006",
    "This torch build has no kernels for the GPU",
    "The GPU's compute capability (sm_XY) is not in torch.cuda.get_arch_list(): kernels fail with "
    "'no kernel image is available'.",
    "Install a torch build compiled for this GPU generation.",
)
PACKAGE_VERSION = register(
    "KEEL-E007",
    "A required package is missing or outside the supported range",
    "keel is tested with Python >= 3.10 and transformers, tokenizers and peft within the ranges "
    "`keel doctor` prints; other versions change APIs keel relies on.",
    "Install a supported version: `pip install -e .` in keel's checkout picks them; `keel doctor` "
    "prints the pip command for each package outside its range.",
)
LOW_DISK = register(
    "KEEL-E008",
    "Little free disk for checkpoints",
    "Each checkpoint holds float32 weights and optimiser state (about 16 bytes per parameter); a "
    "full disk fails a save hours into a run.",
    "Free disk space, point trainer.default_local_dir at a larger disk, or set "
    "trainer.max_actor_ckpt_to_keep.",
    ("trainer.default_local_dir", "trainer.max_actor_ckpt_to_keep"),
)
SANDBOX_INCOMPLETE = register(
    "KEEL-E010",
    "The code sandbox cannot give every protection here",
    "Model-written code (the code_exec scorer) runs in a bubblewrap jail: namespaces of its own, a "
    "read-only view of the system, no network, an unprivileged user, resource limits. On this "
    "machine bubblewrap is missing, or the kernel or container refuses the namespaces it needs, so "
    "some protections are not in force, and reward.sandbox.require asks for them (by default the "
    "isolation ones: model code never runs unfenced unless the config says so).",
    "Where every isolation protection holds, `reward.sandbox.require=isolation` (the fix line "
    "says); else install bubblewrap (`apt-get install bubblewrap`; keel's `make install` does), "
    "or run where user and mount namespaces are allowed (a container started with --security-opt "
    "seccomp=unconfined or a VM). `keel doctor` lists the protections in force. "
    "reward.sandbox.require=none runs with those there are, at your risk.",
    ("reward.sandbox.require",),
)
RUN_DIR_NOT_WRITABLE = register(
    "KEEL-E003",
    "The run directory cannot be written",
    "keel writes its config, metrics and checkpoints under trainer.default_local_dir; the nearest "
    "existing folder above it is not writable.",
    "Point `trainer.default_local_dir` at a folder that can be written (the fix line names one).",
    ("trainer.default_local_dir",),
)
COMPILE_FAILED = register(
    "KEEL-E009",
    "torch.compile could not compile keel's kernels",
    "On a GPU keel compiles the decoder layers and the log-prob arithmetic of training "
    "(actor.use_torch_compile) and the decode step of the native engine. The compiler failed for "
    "this model, torch or Triton release; the first lines of its error follow.",
    "Set actor_rollout_ref.actor.use_torch_compile=false (training) or "
    "actor_rollout_ref.rollout.enforce_eager=true (generation), as the message says; keel runs the "
    "same numbers uncompiled, slower.",
    ("actor_rollout_ref.actor.use_torch_compile", "actor_rollout_ref.rollout.enforce_eager"),
)
TRACKER_UNAVAILABLE = register(
    "KEEL-E011",
    "An experiment tracker in trainer.logger is not installed",
    "trainer.logger names wandb, tensorboard or mlflow, whose Python package is missing here; the "
    "run would otherwise train for days and log nowhere it was asked to.",
    "Remove the tracker from trainer.logger (`trainer.logger=[console]` logs to the console "
    "only), or `pip install -e '.[tracking]'` in keel's checkout (wandb, tensorboard and "
    "mlflow-skinny).",
    ("trainer.logger",),
)

VERL_UNAVAILABLE = register(
    "KEEL-E012",
    "verl is not installed, or cannot be imported",
    "A tool, interaction or function-tool file in rollout.multi_turn names one of verl's classes "
    "(a verl.tools.base_tool.BaseTool subclass, verl's interactions, verl's @function_tool), so "
    "keel runs it through verl's own modules; here verl is not installed, or importing it fails "
    "on a package it needs (the message names the missing module).",
    "Install verl without its training stack, then what verl's package and its tool modules "
    "import: pip install --no-deps verl==0.9.1, then pip install pydantic tensordict (the message "
    "names the module that was missing); or name a class of keel's (keel.tools.Calculator, "
    "file.py:Class) instead.",
    (
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        "actor_rollout_ref.rollout.multi_turn.function_tool_path",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
    ),
)

__all__ = [name for name in dir() if name.isupper()]
