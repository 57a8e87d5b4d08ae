"""keel's native engine against the hf engine on a tiny model (CPU, float32): the same greedy
tokens, samples from the same distribution, and log-probs the trainer agrees with."""

import pytest
import torch

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.native import NativeRolloutEngine, unsupported_reason
from keel.training.batching import MicroBatching
from keel.training.forward import batched_log_probs
from keel.types import SamplingParams

from tests_helpers import compile_for_hopper, run_under_triton_interpreter

PROMPTS = [
    {"prompt": "Digits please: 1"},
    {"prompt": [{"role": "user", "content": "a longer prompt here, padded"}]},
    {"prompt": "x"},
]


def engines(
    model_dir, n: int, max_num_seqs: int = 256, sharpen: float = 1.0, init_std: float | None = None
):
    """`sharpen` scales the output weights (a random tiny model is nearly uniform: a peaked one
    tests sampling); `init_std` redraws every matrix (with the default small init, greedy decoding
    repeats one token forever, which would make token-by-token comparisons trivial)."""
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # matrices, the experts' stacks, biases
            if init_std and (p.dim() >= 2 or name.endswith("bias")):
                p.copy_(torch.randn(p.shape, generator=generator) * init_std)
            # GPT-OSS: sinks that take a real share of the softmax
            elif init_std and name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=generator))
        model.get_output_embeddings().weight.mul_(sharpen)
    records, _ = build_prompt_dataset(PROMPTS, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(n)
    return (
        NativeRolloutEngine(model, tokenizer, max_num_seqs, torch.float32),
        HFRolloutEngine(model, tokenizer, max_num_seqs),
        model,
        prompts,
    )


# (architecture, tied embeddings, weights' std, layers, fewest distinct greedy tokens a row shows).
# Gemma 3: sliding-window layers (16 columns, shorter than the prompts) between global ones;
# SmolLM3: its fourth layer has no rotary embedding; GPT-OSS: attention sinks, biases, sliding
# windows and experts; Phi-3: fused q/k/v and gate/up projections, a sliding window (16) on every
# layer. Random weights of some families repeat themselves more: the floor keeps
# every comparison one that can fail.
FAMILIES = [
    ("qwen2", True, 0.2, 3, 10),
    ("llama", True, 0.2, 3, 10),
    ("qwen2", False, 0.2, 3, 10),
    ("qwen3", True, 0.2, 3, 10),
    ("qwen3_moe", True, 0.5, 3, 10),
    ("gemma3_text", True, 0.02, 3, 8),
    ("olmo2", True, 0.1, 4, 7),
    ("smollm3", True, 0.2, 4, 10),
    ("gpt_oss", False, 0.2, 3, 10),
    ("phi3", False, 0.2, 3, 10),
]


@pytest.mark.parametrize("arch, tied, init_std, layers, distinct", FAMILIES)
def test_greedy_tokens_are_identical_to_the_hf_engine(
    tmp_path, arch, tied, init_std, layers, distinct
):
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(
        tmp_path / arch,
        arch=arch,
        hidden_size=64,
        num_layers=layers,
        seed=3,
        tie_word_embeddings=tied,
    )
    # chunks of 4: groups split
    native, hf, _, prompts = engines(model_dir, n=2, max_num_seqs=4, init_std=init_std)
    greedy = SamplingParams(do_sample=False, max_new_tokens=24, ignore_eos=True)
    ours, theirs = native.generate(prompts, greedy), hf.generate(prompts, greedy)
    # a comparison that can fail
    assert all(len(set(row)) >= distinct for row in theirs.response_ids.tolist())
    assert ours.response_ids.tolist() == theirs.response_ids.tolist()
    assert torch.equal(ours.response_mask, theirs.response_mask)
    assert ours.response_texts == theirs.response_texts
    torch.testing.assert_close(
        ours.sampling_log_probs, theirs.sampling_log_probs, atol=1e-4, rtol=0
    )


def test_samples_follow_the_model_distribution_and_log_probs_match_the_trainer(tiny_assets):
    native, _, model, prompts = engines(tiny_assets["model"], n=400, sharpen=8.0)
    prompts = type(prompts)(
        prompts.input_ids[:400], prompts.attention_mask[:400], prompts.records[:400]
    )
    torch.manual_seed(0)
    params = SamplingParams(n=400, temperature=0.8, max_new_tokens=4)
    batch = native.generate(prompts, params)
    # 400 samples of one prompt differ
    assert len(set(map(tuple, batch.response_ids.tolist()))) > 50
    recomputed = batched_log_probs(model, batch, MicroBatching(100), temperature=0.8)
    torch.testing.assert_close(batch.sampling_log_probs, recomputed, atol=1e-4, rtol=0)
    # The first token's frequencies against the model's probabilities.
    first_logits = model(
        input_ids=prompts.input_ids[:1], attention_mask=prompts.attention_mask[:1]
    ).logits[0, -1]
    assert_drawn_from(
        batch.response_ids[:, 0], torch.softmax(first_logits.float() / 0.8, -1).detach()
    )


def assert_drawn_from(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square of the sample counts against `probs`, over the tokens with an expected count of
    at least 5 (the rest pooled), below about 5 sigma above its mean."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs.double() * len(samples)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expect = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    chi2 = float(((observed - expect) ** 2 / expect.clamp(min=1e-9)).sum())
    dof = int(big.sum())
    # enough well-populated tokens for the test to mean something
    assert dof >= 5
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3_text"])
def test_bf16_sampling_log_probs_are_within_0_005_of_the_float32_master_trainer(tmp_path, arch):
    """The trainer keeps float32 master weights under bf16 autocast: its residual stream, the
    embeddings it starts from and the norms stay float32. The engine computes in bf16 but keeps
    those in float32 too; rounding the embeddings and the stream to bf16 gave 0.007-0.008 here."""
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / arch, arch=arch, hidden_size=256, num_layers=6, seed=1)
    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    records, _ = build_prompt_dataset(PROMPTS, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(4)
    torch.manual_seed(0)
    batch = NativeRolloutEngine(model, tokenizer, 256, torch.bfloat16).generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=48, ignore_eos=True)
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trainer = batched_log_probs(model, batch, MicroBatching(64), temperature=1.0)
    mask = batch.response_mask
    gap = float(((trainer - batch.sampling_log_probs).abs() * mask).sum() / mask.sum())
    assert 0 < gap <= 0.005, gap


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_two_stage_sampling_draws_from_the_softmax(temperature):
    """Plain sampling picks a block of the vocabulary by its mass, then a token in it: the draws
    must still follow the softmax, with blocks of 64 over 1000 tokens (the last one partial)."""
    from keel.rollout.native.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(1000) * 2.5
    draws = 40_000
    tokens, log_probs = sample(
        logits.expand(draws, -1).contiguous(), SamplingParams(temperature=temperature), block=64
    )
    expected = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(log_probs, expected[tokens], atol=1e-5, rtol=0)
    assert int(tokens.max()) < 1000 and len(set(tokens.tolist())) > 100
    assert_drawn_from(tokens, expected.exp())


def test_top_k_keeps_samples_inside_the_top_k(tiny_assets):
    native, _, model, prompts = engines(tiny_assets["model"], n=200, sharpen=8.0)
    prompts = type(prompts)(
        prompts.input_ids[:200], prompts.attention_mask[:200], prompts.records[:200]
    )
    torch.manual_seed(1)
    batch = native.generate(
        prompts, SamplingParams(n=200, temperature=1.0, top_k=3, max_new_tokens=1)
    )
    logits = model(
        input_ids=prompts.input_ids[:1], attention_mask=prompts.attention_mask[:1]
    ).logits[0, -1]
    allowed = set(logits.topk(3).indices.tolist())
    assert (
        set(batch.response_ids[:, 0].tolist()) <= allowed
        and len(set(batch.response_ids[:, 0].tolist())) > 1
    )


def test_ignore_eos_gives_fixed_lengths(tiny_assets):
    native, _, _, prompts = engines(tiny_assets["model"], n=2)
    batch = native.generate(prompts, SamplingParams(n=2, max_new_tokens=7, ignore_eos=True))
    assert batch.response_lengths.tolist() == [7] * len(batch) and batch.truncated.all()


def test_other_architectures_fall_back_with_a_reason(tiny_assets):
    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    assert unsupported_reason(model.config) is None
    model.config.mlp_bias = True
    assert "biases" in unsupported_reason(model.config)
    model.config.model_type = "gemma2"
    assert "gemma2" in unsupported_reason(model.config)


# chosen, or the fallback for a model native cannot run
@pytest.mark.parametrize("name", ["hf", "auto"])
def test_a_sharded_lora_policy_without_the_native_engine_is_refused(tiny_assets, name):
    """Only native applies adapters synced on their own; hf would generate from the bare base."""
    from types import SimpleNamespace

    from keel.errors import INCOMPATIBLE_OPTIONS, KeelError
    from keel.rollout.select import make_rollout_engine

    model = load_causal_lm(tiny_assets["model"], torch.device("cpu"))
    # auto falls back to hf
    model.config.model_type = "gemma2"
    rollout = SimpleNamespace(name=name, max_num_seqs=4, batch_invariant=False)
    with pytest.raises(KeelError) as error:
        make_rollout_engine(
            rollout,
            model,
            load_tokenizer(tiny_assets["model"]),
            torch.device("cpu"),
            torch.float32,
            log_choice=False,
            will_be_sharded=True,
            lora=True,
        )
    assert (
        error.value.code == INCOMPATIBLE_OPTIONS
        and "needs the native rollout engine" in error.value.message
    )
    assert (
        make_rollout_engine(
            rollout,
            model,
            load_tokenizer(tiny_assets["model"]),
            torch.device("cpu"),
            torch.float32,
            log_choice=False,
            will_be_sharded=False,
            lora=True,
        ).model
        is model
    )


@pytest.mark.parametrize("rows", [256, 2])
def test_finished_sequences_leave_the_batch_without_changing_the_rest(
    tiny_assets, monkeypatch, rows
):
    """Variable lengths: rows that hit EOS leave the decode batch (checked every 2 steps here) and,
    with fewer rows than sequences, waiting sequences take their rows (continuous batching); the
    tokens of every sequence are exactly the hf engine's."""
    from keel.rollout.native import batching

    monkeypatch.setattr(batching, "DONE_CHECK_EVERY", 2)
    native, hf, _, prompts = engines(tiny_assets["model"], n=2, init_std=0.2)
    native.max_num_seqs = rows
    greedy = SamplingParams(do_sample=False, max_new_tokens=30)
    free_run = hf.generate(
        prompts, SamplingParams(do_sample=False, max_new_tokens=30, ignore_eos=True)
    ).response_ids

    # A stop token that really occurs, first at different depths in different rows: lengths vary.
    def first_positions(token):
        hits = (free_run == token).int()
        return tuple(int(h.argmax()) if h.any() else 30 for h in hits)

    stop = max(
        set(free_run[:, 1:].flatten().tolist()), key=lambda tok: len(set(first_positions(tok)))
    )
    for engine in (native, hf):
        engine.eos_ids = sorted(set(engine.eos_ids) | {stop})
    native.eos = torch.tensor(native.eos_ids)
    told, decoded = {}, []
    tokenizer = native.tokenizer
    decode, batch_decode = tokenizer.decode, tokenizer.batch_decode
    monkeypatch.setattr(
        tokenizer, "decode", lambda ids, **kw: decoded.append(ids) or decode(ids, **kw)
    )
    monkeypatch.setattr(
        tokenizer,
        "batch_decode",
        lambda rows, **kw: decoded.extend(rows) or batch_decode(rows, **kw),
    )
    ours = native.generate(
        prompts, greedy, on_finished=lambda row, _, text: told.update({row: text})
    )
    monkeypatch.undo()
    theirs = hf.generate(prompts, greedy)
    # the test does exercise variable lengths
    assert len(set(theirs.response_lengths.tolist())) > 1
    assert ours.response_ids.tolist() == theirs.response_ids.tolist()
    # each response decoded once, as it finished; the batch's texts are those, each the masked
    # response's (the stop token is an ordinary one here, so it stays in the text)
    assert len(decoded) == len(prompts)
    assert [told[row] for row in range(len(prompts))] == ours.response_texts
    assert ours.response_texts == theirs.response_texts
    torch.testing.assert_close(
        ours.sampling_log_probs, theirs.sampling_log_probs, atol=1e-4, rtol=0
    )


def test_prefill_in_passes_of_max_num_batched_tokens_gives_the_same_tokens(tiny_assets):
    """Prompts split across prefill passes, and (chunked prefill) a prompt longer than the budget
    split into pieces that extend its KV cache: the tokens do not change."""
    native, _, _, prompts = engines(tiny_assets["model"], n=2, init_std=0.2)
    greedy = SamplingParams(do_sample=False, max_new_tokens=12)
    whole = native.generate(prompts, greedy)
    prompt_len = prompts.input_ids.shape[1]
    # one prompt per pass; then pieces of 5 tokens, of 1 token
    for budget in (prompt_len, 5, 1):
        native.max_num_batched_tokens = budget
        ours = native.generate(prompts, greedy)
        assert ours.response_ids.tolist() == whole.response_ids.tolist(), budget
        torch.testing.assert_close(
            ours.sampling_log_probs, whole.sampling_log_probs, atol=1e-5, rtol=0
        )


def test_the_rows_tables_name_each_copied_prompt_s_source_row(tmp_path):
    """After a generation, each row's device entry names the row its prompt's keys and values were
    copied from and how many columns, as CopiedPrefixes has it, and those columns are equal there.
    The next call's prompts, one sample each, are prefilled over some source rows: their copies
    end, and what stays still holds equal columns."""
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", arch="qwen2", hidden_size=64, num_layers=2, seed=5)
    _, _, model, prompts = engines(model_dir, n=3, init_std=0.2)
    kept = NativeRolloutEngine(
        model, load_tokenizer(model_dir), 256, torch.float32, free_cache_engine=False
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=4, ignore_eos=True)

    def entries():
        decoding = kept._kept_batcher.decoding
        state, source_of = decoding.state, decoding.prefixes.source_of
        copies = {
            row: (source, length)
            for row, (source, length) in enumerate(
                zip(state.prefix_row.tolist(), state.prefix_len.tolist())
            )
            if length
        }
        assert copies == source_of
        for row, (source, length) in copies.items():
            for cache in (state.k[0], state.v[1]):
                assert torch.equal(cache[row, :, :length], cache[source, :, :length])
        return copies

    kept.generate(prompts, greedy)
    first = entries()
    # each prompt's first row is its group's source: its other 2 samples copy it
    assert len(first) == 2 * len(prompts) // 3 and len(set(first.values())) == len(prompts) // 3
    kept.generate(engines(model_dir, n=1, init_std=0.2)[3], greedy)
    assert len(entries()) < len(first)


def test_a_kept_cache_is_reused_and_sees_updated_weights(tmp_path):
    """free_cache_engine=False: the second call of the same shape reuses the first call's scheduler
    and cache (on GPU, its captured graphs), and weights synced in between are used: the output
    equals a fresh engine's on the updated model. Weight buffers keep their addresses (graphs read
    them)."""
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", arch="qwen2", hidden_size=64, num_layers=2, seed=5)
    _, _, model, prompts = engines(model_dir, n=2, init_std=0.2)
    kept = NativeRolloutEngine(
        model, load_tokenizer(model_dir), 256, torch.float32, free_cache_engine=False
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=12, ignore_eos=True)
    first = kept.generate(prompts, greedy)
    batcher, qkv_address = kept._kept_batcher, kept.layers[0].qkv.data_ptr()
    # an "update": every matrix changes
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.2)
    kept.sync_weights(model)
    second = kept.generate(prompts, greedy)
    fresh = NativeRolloutEngine(model, load_tokenizer(model_dir), 256, torch.float32).generate(
        prompts, greedy
    )
    assert kept._kept_batcher is batcher and kept.layers[0].qkv.data_ptr() == qkv_address
    assert second.response_ids.tolist() == fresh.response_ids.tolist()
    # the update mattered
    assert second.response_ids.tolist() != first.response_ids.tolist()
    torch.testing.assert_close(
        second.sampling_log_probs, fresh.sampling_log_probs, atol=1e-5, rtol=0
    )


