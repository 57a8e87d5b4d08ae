"""Error codes KEEL-P: parallel and distributed."""

from keel.errors.base import register

WORKER_RAISED = register(
    "KEEL-P001",
    "A worker raised an exception",
    "Code running in one of the worker processes (generation, log-probs, an update, a checkpoint) "
    "raised. The message names the rank, host, role and phase, and the worker's own traceback "
    "follows it.",
    "Read the worker's traceback: it is the real error. Rerun with --debug for NCCL/torch detail.",
)
WORKER_DIED = register(
    "KEEL-P002",
    "A worker process died",
    "A worker process ended without raising: it was killed by the system (most often the "
    "out-of-memory killer) or crashed in native code. The message gives its last memory reading.",
    "If memory was near the limit: lower the micro-batch sizes or rollout.max_num_seqs, enable "
    "fsdp_config.param_offload / optimizer_offload, or use more GPUs.",
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
    ),
)
PHASE_STALLED = register(
    "KEEL-P003",
    "A distributed phase stalled",
    "Some ranks did not reach a collective (or a phase did not finish on every rank) within the "
    "time allowed. Every rank's stacks are written to the run directory and the ranks that did not "
    "arrive are named.",
    "Look at the stacks of the ranks named as not arrived: they are stuck elsewhere (a reward "
    "call, a data loader, a deadlock). Raise trainer.collective_timeout_s only if the phase is "
    "legitimately slow.",
    ("trainer.collective_timeout_s", "trainer.guards.phase_timeout_s"),
)
NOT_ENOUGH_DEVICES = register(
    "KEEL-P004",
    "More workers asked for than devices or Ray resources available",
    "trainer.n_gpus_per_node x trainer.nnodes workers need that many GPUs (or CPUs with "
    "trainer.device=cpu), and the machine or the Ray cluster has fewer.",
    "Set `trainer.nnodes=1` and trainer.n_gpus_per_node to the devices this machine has (the fix "
    "line gives the values), or add nodes to the Ray cluster (`ray start --address=...` on each).",
    ("trainer.n_gpus_per_node", "trainer.nnodes"),
)
RAY_MISSING = register(
    "KEEL-P005",
    "Ray is needed for more than one worker and is not usable",
    "Training on more than one GPU or node runs its workers as Ray actors; Ray is not installed, "
    "or the cluster in RAY_ADDRESS cannot be reached.",
    "`unset RAY_ADDRESS` to let keel start a local Ray instance when it names a cluster that does "
    "not answer; `pip install ray` when Ray is missing (keel's install has it).",
)
MASTER_PORT_UNUSABLE = register(
    "KEEL-P007",
    "MASTER_PORT is not a port keel can listen on",
    "MASTER_PORT is set in the environment, so keel's rank 0 listens there for the other ranks "
    "(instead of on a free port it picks), and the value is not a port number or the port is "
    "taken on rank 0's node.",
    "Set MASTER_PORT to a free port the nodes can reach (`export MASTER_PORT=PORT`; the fix line "
    "names one free now), or `unset MASTER_PORT` to let keel choose one.",
)
REFERENCE_APART = register(
    "KEEL-P006",
    "The reference model cannot be placed apart from the actor",
    "The reference model runs in the actor's workers, on the same ranks and the same data shard: "
    "its log-probs are compared with the actor's token by token every step (the KL loss or "
    "penalty). On a pool or nodes of its own, every step would ship both sets of log-probs across "
    "the network and the two shards would have to match sample for sample.",
    "Remove the reference's placement keys. To make room for it, offload its weights "
    "(`actor_rollout_ref.ref.fsdp_config.param_offload=true`) or shard over more GPUs.",
    ("actor_rollout_ref.ref.fsdp_config.param_offload",),
)

__all__ = [name for name in dir() if name.isupper()]
