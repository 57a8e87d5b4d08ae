"""`keel check`: everything that can be known to fail before a GPU-hour is spent.

Loads the tokenizer, the model configs (not the weights) and the datasets, runs the scorer on a few
rows, and estimates memory. Each check yields findings (pass / warn / fail); a failure carries the
catalogue code that `keel train` exits with.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from keel import checkpoint as ckpt
from keel.config.plan import make_plan
from keel.config.schema import KeelConfig
from keel.errors import (MEMORY_ESTIMATE, NOT_ENOUGH_DEVICES, RAY_MISSING, RUN_DIR_NOT_WRITABLE,
                         SANDBOX_INCOMPLETE, TOKEN_BUDGET, TOKENIZER_MISMATCH, VOCAB_MISMATCH,
                         WEIGHTS_BROKEN, KeelError)
from keel.rewards.sandbox import jail
from keel.training.forward import LOGITS_CHUNK_TOKENS

if TYPE_CHECKING:
    from keel.trainer.setup import Inputs

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


class Skipped(Exception):
    """A check that needs what an earlier, failed check would have loaded."""


def need(context: dict, key: str):
    if key not in context:
        raise Skipped(key)
    return context[key]


@dataclass
class Finding:
    level: str
    check: str
    message: str
    code: str | None = None
    fix: str | None = None

    @classmethod
    def failed(cls, check: str, error: KeelError) -> "Finding":
        return cls(FAIL, check, error.message, error.code, error.fix)

    def error(self) -> KeelError:
        return KeelError(self.code, self.message, self.fix)


@dataclass
class Report:
    findings: list[Finding]
    plan: dict
    plan_text: str
    audit: dict[str, str]
    memory_gb: dict[str, float]
    inputs: Inputs | None = field(default=None, repr=False)  # for `keel train` to reuse, not load again

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.level == FAIL]

    def as_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings], "plan": self.plan, "audit": self.audit,
                "memory_gb": self.memory_gb, "ok": not self.failures}

    def first_error(self) -> KeelError:
        return self.failures[0].error()


def run_checks(cfg: KeelConfig) -> Report:
    from keel.models.load import quiet_transformers

    quiet_transformers()
    findings: list[Finding] = []
    context: dict = {}
    for name, check in CHECKS:
        try:
            findings += check(cfg, context)
        except KeelError as e:
            findings.append(Finding.failed(name, e))
        except Skipped as missing:
            findings.append(Finding(SKIP, name, f"skipped: needs the {missing} an earlier check could not load"))
    memory = context.get("memory_gb", {})
    plan = make_plan(cfg)
    from keel.trainer.setup import Inputs

    inputs = None
    if all(key in context for key in ("tokenizer", "train_records", "reward")):
        inputs = Inputs(context["tokenizer"], context["train_records"], context.get("val_records", []),
                        context["reward"])
    return Report(findings, plan.as_dict(), plan.render(), audit(cfg, context), memory, inputs)


# --- the checks, in the order a user would fix them ---------------------------------------------

def check_tokenizer(cfg: KeelConfig, context: dict) -> list[Finding]:
    from transformers import AutoTokenizer

    from keel.models.load import check_model_dir, load_tokenizer

    path = check_model_dir(cfg.actor_rollout_ref.model.path)
    raw = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    context["tokenizer"] = tokenizer = load_tokenizer(path, cfg.actor_rollout_ref.model.trust_remote_code)
    found = [Finding(PASS, "tokenizer", f"EOS {tokenizer.eos_token!r}, {len(tokenizer)} tokens")]
    if raw.pad_token_id is None:
        context["pad_from_eos"] = True
        found.append(Finding(WARN, "tokenizer", f"no pad token: keel pads with EOS {tokenizer.eos_token!r}"))
    return found


def check_model(cfg: KeelConfig, context: dict) -> list[Finding]:
    from transformers import AutoConfig

    tokenizer = need(context, "tokenizer")
    model_cfg = AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path,
                                           trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    context["model_config"] = model_cfg
    vocab = model_cfg.vocab_size
    if len(tokenizer) > vocab:
        raise KeelError(VOCAB_MISMATCH, f"the tokenizer has {len(tokenizer)} tokens but the model's embedding "
                                        f"has {vocab} rows: ids >= {vocab} would index out of range")
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("eos", "pad", "bos")}
    bad = {k: v for k, v in special.items() if v is not None and v >= vocab}
    if bad:
        raise KeelError(VOCAB_MISMATCH, f"special token ids {bad} are outside the model's vocabulary of {vocab}")
    budget = cfg.data.max_prompt_length + cfg.data.max_response_length
    limit = getattr(model_cfg, "max_position_embeddings", None)
    if limit is not None and budget > limit:
        raise KeelError(TOKEN_BUDGET, f"data.max_prompt_length + data.max_response_length = {budget} tokens, "
                                      f"over the policy's max_position_embeddings={limit}",
                        f"lower data.max_prompt_length or data.max_response_length so they sum to at most {limit}, "
                        "or use a model with a longer context (rollout.max_model_len cannot go past the "
                        "model's positions)")
    from keel.models.load import check_weights_match, meta_model

    found = check_special_tokens(tokenizer, model_cfg, cfg.actor_rollout_ref.model.path, context.get("pad_from_eos"))
    try:  # built once: the weights check compares its shapes, the memory estimate counts its parameters
        model = meta_model(model_cfg, cfg.actor_rollout_ref.model.trust_remote_code)
        context["parameters"] = sum(p.numel() for p in model.parameters())
    except Exception:  # an architecture that will not build on the meta device is checked when it loads
        model = None
    weights, unmatched = check_weights_match(cfg.actor_rollout_ref.model.path, model_cfg, model)
    if unmatched:
        found.append(Finding(WARN, "model", unmatched, WEIGHTS_BROKEN))
    found.insert(0, Finding(PASS, "model", f"{model_cfg.model_type}, vocab {vocab}, "
                                           f"{budget} of {limit or '?'} positions used; weights: {weights}"))
    if tokenizer.model_max_length < budget:
        found.append(Finding(WARN, "model", f"tokenizer model_max_length={tokenizer.model_max_length} is below "
                                            f"the {budget}-token budget; transformers may warn or truncate"))
    return found


def check_special_tokens(tokenizer, model_cfg, path: str, pad_from_eos: bool) -> list[Finding]:
    """EOS, pad and BOS of the tokenizer against the model's configs: warnings with the fix, or an
    error when they disagree on two or more (a tokenizer from another model). A pad keel chose
    itself (EOS, the tokenizer having none) is not the tokenizer's to compare."""
    from transformers import GenerationConfig

    from keel.models.load import special_token_mismatches

    found, generation_eos = [], None
    if Path(path, "generation_config.json").is_file():
        try:
            generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
        except (OSError, ValueError) as e:
            found.append(Finding(WARN, "model", f"generation_config.json in {path} cannot be read ({e}); its EOS "
                                                "ids are not compared"))
    mismatches = special_token_mismatches(tokenizer, model_cfg, generation_eos, compare_pad=not pad_from_eos)
    if len(mismatches) >= 2:
        raise KeelError(TOKENIZER_MISMATCH, "; ".join(what for what, _ in mismatches) + ": the tokenizer looks "
                        "like another model's", "use the tokenizer saved with this model (its directory's "
                        "tokenizer files), or correct the special tokens as the lines above say")
    return found + [Finding(WARN, "model", what, TOKENIZER_MISMATCH, fix) for what, fix in mismatches]


