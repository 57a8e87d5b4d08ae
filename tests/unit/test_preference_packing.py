"""Pairs packed without padding give each sequence what its own forward pass gives: DPO's summed
completion log-probs and a reward model's score, held against transformers' own forward on each
sequence alone."""

import pytest
import torch

from keel.data.preference import PairColumns, build_pairs
from keel.models.families import PLAIN_LM_HEAD
from keel.models.tiny import build_tokenizer, make_tiny_model, make_tiny_reward_model
from keel.training.pair_layout import shared_prompt_mask
from keel.training.preference import collate_pairs, pair_log_probs, pair_scores
from keel.training.shared_prompt import can_share_prompt

# a family on the chunked lm_head path, and others on the model's own forward
ARCHS = ["qwen2", "olmo2", "gemma3_text", "phi3"]
# (padding_free, share_prompt): sequences packed, padded, pairs packed with their prompt once, and
# a pair a row with its prompt once
LAYOUTS = [(True, False), (False, False), (True, True), (False, True)]
# small enough that a micro-batch packs into several rows, each holding several sequences
ROW_TOKENS = 64
ROWS = [
    {"prompt": [{"role": "user", "content": "2+2"}], "chosen": "4", "rejected": "five"},
    {"prompt": "Reply with digits: 12 7", "chosen": "127", "rejected": "The numbers are 12, 7."},
    {
        "prompt": [{"role": "user", "content": "a question long enough to outgrow a window"}],
        "chosen": "a short answer",
        "rejected": "a much longer answer that goes on",
    },
    {"prompt": "x", "chosen": "y", "rejected": "zz"},
]


def pairs_of(rows: list[dict]):
    built, _ = build_pairs(
        rows,
        build_tokenizer(),
        PairColumns("prompt", "chosen", "rejected", "margin"),
        max_length=256,
        truncation="error",
        for_reward_model=False,
    )
    return built


@pytest.fixture(scope="module")
def pairs():
    return pairs_of(ROWS)


def test_a_shared_prompt_is_computed_once(pairs):
    shared = collate_pairs(pairs, 0, True, ROW_TOKENS, share_prompt=True)
    apart = collate_pairs(pairs, 0, True, ROW_TOKENS)
    prompts = sum(len(p.prompt_ids) for p in pairs)
    # the rows hold each prompt once; the count stands for the sequences, as without sharing
    mask = shared_prompt_mask(*shared.shared_prompt_blocks)  # [rows, 1, L, L]
    assert mask.shape == (shared.input_ids.shape[0], 1, *shared.input_ids.shape[1:] * 2)
    # every token sees itself, and a rejected token never a chosen one
    assert mask.diagonal(dim1=-2, dim2=-1).all()
    parts = shared.shared_prompt_blocks[1]
    rejected_sees_chosen = (parts[:, :, None] == 2) & (parts[:, None, :] == 1) & mask[:, 0]
    assert not rejected_sees_chosen.any()
    assert shared.tokens == apart.tokens
    assert int((shared.input_ids != 0).sum()) == int((apart.input_ids != 0).sum()) - prompts


def test_a_window_shorter_than_the_pairs_keeps_prompts_apart(tmp_path):
    from transformers import AutoConfig

    phi3 = AutoConfig.from_pretrained(make_tiny_model(tmp_path / "phi3", arch="phi3"))
    assert phi3.sliding_window < 256 and not can_share_prompt(phi3, 256)
    assert can_share_prompt(phi3, phi3.sliding_window)


def test_the_families_cover_both_log_prob_paths():
    assert "qwen2" in PLAIN_LM_HEAD and "phi3" in PLAIN_LM_HEAD
    assert "olmo2" not in PLAIN_LM_HEAD and "gemma3_text" not in PLAIN_LM_HEAD


def test_packing_fills_rows_with_whole_sequences(pairs):
    packed = collate_pairs(pairs, 0, padding_free=True, row_tokens=ROW_TOKENS)
    padded = collate_pairs(pairs, 0, padding_free=False, row_tokens=ROW_TOKENS)
    assert 1 < packed.input_ids.shape[0] < 2 * len(pairs) == padded.input_ids.shape[0]
    # no padding counted, whichever way
    whole = sum(len(p.prompt_ids) + len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids))
    assert packed.tokens == padded.tokens == whole
    for batch in (packed, padded):
        assert batch.pairs == len(pairs)
        # each sequence's targets are its completion, in order
        for i, (ids, prompt_len) in enumerate(sequences(pairs)):
            assert batch.targets[batch.target_sequence == i].tolist() == ids[prompt_len:]
            assert batch.input_ids.reshape(-1)[batch.last_token_at[i]] == ids[-1]


