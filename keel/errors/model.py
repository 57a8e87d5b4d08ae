"""Error codes KEEL-M: model and tokenizer."""

from keel.errors.base import register

MODEL_PATH = register(
    "KEEL-M001", "Model path not found or not a Hugging Face model",
    "The model path does not exist or has no `config.json`; keel loads models from local "
    "directories only.",
    "Point `actor_rollout_ref.model.path` (or `critic.model.path`) at a directory saved by "
    "`save_pretrained`, or build a tiny model with `keel.models.tiny.make_tiny_model`.",
    ("actor_rollout_ref.model.path", "critic.model.path"))
NO_EOS = register(
    "KEEL-M002", "Tokenizer has no EOS token",
    "Generation stops at the EOS token and response masks are built from it; without one every "
    "response runs to the length limit.",
    "Set `eos_token` in the tokenizer (tokenizer_config.json) to the model's end-of-turn token.")
NO_CHAT_TEMPLATE = register(
    "KEEL-M003", "Prompt is a chat but the tokenizer has no chat template",
    "A dataset prompt is a list of chat messages, which needs the tokenizer's chat template to "
    "become text; this tokenizer has none.",
    "Use a tokenizer with a chat template, give prompts as plain strings, or set "
    "`data.apply_chat_template=false` to join message contents as plain text.",
    ("data.apply_chat_template",))
VOCAB_MISMATCH = register(
    "KEEL-M004", "Tokenizer and model disagree on the vocabulary",
    "The tokenizer produces ids (or has special-token ids) that the model's embedding has no row "
    "for; training would index out of range or read garbage rows.",
    "Use the tokenizer that was saved with the model, or resize the model's embeddings "
    "(model.resize_token_embeddings) and save it again.", ("actor_rollout_ref.model.path",))

TOKENIZER_MISMATCH = register(
    "KEEL-M006", "Tokenizer and model disagree on special tokens",
    "The tokenizer's EOS, pad or BOS id differs from the one in the model's config.json or "
    "generation_config.json. transformers fills in defaults silently (a Qwen2 tokenizer without "
    "an eos_token gets <|endoftext|>), and a tokenizer copied from another model loads without a "
    "word: responses then end, or are padded, with tokens the model was not trained on.",
    "Use the tokenizer saved with this model, or set the special tokens in tokenizer_config.json "
    "(or the ids in config.json) so they agree; the message names the ids on each side.")
WEIGHTS_BROKEN = register(
    "KEEL-M005", "Model weight files are truncated or do not match the config",
    "keel reads every safetensors file's header before training: a file shorter than its header "
    "says (an interrupted download or copy), an index naming files that are missing, or tensors "
    "whose shapes or names are not the ones config.json describes (weights from another model "
    "size) would fail deep inside loading, or load with random values.",
    "Download or copy the model directory again (compare file sizes with the source), or point the "
    "model path at the directory whose config.json matches these weights.")
LORA_TARGETS = register(
    "KEEL-M007", "LoRA would not train what it should",
    "model.target_modules matches nothing, or only some of each decoder layer's projections (the rest "
    "would train nothing), or names lm_head or the embedding of a model with tied embeddings (an "
    "adapter would untie them), or a parameter outside the adapters would train: the model learns "
    "little, or drifts, while the run looks fine.",
    "Use model.target_modules=all-linear (every projection of every decoder layer), list every "
    "projection the message names, or name extra trainable modules in model.modules_to_save.",
    ("actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.exclude_modules"))
NO_TOOL_ROLE = register(
    "KEEL-M008", "The chat template cannot carry a multi-turn conversation",
    "Multi-turn rollouts append each tool's output as a `tool` message through the tokenizer's chat "
    "template, right after the token the model ended its turn with. This template drops or rejects the "
    "tool role (the model would never see what its tools returned), ends assistant turns with a token "
    "generation does not stop at, or renders earlier turns differently once more follow: the turns "
    "would be joined by tokens the template never makes.",
    "Use a model whose template has a tool role and ends turns with its stop token (Qwen2.5, Llama 3.1 "
    "and later, Hermes), or set the tokenizer's chat_template to one that does.",
    ("actor_rollout_ref.rollout.multi_turn.enable",))

__all__ = [name for name in dir() if name.isupper()]