# Phi-3: adapters on its fused projections, each one part of its buffer
@pytest.mark.parametrize("arch, query", [("qwen2", "q_proj"), ("phi3", "qkv_proj")])
def test_lora_runs_unmerged_on_the_trainers_own_base(tmp_path, arch, query):
    """One copy of the base: the trainer's frozen weights are views of the engine's buffers, the
    adapters are applied unmerged in the step, and the greedy tokens are the merged model's, after
    the adapters change too (a sync moves only them)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from keel.models.lora import adapter_weights, frozen_base
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", arch=arch, hidden_size=64, num_layers=3, seed=3)
    native, _, base, prompts = engines(model_dir, n=2, init_std=0.2)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    greedy = SamplingParams(do_sample=False, max_new_tokens=24, ignore_eos=True)

    def train_adapters(seed: int) -> list[list[int]]:
        """Moves every B as an update would; -> the merged model's greedy tokens."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        merged = copy.deepcopy(policy).merge_and_unload()
        return (
            HFRolloutEngine(merged, native.tokenizer)
            .generate(prompts, greedy)
            .response_ids.tolist()
        )

    expected = train_adapters(seed=1)
    frozen = dict(frozen_base(policy))
    freed = native.share_frozen_weights(frozen.items())
    q = frozen[f"model.layers.0.self_attn.{query}.weight"]
    assert (
        q.untyped_storage().data_ptr()
        == native.weights.buffers["0.qkv"].untyped_storage().data_ptr()
    )
    assert freed >= sum(
        p.nbytes for name, p in frozen.items() if "layers" in name and "proj" in name
    )
    native.load_adapters(adapter_weights(policy))
    first = native.generate(prompts, greedy).response_ids.tolist()
    assert first == expected
    expected = train_adapters(seed=2)
    native.load_adapters(adapter_weights(policy))
    assert native.generate(prompts, greedy).response_ids.tolist() == expected != first


