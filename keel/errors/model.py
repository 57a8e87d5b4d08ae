"""Error codes KEEL-M: model and tokenizer."""

from keel.errors.base import register

MODEL_PATH = register(
    "KEEL-M001",
    "Model path not found or not a Hugging Face model",
    "The model path does not exist or has no `config.json`; keel loads models from local "
    "directories only.",
    "Point `actor_rollout_ref.model.path` (or `critic.model.path`, or the distillation teacher's "
    "`distillation.teacher.path`) at a directory holding config.json (one saved by "
    "`save_pretrained`): the fix line names one beside the path given, or the script that makes "
    "it (`python examples/quickstart/prepare.py` for examples/data/model).",
    ("actor_rollout_ref.model.path", "critic.model.path", "distillation.teacher.path"),
)
NO_EOS = register(
    "KEEL-M002",
    "Tokenizer has no EOS token",
    "Generation stops at the EOS token and response masks are built from it; without one every "
    "response runs to the length limit.",
    "Set \"eos_token\" in the model directory's tokenizer_config.json to the model's end-of-turn "
    "token (the fix line gives the line to write: the token config.json's eos_token_id names).",
)
NO_CHAT_TEMPLATE = register(
    "KEEL-M003",
    "Prompt is a chat but the tokenizer has no chat template",
    "A dataset prompt is a list of chat messages, which needs the tokenizer's chat template to "
    "become text; this tokenizer has none.",
    "Set `data.apply_chat_template=false` to join the messages' contents as plain text, give "
    "prompts as plain strings, or use a tokenizer with a chat template.",
    ("data.apply_chat_template",),
)
VOCAB_MISMATCH = register(
    "KEEL-M004",
    "Tokenizer and model disagree on the vocabulary",
    "The tokenizer produces ids (or has special-token ids) that the model's embedding has no row "
    "for; training would index out of range or read garbage rows.",
    "Resize the model's embeddings to the tokenizer and save it beside the model (the fix line "
    "gives the command, then the new model path), or use the tokenizer that was saved with the "
    "model.",
    ("actor_rollout_ref.model.path",),
)

TOKENIZER_MISMATCH = register(
    "KEEL-M006",
    "Tokenizer and model disagree on special tokens",
    "The tokenizer's EOS, pad or BOS id differs from the one in the model's config.json or "
    "generation_config.json. transformers fills in defaults silently (a Qwen2 tokenizer without "
    "an eos_token gets <|endoftext|>), and a tokenizer copied from another model loads without a "
    "word: responses then end, or are padded, with tokens the model was not trained on.",
    "Set the tokenizer's special tokens to the model's in tokenizer_config.json (the fix line "
    "gives each line to write), or use the tokenizer saved with this model; the message names the "
    "ids on each side.",
)
WEIGHTS_BROKEN = register(
    "KEEL-M005",
    "Model weight files are truncated or do not match the config",
    "keel reads every safetensors file's header before training: a file shorter than its header "
    "says (an interrupted download or copy), an index naming files that are missing, or tensors "
    "whose shapes or names are not the ones config.json describes (weights from another model "
    "size) would fail deep inside loading, or load with random values.",
    "When the weights are another size than config.json says, set the size they have in "
    "config.json (the fix line names the field) or point the model path at the directory whose "
    "config.json matches them; when a file is truncated, download or copy the model directory "
    "again (compare file sizes with the source).",
)
LORA_TARGETS = register(
    "KEEL-M007",
    "LoRA would not train what it should",
    "model.target_modules matches nothing, or only some of each decoder layer's projections (the "
    "rest would train nothing), or names lm_head or the embedding of a model with tied embeddings "
    "(an adapter would untie them), or a parameter outside the adapters would train: the model "
    "learns little, or drifts, while the run looks fine.",
    "Set `actor_rollout_ref.model.target_modules=all-linear` (every projection of every decoder "
    "layer), list every projection the message names, or name extra trainable modules in "
    "model.modules_to_save.",
    ("actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.exclude_modules"),
)
EOS_ADDED_ON_LOAD = register(
    "KEEL-M009",
    "The tokenizer's EOS token is not one of its tokens",
    "tokenizer_config.json names an eos_token that none of the tokenizer's files holds. "
    "transformers adds such a token silently as a new id when it loads the tokenizer: a row of "
    "the embedding the model never trained, which it never samples, so no response would end "
    "before the length limit.",
    'Set "eos_token" in tokenizer_config.json to the model\'s end-of-turn token (the fix line '
    "gives the line to write: the token config.json's eos_token_id names).",
)
NO_TOOL_ROLE = register(
    "KEEL-M008",
    "The chat template cannot carry a multi-turn conversation",
    "Multi-turn rollouts append each tool's output as a `tool` message through the tokenizer's "
    "chat template, right after the token the model ended its turn with. This template drops or "
    "rejects the tool role (the model would never see what its tools returned), ends assistant "
    "turns with a token generation does not stop at, or renders earlier turns differently once "
    "more follow: the turns would be joined by tokens the template never makes.",
    "Use a model whose template has a tool role and ends turns with its stop token (Qwen2.5, "
    "Llama 3.1 and later, Hermes), or set the tokenizer's chat_template to one that does.",
    ("actor_rollout_ref.rollout.multi_turn.enable",),
)

TEACHER_VOCAB = register(
    "KEEL-M010",
    "Teacher and student tokenizers differ",
    "On-policy distillation scores the student's sampled token ids with the teacher: the teacher's "
    "log-prob of id 42 is only the student's token 42 when both tokenizers map every token to the "
    "same id and end turns (EOS) with the same one. Here a token has another id, is in one "
    "vocabulary only, or the EOS or pad ids differ: the teacher's log-probs would be of other "
    "tokens, and the student would learn from noise.",
    "Use a teacher whose tokenizer is the student's (the same family: a larger model of the "
    "student's series, saved with the same tokenizer files); the message names the first tokens "
    "that differ.",
    ("distillation.teacher.path",),
)

TEACHER_FLOAT8 = register(
    "KEEL-M011",
    "A float8 teacher cannot run here",
    "distillation.teacher.dtype=float8 runs the teacher's decoder layers as float8 matmuls (e4m3 "
    "weights and activations, a scale per row). Those need a CUDA GPU with float8 tensor cores "
    "(compute capability 8.9 or later: L4, L40S, H100, H200, B200); elsewhere they would run "
    "slower than the bfloat16 they replace.",
    "Set `distillation.teacher.dtype=auto` (the student's compute dtype, bfloat16 on a GPU), or "
    "run on a GPU of compute capability 8.9 or later.",
    ("distillation.teacher.dtype",),
)

__all__ = [name for name in dir() if name.isupper()]