def check_data(cfg: KeelConfig, context: dict) -> list[Finding]:
    from keel.trainer.setup import read_prompts, require_enough_prompts

    found = []
    for name, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        if not files:
            continue
        records, stats = read_prompts(files, need(context, "tokenizer"), cfg, name)
        context[f"{name}_records"] = records
        found.append(Finding(WARN if stats.truncated or stats.dropped else PASS, "data", stats.summary()))
    require_enough_prompts(len(context["train_records"]), cfg)
    return found


def check_reward(cfg: KeelConfig, context: dict) -> list[Finding]:
    """The scorer must run on real rows: the ground truth as the answer, and an empty answer."""
    from keel.trainer.setup import build_reward

    scorer = build_reward(cfg)
    records = need(context, "train_records") + context.get("val_records", [])
    scorer.check_records(records)
    sample = records[:4]
    for responses in ([str(r.ground_truth) for r in sample], [""] * len(sample)):
        scores = scorer.score_batch(sample, responses, on_error="raise").scores
    scorer.close()  # its worker pool; the scorer starts a new one when the trainer reuses it
    context["reward"] = scorer
    found = [Finding(PASS, "reward", f"scorer ran on {len(sample)} rows (last scores {scores.tolist()})")]
    if scorer.runs_model_code(records):
        found.append(sandbox_finding(jail()))
    if cfg.reward_model.enable:
        found.append(check_reward_model_budget(cfg, scorer.reward_model, records, need(context, "tokenizer")))
    return found