# Every episode resident, or 3 rows for 6 episodes, refilled; each family on the second.
@pytest.mark.parametrize(
    "arch, rows, init_std, layers",
    [("qwen2", 256, 0.2, 3)]
    + list(
        {arch: (arch, 3, init_std, layers) for arch, _, init_std, layers, _ in FAMILIES}.values()
    ),
)
def test_multi_turn_greedy_rollouts_equal_the_hf_engines_and_prefill_only_new_tokens(
    tmp_path, monkeypatch, arch, rows, init_std, layers
):
    """The agent loop on the native engine (turns scheduled by continuous batching, KV kept across
    turns, tools run while others decode) against the hf engine (each turn generated again from its
    whole context): the same tokens, masks and log-probs for every episode. Native prefilled each
    group's prompt once, then only what came after each turn: its last token and the tool turn."""
    from keel.models.tiny import make_tiny_model
    from keel.rollout.agent import AgentLoop, AgentOptions, tool
    from keel.rollout.agent.parse import PARSERS, ParsedTurn, ToolCall
    from keel.rollout.native import batching

    # turns end, and tools return, at different checks
    monkeypatch.setattr(batching, "DONE_CHECK_EVERY", 2)
    monkeypatch.setitem(
        PARSERS, "every-turn", lambda text: ParsedTurn([ToolCall("echo", {"text": text[:12]})], [])
    )

    @tool
    def echo(text: str) -> str:
        """The text reversed."""
        return text[::-1]

    model_dir = make_tiny_model(
        tmp_path / "m", arch=arch, hidden_size=64, num_layers=layers, seed=3
    )
    native, hf, _, prompts = engines(model_dir, n=2, max_num_seqs=rows, init_std=init_std)
    # the batcher stays, to be looked at
    native.free_cache_engine = False

    loops = [
        AgentLoop(
            engine,
            native.tokenizer,
            [echo],
            AgentOptions(max_assistant_turns=4, budget=160, turn_tokens=8, format="every-turn"),
            native.eos_ids,
        )
        for engine in (native, hf)
    ]
    ours, theirs = (
        loop.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=160))
        for loop in loops
    )
    # timing_s/gen_* of the engine's parts
    assert {"prefill", "decode", "tools"} <= set(loops[0].timing)
    # several tool turns: a real comparison
    assert max(r.extra_info["num_turns"] for r in theirs.records) >= 5
    assert ours.response_ids.tolist() == theirs.response_ids.tolist()
    assert torch.equal(ours.response_mask, theirs.response_mask)
    torch.testing.assert_close(
        ours.sampling_log_probs, theirs.sampling_log_probs, atol=1e-4, rtol=0
    )
    if rows == 256:
        lengths = prompts.attention_mask.sum(-1)
        once_per_group = int(lengths[::2].sum())
        after_turns = int((ours.response_attention - ours.response_mask).sum())
        # each tool turn is followed by a turn
        returns = sum(r.extra_info["tool_calls"] for r in ours.records)
        assert native._kept_batcher.decoding.prefilled == once_per_group + after_turns + returns


