"""Named benchmark workloads: Qwen2.5 shapes with random weights, fixed response lengths."""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.rollout.agent.environment import Environment

# Qwen2.5 architectures (config.json of the released checkpoints), built with random weights.
QWEN25_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
QWEN25_SHAPES.update({  # the LoRA workloads' shapes
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, tie_word_embeddings=False, vocab_size=152064),
})
# Shapes of 3B and more are never written: their random weights are drawn on the device at load
# (keel.models.load.RANDOM_WEIGHTS), in seconds, where writing 7B took minutes and 32B would not
# fit the disk.
DRAWN_ON_DEVICE = {"3b", "7b", "32b"}
QWEN25_SHAPES["tiny"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=True)  # CPU check of the harness
QWEN25_COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class Workload:
    model: str                 # a key of QWEN25_SHAPES
    prompts: int               # prompts per step
    n: int                     # samples per prompt
    prompt_length: int
    response_length: int
    kl_loss: bool = False      # GRPO with a KL loss to the reference model
    overrides: dict = field(default_factory=dict)


WORKLOADS = {
    "t1": Workload("0.5b", 16, 8, 256, 256),
    "w1": Workload("0.5b", 64, 8, 512, 512, kl_loss=True),
    "w2": Workload("0.5b", 32, 8, 256, 2048),
    "w3": Workload("1.5b", 64, 8, 512, 512, kl_loss=True),
    "tiny": Workload("tiny", 4, 4, 32, 16),
}
LORA_64 = {"actor_rollout_ref.model.lora_rank": 64, "actor_rollout_ref.model.lora_alpha": 128,
           "actor_rollout_ref.model.target_modules": "all-linear",
           "actor_rollout_ref.model.enable_gradient_checkpointing": True}
WORKLOADS.update({
    "w7": Workload("7b", 16, 8, 512, 512, overrides=LORA_64),       # LoRA on 7B shapes
    "w3l": Workload("1.5b", 64, 8, 512, 512, kl_loss=True, overrides=LORA_64),  # w3 with LoRA
    "tinyl": Workload("tiny", 4, 4, 32, 16, overrides={**LORA_64, "actor_rollout_ref.model.lora_rank": 8}),
    "w32": Workload("32b", 16, 8, 512, 512, overrides=LORA_64),     # LoRA on 32B shapes: one copy of the base
    # 7B full-parameter, the optimiser offloaded a bucket at a time, micro-batches as w7's
    "w7f": Workload("7b", 16, 8, 512, 512, overrides={"actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
                                                     "actor_rollout_ref.model.enable_gradient_checkpointing": True}),
})


class InstantEnvironment(Environment):
    """m1's environment: answers every assistant turn at once with a short observation, so a random
    model's rollouts have their turns."""

    def step(self, text: str) -> tuple[str, float, bool]:
        return "ok, go on", 0.0, False


# m1: multi-turn, 0.5B shapes, 64 prompts x 8, 4 assistant turns of 128 tokens, the environment
# answering in between (3 user turns); the budget holds the turns and the template's tokens.
MULTI_TURN_4x128 = {"actor_rollout_ref.rollout.multi_turn.enable": True,
                    "actor_rollout_ref.rollout.multi_turn.environment": "keel.bench.workloads.InstantEnvironment",
                    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 4,
                    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 128}
WORKLOADS.update({
    "m1": Workload("0.5b", 64, 8, 256, 4 * 128 + 3 * 40, overrides=MULTI_TURN_4x128),
    "tinym": Workload("tiny", 4, 4, 32, 4 * 8 + 3 * 40,
                      overrides={**MULTI_TURN_4x128, "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 8}),
})
