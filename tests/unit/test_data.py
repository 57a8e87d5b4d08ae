"""Prompt datasets (loading, templating, truncation, collation) and the resumable sampler."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from keel.data.prompts import PromptRecord, build_prompt_dataset, collate_prompts, load_rows
from keel.data.sampler import ResumableSampler
from keel.errors import (
    DATA_COLUMN,
    DATA_EMPTY,
    DATA_FILE,
    NO_CHAT_TEMPLATE,
    PROMPT_TOO_LONG,
    KeelError,
)
from keel.models.tiny import build_tokenizer

GEN_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def chat_row(question: str, answer: str = "4", **extra) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "data_source": "math",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"split": "train"},
        **extra,
    }


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# --- loading ------------------------------------------------------------------------------------


def test_parquet_and_jsonl_load_in_order_with_nested_columns(tmp_path):
    first = write_parquet(tmp_path / "a.parquet", [chat_row("2+2?"), chat_row("3+3?", "6")])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+1?"}])
    rows = load_rows([first, second])
    assert [r["prompt"] for r in rows] == [
        [{"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "3+3?"}],
        "1+1?",
    ]
    assert rows[1]["reward_model"] == {"ground_truth": "6", "style": "rule"}


def test_json_file_may_be_a_list_or_json_lines(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    as_lines = write_jsonl(tmp_path / "lines.json", [{"prompt": "c"}])
    assert [r["prompt"] for r in load_rows([str(as_list), as_lines])] == ["a", "b", "c"]


def test_missing_file_is_a_data_file_error(tmp_path):
    with pytest.raises(KeelError) as e:
        load_rows(str(tmp_path / "nope.parquet"))
    assert e.value.code == DATA_FILE and "nope.parquet" in e.value.message


def test_files_without_rows_are_an_empty_dataset(tmp_path):
    """An empty file or one of blank lines: refused by name, not an IndexError from the tokenizer;
    an empty file beside a non-empty one is fine."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(KeelError) as e:
        load_rows([tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"])
    assert e.value.code == DATA_EMPTY and "blank.jsonl" in e.value.message
    assert load_rows([tmp_path / "empty.jsonl", tmp_path / "one.jsonl"]) == [{"prompt": "hi"}]


def test_unknown_extension_is_a_data_file_error(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(KeelError) as e:
        load_rows(str(path))
    assert e.value.code == DATA_FILE and "data.csv" in e.value.message


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(KeelError) as e:
        load_rows(str(path))
    assert e.value.code == DATA_FILE
    assert "bad.jsonl" in e.value.message and "line 2" in e.value.message


def test_corrupt_parquet_is_a_data_file_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(KeelError) as e:
        load_rows(str(path))
    assert e.value.code == DATA_FILE and "broken.parquet" in e.value.message


# --- templating and fields ----------------------------------------------------------------------


def test_chat_prompt_is_templated_with_generation_prompt(tokenizer):
    records, stats = build_prompt_dataset([chat_row("2+2?")], tokenizer)
    (record,) = records
    assert record.prompt_text == "<|im_start|>user\n2+2?<|im_end|>\n" + GEN_PROMPT
    assert tokenizer.decode(record.prompt_ids) == record.prompt_text
    # Special tokens are single ids, not spelled out character by character.
    assert record.prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert (record.index, record.data_source, record.ground_truth) == (0, "math", "4")
    assert record.extra_info == {"split": "train"}
    assert (stats.total, stats.kept, stats.truncated, stats.dropped) == (1, 1, 0, 0)


def test_string_prompt_becomes_a_user_message(tokenizer):
    (record,), _ = build_prompt_dataset([{"prompt": "hi"}], tokenizer)
    assert record.prompt_text == "<|im_start|>user\nhi<|im_end|>\n" + GEN_PROMPT


def test_missing_optional_fields_get_defaults(tmp_path, tokenizer):
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}]))
    (record,), _ = build_prompt_dataset(rows, tokenizer)
    assert (record.data_source, record.ground_truth, record.extra_info) == ("unknown", None, {})


def test_parquet_rows_with_null_fields_get_defaults(tmp_path, tokenizer):
    # In one parquet file, a row without reward_model/extra_info reads back with nulls there.
    full = {"prompt": "2+2?", "reward_model": {"ground_truth": "4"}, "extra_info": {"k": 1}}
    rows = load_rows(write_parquet(tmp_path / "d.parquet", [full, {"prompt": "hi"}]))
    records, _ = build_prompt_dataset(rows, tokenizer)
    assert records[0].ground_truth == "4"
    assert (records[1].data_source, records[1].ground_truth, records[1].extra_info) == (
        "unknown",
        None,
        {},
    )


def test_without_chat_template_flag_messages_are_joined(tokenizer):
    row = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    }
    (chat,), _ = build_prompt_dataset([row], tokenizer, apply_chat_template=False)
    (plain,), _ = build_prompt_dataset([{"prompt": "raw"}], tokenizer, apply_chat_template=False)
    assert chat.prompt_text == "be brief\n2+2?"
    assert plain.prompt_text == "raw"


