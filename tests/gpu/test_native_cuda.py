"""The native engine on a GPU: CUDA-graph decoding equals eager decoding, greedy tokens equal the
hf engine's in float32, and bf16 samples' log-probs agree with the trainer's. Run on the GPU
machine."""

import pytest
import torch

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.native import NativeRolloutEngine
from keel.training.batching import MicroBatching
from keel.training.forward import batched_log_probs
from keel.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def setup(model_dir, n, init_std: float | None = None):
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, CUDA)
    generator = torch.Generator(device="cuda").manual_seed(0)
    # redrawn: the default small init makes greedy decoding repeat one token
    with torch.no_grad():
        for name, p in model.named_parameters():
            # matrices, the experts' stacks, biases
            if init_std and (p.dim() >= 2 or name.endswith("bias")):
                p.copy_(torch.randn(p.shape, generator=generator, device="cuda") * init_std)
            # GPT-OSS: sinks that take a real share of the softmax
            elif init_std and name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=generator, device="cuda"))
    rows = [{"prompt": f"Digits please: {i} " * (1 + i % 3)} for i in range(6)]
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=128)
    return model, tokenizer, collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(n)


# (tiny model's architecture, weights' std)
FAMILIES = [
    ("qwen2", 0.2),
    ("qwen3", 0.2),
    ("qwen3_moe", 0.5),
    ("gemma3_text", 0.02),
    ("olmo2", 0.1),
    ("smollm3", 0.2),
    ("gpt_oss", 0.2),
    ("phi3", 0.2),
]


@pytest.mark.parametrize("arch, init_std", FAMILIES)
def test_graph_replay_equals_eager_and_greedy_equals_hf(tmp_path, arch, init_std):
    from keel.models.tiny import make_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", arch=arch, hidden_size=128, num_layers=4),
        n=3,
        init_std=init_std,
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=40, ignore_eos=True)
    graphs = NativeRolloutEngine(model, tokenizer, 256, torch.float32).generate(prompts, greedy)
    eager = NativeRolloutEngine(model, tokenizer, 256, torch.float32, enforce_eager=True).generate(
        prompts, greedy
    )
    hf = HFRolloutEngine(model, tokenizer).generate(prompts, greedy)
    # varied text: a real comparison
    assert len(set(hf.response_ids.flatten().tolist())) >= 8
    assert torch.equal(graphs.response_ids, eager.response_ids)
    same = (graphs.response_ids == hf.response_ids).float().mean().item()
    assert same == 1.0, f"{same:.3f} of tokens equal"


def test_a_kept_graph_replays_with_updated_weights(tmp_path):
    """free_cache_engine=False on GPU: the second call replays the first call's CUDA graph, which
    must read the weights synced in between (buffers filled in place), not the old ones."""
    from keel.models.tiny import make_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", hidden_size=128, num_layers=4), n=3, init_std=0.2
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=40, ignore_eos=True)
    kept = NativeRolloutEngine(model, tokenizer, 256, torch.float32, free_cache_engine=False)
    first = kept.generate(prompts, greedy)
    graphs = {bucket: step for bucket, (_, _, step) in kept._kept_batcher.decoding.graphs.items()}
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.2)
    kept.sync_weights(model)
    second = kept.generate(prompts, greedy)
    fresh = NativeRolloutEngine(model, tokenizer, 256, torch.float32).generate(prompts, greedy)
    # replayed
    assert (
        graphs
        and {bucket: step for bucket, (_, _, step) in kept._kept_batcher.decoding.graphs.items()}
        == graphs
    )
    assert torch.equal(second.response_ids, fresh.response_ids)
    assert not torch.equal(second.response_ids, first.response_ids)


def test_a_kept_cache_captures_again_for_other_sampling_settings(tmp_path):
    """Validation's settings, then training's, then validation's again on one kept cache: each
    change drops the graphs and captures new ones (once, into a pool that had no graph left, this
    failed torch's allocator), and the last call equals the first."""
    from keel.models.tiny import make_tiny_model

    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", hidden_size=128, num_layers=4), n=3, init_std=0.2
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, max_new_tokens=40, ignore_eos=True)
    kept = NativeRolloutEngine(model, tokenizer, 256, torch.bfloat16, free_cache_engine=False)
    first = kept.generate(prompts, greedy)
    assert kept.generate(prompts, sampled).response_ids.shape == first.response_ids.shape
    assert torch.equal(kept.generate(prompts, greedy).response_ids, first.response_ids)


