"""The catalogue of every error a user can cause, and the exception that carries one.

Each code is `KEEL-<area><nnn>`: E environment, C configuration, M model/tokenizer, D data,
R reward, T training numerics, P parallel/distributed. `keel explain CODE` prints an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Code:
    code: str
    title: str
    cause: str
    fix: str
    keys: tuple[str, ...] = field(default_factory=tuple)  # config keys involved


CATALOGUE: dict[str, Code] = {}


def _code(code: str, title: str, cause: str, fix: str, keys: tuple[str, ...] = ()) -> str:
    assert code not in CATALOGUE, f"duplicate code {code}"
    CATALOGUE[code] = Code(code, title, cause, fix, keys)
    return code


# --- C: configuration -------------------------------------------------------------------------
UNKNOWN_KEY = _code(
    "KEEL-C001", "Unknown configuration key",
    "A key in the YAML file or a command-line override is not part of keel's configuration; "
    "other frameworks ignore such keys silently, so a misspelt key would never take effect.",
    "Correct the spelling to the suggested key, or remove it; docs/config.md lists every key.")
BAD_VALUE = _code(
    "KEEL-C002", "Configuration value of the wrong type or out of range",
    "A configuration value cannot be converted to the key's type, is outside its allowed range, "
    "or is not one of the allowed choices.",
    "Set the key to a value of the type and range the message names.")
BAD_OVERRIDE = _code(
    "KEEL-C003", "Malformed command-line override",
    "Overrides are written `section.key=value`; this one has no `=` or an empty key.",
    "Write the override as `section.key=value`, e.g. `data.train_batch_size=16`.")
BATCH_ARITHMETIC = _code(
    "KEEL-C004", "Batch sizes do not divide",
    "The batch plan needs samples per step to split evenly into mini-batches and mini-batches "
    "into micro-batches; otherwise some samples would be silently dropped or reused.",
    "Change the batch sizes so each divides the one above it; the message gives the numbers.",
    ("data.train_batch_size", "actor_rollout_ref.rollout.n",
     "actor_rollout_ref.actor.ppo_mini_batch_size",
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"))
CONFIG_FILE = _code(
    "KEEL-C005", "Configuration file missing or not valid YAML",
    "The configuration path does not exist, cannot be read, or is not a YAML mapping.",
    "Pass the path of a YAML file whose top level is a mapping of sections.")
INCOMPATIBLE_OPTIONS = _code(
    "KEEL-C006", "Options that cannot be used together",
    "Two settings contradict each other, e.g. an advantage estimator that needs a critic with "
    "no critic configured, or a KL loss with no reference model.",
    "Change one of the settings the message names.")
RESUME_PATH = _code(
    "KEEL-C007", "Resume checkpoint not found or incomplete",
    "`trainer.resume_mode` names a checkpoint directory that does not exist or has no "
    "completion marker (it was being written when a run stopped).",
    "Point `trainer.resume_mode` at a complete `global_step_<N>` directory, or use `auto`/`disable`.",
    ("trainer.resume_mode",))
RESUME_MISMATCH = _code(
    "KEEL-C008", "Checkpoint does not match the current config or data",
    "The run directory holds a checkpoint from a run with a different dataset size, batch size or "
    "set of models (e.g. a critic); continuing from it would not be the same run.",
    "Resume with the config the checkpoint was made with, set `trainer.resume_mode=disable` to "
    "start fresh in this directory, or choose another `trainer.experiment_name`.",
    ("trainer.resume_mode", "trainer.default_local_dir"))
DEMO_DIR = _code(
    "KEEL-C009", "Demo output directory holds something else",
    "`keel demo` clears and reuses only directories it made itself (they contain keel_demo.json); "
    "the directory given exists, is not empty and was not made by the demo.",
    "Pass another directory with `keel demo --out DIR`, or empty this one.")
EXPORT_TARGET = _code(
    "KEEL-C010", "Export target exists and is not an earlier export",
    "`keel export` writes a new directory; it never deletes a directory it did not write itself "
    "(one without keel_export.json), since that could be a run directory or your own files.",
    "Pass a new or empty output directory.")
NOT_A_CHECKPOINT = _code(
    "KEEL-C011", "Not a complete keel checkpoint",
    "The path given to `keel export` is not a `global_step_<N>` directory with a COMPLETE marker "
    "(it may be missing, or still being written when a run stopped).",
    "Pass a complete checkpoint directory, e.g. checkpoints/<project>/<experiment>/global_step_<N>.")
NO_METRICS = _code(
    "KEEL-C012", "No metrics to report",
    "`keel report` reads RUN_DIR/metrics.jsonl, which is missing or empty: the path is not a run "
    "directory, or the run has not finished a step yet.",
    "Pass the run directory (trainer.default_local_dir) of a run that has logged at least one step.")
TOKEN_BUDGET = _code(
    "KEEL-C013", "Prompt plus response longer than the model reads",
    "`data.max_prompt_length + data.max_response_length` is more than the policy's "
    "`max_position_embeddings` (long rollouts would run past the positions the model was trained on), "
    "or more than `actor_rollout_ref.rollout.max_model_len`.",
    "Lower data.max_prompt_length or data.max_response_length, or use a model with a longer context "
    "(or raise rollout.max_model_len).",
    ("data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.rollout.max_model_len"))
HOOK_LOAD = _code(
    "KEEL-C014", "A hook cannot be loaded",
    "An entry of trainer.hooks is not `module:function`, the module does not import, or it has no "
    "such function.",
    "Write hooks as `package.module:function` importable from where keel runs.", ("trainer.hooks",))

# --- M: model / tokenizer ---------------------------------------------------------------------
MODEL_PATH = _code(
    "KEEL-M001", "Model path not found or not a Hugging Face model",
    "The model path does not exist or has no `config.json`; keel loads models from local "
    "directories only.",
    "Point `actor_rollout_ref.model.path` (or `critic.model.path`) at a directory saved by "
    "`save_pretrained`, or build a tiny model with `keel.models.tiny.make_tiny_model`.",
    ("actor_rollout_ref.model.path", "critic.model.path"))
NO_EOS = _code(
    "KEEL-M002", "Tokenizer has no EOS token",
    "Generation stops at the EOS token and response masks are built from it; without one every "
    "response runs to the length limit.",
    "Set `eos_token` in the tokenizer (tokenizer_config.json) to the model's end-of-turn token.")
NO_CHAT_TEMPLATE = _code(
    "KEEL-M003", "Prompt is a chat but the tokenizer has no chat template",
    "A dataset prompt is a list of chat messages, which needs the tokenizer's chat template to "
    "become text; this tokenizer has none.",
    "Use a tokenizer with a chat template, give prompts as plain strings, or set "
    "`data.apply_chat_template=false` to join message contents as plain text.",
    ("data.apply_chat_template",))
VOCAB_MISMATCH = _code(
    "KEEL-M004", "Tokenizer and model disagree on the vocabulary",
    "The tokenizer produces ids (or has special-token ids) that the model's embedding has no row "
    "for; training would index out of range or read garbage rows.",
    "Use the tokenizer that was saved with the model, or resize the model's embeddings "
    "(model.resize_token_embeddings) and save it again.", ("actor_rollout_ref.model.path",))

TOKENIZER_MISMATCH = _code(
    "KEEL-M006", "Tokenizer and model disagree on special tokens",
    "The tokenizer's EOS, pad or BOS id differs from the one in the model's config.json or "
    "generation_config.json. transformers fills in defaults silently (a Qwen2 tokenizer without "
    "an eos_token gets <|endoftext|>), and a tokenizer copied from another model loads without a "
    "word: responses then end, or are padded, with tokens the model was not trained on.",
    "Use the tokenizer saved with this model, or set the special tokens in tokenizer_config.json "
    "(or the ids in config.json) so they agree; the message names the ids on each side.")
WEIGHTS_BROKEN = _code(
    "KEEL-M005", "Model weight files are truncated or do not match the config",
    "keel reads every safetensors file's header before training: a file shorter than its header "
    "says (an interrupted download or copy), an index naming files that are missing, or tensors "
    "whose shapes or names are not the ones config.json describes (weights from another model "
    "size) would fail deep inside loading, or load with random values.",
    "Download or copy the model directory again (compare file sizes with the source), or point the "
    "model path at the directory whose config.json matches these weights.")


# --- D: data ----------------------------------------------------------------------------------
DATA_FILE = _code(
    "KEEL-D001", "Dataset file missing or unreadable",
    "A path in `data.train_files` / `data.val_files` does not exist or is not parquet or JSONL.",
    "Give existing `.parquet`, `.jsonl` or `.json` files.", ("data.train_files", "data.val_files"))
DATA_COLUMN = _code(
    "KEEL-D002", "Dataset is missing a required column",
    "Every row needs the prompt column (`data.prompt_key`, default `prompt`).",
    "Add the column, or point `data.prompt_key` at the column that holds prompts.",
    ("data.prompt_key",))
PROMPT_TOO_LONG = _code(
    "KEEL-D003", "Prompt longer than data.max_prompt_length",
    "With `data.truncation=error`, a prompt over the limit stops the run rather than being "
    "cut silently.",
    "Raise `data.max_prompt_length`, set `data.truncation` to `left` or `right`, or set "
    "`data.filter_overlong_prompts=true`.",
    ("data.max_prompt_length", "data.truncation", "data.filter_overlong_prompts"))
DATA_EMPTY = _code(
    "KEEL-D004", "Dataset empty or smaller than one batch",
    "The dataset files hold no rows at all, or after filtering the dataset has fewer prompts "
    "than `data.train_batch_size`, so not one step could run.",
    "Add data, lower `data.train_batch_size`, or relax the overlong-prompt filter.",
    ("data.train_batch_size", "data.filter_overlong_prompts"))
SFT_TOO_LONG = _code(
    "KEEL-D005", "SFT example longer than data.max_length",
    "With `data.truncation=error`, an example over the limit stops the run rather than being cut "
    "silently (a cut example may lose the very answer it should teach).",
    "Raise `data.max_length`, or set `data.truncation` to `right` (keep the start) or `left`.",
    ("data.max_length", "data.truncation"))
NO_ASSISTANT_TURN = _code(
    "KEEL-D006", "SFT example has nothing to learn from",
    "SFT trains only on assistant tokens; this conversation has no assistant message with content, "
    "so its loss would be empty.",
    "Give every example an assistant turn (`messages` with role `assistant`, or a response column).",
    ("data.messages_key", "data.response_key"))

# --- R: reward --------------------------------------------------------------------------------
REWARD_FN_LOAD = _code(
    "KEEL-R001", "Custom reward function cannot be loaded",
    "`custom_reward_function.path` does not exist, does not import, or has no function named "
    "`custom_reward_function.name`.",
    "Fix the path or the name; the function takes (data_source, solution_str, ground_truth, "
    "extra_info) and returns a float.",
    ("custom_reward_function.path", "custom_reward_function.name"))
NO_SCORER = _code(
    "KEEL-R002", "No scorer for a data_source",
    "A row's `data_source` matches no built-in scorer and no custom reward function is set; "
    "scoring it as 0 would look like a model that never learns.",
    "Set `custom_reward_function.path` to a file with your scorer, or set the rows' data_source to "
    "one a built-in scorer serves (gsm8k, openai/gsm8k, exact_match).",
    ("custom_reward_function.path", "custom_reward_function.name"))
REWARD_NOT_NUMBER = _code(
    "KEEL-R003", "Reward function returned a non-finite number or a non-number",
    "The reward function returned None, a string, NaN or infinity for a sample.",
    "Make the reward function return a finite float for every sample.")
MISSING_GROUND_TRUTH = _code(
    "KEEL-R004", "Rows without a ground truth for a built-in scorer",
    "Built-in scorers compare the response with `reward_model.ground_truth`; a row without one "
    "would score 0 on every sample, which looks like a model that never learns.",
    "Add `reward_model: {ground_truth: ...}` to every row, or score with your own "
    "`custom_reward_function` that does not need one.", ("custom_reward_function.path",))
SCORER_RAISED = _code(
    "KEEL-R005", "The scorer raised an exception on a real row",
    "`keel check` ran the reward function on a few dataset rows (the ground truth as the answer, "
    "and an empty answer) and it raised; during training every such sample would crash the run.",
    "Make the reward function handle these inputs (an empty response must score, e.g. 0.0).",
    ("custom_reward_function.path", "custom_reward_function.name"))
TOO_MANY_NOT_SCORED = _code(
    "KEEL-R006", "Too many samples could not be scored",
    "More than reward.max_not_scored_ratio of a batch's samples raised, hung or returned a "
    "non-number in the scorer; a scorer failing that often is broken, and training on the rest "
    "would quietly follow a different reward than the one you wrote.",
    "Read the reason in the message (and reward/not_scored/* in the metrics), fix the scorer, or "
    "raise reward.max_not_scored_ratio / reward.timeout_s if the failures are expected.",
    ("reward.max_not_scored_ratio", "reward.on_error", "reward.timeout_s"))
SCORER_TIMEOUT = _code(
    "KEEL-R007", "A scorer took longer than reward.timeout_s",
    "With reward.on_error=raise, one sample whose scoring runs past the limit stops the run.",
    "Make the scorer faster, raise reward.timeout_s, or let reward.on_error=mask leave such samples "
    "out of the update (counted as reward/not_scored/timeout).", ("reward.timeout_s", "reward.on_error"))
SERVICE_UNAVAILABLE = _code(
    "KEEL-R008", "The reward service is not reachable or not healthy",
    "reward.service.url is set, but GET /health did not answer {\"status\": \"ok\"} before training "
    "started: every batch would end up not scored.",
    "Start the service (`keel reward-server ...`), check the URL, port and token, or unset "
    "reward.service.url.", ("reward.service.url", "reward.service.token"))

# --- T: training numerics ---------------------------------------------------------------------
NONFINITE_LOSS = _code(
    "KEEL-T001", "Loss or gradient norm is not finite",
    "A NaN or infinite loss or gradient norm would corrupt the weights; the update was refused "
    "and the run stopped before any bad weights were saved.",
    "Lower the learning rate, check rewards for extreme values, or enable gradient clipping "
    "(`actor_rollout_ref.actor.grad_clip`).",
    ("actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.grad_clip"))
NO_GRADIENT = _code(
    "KEEL-T002", "No parameter received a gradient",
    "After backward, every trainable parameter's gradient is None: the loss does not depend on "
    "the weights being trained, so the run would move its loss and learn nothing.",
    "Check that the model is trainable (not frozen) and that the loss uses the policy's log-probs.")
NONFINITE_VALUES = _code(
    "KEEL-T003", "Non-finite values in a stage of the step",
    "A reward, log-prob, value or advantage is NaN or infinite; one such number poisons the loss "
    "and then every weight. The step was stopped before any update.",
    "Look at the stage the message names: for rewards, the scorer on samples.jsonl; for log-probs, "
    "the model's dtype and inputs. `trainer.guards.nonfinite=skip` drops such steps (counted as "
    "guards/skipped_steps) instead of stopping.", ("trainer.guards.nonfinite",))
PHASE_TIMEOUT = _code(
    "KEEL-T004", "A phase of the step ran past its time limit",
    "Generation, scoring, a forward/backward or a save took longer than "
    "trainer.guards.phase_timeout_s: something hangs (a reward service, a collective, a deadlock).",
    "Read the stacks printed with the error to see where it hung; raise "
    "trainer.guards.phase_timeout_s if the phase is just slow.", ("trainer.guards.phase_timeout_s",))

# --- E: environment ---------------------------------------------------------------------------
DEVICE_UNAVAILABLE = _code(
    "KEEL-E001", "Requested device is not available",
    "`trainer.device` names a device this machine does not have (e.g. cuda without a GPU).",
    "Set `trainer.device=cpu` or `auto`.", ("trainer.device",))
MEMORY_ESTIMATE = _code(
    "KEEL-E002", "The run will not fit in the device's memory",
    "keel's estimate (float32 weights, gradients and AdamW state of each trained model, the "
    "reference, one micro-batch's activations and logits, the generation KV cache) exceeds the "
    "free memory of the device.",
    "Lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, rollout.max_num_seqs or the sequence "
    "lengths, turn on model.enable_gradient_checkpointing, or use a smaller model.",
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.max_num_seqs"))
TORCH_UNSUPPORTED = _code(
    "KEEL-E004", "Unsupported torch release",
    "keel needs torch >= 2.4; torch 2.3.x has an FSDP bug that can leave gradients None after "
    "backward, so the loss moves and the model learns nothing.",
    "Install torch >= 2.4 (a build matching your CUDA driver).")
CUDA_DRIVER_TOO_OLD = _code(
    "KEEL-E005", "The NVIDIA driver is older than torch's CUDA",
    "torch was built for a CUDA major version the installed driver does not support; torch then "
    "sees no GPU, or fails at the first kernel.",
    "Update the NVIDIA driver, or install a torch build for the CUDA version the driver supports.")
GPU_ARCH_UNSUPPORTED = _code(
    "KEEL-E006", "This torch build has no kernels for the GPU",
    "The GPU's compute capability (sm_XY) is not in torch.cuda.get_arch_list(): kernels fail with "
    "'no kernel image is available'.",
    "Install a torch build compiled for this GPU generation.")
PACKAGE_VERSION = _code(
    "KEEL-E007", "A required package is missing or outside the supported range",
    "keel is tested with Python >= 3.10 and transformers, tokenizers and peft within the ranges "
    "`keel doctor` prints; other versions change APIs keel relies on.",
    "Install a supported version: pip install -e . picks them.")
LOW_DISK = _code(
    "KEEL-E008", "Little free disk for checkpoints",
    "Each checkpoint holds float32 weights and optimiser state (about 16 bytes per parameter); a "
    "full disk fails a save hours into a run.",
    "Free disk space, point trainer.default_local_dir at a larger disk, or set "
    "trainer.max_actor_ckpt_to_keep.", ("trainer.default_local_dir", "trainer.max_actor_ckpt_to_keep"))
SANDBOX_INCOMPLETE = _code(
    "KEEL-E010", "The code sandbox cannot give every protection here",
    "Model-written code (the code_exec scorer) runs in a bubblewrap jail: namespaces of its own, a "
    "read-only view of the system, no network, an unprivileged user, resource limits. On this "
    "machine bubblewrap is missing, or the kernel or container refuses the namespaces it needs, so "
    "some protections are not in force, and reward.sandbox.require asks for them (by default the "
    "isolation ones: model code never runs unfenced unless the config says so).",
    "Install bubblewrap (apt-get install bubblewrap; keel's `make install` does), or run where user "
    "and mount namespaces are allowed (a container started with --security-opt seccomp=unconfined "
    "or a VM). `keel doctor` lists the protections in force. reward.sandbox.require=none runs "
    "with those there are, at your risk.", ("reward.sandbox.require",))
RUN_DIR_NOT_WRITABLE = _code(
    "KEEL-E003", "The run directory cannot be written",
    "keel writes its config, metrics and checkpoints under trainer.default_local_dir; the nearest "
    "existing folder above it is not writable.",
    "Point trainer.default_local_dir at a writable location.", ("trainer.default_local_dir",))
COMPILE_FAILED = _code(
    "KEEL-E009", "torch.compile could not compile keel's kernels",
    "On a GPU keel compiles the decoder layers and the log-prob arithmetic of training "
    "(actor.use_torch_compile) and the decode step of the native engine. The compiler failed for "
    "this model, torch or Triton release; the first lines of its error follow.",
    "Set actor_rollout_ref.actor.use_torch_compile=false (training) or "
    "actor_rollout_ref.rollout.enforce_eager=true (generation), as the message says; keel runs the "
    "same numbers uncompiled, slower.",
    ("actor_rollout_ref.actor.use_torch_compile", "actor_rollout_ref.rollout.enforce_eager"))


# --- P: parallel / distributed ------------------------------------------------------------------
WORKER_RAISED = _code(
    "KEEL-P001", "A worker raised an exception",
    "Code running in one of the worker processes (generation, log-probs, an update, a checkpoint) "
    "raised. The message names the rank, host, role and phase, and the worker's own traceback "
    "follows it.",
    "Read the worker's traceback: it is the real error. Rerun with --debug for NCCL/torch detail.")
WORKER_DIED = _code(
    "KEEL-P002", "A worker process died",
    "A worker process ended without raising: it was killed by the system (most often the "
    "out-of-memory killer) or crashed in native code. The message gives its last memory reading.",
    "If memory was near the limit: lower the micro-batch sizes or rollout.max_num_seqs, enable "
    "fsdp_config.param_offload / optimizer_offload, or use more GPUs.",
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.max_num_seqs",
     "actor_rollout_ref.actor.fsdp_config.param_offload"))
PHASE_STALLED = _code(
    "KEEL-P003", "A distributed phase stalled",
    "Some ranks did not reach a collective (or a phase did not finish on every rank) within the "
    "time allowed. Every rank's stacks are written to the run directory and the ranks that did not "
    "arrive are named.",
    "Look at the stacks of the ranks named as not arrived: they are stuck elsewhere (a reward "
    "call, a data loader, a deadlock). Raise trainer.collective_timeout_s only if the phase is "
    "legitimately slow.", ("trainer.collective_timeout_s", "trainer.guards.phase_timeout_s"))
NOT_ENOUGH_DEVICES = _code(
    "KEEL-P004", "More workers asked for than devices or Ray resources available",
    "trainer.n_gpus_per_node x trainer.nnodes workers need that many GPUs (or CPUs with "
    "trainer.device=cpu), and the machine or the Ray cluster has fewer.",
    "Lower trainer.n_gpus_per_node / trainer.nnodes, or add nodes to the Ray cluster "
    "(`ray start --address=...` on each).", ("trainer.n_gpus_per_node", "trainer.nnodes"))
RAY_MISSING = _code(
    "KEEL-P005", "Ray is needed for more than one worker and is not usable",
    "Training on more than one GPU or node runs its workers as Ray actors; Ray is not installed, "
    "or the cluster in RAY_ADDRESS cannot be reached.",
    "pip install 'ray[default]' (keel's install does this), or unset RAY_ADDRESS to start a local "
    "Ray instance.")
MASTER_PORT_UNUSABLE = _code(
    "KEEL-P007", "MASTER_PORT is not a port keel can listen on",
    "MASTER_PORT is set in the environment, so keel's rank 0 listens there for the other ranks "
    "(instead of on a free port it picks), and the value is not a port number or the port is "
    "taken on rank 0's node.",
    "Set MASTER_PORT to a free port between 1 and 65535 that the nodes can reach, or unset it to "
    "let keel choose one.")
REFERENCE_APART = _code(
    "KEEL-P006", "The reference model cannot be placed apart from the actor",
    "The reference model runs in the actor's workers, on the same ranks and the same data shard: "
    "its log-probs are compared with the actor's token by token every step (the KL loss or "
    "penalty). On a pool or nodes of its own, every step would ship both sets of log-probs across "
    "the network and the two shards would have to match sample for sample.",
    "Remove the reference's placement keys. To make room for it, offload its weights "
    "(actor_rollout_ref.ref.fsdp_config.param_offload=true) or shard over more GPUs.",
    ("actor_rollout_ref.ref.fsdp_config.param_offload",))


class KeelError(Exception):
    """An error the user can fix: it carries a catalogue code and a fix line."""

    def __init__(self, code: str, message: str, fix: str | None = None):
        assert code in CATALOGUE, f"unregistered error code {code}"
        self.code = code
        self.message = message
        self.fix = fix or CATALOGUE[code].fix
        super().__init__(f"{code}: {message}")

    def __reduce__(self):  # crosses process boundaries (Ray workers) with its code intact
        return KeelError, (self.code, self.message, self.fix)

    def render(self) -> str:
        return f"error[{self.code}]: {self.message}\nfix: {self.fix}"


class SkipStep(Exception):
    """Raised instead of an error when `trainer.guards.nonfinite=skip`: the step is dropped, counted."""


def explain(code: str) -> str:
    entry = CATALOGUE[code]
    lines = [f"{entry.code}: {entry.title}", "", f"cause: {entry.cause}", f"fix:   {entry.fix}"]
    if entry.keys:
        lines.append("keys:  " + ", ".join(entry.keys))
    return "\n".join(lines)
