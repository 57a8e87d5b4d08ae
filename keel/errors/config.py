"""Error codes KEEL-C: configuration."""

from keel.errors.base import register

UNKNOWN_KEY = register(
    "KEEL-C001",
    "Unknown configuration key",
    "A key in the YAML file or a command-line override is not part of keel's configuration; "
    "other frameworks ignore such keys silently, so a misspelt key would never take effect.",
    "Write the suggested key in place of the misspelt one (the fix line gives `right.key=value`), "
    "or remove the key; docs/config.md lists every key.",
)
BAD_VALUE = register(
    "KEEL-C002",
    "Configuration value of the wrong type or out of range",
    "A configuration value cannot be converted to the key's type, is outside its allowed range, "
    "or is not one of the allowed choices.",
    "Set the value the fix line names: the nearest value allowed, the choice spelt like the one "
    "given, or the key's default; docs/config.md gives each key's type and range.",
)
BAD_OVERRIDE = register(
    "KEEL-C003",
    "Malformed command-line override",
    "Overrides are written `section.key=value`; this one has no `=` or an empty key.",
    "Write the override as `section.key=value`, e.g. `data.train_batch_size=16`.",
)
BATCH_ARITHMETIC = register(
    "KEEL-C004",
    "Batch sizes do not divide",
    "The batch plan needs samples per step to split evenly into mini-batches and mini-batches "
    "into micro-batches; otherwise some samples would be silently dropped or reused.",
    "Set the size the fix line names (the nearest divisor: "
    "`actor_rollout_ref.actor.ppo_mini_batch_size=2` for data.train_batch_size=4 and a mini-batch "
    "of 3), so each size divides the one above it.",
    (
        "data.train_batch_size",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
)
CONFIG_FILE = register(
    "KEEL-C005",
    "Configuration file missing or not valid YAML",
    "The configuration path does not exist, cannot be read, or is not a YAML mapping.",
    "Pass the path of an existing YAML file whose top level is a mapping of sections; for a "
    "missing file the fix line names the YAML file beside it spelt most like it.",
)
INCOMPATIBLE_OPTIONS = register(
    "KEEL-C006",
    "Options that cannot be used together",
    "Two settings contradict each other, e.g. an advantage estimator that needs a critic with "
    "no critic configured, or a KL loss with no reference model.",
    "Set the value the fix line names for one of the two settings (e.g. "
    "`algorithm.critic_warmup=0` when there is no critic).",
)
RESUME_PATH = register(
    "KEEL-C007",
    "Resume checkpoint not found or incomplete",
    "`trainer.resume_mode` names a checkpoint directory that does not exist or has no "
    "completion marker (it was being written when a run stopped).",
    "Set `trainer.resume_mode` to a complete `global_step_<N>` directory (the fix line names the "
    "newest there is), or `trainer.resume_mode=auto` (the run's newest complete checkpoint, or a "
    "fresh start).",
    ("trainer.resume_mode",),
)
RESUME_MISMATCH = register(
    "KEEL-C008",
    "Checkpoint does not match the current config or data",
    "The run directory (trainer.default_local_dir, by default checkpoints/<project>/<experiment>) "
    "holds a checkpoint of a run with other settings (a learning rate, LoRA, the dataset, a "
    "critic), which `trainer.resume_mode=auto` would resume; continuing it with these settings "
    "would not be the same run.",
    "Start the new run in a directory that does not exist yet: `trainer.experiment_name=<a new "
    "name>` (or `trainer.default_local_dir=<a new directory>` when the config sets it); the fix "
    "line names a free one. Or resume with the checkpoint's settings: set back the keys the "
    "message lists as changed (the fix line gives their old values). "
    "`trainer.resume_mode=disable` does not help: a fresh run is refused where checkpoints are.",
    ("trainer.experiment_name", "trainer.default_local_dir", "trainer.resume_mode"),
)
DEMO_DIR = register(
    "KEEL-C009",
    "Demo output directory holds something else",
    "`keel demo` clears and reuses only directories it made itself (they contain keel_demo.json); "
    "the directory given exists, is not empty and was not made by the demo.",
    "Pass a directory that does not exist yet with `keel demo --out DIR`, or empty this one.",
)
EXPORT_TARGET = register(
    "KEEL-C010",
    "Export target exists and is not an earlier export",
    "`keel export` writes a new directory; it never deletes a directory it did not write itself "
    "(one without keel_export.json), since that could be a run directory or your own files.",
    "Pass an output directory that does not exist yet: the fix line gives `keel export "
    "CHECKPOINT NEW_DIR`.",
)
NOT_A_CHECKPOINT = register(
    "KEEL-C011",
    "Not a complete keel checkpoint",
    "The path given to `keel export` is not a `global_step_<N>` directory with a COMPLETE marker "
    "(it may be missing, or still being written when a run stopped).",
    "Pass a complete checkpoint directory, e.g. "
    "checkpoints/<project>/<experiment>/global_step_<N>; the fix line gives `keel export` with "
    "the newest one under the path given.",
)
NO_METRICS = register(
    "KEEL-C012",
    "No metrics to report",
    "`keel report` reads RUN_DIR/metrics.jsonl, which is missing or empty: the path is not a run "
    "directory, or the run has not finished a step yet.",
    "Pass the run directory (trainer.default_local_dir) of a run that has logged at least one "
    "step.",
    ("trainer.default_local_dir",),
)
TOKEN_BUDGET = register(
    "KEEL-C013",
    "Prompt plus response longer than the model reads",
    "`data.max_prompt_length + data.max_response_length` is more than the policy's "
    "`max_position_embeddings` (long rollouts would run past the positions the model was trained "
    "on), or more than `actor_rollout_ref.rollout.max_model_len`.",
    "Set data.max_response_length (or data.max_prompt_length) so the two fit what the model reads "
    "(the fix line gives values that fit), or use a model with a longer context; "
    "rollout.max_model_len may be raised up to the model's positions, not past them.",
    (
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.rollout.max_model_len",
    ),
)
HOOK_LOAD = register(
    "KEEL-C014",
    "A hook cannot be loaded",
    "An entry of trainer.hooks is not `module:function`, the module does not import, or it "
    "has no such function.",
    "Write hooks as `package.module:function` importable where keel runs (the keel command "
    "imports from the working directory only with `export PYTHONPATH=$PWD`); the fix line names "
    "the function spelt like the one given.",
    ("trainer.hooks",),
)
VERL_UNSUPPORTED = register(
    "KEEL-C015",
    "A verl setting keel does not have",
    "The key is verl's, and its value asks for something keel does not do (sequence parallelism, "
    "Megatron, a remote sandbox, a feature a later keel adds). Silently ignoring it would train "
    "another run than the one the script describes.",
    "Remove the key (verl's default then applies) or, for a key keel has, set keel's default "
    "(the fix line says which); the message says what keel offers instead. Keys "
    'keel does another way are accepted and listed by `keel check` under "decided for you".',
)
TOOL_CONFIG = register(
    "KEEL-C016",
    "A tool or environment the rollout calls cannot be built",
    "Multi-turn rollouts call the tools in actor_rollout_ref.rollout.multi_turn.tool_config_path "
    "(verl's format: class_name, config, tool_schema) or given in Python, multi_turn.environment, "
    "and verl's interactions in multi_turn.interaction_config_path (name, class_name, config): "
    "the file is missing or malformed, a class name resolves to no class with an execute (tool), "
    "step (environment) or generate_response (interaction) method, two tools or interactions "
    "share a name, a class raises when built, or a Python tool's parameters lack type hints, so "
    "its schema cannot be derived.",
    "Fix the entry the message names: a path that exists (for a missing file the fix line names "
    "the one beside it spelt most like it), class_name one of keel's built-ins "
    "(keel.tools.Calculator) or an importable module.Class, every tool with a "
    "tool_schema.function.name of its own.",
    (
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        "actor_rollout_ref.rollout.multi_turn.environment",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
    ),
)

LAUNCH_CONFIG_PATH = register(
    "KEEL-C018",
    "--config-path is not a directory of configs",
    "verl's launch form `keel train --config-path DIR --config-name NAME` names a directory of "
    "YAML configs (as Hydra does; a relative `config` is verl's own trainer config, as verl's "
    "main_ppo reads it): the directory does not exist, is a file, the option has no value, or a "
    "config file was given as well.",
    "Pass the directory that holds NAME.yaml with --config-path (the fix line names the directory "
    "beside the one given spelt most like it), and its file's name without .yaml with "
    "--config-name; or pass one YAML file as `keel train FILE`, not both.",
)
LAUNCH_CONFIG_NAME = register(
    "KEEL-C019",
    "--config-name names no config in the directory",
    "`--config-name NAME` must name NAME.yaml in the --config-path directory (or in verl's "
    "trainer config without --config-path); that file is not there, or the option has no value.",
    "Pass the name of a YAML file of that directory, without .yaml (the fix line names the one "
    "spelt most like the name given).",
)
LAUNCH_DEFAULTS = register(
    "KEEL-C020",
    "A config's defaults list cannot be composed",
    "A verl-style YAML composes other configs through its `defaults:` list (verl's trainer "
    "config: `defaults: [ppo_trainer, _self_]`); an entry names a config found in no directory of "
    "the search path (the config's own directory and its hydra.searchpath), or the list is "
    "malformed, so Hydra cannot compose it.",
    "Name, in the defaults list, a config of the search path (the fix line names the one spelt "
    "most like it); for verl's trainer config keep `hydra: searchpath: "
    "[file://verl/trainer/config]` in the YAML, which keel resolves to the installed verl or its "
    "own copy of verl's trainer config.",
)
LAUNCH_SEARCHPATH = register(
    "KEEL-C021",
    "A hydra.searchpath entry is not there",
    "An entry of the YAML's `hydra: searchpath:` list names a directory (file://, relative to the "
    "working directory as Hydra reads it) or a package (pkg://) that does not exist, so configs "
    "its defaults list names would not be found. verl's own trainer config "
    "(file://verl/trainer/config, pkg://verl.trainer.config) is always found: from the installed "
    "verl, else keel's copy.",
    "Make the entry a directory that exists (an absolute path, or one relative to where keel "
    "runs), or remove it from the YAML's hydra.searchpath.",
)

AGENT_REQUEST = register(
    "KEEL-C022",
    "An agent's request to keel's OpenAI-compatible endpoint cannot be served",
    "During a rollout, agent code reaches the policy through keel's endpoint "
    "(`/v1/chat/completions`, `/v1/completions`). The request asked for what this rollout's "
    "engine does not do: sampling settings other than the rollout's (its captured CUDA graphs "
    "hold temperature, top_p and top_k), more than one choice (`n`: each sample is one request of "
    "its own), more tokens than the rollout's budget, a body that is not a completion request, or "
    "no sample to tie the tokens to. The endpoint answers 400 with this code.",
    "Leave temperature/top_p/top_k unset in the agent (or set them to the rollout's: "
    "actor_rollout_ref.rollout.temperature, top_p, top_k), ask for n=1, keep max_tokens within "
    "the rollout's response budget, and send each sample's requests with its own model name (the "
    "one keel gives the agent).",
)

AGENT_FUNCTION = register(
    "KEEL-C023",
    "rollout.agent.function names no async function",
    "actor_rollout_ref.rollout.agent.function is agent code that runs as the rollout: "
    "`module:function` (an importable module) or `file.py:function` (relative to the working "
    "directory), an `async def` taking (client, row, extra_info). The name given does not resolve "
    "to one: the module or file is not there, it raised on import, it has no such attribute, or "
    "the attribute is not an async function.",
    "Name an async def agent(client, row, extra_info) as file.py:function (relative to the "
    "working directory) or module:function, e.g. "
    "`actor_rollout_ref.rollout.agent.function=my_agent.py:agent`; or unset it, "
    "`actor_rollout_ref.rollout.agent.function=null`, to roll out with keel's own agent loop.",
    keys=("actor_rollout_ref.rollout.agent.function",),
)

AGENT_ENVIRONMENT = register(
    "KEEL-C024",
    "rollout.agent.environment cannot be loaded or run",
    "actor_rollout_ref.rollout.agent.environment runs an environment library's environment as the "
    "rollout: `verifiers:NAME` (a verifiers environment package: with verifiers >= 0.4 a v1 "
    "taskset through verifiers' own loader, with <= 0.3 verifiers.load_environment(NAME, "
    "**environment_args)) or `openenv:module:ClientClass` (an OpenEnv environment's client, its "
    "server at environment_args.base_url). The library or the environment is not installed, its "
    "loader raised, the class is not what the library makes, environment_args.client or "
    ".renderer is not one verifiers takes, the taskset is infinite, its action has no one text "
    "field to put the model's turn in, or its server does not answer.",
    "Install the library (pip install 'keel[verifiers]' or 'keel[openenv]') and the environment's "
    "package, name it as verifiers:NAME or openenv:module:ClientClass, and give what it needs in "
    "actor_rollout_ref.rollout.agent.environment_args (verifiers v1: its env config, taskset and "
    "agent, and client train | eval; classic verifiers: load_environment's arguments; for OpenEnv "
    "base_url, and action_field / observation_field when its action or observation has several "
    "text fields); or unset it, `actor_rollout_ref.rollout.agent.environment=null`.",
    keys=(
        "actor_rollout_ref.rollout.agent.environment",
        "actor_rollout_ref.rollout.agent.environment_args",
    ),
)

PREFERENCE_OPTION = register(
    "KEEL-C025",
    "Preference-training settings that contradict each other",
    "A DPO setting is read by other losses only (label_smoothing by robust and simpo), a "
    "reference-free loss (simpo) was given a reference or a reference-based one none, "
    "dpo.reference=adapter was asked without LoRA or with a starting adapter (the base alone is "
    "then not the starting model), or label_smoothing is 0.5 or more.",
    "Do as the fix line says: the loss that reads the setting, or `dpo.reference=auto` (cached "
    "log-probs for DPO's losses, none for simpo).",
    keys=("dpo.loss_type", "dpo.reference", "dpo.label_smoothing", "model.lora_rank"),
)
SEPARATE_REFERENCE = register(
    "KEEL-C026",
    "A LoRA run holds a second copy of the model as its reference",
    "With LoRA the reference is the base with the adapters off, which the run already holds; "
    "`dpo.reference=model` loads another copy of every weight for the same log-probs (a warning: "
    "the run goes on).",
    "Set `dpo.reference=adapter` (the base, adapters off) or `dpo.reference=cached` (log-probs "
    "computed once before training).",
    keys=("dpo.reference", "model.lora_rank"),
)
UNKNOWN_OBJECTIVE = register(
    "KEEL-C027",
    "Unknown training objective",
    "`objective` at the top of a `keel train` config picks preference training: `dpo` or "
    "`reward_model`. An RL config has no `objective` key.",
    "Set `objective=dpo` or `objective=reward_model`, or remove the key for RL (PPO, GRPO, ...).",
    keys=("objective",),
)

DISTILLATION_OPTION = register(
    "KEEL-C028",
    "Distillation without a teacher, or a distillation setting nothing reads",
    "distillation.enable=true needs distillation.teacher.path, the frozen teacher that scores the "
    "student's samples; or a distillation setting was given that this run never reads: any of "
    "distillation.* while distillation.enable=false, distillation.gkd.* (and response_key) under "
    "mode=reverse_kl, kl_estimator under mode=gkd, or the teacher's pool sizes without "
    "teacher.enable_resource_pool, or algorithm.use_kl_in_reward or filter_groups with "
    "task_reward_coef=0 (they act on the task's rewards, which that coefficient leaves out of the "
    "signal). keel refuses what it would silently ignore.",
    "Set distillation.teacher.path to the teacher's local Hugging Face model directory (its "
    "tokenizer the student's), or, for a setting nothing reads, do as the fix line says: the mode "
    "or switch that reads it (`distillation.mode=gkd` for gkd.*), or remove the key.",
    keys=(
        "distillation.enable",
        "distillation.teacher.path",
        "distillation.mode",
        "distillation.kl_estimator",
        "distillation.teacher.enable_resource_pool",
    ),
)

GKD_OFF_POLICY = register(
    "KEEL-C029",
    "GKD's on-policy fraction (distillation.gkd.lmbda < 1) cannot work with these settings",
    "With lmbda < 1 a share of 1 - lmbda of the steps trains on the data's own responses instead "
    "of the student's samples. That needs distillation.mode=gkd (reverse_kl's advantage is the "
    "teacher's judgement of the student's own samples), trainer.mode=sync (async mode generates "
    "a step's batch before the step, under rollout correction that takes the sampler's log-probs "
    "as the old policy's; partial rollouts keep samples under way across steps), and no "
    "rollout_correction.bypass_mode (the sampler's log-probs are then the old policy's, and the "
    "data's responses have no sampler).",
    "Set `distillation.gkd.lmbda=1` (every step on the student's samples), or do as the fix line "
    "says: `distillation.mode=gkd`, `trainer.mode=sync`, or "
    "`algorithm.rollout_correction.bypass_mode=false`.",
    keys=(
        "distillation.gkd.lmbda",
        "distillation.mode",
        "trainer.mode",
        "trainer.partial_rollout",
        "algorithm.rollout_correction.bypass_mode",
    ),
)

BATCH_INVARIANT_UNSUPPORTED = register(
    "KEEL-C030",
    "A batch-invariant rollout cannot run with these settings",
    "rollout.batch_invariant makes the sampler's log-probs and the old-log-prob pass equal bit for "
    "bit: keel's native engine computes both, in arithmetic that gives a token the same numbers "
    "whatever else is in its batch. So it needs the native engine on the actor's own workers "
    "(hybrid_engine=true: the pass runs on the engine holding the policy's current weights), and "
    "a model that arithmetic covers: a dense decoder with full attention and a SiLU-gated MLP "
    "(Qwen2, Qwen3, Llama, Mistral, Phi-3, OLMo 2), not sliding windows (Gemma 3), attention sinks "
    "(GPT-OSS) or mixtures of experts.",
    "Set `actor_rollout_ref.rollout.batch_invariant=false` (the sampler's and the trainer's "
    "log-probs then differ by rounding, which rollout/log_prob_gap reports), or run the native "
    "engine on the actor's workers with a model it covers.",
    keys=(
        "actor_rollout_ref.rollout.batch_invariant",
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.hybrid_engine",
    ),
)

__all__ = [name for name in dir() if name.isupper()]