def test_lora_adapters_unmerged_in_the_graph_equal_eager_and_the_merged_model(tmp_path):
    """One copy of the base on the GPU: the compiled, graph-captured step applies the adapters
    unmerged on the trainer's own base (views of the engine's buffers), and a kept graph reads
    adapters synced in place."""
    import copy

    from peft import LoraConfig, get_peft_model

    from keel.models.lora import adapter_weights, frozen_base
    from keel.models.tiny import make_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", hidden_size=128, num_layers=4), n=3, init_std=0.2
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=32, ignore_eos=True)
    kept = NativeRolloutEngine(model, tokenizer, 256, torch.float32, free_cache_engine=False)
    eager = NativeRolloutEngine(model, tokenizer, 256, torch.float32, enforce_eager=True)
    policy = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    assert kept.share_frozen_weights(frozen_base(policy)) > 0
    # the second round replays the kept graph with the adapters copied in place
    for step in range(2):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.3)
        kept.load_adapters(adapter_weights(policy))
        eager.load_adapters(adapter_weights(policy))
        merged = copy.deepcopy(policy).merge_and_unload()
        ours, theirs = (
            kept.generate(prompts, greedy),
            HFRolloutEngine(merged, tokenizer).generate(prompts, greedy),
        )
        assert torch.equal(ours.response_ids, eager.generate(prompts, greedy).response_ids), step
        same = (ours.response_ids == theirs.response_ids).float().mean().item()
        # fp32 reassociation
        assert same >= 0.97, f"round {step}: {same:.3f} of tokens equal the merged model's"


def test_bf16_samples_agree_with_the_trainer(tiny_assets):
    model, tokenizer, prompts = setup(tiny_assets["model"], n=8)
    engine = NativeRolloutEngine(model, tokenizer, 256, torch.bfloat16)
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=32))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trainer = batched_log_probs(model, batch, MicroBatching(64), temperature=1.0)
    gap = (
        (trainer - batch.sampling_log_probs).abs() * batch.response_mask
    ).sum() / batch.response_mask.sum()
    assert float(gap) < 0.02, float(gap)


SPLITS = {"one_pass": dict(split=0), "splits_of_64": dict(split=64, block=32), "default": {}}


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("column", [200, 256])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("kv_heads, group, dim", [(2, 7, 64), (2, 6, 128), (8, 1, 64)])
def test_triton_decode_attention_matches_sdpa(kv_heads, group, dim, splits, column, sinks):
    """The fused kernel (cache write + attention over the visible columns) against the cache write
    and SDPA over a masked cache, on bf16 rows with different left padding; in one pass and in
    splits (rows whose first column falls in a later split, and a new token at a split's start);
    with attention sinks (GPT-OSS) against the sinks' softmax in float32."""
    from keel.rollout.native.attention import (
        KernelConfig,
        sdpa_decode_attention,
        triton_available,
        triton_decode_attention,
    )

    if not triton_available(CUDA, torch.bfloat16, dim):
        pytest.skip("no Triton")
    torch.manual_seed(0)
    batch, length = 9, 300
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, kv_heads * group, 1, dim, **bf16)
    k, v = (
        torch.randn(batch, kv_heads, 1, dim, **bf16),
        torch.randn(batch, kv_heads, 1, dim, **bf16),
    )
    k_cache, v_cache = (
        torch.randn(batch, kv_heads, length, dim, **bf16),
        torch.randn(batch, kv_heads, length, dim, **bf16),
    )
    pad = torch.tensor([0, 1, 5, 63, 64, 65, 130, 200, 0], device="cuda")
    column = torch.tensor([column], device="cuda")
    visible = (torch.arange(length, device="cuda") >= pad[:, None]) & (
        torch.arange(length, device="cuda") <= column
    )
    caches = (k_cache.clone(), v_cache.clone())
    sink = torch.randn(kv_heads * group, **bf16) * 3 if sinks else None
    expected = sdpa_decode_attention(
        q, k, v, k_cache, v_cache, pad, column, visible[:, None, None], sinks=sink
    )
    got = triton_decode_attention(
        q, k, v, *caches, pad, column, sinks=sink, config=KernelConfig(**SPLITS[splits])
    )
    assert (got.float() - expected.float()).abs().max().item() < 2e-2
    # the new token written
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


