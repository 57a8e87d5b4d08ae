"""What keel knows of each model family outside the native engine, one record a family: its model
types, which of them take the trainer's chunked lm_head path, the config of its test-sized models,
and how many parameters a token passes through. The trainer, the tiny models and the benchmark read
these (they must not import rollout/); the native engine's family (rollout/native/models/) points
to its record. Adding a family is a record here and a line in RECORDS."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# (hidden_size, num_heads, num_layers) of a tiny model -> the config fields its model type needs
# beside those common sizes, scaled down with them
TinyFields = Callable[[int, int, int], dict]


def no_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    return {}


def every_parameter(config, parameters: int) -> int:
    """A dense model's active parameters: all of them."""
    return parameters


@dataclass(frozen=True)
class FamilyFacts:
    """One family's facts that are not the native engine's."""

    model_types: frozenset[str]
    # The model types whose logits are exactly lm_head(final hidden state): no soft-capping or
    # scaling that the trainer's chunked path (training/forward.py) would skip. The others take
    # transformers' own head through `logits_to_keep`, exact for any head. Each record says why.
    plain_lm_head: frozenset[str]
    # model type -> its tiny model's extra config fields; the model types keel builds tiny models of
    tiny_fields: Mapping[str, TinyFields] = field(default_factory=dict)
    # (config, all parameters) -> the parameters a token passes through
    active_parameters: Callable[[object, int], int] = every_parameter


def _head_dim_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    return dict(head_dim=hidden_size // num_heads)


def _smollm3_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    # every fourth layer has no rotary embedding, as the released checkpoints
    return dict(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(num_layers)])


LLAMA = FamilyFacts(
    model_types=frozenset({"qwen2", "qwen3", "llama", "mistral", "smollm3"}),
    # SmolLM3's head is plain too, but it was not checked against the chunked path when it came
    # (0a09479): it keeps logits_to_keep until a test compares the two.
    plain_lm_head=frozenset({"qwen2", "qwen3", "llama", "mistral"}),
    # none of Mistral: its config's sliding window, on by default, is one native does not run
    tiny_fields={
        "qwen2": no_fields,
        "llama": no_fields,
        "qwen3": _head_dim_fields,
        "smollm3": _smollm3_fields,
    },
)


def _qwen3_moe_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    # 8 experts of which 2 route each token, the last layer dense (mlp_only_layers), as the
    # released checkpoints' shapes scaled down
    return dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden_size // 2,
        mlp_only_layers=[num_layers - 1],
        norm_topk_prob=True,
    )


def _qwen3_moe_active(config, parameters: int) -> int:
    """Every parameter but the unrouted experts of each sparse layer (gated, no biases)."""
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    sparse = [
        i
        for i in range(config.num_hidden_layers)
        if i not in (config.mlp_only_layers or []) and (i + 1) % config.decoder_sparse_step == 0
    ]
    return parameters - len(sparse) * (config.num_experts - config.num_experts_per_tok) * per_expert


QWEN3_MOE = FamilyFacts(
    model_types=frozenset({"qwen3_moe"}),
    # the router's output is not in the logits
    plain_lm_head=frozenset({"qwen3_moe"}),
    tiny_fields={"qwen3_moe": _qwen3_moe_fields},
    active_parameters=_qwen3_moe_active,
)


def _gemma3_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    # sliding-window and global layers in turn; a window shorter than the tests' prompts
    return dict(
        head_dim=hidden_size // num_heads,
        query_pre_attn_scalar=hidden_size // num_heads,
        sliding_window=16,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
    )


GEMMA3 = FamilyFacts(
    model_types=frozenset({"gemma3_text"}),
    # its config can soft-cap the logits (final_logit_softcapping), which the chunked path skips
    plain_lm_head=frozenset(),
    tiny_fields={"gemma3_text": _gemma3_fields},
)

OLMO2 = FamilyFacts(
    model_types=frozenset({"olmo2"}),
    # a plain head, not checked against the chunked path when it came (0a09479): logits_to_keep
    plain_lm_head=frozenset(),
    tiny_fields={"olmo2": no_fields},
)


def _gpt_oss_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    return dict(
        head_dim=hidden_size // num_heads,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
    )


def _gpt_oss_active(config, parameters: int) -> int:
    """Every parameter but the unrouted experts: every layer a mixture, experts with biases."""
    hidden, inner = config.hidden_size, config.intermediate_size
    per_expert = 3 * hidden * inner + 2 * inner + hidden
    unrouted = config.num_local_experts - config.num_experts_per_tok
    return parameters - config.num_hidden_layers * unrouted * per_expert


GPT_OSS = FamilyFacts(
    model_types=frozenset({"gpt_oss"}),
    # a plain head, not checked against the chunked path when it came (66dfd2f): logits_to_keep
    plain_lm_head=frozenset(),
    tiny_fields={"gpt_oss": _gpt_oss_fields},
    active_parameters=_gpt_oss_active,
)


def _phi3_fields(hidden_size: int, num_heads: int, num_layers: int) -> dict:
    # a sliding window shorter than the tests' prompts, as Phi-3-mini-4k's 2047 is shorter than its
    # 4096 positions
    return dict(sliding_window=16)


PHI3 = FamilyFacts(
    model_types=frozenset({"phi3"}),
    # its logits are lm_head(final hidden state), unscaled and uncapped; a test holds the chunked
    # path equal to transformers' own head on a tiny Phi-3
    plain_lm_head=frozenset({"phi3"}),
    tiny_fields={"phi3": _phi3_fields},
)

# every family's record, one line each
RECORDS = (LLAMA, QWEN3_MOE, GEMMA3, OLMO2, GPT_OSS, PHI3)
FACTS: dict[str, FamilyFacts] = {
    model_type: facts for facts in RECORDS for model_type in facts.model_types
}

# every family's model types that take the trainer's chunked lm_head path
PLAIN_LM_HEAD = frozenset().union(*(facts.plain_lm_head for facts in RECORDS))


def tiny_fields(model_type: str) -> TinyFields | None:
    """The extra config fields of a tiny model of this type, or None: keel builds none of it."""
    facts = FACTS.get(model_type)
    return facts.tiny_fields.get(model_type) if facts else None


def tiny_model_types() -> list[str]:
    return sorted(t for facts in RECORDS for t in facts.tiny_fields)


def active_parameters(config, parameters: int) -> int:
    """Parameters a token passes through: a mixture of experts' unrouted experts left out. A model
    type no family knows is counted as Qwen's mixtures count (qwen2_moe's config names the same
    fields) when its config has experts, else whole."""
    facts = FACTS.get(config.model_type)
    if facts is not None:
        return facts.active_parameters(config, parameters)
    if getattr(config, "num_experts", 0):
        return _qwen3_moe_active(config, parameters)
    return parameters