def sequences(pairs):
    """Each pair's chosen then rejected sequence, with its prompt length."""
    return [
        (p.prompt_ids + completion, len(p.prompt_ids))
        for p in pairs
        for completion in (p.chosen_ids, p.rejected_ids)
    ]


def alone_log_probs(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    """transformers' own forward on one sequence: each completion token's log-prob."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return torch.stack([log_probs[t - 1, ids[t]] for t in range(prompt_len, len(ids))])


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_log_probs_equal_each_sequence_alone(tmp_path, pairs, arch):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    alone = [alone_log_probs(model, ids, n) for ids, n in sequences(pairs)]
    # the shared prompt's mask would drop a sliding window shorter than the sequences
    sharing = can_share_prompt(model.config, 256)
    for padding_free, share_prompt in LAYOUTS:
        if share_prompt and not sharing:
            continue
        batch = collate_pairs(pairs, 0, padding_free, ROW_TOKENS, share_prompt)
        with torch.no_grad():
            summed, token_log_probs = pair_log_probs(model, batch)
        for i, expected in enumerate(alone):
            got = token_log_probs[batch.target_sequence == i]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        # sums near 100 differ by float32 rounding (a step of 8e-6 there), summed in another order
        got = torch.stack([summed.chosen, summed.rejected], dim=1).reshape(-1)
        expected = torch.stack([a.sum() for a in alone])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
        lengths = [len(ids) - n for ids, n in sequences(pairs)]
        assert summed.chosen_tokens.tolist() == lengths[0::2]
        assert summed.rejected_tokens.tolist() == lengths[1::2]


def alone_score(model, ids: list[int]) -> torch.Tensor:
    """transformers' own sequence-classification forward on one unpadded sequence."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].float()


@pytest.mark.parametrize("arch", ["qwen2", "olmo2"])
def test_packed_scores_equal_each_sequence_alone(tmp_path, pairs, arch):
    from transformers import AutoModelForSequenceClassification

    if arch == "qwen2":
        path = make_tiny_reward_model(tmp_path / arch)
    else:
        path = make_tiny_model(tmp_path / arch, arch=arch)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32
    ).eval()
    expected = torch.stack([alone_score(model, ids) for ids, _ in sequences(pairs)])
    for padding_free, share_prompt in LAYOUTS:
        batch = collate_pairs(pairs, 0, padding_free, ROW_TOKENS, share_prompt)
        with torch.no_grad():
            chosen, rejected = pair_scores(model, batch)
        got = torch.stack([chosen, rejected], dim=1).reshape(-1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False])
def test_pairs_of_one_length_take_a_row_each_and_match_too(tmp_path, padding_free):
    from transformers import AutoModelForCausalLM

    # every sequence 6 tokens: no packing and no padding needed
    same = pairs_of(
        [
            {"prompt": "abc", "chosen": "de", "rejected": "fg"},
            {"prompt": "hi", "chosen": "jkl", "rejected": "mno"},
        ]
    )
    batch = collate_pairs(same, 0, padding_free=padding_free, row_tokens=ROW_TOKENS)
    assert batch.input_ids.shape == (4, 6) and batch.attention_mask is None
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        summed, _ = pair_log_probs(model.eval(), batch)
    expected = torch.stack([alone_log_probs(model, ids, n).sum() for ids, n in sequences(same)])
    got = torch.stack([summed.chosen, summed.rejected], dim=1).reshape(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("padding_free", [True, False])
def test_an_empty_prompt_leaves_the_first_completion_token_unpredicted(tmp_path, padding_free):
    from transformers import AutoModelForCausalLM

    # the strings format with an empty prompt: a sequence is its completion alone; its first token
    # has nothing before it to predict it (TRL's shifted labels leave it out too)
    empty = pairs_of(
        [
            {"prompt": "", "chosen": "ab", "rejected": "c"},
            {"prompt": "", "chosen": "d", "rejected": "efg"},
        ]
    )
    assert all(p.prompt_ids == [] for p in empty)
    batch = collate_pairs(empty, 0, padding_free=padding_free, row_tokens=ROW_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        summed, _ = pair_log_probs(model.eval(), batch)
    completions = [c for p in empty for c in (p.chosen_ids, p.rejected_ids)]
    expected = torch.stack([alone_log_probs(model, ids, 1).sum() for ids in completions])
    got = torch.stack([summed.chosen, summed.rejected], dim=1).reshape(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    counted = torch.stack([summed.chosen_tokens, summed.rejected_tokens], dim=1).reshape(-1)
    assert counted.tolist() == [len(c) - 1 for c in completions]