def test_free_cache_engine_unset_keeps_a_cache_of_at_most_eight_percent_of_the_gpu():
    """Qwen3-0.6B's t1 cache (7.5 GB, 5.3% of an H200) is kept from the first step: capturing
    again cost 0.064 s a step on an H100."""
    from keel.rollout.native.engine import keeps_cache

    gpu = 140 * 2**30
    assert keeps_cache(None, int(0.053 * gpu), gpu) and keeps_cache(None, int(0.08 * gpu), gpu)
    assert not keeps_cache(None, int(0.09 * gpu), gpu)
    # CPU: no graphs to keep
    assert not keeps_cache(None, 1, 0)
    # as set, whatever the size
    assert keeps_cache(False, gpu, gpu) and not keeps_cache(True, 1, gpu)


def test_after_a_trained_step_a_larger_cache_stays_where_it_fits_beside_the_steps_memory():
    """Qwen3-0.6B's t1 cache is 9.4% of an H100: kept once the allocator shows the step's memory
    leaves room for it, not before a step has trained, and not when the step filled the GPU."""
    from keel.rollout.native.engine import keeps_cache

    gpu = 80 * 2**30
    cache = int(0.094 * gpu)
    assert not keeps_cache(None, cache, gpu)
    assert keeps_cache(None, cache, gpu, step_reserved=40 * 2**30)
    assert not keeps_cache(None, cache, gpu, step_reserved=70 * 2**30)
    # set, it is as set
    assert not keeps_cache(True, cache, gpu, step_reserved=0)