@pytest.mark.parametrize("norm_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, dim", [(2, 7, 64), (8, 2, 128)])
def test_the_kernel_norms_and_rotates_the_projection_as_attention_inputs_does(
    kv_heads, group, dim, norm_dtype
):
    """Given the QKV projection as it is (attention.Rotary), the kernel's keys written to the cache
    are attention_inputs' bits, and its output is the output from attention_inputs' q, k, v:
    Qwen2.5's shapes without per-head norms, Qwen3's with them (float32 weights, as the trainer's
    master weights give the stream; and bf16)."""
    from keel.rollout.native.attention import Rotary, triton_available, triton_decode_attention
    from keel.rollout.native.layers import AttentionArgs, attention_inputs, projected_heads, rope

    if not triton_available(CUDA, torch.bfloat16, dim):
        pytest.skip("no Triton")
    torch.manual_seed(0)
    batch, hidden, heads, length = 9, 256, kv_heads * group, 300
    size = (heads + 2 * kv_heads) * dim
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    norms = [
        (torch.rand(dim, device="cuda") + 0.5).to(norm_dtype) if norm_dtype else None
        for _ in range(2)
    ]
    args = AttentionArgs(
        torch.randn(size, hidden, **bf16) / hidden**0.5, torch.randn(size, **bf16), None,
        *norms, heads, kv_heads, 1e-6, 1.0,
    )  # fmt: skip
    h = torch.randn(batch, hidden, device="cuda")
    positions = torch.randint(0, 4000, (batch,), device="cuda")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    cos, sin = rope(positions, inv_freq, 1.0, torch.float32)
    caches = [torch.randn(batch, kv_heads, length, dim, **bf16) for _ in range(2)]
    pad = torch.zeros(batch, dtype=torch.long, device="cuda")
    column = torch.tensor([250], device="cuda")
    unfused = [c.clone() for c in caches]
    expected = triton_decode_attention(*attention_inputs(h, cos, sin, args), *unfused, pad, column)
    rotary = Rotary(cos, sin, *norms, 1e-6)
    got = triton_decode_attention(*projected_heads(h, args), *caches, pad, column, rotary=rotary)
    assert torch.equal(caches[1], unfused[1])
    keys = (caches[0][:, :, 250] != unfused[0][:, :, 250]).float().mean().item()
    # the per-head norm's sum in another order may move a bf16 rounding, rarely
    assert keys == 0 if norm_dtype is None else keys < 0.01, keys
    assert (got.float() - expected.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("kv_heads, group, dim", [(2, 7, 64), (8, 1, 128)])
def test_triton_decode_attention_reads_rows_through_the_table_as_sdpa_does(
    kv_heads, group, dim, splits
):
    """Continuous batching: query b is cache row rows[b] at its own column."""
    from keel.rollout.native.attention import (
        KernelConfig,
        sdpa_decode_attention,
        triton_available,
        triton_decode_attention,
    )

    if not triton_available(CUDA, torch.bfloat16, dim):
        pytest.skip("no Triton")
    torch.manual_seed(0)
    cache_rows, length = 12, 300
    rows = torch.tensor([7, 2, 11, 0, 5, 11], device="cuda")
    column = torch.tensor([0, 63, 64, 130, 299, 1], device="cuda")
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(len(rows), kv_heads * group, 1, dim, **bf16)
    k, v = (
        torch.randn(len(rows), kv_heads, 1, dim, **bf16),
        torch.randn(len(rows), kv_heads, 1, dim, **bf16),
    )
    k_cache = torch.randn(cache_rows, kv_heads, length, dim, **bf16)
    v_cache = torch.randn(cache_rows, kv_heads, length, dim, **bf16)
    pad = torch.zeros_like(rows)
    visible = (torch.arange(length, device="cuda") <= column[:, None])[:, None, None]
    caches = (k_cache.clone(), v_cache.clone())
    expected = sdpa_decode_attention(
        q[:5], k[:5], v[:5], k_cache, v_cache, pad[:5], column[:5], visible[:5], rows[:5]
    )
    got = triton_decode_attention(
        q[:5],
        k[:5],
        v[:5],
        *caches,
        pad[:5],
        column[:5],
        rows=rows[:5],
        config=KernelConfig(**SPLITS[splits]),
    )
    assert (got.float() - expected.float()).abs().max().item() < 2e-2
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


@pytest.mark.parametrize("splits", SPLITS)
def test_triton_decode_attention_reads_copied_columns_in_their_source_row(splits):
    """A prompt's samples hold copies of its prefill's columns: the kernel reads them in the row
    they were copied from, the same bits in the same order, so the result is bit for bit the same
    (here where the copies themselves are spoilt)."""
    from keel.rollout.native.attention import KernelConfig, SharedPrefix, triton_decode_attention

    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(5, heads, 1, 64, **bf16) for heads in (14, 2, 2))
    caches = [torch.randn(6, 2, 300, 64, **bf16) for _ in range(2)]
    for cache in caches:
        cache[[1, 2, 4], :, :70] = cache[0, :, :70]
    rows = torch.tensor([2, 0, 4, 3, 1], device="cuda")
    column = torch.tensor([70, 75, 130, 299, 200], device="cuda")
    # per cache row
    prefix = SharedPrefix(
        torch.tensor([0, 0, 0, 3, 0, 5], device="cuda"),
        torch.tensor([0, 70, 70, 0, 70, 0], device="cuda"),
    )
    pad, config = torch.zeros_like(rows), KernelConfig(**SPLITS[splits])
    plain = triton_decode_attention(
        q, k, v, *[c.clone() for c in caches], pad, column, rows=rows, config=config
    )
    for cache in caches:
        cache[[1, 2, 4], :, :70] = float("nan")
    shared = triton_decode_attention(
        q, k, v, *caches, pad, column, rows=rows, prefix=prefix, config=config
    )
    assert torch.equal(shared, plain)


