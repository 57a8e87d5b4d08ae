"""Named benchmark workloads: the released shapes of each model family (Qwen2.5 first, then Qwen3,
Qwen3-MoE, Llama 3.2, Gemma 3) with random weights, fixed response lengths."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from keel.rollout.agent.environment import Environment

# Qwen2.5 architectures (config.json of the released checkpoints), built with random weights.
QWEN25_SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
QWEN25_SHAPES.update(
    # the LoRA workloads' shapes
    {
        "3b": dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        "7b": dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
        "32b": dict(
            hidden_size=5120,
            intermediate_size=27648,
            num_hidden_layers=64,
            num_attention_heads=40,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            vocab_size=152064,
        ),
    }
)
# Shapes of 3B and more are never written: their random weights are drawn on the device at load
# (keel.models.load.RANDOM_WEIGHTS), in seconds, where writing 7B took minutes and 32B would not
# fit the disk.
DRAWN_ON_DEVICE = {"3b", "7b", "32b"}
QWEN25_SHAPES["tiny"] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    # CPU check of the harness
)
QWEN25_COMMON = dict(
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6
)

# Other families' released shapes (config.json of each checkpoint), as (model_type, config).
QWEN3_COMMON = dict(
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    head_dim=128,
)
FAMILY_SHAPES = {
    "qwen3-0.6b": (
        "qwen3",
        dict(
            QWEN3_COMMON,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            QWEN3_COMMON,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            QWEN3_COMMON,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # the MoE of issue 29's first measurement: Qwen3-30B-A3B's layers, 12 of them, 64 experts, 8
    # active
    "qwen3-moe-12l": (
        "qwen3_moe",
        dict(
            QWEN3_COMMON,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=4,
            moe_intermediate_size=768,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500_000.0,
            rms_norm_eps=1e-5,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    "gemma-3-1b": (
        "gemma3_text",
        dict(
            vocab_size=262144,
            max_position_embeddings=32768,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            query_pre_attn_scalar=256,
            rms_norm_eps=1e-6,
        ),
    ),
    "gpt-oss-20b": (
        "gpt_oss",
        dict(
            vocab_size=201088,
            max_position_embeddings=131072,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            rope_theta=150_000.0,
            rms_norm_eps=1e-5,
            swiglu_limit=7.0,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
        ),
    ),
}
DRAWN_ON_DEVICE |= {"qwen3-8b", "qwen3-30b-a3b", "qwen3-moe-12l", "gpt-oss-20b"}


def shape_config(shape: str):
    """The transformers config of a shape (any key of QWEN25_SHAPES or FAMILY_SHAPES)."""
    from transformers import AutoConfig

    model_type, fields = FAMILY_SHAPES.get(shape) or (
        "qwen2",
        {**QWEN25_COMMON, **QWEN25_SHAPES[shape]},
    )
    return AutoConfig.for_model(model_type, **fields)


@dataclass(frozen=True)
class Workload:
    # a key of QWEN25_SHAPES or FAMILY_SHAPES
    model: str
    # prompts per step
    prompts: int
    # samples per prompt
    n: int
    prompt_length: int
    response_length: int
    # GRPO with a KL loss to the reference model
    kl_loss: bool = False
    # None: every response response_length long; else EOS ends them (make_model)
    mean_response: int | None = None
    overrides: dict = field(default_factory=dict)


WORKLOADS = {
    "t1": Workload("0.5b", 16, 8, 256, 256),
    "w1": Workload("0.5b", 64, 8, 512, 512, kl_loss=True),
    "w2": Workload("0.5b", 32, 8, 256, 2048),
    "w3": Workload("1.5b", 64, 8, 512, 512, kl_loss=True),
    "tiny": Workload("tiny", 4, 4, 32, 16),
    # t1 on the other families' shapes (issue 29's table)
    "q1": Workload("qwen3-0.6b", 16, 8, 256, 256),
    "l1": Workload("llama-3.2-1b", 16, 8, 256, 256),
    "g1": Workload("gemma-3-1b", 16, 8, 256, 256),
    "e1": Workload("qwen3-moe-12l", 16, 8, 256, 256),
}
# s1: a reward that takes 1 s of host time per sample (keel/bench/slow_reward.py), scored by 64
# processes, on t1's model with twice its batch: what trainer.mode=async overlaps with the GPU's
# work.
SLOW_REWARD = {
    "custom_reward_function.path": str(Path(__file__).with_name("slow_reward.py")),
    "reward.num_workers": 64,
}
WORKLOADS.update(
    {
        # v2: w2's shapes and batch with lengths that EOS ends, about geometric with mean 512 (cut
        # at 2048): a long tail, which partial rollouts (trainer.partial_rollout) keep from holding
        # up each step.
        "v2": Workload("0.5b", 32, 8, 256, 2048, mean_response=512),
        "tinyv": Workload("tiny", 4, 4, 32, 64, mean_response=16),
        "s1": Workload("0.5b", 32, 8, 256, 512, overrides=SLOW_REWARD),
        "tinys": Workload("tiny", 4, 4, 32, 16, overrides={**SLOW_REWARD, "reward.num_workers": 8}),
        # sv: s1's slow scorer on lengths that EOS ends (mean 256, cut at 1024): samples finish
        # while others decode, so their scoring can begin then (reward.score_ahead) instead of after
        # the batch
        "sv": Workload("0.5b", 32, 8, 256, 1024, mean_response=256, overrides=SLOW_REWARD),
    }
)
LORA_64 = {
    "actor_rollout_ref.model.lora_rank": 64,
    "actor_rollout_ref.model.lora_alpha": 128,
    "actor_rollout_ref.model.target_modules": "all-linear",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
}
WORKLOADS.update(
    {
        # LoRA on 7B shapes
        "w7": Workload("7b", 16, 8, 512, 512, overrides=LORA_64),
        # w3 with LoRA
        "w3l": Workload("1.5b", 64, 8, 512, 512, kl_loss=True, overrides=LORA_64),
        "tinyl": Workload(
            "tiny", 4, 4, 32, 16, overrides={**LORA_64, "actor_rollout_ref.model.lora_rank": 8}
        ),
        # LoRA on 32B shapes: one copy of the base
        "w32": Workload("32b", 16, 8, 512, 512, overrides=LORA_64),
        # w7 on Qwen3-8B
        "q8l": Workload("qwen3-8b", 16, 8, 512, 512, overrides=LORA_64),
        # w7 on Qwen3-30B-A3B
        "e30l": Workload("qwen3-30b-a3b", 16, 8, 512, 512, overrides=LORA_64),
        # t1's work on GPT-OSS-20B, LoRA
        "o20l": Workload("gpt-oss-20b", 16, 8, 256, 256, overrides=LORA_64),
        # 7B full-parameter, the optimiser offloaded a bucket at a time, micro-batches as w7's
        "w7f": Workload(
            "7b",
            16,
            8,
            512,
            512,
            overrides={
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
                "actor_rollout_ref.model.enable_gradient_checkpointing": True,
            },
        ),
    }
)


class InstantEnvironment(Environment):
    """m1's environment: answers every assistant turn at once with a short observation, so a random
    model's rollouts have their turns."""

    def step(self, text: str) -> tuple[str, float, bool]:
        return "ok, go on", 0.0, False