def test_the_engine_reads_the_steps_memory_only_once_weights_came_after_a_generation(
    tiny_assets, monkeypatch
):
    """The first call (nothing trained yet: the allocator holds no update's memory) decides by the
    cache's share alone; a call after an update's weights arrived also weighs the step's memory."""
    import keel.rollout.native.engine as engine_module

    native, _, model, prompts = engines(tiny_assets["model"], n=2)
    seen = []
    monkeypatch.setattr(engine_module, "keeps_cache", lambda *args: seen.append(args[3]) or False)
    greedy = SamplingParams(do_sample=False, max_new_tokens=4, ignore_eos=True)
    native.sync_weights(model)  # before any generation: not a trained step
    native.generate(prompts, greedy)
    native.generate(prompts, greedy)
    native.sync_weights(model)
    native.generate(prompts, greedy)
    # on CPU the allocator holds 0 bytes
    assert seen == [None, None, 0]


def test_a_turn_that_does_not_fit_its_batcher_is_refused_before_it_writes(tiny_assets):
    """Rows of 40 tokens, turns of 8: a longer turn, a context that would pass the row's end, and a
    second turn for a sequence that has one under way are refused (each would write past a
    buffer)."""
    native, _, _, _ = engines(tiny_assets["model"], n=1)
    batcher = native.continuous_batcher(4, 40, 8)
    for context, limit in (([5] * 10, 9), ([5] * 35, 8), ([5] * 10, 0)):
        with pytest.raises(ValueError):
            batcher.add("a", context, limit)
    batcher.add("a", [5] * 10, 8)
    with pytest.raises(ValueError, match="under way"):
        batcher.add("a", [5] * 10, 8)