def test_samples_reading_their_prompt_in_one_row_decode_the_same_bits(tmp_path, monkeypatch):
    """bf16 on Triton's kernel, sampled, EOS on and fewer rows than sequences: a prompt's samples
    end at different depths, so its first row is taken by another sequence while its other samples
    still decode. Reading the copied prompt in its source row gives the same tokens and log-probs,
    bit for bit, as every row reading its own; had the copies not ended when their source row was
    written again, they would differ."""
    from keel.models.tiny import make_tiny_model
    from keel.rollout.native import decode_state
    from keel.rollout.native.attention import triton_decode_attention
    from keel.rollout.native.scheduler import CopiedPrefixes

    # samples a prompt; tokens a sample at most
    n, length = 4, 40
    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", hidden_size=128, num_layers=4), n=n, init_std=0.2
    )
    # Sampled: greedy samples of a prompt are one sequence, ending together with their source row.
    # The noise is drawn eagerly, so a seed gives each run the same draws.
    torch.manual_seed(0)
    free_run = NativeRolloutEngine(model, tokenizer, 24, torch.bfloat16).generate(
        prompts, SamplingParams(max_new_tokens=length, ignore_eos=True)
    )
    # a stop token that really occurs
    stop = int(free_run.response_ids[:, 3:].flatten().mode().values)

    def generate(share: bool):
        monkeypatch.setattr(decode_state, "SHARE_PREFIX_READS", share)
        engine = NativeRolloutEngine(model, tokenizer, 5, torch.bfloat16)
        assert engine.attention is triton_decode_attention
        engine.eos_ids = sorted(set(engine.eos_ids) | {stop})
        engine.eos = torch.tensor(engine.eos_ids, device="cuda")
        torch.manual_seed(1)
        out = engine.generate(prompts, SamplingParams(max_new_tokens=length))
        return out.response_ids, out.sampling_log_probs

    own = generate(share=False)
    ends = own[0] == stop
    # where each sample ended (`length`: at the cap), one row a prompt
    depths = torch.where(ends.any(1), ends.int().argmax(1), length).view(-1, n)
    assert any(len(set(samples)) > 1 for samples in depths.tolist())
    shared = generate(share=True)
    assert torch.equal(shared[0], own[0]) and torch.equal(shared[1], own[1])

    def never_ended(self, items, copies):
        width = {row: len(new) for row, _, new, _ in items}
        return {row: (source, width[row]) for row, source in copies}

    monkeypatch.setattr(CopiedPrefixes, "update", never_ended)
    stale = generate(share=True)
    assert not torch.equal(stale[1], own[1])


