"""SFT examples: loss only on assistant tokens, truncation, and the errors bad rows raise."""

import pytest

from keel.data.sft import build_sft_dataset, collate_sft, tokenize_conversation
from keel.errors import DATA_COLUMN, NO_ASSISTANT_TURN, SFT_TOO_LONG, KeelError
from keel.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def learnt_text(example, tokenizer) -> str:
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


def test_loss_covers_every_assistant_turn_and_nothing_else(tokenizer):
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    example = tokenize_conversation(chat, tokenizer)
    # each answer and its end-of-turn token (the model must learn to stop), nothing of the prompts
    assert learnt_text(example, tokenizer) == "2<|im_end|>\n4<|im_end|>\n"
    assert len(example.input_ids) == len(example.loss_mask)


def test_prompt_response_columns_and_chat_prompts(tokenizer):
    rows = [
        {"prompt": "3+4", "response": "7"},
        {"prompt": [{"role": "user", "content": "5+5"}], "response": "10"},
    ]
    examples, stats = build_sft_dataset(rows, tokenizer)
    assert [learnt_text(e, tokenizer) for e in examples] == ["7<|im_end|>\n", "10<|im_end|>\n"]
    assert stats.total == 2 and stats.truncated == 0


def test_truncation_modes(tokenizer):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "x" * 40},
                {"role": "assistant", "content": "yes"},
            ]
        }
    ]
    with pytest.raises(KeelError) as info:
        build_sft_dataset(rows, tokenizer, max_length=20)
    assert info.value.code == SFT_TOO_LONG
    kept, stats = build_sft_dataset(rows, tokenizer, max_length=20, truncation="left")
    assert len(kept[0].input_ids) == 20 and stats.truncated == 1
    # the end, with the answer, is kept
    assert learnt_text(kept[0], tokenizer) == "yes<|im_end|>\n"
    # cutting the end removes the answer itself
    with pytest.raises(KeelError) as info:
        build_sft_dataset(rows, tokenizer, max_length=20, truncation="right")
    assert info.value.code == NO_ASSISTANT_TURN


def test_rows_that_cannot_teach_anything(tokenizer):
    with pytest.raises(KeelError) as info:
        build_sft_dataset([{"messages": [{"role": "user", "content": "hi"}]}], tokenizer)
    assert info.value.code == NO_ASSISTANT_TURN
    with pytest.raises(KeelError) as info:
        build_sft_dataset([{"text": "hi"}], tokenizer)
    assert info.value.code == DATA_COLUMN and "'text'" in info.value.message


def test_collate_right_pads_with_masks(tokenizer):
    examples, _ = build_sft_dataset(
        [{"prompt": "a", "response": "b"}, {"prompt": "long prompt", "response": "c"}], tokenizer
    )
    batch = collate_sft(examples, tokenizer.pad_token_id)
    short, long_ = (len(e.input_ids) for e in examples)
    assert batch["input_ids"].shape == (2, long_)
    assert batch["attention_mask"][0].tolist() == [1] * short + [0] * (long_ - short)
    assert (
        batch["loss_mask"][0, short:].sum() == 0
        and batch["input_ids"][0, short:].eq(tokenizer.pad_token_id).all()
    )