def test_chat_prompt_without_template_is_an_error(tokenizer):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(KeelError) as e:
        build_prompt_dataset([{"prompt": "fine"}, chat_row("2+2?")], bare)
    assert e.value.code == NO_CHAT_TEMPLATE and "row 1" in e.value.message
    # Plain strings need no template: they are used as they are.
    (record,), _ = build_prompt_dataset([{"prompt": "fine"}], bare)
    assert record.prompt_text == "fine"


def test_missing_prompt_column_names_key_row_and_columns(tokenizer):
    rows = [{"prompt": "ok"}, {"question": "2+2?", "data_source": "math"}]
    with pytest.raises(KeelError) as e:
        build_prompt_dataset(rows, tokenizer)
    assert e.value.code == DATA_COLUMN
    assert "'prompt'" in e.value.message and "row 1" in e.value.message
    assert "question" in e.value.message and "data_source" in e.value.message
    # Pointing prompt_key at the right column fixes it.
    records, _ = build_prompt_dataset([{"question": "2+2?"}], tokenizer, prompt_key="question")
    assert "2+2?" in records[0].prompt_text


@pytest.mark.parametrize("bad", [[], [{"text": "no role"}], 42])
def test_malformed_prompt_is_a_data_column_error(tokenizer, bad):
    with pytest.raises(KeelError) as e:
        build_prompt_dataset([{"prompt": "ok"}, {"prompt": bad}], tokenizer)
    assert e.value.code == DATA_COLUMN and "row 1" in e.value.message


# --- over-length prompts ------------------------------------------------------------------------


def long_and_short_rows() -> list[dict]:
    # Templated lengths: 11 + 11 characters of overhead plus one token per content character.
    return [chat_row("SYSTEM-START " + "x" * 40 + " QUESTION-END"), chat_row("short")]


def test_overlong_prompt_with_error_names_row_length_and_limit(tokenizer):
    with pytest.raises(KeelError) as e:
        build_prompt_dataset(long_and_short_rows(), tokenizer, max_prompt_length=30)
    full = len(
        build_prompt_dataset(long_and_short_rows()[:1], tokenizer, max_prompt_length=1000)[0][
            0
        ].prompt_ids
    )
    assert e.value.code == PROMPT_TOO_LONG
    assert "row 0" in e.value.message and str(full) in e.value.message and "30" in e.value.message


def test_left_truncation_keeps_the_tail_with_generation_prompt(tokenizer):
    (full,), _ = build_prompt_dataset(long_and_short_rows()[:1], tokenizer, max_prompt_length=1000)
    records, stats = build_prompt_dataset(
        long_and_short_rows(), tokenizer, max_prompt_length=30, truncation="left"
    )
    assert records[0].prompt_ids == full.prompt_ids[-30:]
    assert records[0].prompt_text.endswith("QUESTION-END<|im_end|>\n" + GEN_PROMPT)
    assert records[0].prompt_text == tokenizer.decode(full.prompt_ids[-30:])
    assert "SYSTEM-START" not in records[0].prompt_text
    assert (stats.total, stats.kept, stats.truncated, stats.dropped) == (2, 2, 1, 0)


def test_right_truncation_keeps_the_head(tokenizer):
    (full,), _ = build_prompt_dataset(long_and_short_rows()[:1], tokenizer, max_prompt_length=1000)
    records, stats = build_prompt_dataset(
        long_and_short_rows(), tokenizer, max_prompt_length=30, truncation="right"
    )
    assert records[0].prompt_ids == full.prompt_ids[:30]
    assert records[0].prompt_text.startswith("<|im_start|>user\nSYSTEM-START")
    assert GEN_PROMPT not in records[0].prompt_text
    assert (stats.kept, stats.truncated, stats.dropped) == (2, 1, 0)


def test_filter_drops_overlong_prompts_and_counts_them(tokenizer):
    records, stats = build_prompt_dataset(
        long_and_short_rows() * 3, tokenizer, max_prompt_length=30, filter_overlong_prompts=True
    )
    # Kept records remember their row in the file, so scores can be traced back.
    assert [r.index for r in records] == [1, 3, 5]
    assert all(len(r.prompt_ids) <= 30 for r in records)
    assert (stats.total, stats.kept, stats.truncated, stats.dropped) == (6, 3, 0, 3)
    assert "6" in stats.summary() and "3 dropped" in stats.summary()


def test_unknown_truncation_mode_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="truncation"):
        build_prompt_dataset([{"prompt": "hi"}], tokenizer, truncation="middle")


def test_ten_thousand_rows_load_in_one_batched_pass(tmp_path, tokenizer):
    rows = [chat_row(f"What is {i} + {i}?", str(2 * i)) for i in range(10_000)]
    path = write_parquet(tmp_path / "big.parquet", rows)
    records, stats = build_prompt_dataset(load_rows(path), tokenizer)
    # speed is a benchmark's business, not a timed test's: check what was loaded
    assert stats.kept == 10_000 and records[9_999].ground_truth == "19998"
    assert records[9_999].prompt_text.endswith("<|im_start|>assistant\n")


