"""Error codes KEEL-T: training numerics."""

from keel.errors.base import register

NONFINITE_LOSS = register(
    "KEEL-T001",
    "Loss or gradient norm is not finite",
    "A NaN or infinite loss or gradient norm would corrupt the weights; the update was refused "
    "and the run stopped before any bad weights were saved.",
    "Lower the learning rate, check rewards for extreme values, or enable gradient clipping "
    "(`actor_rollout_ref.actor.grad_clip`).",
    ("actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.grad_clip"),
)
NO_GRADIENT = register(
    "KEEL-T002",
    "No parameter received a gradient",
    "After backward, every trainable parameter's gradient is None: the loss does not depend on "
    "the weights being trained, so the run would move its loss and learn nothing.",
    "Check that the model is trainable (not frozen) and that the loss uses the policy's log-probs.",
)
NONFINITE_VALUES = register(
    "KEEL-T003",
    "Non-finite values in a stage of the step",
    "A reward, log-prob, value or advantage is NaN or infinite; one such number poisons the loss "
    "and then every weight. The step was stopped before any update.",
    "`trainer.guards.nonfinite=skip` drops such steps (counted as guards/skipped_steps) instead "
    "of stopping; to remove the cause, look at the stage the message names: for rewards, the "
    "scorer on samples.jsonl; for log-probs, the model's dtype and inputs.",
    ("trainer.guards.nonfinite",),
)
PHASE_TIMEOUT = register(
    "KEEL-T004",
    "A phase of the step ran past its time limit",
    "Generation, scoring, a forward/backward or a save took longer than "
    "trainer.guards.phase_timeout_s: something hangs (a reward service, a collective, a deadlock).",
    "Read the stacks printed with the error to see where it hung; raise "
    "trainer.guards.phase_timeout_s if the phase is just slow.",
    ("trainer.guards.phase_timeout_s",),
)
FILTER_GROUPS_EXHAUSTED = register(
    "KEEL-T005",
    "Dynamic sampling found too few prompts with a learning signal",
    "algorithm.filter_groups (DAPO's dynamic sampling) drops prompts whose samples all scored "
    "alike and generates more until data.train_batch_size prompts remain; after "
    "max_num_gen_batches generation batches there were still too few. The data is too easy or too "
    "hard for the model, or the reward function scores everything alike.",
    "Raise algorithm.filter_groups.max_num_gen_batches (the fix line gives twice what the share "
    "of prompts with a signal needs); when no prompt had one, look at samples.jsonl and the "
    "scorer, or use data that the model solves sometimes.",
    ("algorithm.filter_groups.max_num_gen_batches",),
)
ENGINE_OUT_OF_SYNC = register(
    "KEEL-T006",
    "The rollout engine generates from other weights than the trainer's",
    "The log-probs the rollout engine sampled with differ from the trainer's on the same tokens "
    "by more than numerics explain (trainer.guards.max_log_prob_gap): the weights the engine "
    "generated with are not the ones being trained (a weight sync that did not happen, LoRA "
    "adapters that never reached the engine). Training on such samples is off-policy without "
    "anyone knowing.",
    "Set `actor_rollout_ref.rollout.name=hf` (generation with the trainer's own module: its "
    "weights by construction) and report it with the step and the engine; if the gap is numerics "
    "(an unusual model in bf16), raise trainer.guards.max_log_prob_gap.",
    ("trainer.guards.max_log_prob_gap", "actor_rollout_ref.rollout.name"),
)

__all__ = [name for name in dir() if name.isupper()]