@pytest.mark.parametrize("arch, init_std", FAMILIES)
def test_continuous_batching_graphs_equal_eager_and_hf(tmp_path, monkeypatch, arch, init_std):
    """EOS on (lengths vary) and fewer rows than sequences: rows are refilled, each batch bucket
    replays its own graph; tokens equal eager's and the hf engine's. Then a multi-turn rollout whose
    every turn calls a tool, on the same graphs, equals hf's turn-by-turn generation."""
    from keel.models.tiny import make_tiny_model
    from keel.rollout.agent import AgentLoop, AgentOptions, tool
    from keel.rollout.agent.parse import PARSERS, ParsedTurn, ToolCall
    from keel.rollout.native import batching

    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(batching, "DONE_CHECK_EVERY", 4)
    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", arch=arch, hidden_size=128, num_layers=4),
        n=3,
        init_std=init_std,
    )
    hf = HFRolloutEngine(model, tokenizer)
    free_run = hf.generate(
        prompts, SamplingParams(do_sample=False, max_new_tokens=40, ignore_eos=True)
    ).response_ids
    # a stop token that really occurs, at varied depths
    stop = int(free_run[:, 3:].flatten().mode().values)
    graphs = NativeRolloutEngine(model, tokenizer, 5, torch.float32, free_cache_engine=False)
    eager = NativeRolloutEngine(model, tokenizer, 5, torch.float32, enforce_eager=True)
    for engine in (graphs, eager, hf):
        engine.eos_ids = sorted(set(engine.eos_ids) | {stop})
    graphs.eos, eager.eos = (
        torch.tensor(graphs.eos_ids, device="cuda"),
        torch.tensor(eager.eos_ids, device="cuda"),
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=40)
    ours, theirs = graphs.generate(prompts, greedy), hf.generate(prompts, greedy)
    assert len(set(theirs.response_lengths.tolist())) > 3
    # buckets of several sizes
    assert len(graphs._kept_batcher.decoding.graphs) > 1
    assert torch.equal(ours.response_ids, eager.generate(prompts, greedy).response_ids)
    assert ours.response_ids.tolist() == theirs.response_ids.tolist()

    monkeypatch.setitem(
        PARSERS, "every-turn", lambda text: ParsedTurn([ToolCall("echo", {"text": text[:12]})], [])
    )

    @tool
    def echo(text: str) -> str:
        """The text reversed."""
        return text[::-1]

    options = AgentOptions(max_assistant_turns=4, budget=200, turn_tokens=12, format="every-turn")
    turns = [
        AgentLoop(engine, tokenizer, [echo], options, engine.eos_ids).generate(
            prompts, SamplingParams(do_sample=False, max_new_tokens=200)
        )
        for engine in (graphs, hf)
    ]
    assert max(r.extra_info["num_turns"] for r in turns[1].records) >= 5
    assert turns[0].response_ids.tolist() == turns[1].response_ids.tolist()
    assert torch.equal(turns[0].response_mask, turns[1].response_mask)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs sm_90 (Hopper) or newer",
)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_programmatic_launch_decodes_the_same_bits(tmp_path, monkeypatch, arch):
    """runner.PROGRAMMATIC_LAUNCH on: the compiled step's kernels (inductor's, the attention, its
    splits' merge and the record kernel) start before the kernel they follow ends and wait for its
    writes. Sampled tokens and log-probs through the CUDA graphs are the bits of the same engine
    launched plainly: 12 rows, so the attention splits its columns and merges them."""
    from functools import partial

    from keel.models.tiny import make_tiny_model
    from keel.rollout.native import runner

    model, tokenizer, prompts = setup(
        make_tiny_model(tmp_path / "m", arch=arch, hidden_size=128, num_layers=4), n=2, init_std=0.2
    )

    def generate(programmatic: bool):
        monkeypatch.setattr(runner, "PROGRAMMATIC_LAUNCH", programmatic)
        engine = NativeRolloutEngine(model, tokenizer, 12, torch.bfloat16)
        assert engine.runner.programmatic == programmatic
        assert isinstance(engine.attention, partial) == programmatic
        torch.manual_seed(0)
        out = engine.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
        return out.response_ids, out.sampling_log_probs

    plain, programmatic = generate(False), generate(True)
    assert torch.equal(plain[0], programmatic[0]) and torch.equal(plain[1], programmatic[1])
    assert plain[1].abs().sum() > 0