def sandbox_finding(found) -> Finding:
    """Which of the jail's protections hold for model-written code (check_records has already
    refused a jail short of what reward.sandbox.require asks for)."""
    return Finding(PASS if found.complete else WARN, "sandbox", found.summary(),
                   None if found.complete else SANDBOX_INCOMPLETE)


def check_reward_model_budget(cfg: KeelConfig, reward_model, records: list, policy_tokenizer) -> Finding:
    """The longest prompt, in the reward model's own template and tokens, plus a full-length
    response in its tokens must fit what it reads: a 4096-token rollout scored by a 512-token model
    is an error. The response budget is in the policy's tokens, so it is converted by the ratio of
    the two tokenizers' counts on the prompts."""
    def count(tokenizer, text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    longest = max(count(reward_model.tokenizer, reward_model.text(r.raw_prompt, "")) for r in records)
    texts = [reward_model.text(r.raw_prompt, "") for r in records[:64]]
    ratio = max(count(reward_model.tokenizer, t) / max(count(policy_tokenizer, t), 1) for t in texts)
    response = math.ceil(cfg.data.max_response_length * ratio)
    need = longest + response
    budget = (f"the longest prompt is {longest} tokens in the reward model's own template, and a "
              f"data.max_response_length={cfg.data.max_response_length} response about {response} of its tokens")
    if reward_model.max_length and need > reward_model.max_length:
        raise KeelError(TOKEN_BUDGET, f"{budget}: {need}, over the {reward_model.max_length} tokens the reward model "
                                      f"reads ({reward_model.limited_by})",
                        "lower data.max_response_length or data.max_prompt_length, or use a reward model "
                        "with a longer context; if its tokenizer's model_max_length is wrong, correct it in "
                        "tokenizer_config.json")
    return Finding(PASS, "reward model", f"reads {reward_model.max_length} tokens "
                                         f"({reward_model.limited_by}); {budget}: {need}")


def check_run_dir(cfg: KeelConfig, context: dict) -> list[Finding]:
    run_dir = Path(cfg.run_dir)
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise KeelError(RUN_DIR_NOT_WRITABLE, f"cannot write under {existing}: {e}") from e
    resume = ckpt.resolve_resume(run_dir, cfg.trainer.resume_mode)
    if resume is not None:
        ckpt.check_same_run(resume, cfg)
    action = f"resume from {resume}" if resume is not None else "start a new run"
    return [Finding(PASS, "run directory", f"{run_dir}: writable; will {action}")]


def check_memory(cfg: KeelConfig, context: dict) -> list[Finding]:
    model_cfg = need(context, "model_config")
    estimate = estimate_memory_gb(cfg, model_cfg, context.get("parameters") or architecture_parameters(model_cfg))
    context["memory_gb"] = estimate
    total, available, where = device_memory_gb(cfg)
    required = max(estimate["total"], estimate.get("critic_pool", 0.0))
    message = f"about {required:.2f} GB needed on {where}, {available:.1f} GB free of {total:.1f} GB"
    if required > available:
        raise KeelError(MEMORY_ESTIMATE, message)
    # verl honours param_offload on one GPU; keel uses FSDP (whose offload it is) only across ranks
    idle = [f"{key}.fsdp_config.param_offload=true has no effect on one worker (FSDP shards and offloads "
            "across 2 or more); the estimate counts those weights on the device"
            for key, fsdp, ranks in cfg.fsdp_roles if fsdp.param_offload and ranks == 1]
    return ([Finding(WARN if required > 0.9 * available else PASS, "memory", message)]
            + [Finding(WARN, "memory", text) for text in idle])


def check_workers(cfg: KeelConfig, context: dict) -> list[Finding]:
    """Workers against what this machine has, and Ray itself. A cluster in RAY_ADDRESS must
    answer; its resources are checked when the workers are placed."""
    from keel.distributed.dist import port_from_environment, rendezvous_port
    from keel.distributed.group import Devices, require_reachable
    from keel.models.load import resolve_device

    world = cfg.world_size
    if world == 1 and not cfg.pools:
        return [Finding(PASS, "workers", "1 worker in this process")]
    try:
        import ray  # noqa: F401
    except ImportError:
        raise KeelError(RAY_MISSING, f"{world} workers need Ray, which is not installed") from None
    port = port_from_environment()
    if os.environ.get("RAY_ADDRESS"):
        require_reachable(os.environ["RAY_ADDRESS"])
        return [Finding(PASS, "workers", f"{world} workers on the Ray cluster at {os.environ['RAY_ADDRESS']}")]
    if cfg.trainer.nnodes > 1:
        raise KeelError(NOT_ENOUGH_DEVICES, f"trainer.nnodes={cfg.trainer.nnodes} but RAY_ADDRESS is not set: "
                        "a local Ray instance has one node", "start the cluster (`ray start --head`, then "
                        "`ray start --address=HEAD:6379` on each node) and set RAY_ADDRESS")
    device = resolve_device(cfg.trainer.device)
    have = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
    what = "GPUs" if device.type == "cuda" else "CPU cores"
    needed = Devices.of(cfg).total
    placed = f"{world} workers" + "".join(f" + {count} for the {role} pool" for role, count in cfg.pools.items())
    if device.type == "cuda" and have < needed:
        raise KeelError(NOT_ENOUGH_DEVICES, f"{placed} need {needed} {what}, and this machine has {have}")
    level = WARN if have < needed else PASS
    meeting = f"; rank 0 listens on MASTER_PORT={rendezvous_port(port)}" if port else ""
    return [Finding(level, "workers", f"{placed} on this machine ({have} {what}), Ray started by keel{meeting}")]


CHECKS = [("tokenizer", check_tokenizer), ("model", check_model), ("data", check_data),
          ("reward", check_reward), ("run directory", check_run_dir), ("workers", check_workers),
          ("memory", check_memory)]


# --- memory ---------------------------------------------------------------------------------

def architecture_parameters(model_cfg) -> int:
    """Exact count from the architecture, built on the meta device (no memory, no weights)."""
    from keel.models.load import meta_model

    return sum(p.numel() for p in meta_model(model_cfg).parameters())


def estimate_memory_gb(cfg: KeelConfig, model_cfg, params: int) -> dict[str, float]:
    """Per-device estimate for a policy of `params` parameters. float32 master weights (4 B) + gradients (4 B) + AdamW moments (8 B) for
    each trained model, divided among the ranks FSDP shards them over (and off the device when
    offloaded); 4 B per weight for the frozen reference; with more than one worker, the rollout
    hf engine's whole float32 copy of the policy; activations of one micro-batch (about 34 bytes x
    hidden per token per layer, Korthikanti et al. arXiv 2205.05198, plus one chunk's float32 logits);
    the KV cache of one generation batch and, for the native engine, its decode weights. A critic
    with a pool of its own is estimated for its own devices, as `critic_pool`, outside the total."""
    from keel.rollout.native.weights import unsupported_reason

    gb = 2 ** 30
    policy = cfg.actor_rollout_ref
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    layers, hidden = model_cfg.num_hidden_layers, model_cfg.hidden_size
    heads = model_cfg.num_attention_heads
    kv_heads = getattr(model_cfg, "num_key_value_heads", heads) or heads
    head_dim = getattr(model_cfg, "head_dim", None) or hidden // heads
    micro = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    bytes_act = _compute_dtype(cfg).itemsize
    layer_activations = lambda samples: 34 * hidden * layers * samples * seq * bytes_act / 2  # noqa: E731
    # Log-probs are computed over chunks of LOGITS_CHUNK_TOKENS positions: the float32 logits,
    # and their gradient, of one chunk at a time.
    logit_rows = min(micro * cfg.data.max_response_length, LOGITS_CHUNK_TOKENS)
    estimate = {
        "actor_states": _sharded_bytes(params, True, policy.actor.fsdp_config, cfg.world_size) / gb,
        "activations": (layer_activations(micro) + logit_rows * model_cfg.vocab_size * 4 * 2) / gb,
        "kv_cache": 2 * layers * kv_heads * head_dim * seq * cfg.actor_rollout_ref.rollout.max_num_seqs
                    * bytes_act / gb,
    }
    native = policy.rollout.name != "hf" and unsupported_reason(model_cfg) is None
    if native:  # the native engine's decode weights, in the compute dtype: its only copy
        estimate["rollout_weights"] = bytes_act * params / gb
    if cfg.world_size > 1 and policy.actor.fsdp_config.fsdp_size != 1 and not native:
        estimate["rollout_copy"] = 4 * params / gb  # sharded: the hf engine generates with a whole copy
    if cfg.ref_enabled:
        estimate["reference"] = _sharded_bytes(params, False, policy.ref.fsdp_config, cfg.world_size) / gb
    if cfg.critic_enabled and "critic" not in cfg.pools:  # colocated with the actor
        estimate["critic_states"] = _sharded_bytes(params, True, cfg.critic.model.fsdp_config, cfg.world_size) / gb
    estimate["total"] = sum(estimate.values())
    if cfg.critic_enabled and "critic" in cfg.pools:  # the critic pool's devices: states and activations
        estimate["critic_pool"] = (_sharded_bytes(params, True, cfg.critic.model.fsdp_config, cfg.critic_world_size)
                                   + layer_activations(cfg.critic_batching[1])) / gb
    return {k: float(f"{v:.4g}") for k, v in estimate.items()}  # tiny models stay visible


def _compute_dtype(cfg: KeelConfig):
    from keel.models.load import resolve_device, resolve_dtype

    try:
        device = resolve_device(cfg.trainer.device)
    except KeelError:  # reported by the device check
        device = torch.device("cpu")
    return resolve_dtype(cfg.actor_rollout_ref.model.dtype, device)


def _sharded_bytes(params: int, trained: bool, fsdp_cfg, world: int) -> float:
    """Device bytes of one rank: float32 weights (and gradients, if trained) and AdamW's two
    moments, sharded over the fsdp group, minus what is offloaded to CPU."""
    shards = world if fsdp_cfg.fsdp_size == -1 else fsdp_cfg.fsdp_size
    offloaded = fsdp_cfg.param_offload and shards > 1  # FSDP's: a single rank keeps its weights
    weights = 0 if offloaded else (8 if trained else 4) * params
    moments = 0 if (not trained or offloaded or fsdp_cfg.optimizer_offload) else 8 * params
    return (weights + moments) / shards


def device_memory_gb(cfg: KeelConfig) -> tuple[float, float, str]:
    """(total, free, device name) of the device the run will use."""
    from keel.models.load import resolve_device

    device = resolve_device(cfg.trainer.device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total / 2 ** 30, free / 2 ** 30, torch.cuda.get_device_name(device)
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    available = page * os.sysconf("SC_AVPHYS_PAGES") / 2 ** 30
    return total, available, "cpu"


# --- what keel decided for you ----------------------------------------------------------------

def audit(cfg: KeelConfig, context: dict) -> dict[str, str]:
    """Every value keel derived or overrode, so no change is silent."""
    from keel.models.load import resolve_device, resolve_dtype

    actor = cfg.actor_rollout_ref.actor
    device = resolve_device(cfg.trainer.device)
    mini, micro, epochs = cfg.critic_batching
    decided = {
        "trainer.default_local_dir": cfg.run_dir,
        "device": f"{device} (trainer.device={cfg.trainer.device})",
        "compute dtype": f"{resolve_dtype(cfg.actor_rollout_ref.model.dtype, device)}; weights and optimiser "
                         "state float32",
        "critic": "on" if cfg.critic_enabled else "off",
        "reference model": "on" if cfg.ref_enabled else "off",
        "clip range": f"[1 - {actor.clip_ratio_low or actor.clip_ratio}, 1 + {actor.clip_ratio_high or actor.clip_ratio}]",
    }
    if cfg.critic_enabled:
        decided["critic batching"] = f"mini {mini} prompts, micro {micro} samples, {epochs} epochs"
    if "train_records" in context:
        from keel.trainer.setup import total_steps

        per_epoch = len(context["train_records"]) // cfg.data.train_batch_size  # the sampler drops the rest
        decided["total training steps"] = f"{total_steps(cfg, per_epoch)} ({per_epoch} per epoch)"
    if context.get("pad_from_eos"):
        decided["pad token"] = "EOS (the tokenizer has none)"
    if actor.policy_loss.loss_mode == "gspo":
        decided["loss_agg_mode"] = "seq-mean-token-mean (GSPO's objective; actor.loss_agg_mode is not used)"
    return decided


def render(report: Report) -> str:
    marks = {PASS: "ok  ", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}
    lines = ["keel check"]
    for f in report.findings:
        if f.level == FAIL:  # exactly what `keel train` prints for the same problem: the error, then the fix
            lines.append(f"  [{marks[f.level]}] {f.check}")
            lines += [f"         {line}" for line in f.error().render().splitlines()]
        else:
            lines.append(f"  [{marks[f.level]}] {f.check:<14} {f.message}" + (f"  ({f.code})" if f.code else ""))
    lines.append(report.plan_text)
    lines.append("decided for you")
    lines += [f"  {key:<26} {value}" for key, value in report.audit.items()]
    if report.memory_gb:
        lines.append("memory estimate per device (GB): " + ", ".join(f"{k} {v}" for k, v in report.memory_gb.items()))
    counts = {level: sum(f.level == level for f in report.findings) for level in (PASS, WARN, FAIL)}
    verdict = "ready to train" if not counts[FAIL] else "fix the failures above before training"
    lines.append(f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed: {verdict}")
    return "\n".join(lines)