# m1: multi-turn, 0.5B shapes, 64 prompts x 8, 4 assistant turns of 128 tokens, the environment
# answering in between (3 user turns); the budget holds the turns and the template's tokens.
MULTI_TURN_4x128 = {
    "actor_rollout_ref.rollout.multi_turn.enable": True,
    "actor_rollout_ref.rollout.multi_turn.environment": "keel.bench.workloads.InstantEnvironment",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 4,
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 128,
}


async def instant_agent(client, row, extra_info, turn_tokens: int = 128):
    """m1a's agent: m1's episode written against an OpenAI client (4 assistant turns of 128 tokens,
    each answered at once with m1's observation), its requests served by keel's endpoint."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(4):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=turn_tokens
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn < 3:
            messages.append({"role": "user", "content": "ok, go on"})


async def tiny_instant_agent(client, row, extra_info):
    """tinyma's agent: instant_agent's episode in turns of 8 tokens (tinym's)."""
    await instant_agent(client, row, extra_info, turn_tokens=8)


# m1a: m1 driven through the OpenAI-compatible endpoint by instant_agent (issue 30)
AGENT_4x128 = {
    "actor_rollout_ref.rollout.name": "native",
    "actor_rollout_ref.rollout.agent.function": "keel.bench.workloads:instant_agent",
    "actor_rollout_ref.rollout.agent.concurrency": 512,
    "actor_rollout_ref.rollout.agent.max_prompt_length": 320,
}
WORKLOADS.update(
    {
        "m1": Workload("0.5b", 64, 8, 256, 4 * 128 + 3 * 40, overrides=MULTI_TURN_4x128),
        "m1a": Workload("0.5b", 64, 8, 256, 4 * 128 + 3 * 40, overrides=AGENT_4x128),
        "tinyma": Workload(
            "tiny",
            4,
            4,
            32,
            4 * 8 + 3 * 40,
            overrides={
                **AGENT_4x128,
                "actor_rollout_ref.rollout.agent.function": (
                    "keel.bench.workloads:tiny_instant_agent"
                ),
                "actor_rollout_ref.rollout.agent.concurrency": 16,
            },
        ),
        "tinym": Workload(
            "tiny",
            4,
            4,
            32,
            4 * 8 + 3 * 40,
            overrides={
                **MULTI_TURN_4x128,
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 8,
            },
        ),
    }
)