# --- collation ----------------------------------------------------------------------------------


def record(ids: list[int]) -> PromptRecord:
    return PromptRecord(
        index=0, prompt_ids=ids, prompt_text="", data_source="s", ground_truth=None, extra_info={}
    )


def test_collate_left_pads_to_the_longest_prompt():
    batch = collate_prompts([record([5, 6, 7]), record([8])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]  # [B=2, P=3]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert len(batch) == 2


def test_collate_real_prompts_end_at_the_same_column(tokenizer):
    records, _ = build_prompt_dataset(
        [chat_row("a much longer question"), chat_row("hi")], tokenizer
    )
    batch = collate_prompts(records, tokenizer.pad_token_id)
    assert batch.input_ids.shape == (2, len(records[0].prompt_ids))
    # Generation appends at the right edge, so every row ends with the generation prompt.
    gen_len = len(tokenizer(GEN_PROMPT, add_special_tokens=False)["input_ids"])
    for row in range(2):
        assert tokenizer.decode(batch.input_ids[row, -gen_len:]) == GEN_PROMPT
    pads = batch.input_ids[1] == tokenizer.pad_token_id
    assert torch.equal(batch.attention_mask[1].bool(), ~pads)
    assert batch.attention_mask.sum(-1).tolist() == [len(r.prompt_ids) for r in records]


def test_repeat_interleave_repeats_each_prompt_consecutively():
    a, b = record([1, 2]), record([3])
    batch = collate_prompts([a, b], pad_token_id=0).repeat_interleave(3)
    assert batch.input_ids.tolist() == [[1, 2]] * 3 + [[0, 3]] * 3  # [B*n=6, P=2]
    assert batch.attention_mask.tolist() == [[1, 1]] * 3 + [[0, 1]] * 3
    assert batch.records == [a, a, a, b, b, b] and len(batch) == 6


# --- sampler ------------------------------------------------------------------------------------


def take_epoch(sampler: ResumableSampler) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(sampler.batches_per_epoch)]


def test_sampler_covers_every_index_once_per_epoch():
    sampler = ResumableSampler(dataset_size=12, batch_size=4, seed=0)
    for epoch in range(3):
        batches = take_epoch(sampler)
        assert sampler.epoch == epoch and sampler.position == 3
        assert all(len(b) == 4 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(12))


def test_sampler_drop_last_and_keep_last():
    dropped = ResumableSampler(dataset_size=10, batch_size=4, seed=0)
    kept = ResumableSampler(dataset_size=10, batch_size=4, seed=0, drop_last=False)
    assert dropped.batches_per_epoch == 2 and kept.batches_per_epoch == 3
    assert [len(b) for b in take_epoch(kept)] == [4, 4, 2]
    assert sorted(i for b in take_epoch(kept) for i in b) == list(range(10))


def test_sampler_epochs_differ_and_seed_fixes_order():
    first = ResumableSampler(dataset_size=50, batch_size=10, seed=7)
    epoch0, epoch1 = take_epoch(first), take_epoch(first)
    assert epoch0 != epoch1
    same = ResumableSampler(dataset_size=50, batch_size=10, seed=7)
    assert take_epoch(same) == epoch0 and take_epoch(same) == epoch1
    assert take_epoch(ResumableSampler(dataset_size=50, batch_size=10, seed=8)) != epoch0


def test_sampler_without_shuffle_is_in_order():
    sampler = ResumableSampler(dataset_size=6, batch_size=3, seed=0, shuffle=False)
    assert take_epoch(sampler) == [[0, 1, 2], [3, 4, 5]]


# 3 batches per epoch: mid-epoch and boundaries
@pytest.mark.parametrize("k", [0, 2, 3, 5, 7])
def test_sampler_restored_from_state_dict_continues_identically(k):
    uninterrupted = ResumableSampler(dataset_size=10, batch_size=3, seed=123)
    for _ in range(k):
        uninterrupted.next_batch()
    # A checkpoint round-trips through JSON, as it does on disk.
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    resumed = ResumableSampler(dataset_size=10, batch_size=3, seed=123)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (uninterrupted.epoch, uninterrupted.position)
    assert [resumed.next_batch() for _ in range(8)] == [
        uninterrupted.next_batch() for _ in range(8)
    ]


def test_sampler_state_from_other_dataset_or_batch_size_is_rejected():
    state = ResumableSampler(dataset_size=10, batch_size=2, seed=0).state_dict()
    assert set(state) == {"epoch", "position", "seed", "dataset_size", "batch_size"}
    with pytest.raises(ValueError, match="dataset size changed"):
        ResumableSampler(dataset_size=11, batch_size=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="batch size changed"):
        ResumableSampler(dataset_size=10, batch_size=5, seed=0).load_state_dict(state)


def test_sampler_batch_larger_than_dataset_is_rejected():
    with pytest.raises(ValueError, match="larger than the dataset"):
        ResumableSampler(dataset_size=3, batch_size=4, seed=0)
    assert ResumableSampler(dataset_size=3, batch_size=4, seed=0, drop_last=False).next_batch() in (
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    )
