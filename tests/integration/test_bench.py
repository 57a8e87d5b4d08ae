"""keel bench: a real (tiny) GRPO run timed per phase, one JSON record appended per run."""

import json

from keel.cli import main

REQUIRED = ("workload", "date", "commit", "device", "step_time_s", "gen_tokens_per_s", "update_tokens_per_s",
            "update_mfu", "throughput_tokens_per_s_per_gpu", "peak_memory_gb", "log_prob_gap")


def test_bench_appends_a_record_with_the_required_fields(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert main(["bench", "tiny,tiny", "trainer.device=cpu", "--steps", "1", "--warmup", "1", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(set(REQUIRED) <= set(r) for r in records)
    r = records[0]
    assert r["workload"] == "tiny" and r["engine"] == "NativeRolloutEngine" and r["n_gpus"] == 1
    assert r["step_time_s"] > r["timing_s"]["gen"] > 0 and r["gen_tokens_per_s"] > 0 and r["update_tokens_per_s"] > 0
    # fixed-length responses: every sample generated 16 tokens
    assert r["gen_tokens_per_s"] == 4 * 4 * 16 / r["timing_s"]["gen"]
    assert 0 <= r["log_prob_gap"] < 1e-3  # float32 on CPU: sampler and trainer agree
    assert capsys.readouterr().out.count("\"workload\": \"tiny\"") == 2  # and printed
