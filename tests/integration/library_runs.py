"""What the environment libraries' integration tests share: a tiny run whose rollout is a library's
environment, and its metrics."""

import json

from keel.api import train


def run_metrics(cfg: dict) -> list[dict]:
    run_dir = train(cfg).run_dir
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def library_config(tiny_config: dict, agent: dict) -> dict:
    tiny_config["actor_rollout_ref"]["rollout"]["agent"] = agent
    tiny_config["actor_rollout_ref"]["rollout"]["name"] = "native"
    tiny_config["data"]["max_response_length"] = 64
    tiny_config["trainer"].update({"test_freq": -1, "val_before_train": False})
    # the environment's rewards are the run's
    tiny_config.pop("custom_reward_function", None)
    return tiny_config