def test_decode_attention_splits_the_cache_only_when_rows_leave_sms_idle():
    """Rows x KV heads that occupy half the SMs or more attend in one pass (0); fewer are cut into
    power-of-two splits, about four programs per SM over the whole cache, none below a block."""
    from keel.rollout.native.attention import split_columns

    sms = 132
    # 128 rows x 2 KV heads
    assert split_columns(2304, programs=256, sms=sms) == 0
    assert split_columns(2304, programs=66, sms=sms) == 0
    for programs in (1, 16, 32, 65):
        split = split_columns(2304, programs, sms)
        assert split & (split - 1) == 0 and split >= 64
        splits = -(-2304 // split)
        assert 2 * sms <= programs * splits <= 8 * sms or split == 64, (programs, split)
    # 8 rows: 18 splits each
    assert split_columns(2304, programs=16, sms=sms) == 128
    # never below one block of columns
    assert split_columns(256, programs=2, sms=sms) == 64


def test_decode_attention_config_is_resolved_for_the_launch_and_keeps_what_is_set():
    from keel.rollout.native.attention import KernelConfig

    # 256 rows x 2 KV heads
    wide = KernelConfig().resolved(768, programs=512, sms=132)
    # one pass: the whole cache
    assert (wide.split, wide.num_stages, wide.block) == (1024, 2, 64)
    # a prompt's copies read in its one row: three stages, unless set
    assert KernelConfig().resolved(768, programs=512, sms=132, shared=True).num_stages == 3
    assert KernelConfig(num_stages=2).resolved(768, 512, 132, shared=True).num_stages == 2
    narrow = KernelConfig().resolved(2304, programs=16, sms=132)
    assert narrow.split == 128 and narrow.num_stages == 3
    one_pass = KernelConfig(split=0, num_stages=4, block=128).resolved(2304, programs=16, sms=132)
    assert (one_pass.split, one_pass.num_stages, one_pass.block) == (4096, 4, 128)
    # a block within its split
    assert KernelConfig(split=32).resolved(2304, programs=16, sms=132).block == 32
    # a prompt and response of 8 tokens
    tiny = KernelConfig().resolved(8, programs=4, sms=132)
    # tl.dot needs 16
    assert tiny.block == tiny.split == 16
    # a power of two
    assert KernelConfig(split=48).resolved(2304, programs=16, sms=132).block == 32


INTERPRETED_ATTENTION = (
    """
import types, torch
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=132)
from keel.rollout.native.attention import KernelConfig, SharedPrefix, sdpa_decode_attention, """
    """triton_decode_attention

def check(pad, column, length=300, rows=None, cache_rows=None, heads=14, kv=2, dim=64, """
    """sinks=False, **config):
    torch.manual_seed(0)
    batch = len(pad)
    pad, column = torch.tensor(pad), torch.tensor(column)
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv, 1, dim), torch.randn(batch, kv, 1, dim)
    caches = [torch.randn(cache_rows or batch, kv, length, dim) for _ in range(2)]
    sinks = torch.randn(heads) * 3 if sinks else None  # some above every score: a real share
    cols = torch.arange(length)
    visible = ((cols >= pad[:, None]) & (cols <= column.expand(batch)[:, None]))[:, None, None]
    expected_caches = [c.clone() for c in caches]
    expected = sdpa_decode_attention(q, k, v, *expected_caches, pad, column, visible, rows, sinks)
    got = triton_decode_attention(q, k, v, *caches, pad, column, rows=rows, sinks=sinks, """
    """config=KernelConfig(**config))
    assert (got - expected).abs().max() < 1e-4, (pad, column, config)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches)), (pad, column, config)

for config in (dict(split=0), dict(split=64, block=32), dict()):
    check([0, 1, 63, 64, 65, 130, 200, 256], [256], **config)        """
    """# first columns in later splits; a split's start
    check([0, 10, 64, 129, 200], [0, 63, 64, 130, 299], rows=torch.tensor([7, 2, 11, 0, 5]), """
    """cache_rows=12,
          heads=12, dim=128, **config)                                 """
    """# continuous batching: rows, own columns
check([0, 5, 200], [200])                                              """
    """# a row whose first column is its new token's
check([0, 3], [6], length=8)                                           """
    """# a cache shorter than tl.dot's 16
check([0] * 4, [1000], length=2304)                                    """
    """# few rows, long cache: splits by default
for config in (dict(split=0), dict(split=64, block=32)):                """
    """# attention sinks (GPT-OSS), with and
    check([0, 1, 64, 130, 256], [256], heads=8, kv=2, sinks=True, **config)  """
    """# without splits to merge

def check_shared(**config):
    # rows 1, 2 and 4 hold a copy of row 0's first 70 columns (one prompt's samples); row 3 none
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 14, 1, 64), torch.randn(5, 2, 1, 64), torch.randn(5, 2, 1, 64)
    caches = [torch.randn(6, 2, 300, 64) for _ in range(2)]
    for cache in caches:
        cache[[1, 2, 4], :, :70] = cache[0, :, :70]
    rows, column = torch.tensor([2, 0, 4, 3, 1]), torch.tensor([70, 75, 130, 299, 200])
    # per cache row
    prefix = SharedPrefix(torch.tensor([0, 0, 0, 3, 0, 5]), torch.tensor([0, 70, 70, 0, 70, 0]))
    pad = torch.zeros(5, dtype=torch.long)
    args = (q, k, v, *[c.clone() for c in caches], pad, column)
    plain = triton_decode_attention(*args, rows=rows, config=KernelConfig(**config))
    # the copies spoilt: only reads in row 0 give the same result
    for cache in caches:
        cache[[1, 2, 4], :, :70] = float("nan")
    shared = triton_decode_attention(
        q, k, v, *caches, pad, column, rows=rows, prefix=prefix, config=KernelConfig(**config)
    )
    assert torch.equal(shared, plain), config

for config in (dict(split=0), dict(split=64, block=32), dict(split=64, block=16)):
    check_shared(**config)
print("ok")
"""
)


def test_triton_decode_attention_matches_sdpa_under_the_interpreter():
    """Where Triton is installed (not in keel's CPU install), its interpreter runs the decode
    kernel on the CPU in float32: one pass, splits, the default's choice, continuous batching's
    row table and per-row columns, a tiny cache; against the cache write and SDPA. A prompt's
    samples read its copied columns in the row they were copied from: the same bits, where their
    own copies are spoilt."""
    pytest.importorskip("triton")
    run_under_triton_interpreter(INTERPRETED_ATTENTION)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("rotary", ["", "rotary", "rotary_and_norms"])
def test_the_decode_kernel_compiles_for_hopper_without_a_gpu(shared, one_pass, rotary):
    """Where Triton is installed, its compiler builds the decode kernel for sm_90 (H100, H200) on
    any machine: Qwen2.5-0.5B's heads through the row table, with and without copied columns read
    in their source row, in one pass and in splits, and norming and rotating the projected heads
    itself. A GPU's time is scarce; a compile error shows here first."""
    pytest.importorskip("triton")
    from keel.rollout.native.attention_kernels import decode_attention_kernel

    pointers = dict.fromkeys(["Q", "K", "V", "KCache", "VCache", "Out", "Sinks"], "*bf16")
    pointers |= dict.fromkeys(["Cos", "Sin", "QNorm", "KNorm"], "*bf16")
    pointers |= dict.fromkeys(["PartialOut", "PartialLse"], "*fp32")
    pointers |= dict.fromkeys(["Pad", "Column", "Rows", "PrefixRow", "PrefixLen"], "*i64")
    constants = dict(GROUP=7, BLOCK_GROUP=16, DIM=64, BLOCK=64, ONE_PASS=one_pass, INDIRECT=True)
    constants |= dict(COLUMN_STRIDE=1, SINKS=False, SHARED=shared)
    constants |= dict(ROTARY=bool(rotary), QK_NORM=rotary == "rotary_and_norms", PDL=False)
    ptx = compile_for_hopper(decode_attention_kernel, pointers, constants, ("scale", "eps"))
    assert "decode_attention_kernel" in ptx


# grouped matmuls, or every expert masked (float32 on a GPU)
@pytest.mark.parametrize("grouped", [True, False])
def test_routed_experts_equal_transformers_mixture_block(grouped):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from keel.models.tiny import build_model_config
    from keel.rollout.native.models.qwen3_moe import routed_experts

    config = build_model_config("qwen3_moe", hidden_size=64)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    h = torch.randn(37, 64)
    expected = block(h[None])[0]
    ours = routed_experts(
        h,
        block.gate.weight,
        block.experts.gate_up_proj,
        block.experts.down_proj,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        grouped,
    )
    # the experts contribute: a comparison that can fail
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_a_turn_arriving_mid_decode_joins_within_look_every_steps(tiny_assets):
    """Without stop tokens a decode call runs to the first turn's end unlooked; the engine service
    bounds it, so a turn that arrives while another decodes joins the batch within that many steps
    instead of waiting out the other's whole turn."""
    native, _, _, _ = engines(tiny_assets["model"], n=1)
    params = SamplingParams(temperature=1.0, ignore_eos=True)
    unbounded = native.continuous_batcher(4, 200, 64)
    unbounded.add("long", [5] * 10, 64)
    # all 64 steps in one call
    assert [f.key for f in unbounded.step(params)] == ["long"]

    batcher = native.continuous_batcher(4, 200, 64)
    batcher.add("long", [5] * 10, 64)
    # 16 steps: the long turn goes on
    assert batcher.step(params, look_every=16) == []
    batcher.add("short", [6] * 10, 4)
    (short,) = batcher.step(params, look_every=16)
    assert short.key == "short" and len(short.ids) == 4
    rest = []
    while not rest:
        rest = batcher.step(params, look_every=16)
    assert [f.key for f in rest] == ["long"] and len(rest[0].ids) == 64


def test_every_native_family_points_to_the_facts_record_of_its_model_types():
    """A family is one unit: the native engine runs exactly the model types the facts records
    (models/families.py) name, each through the family whose record names it."""
    from keel.models.families import FACTS
    from keel.rollout.native.models import FAMILIES

    assert set(FAMILIES) == set(FACTS)
    assert all(FACTS[model_type] is family.facts for model_type, family in FAMILIES.items())


def test_a_step_functions_argument_is_filled_by_name():
    """Each field of a layer's NamedTuple is the LayerWeights tensor or the family constant of its
    name, so two tensors of one shape cannot trade places; constants come after the tensors."""
    from typing import NamedTuple

    from keel.models.tiny import build_model_config
    from keel.rollout.native.layers import MlpArgs
    from keel.rollout.native.models import family_for
    from keel.rollout.native.models.base import LayerWeights, layer_args

    family = family_for(build_model_config("qwen2"))
    post_norm, gate_up, down, o = (torch.full((2,), float(i)) for i in range(4))
    layer = LayerWeights(qkv=o, o=o, post_norm=post_norm, gate_up=gate_up, down=down)
    args = layer_args(MlpArgs, layer, family)
    filled = (args.o, args.post_norm, args.gate_up, args.down)
    assert all(a is b for a, b in zip(filled, (o, post_norm, gate_up, down)))
    assert args.pre_mlp_norm is None and args.eps == family.eps

    class ConstantFirst(NamedTuple):
        eps: float
        o: torch.Tensor

    with pytest.raises(TypeError, match="tensors come before the constants"):
        layer_args(ConstantFirst, layer, family)


@pytest.mark.parametrize(
    "shape, fused", [("0.5b", True), ("qwen3-0.6b", True), ("gemma-3-1b", False)]
)
def test_the_kernel_makes_the_heads_only_where_attention_inputs_would(shape, fused):
    """The decode kernel norms and rotates the heads itself for families whose attention inputs
    are layers.attention_inputs' (Qwen2.5, Qwen3), not Gemma 3's own (its query scale and norms);
    never in batch-invariant mode (its own attention) or without Triton (SDPA)."""
    from keel.bench.workloads import shape_config
    from keel.rollout.native.models import family_for
    from keel.rollout.native.runner import rotary_in_attention

    family = family_for(shape_config(shape))
    assert rotary_in_attention(family, use_triton=True, batch_invariant=False) is fused
    assert not rotary_in_attention(family, use_triton=True, batch_invariant=True)
    assert not rotary_in_attention(family, use_triton=False, batch_invariant=False)
