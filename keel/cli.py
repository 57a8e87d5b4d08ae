"""keel's command line: a thin shell over the Python API.

Errors a user can fix print `error[KEEL-...]` and a fix line and exit 2; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from keel import commands
from keel.errors import KeelError
from keel.version import __version__


def _list_of(parse, choices=None):
    """argparse type for comma-separated values: `t1,w1` or `1,2`."""

    def convert(text: str) -> list:
        values = [parse(v) for v in text.split(",")]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {bad}; choose from {', '.join(sorted(choices))}"
            )
        return values

    return convert


def _builtin_scorers() -> list[str]:
    from keel.rewards.registry import SCORERS

    return list(SCORERS)


def _is_override(word: str) -> bool:
    return "=" in word or word.startswith("~") and not word.startswith("~/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"keel {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="full tracebacks; CUDA_LAUNCH_BLOCKING=1 and TORCH_DISTRIBUTED_DEBUG=DETAIL",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_config_commands(sub)
    _add_machine_commands(sub)
    _add_reward_server(sub)
    _add_bench(sub)
    explain_cmd = sub.add_parser("explain", help="explain an error code (cause and fix)")
    explain_cmd.add_argument("code", nargs="?", help="e.g. KEEL-C001")
    explain_cmd.add_argument("--list", action="store_true", help="list every code")
    explain_cmd.set_defaults(func=commands.cmd_explain)
    return parser


def _config_command(sub, name: str, help: str, func) -> argparse.ArgumentParser:
    """A command that reads a config: a YAML file and overrides."""
    command = sub.add_parser(name, help=help)
    command.add_argument(
        "config",
        nargs="?",
        help="YAML config file (optional: a verl script passes overrides only)",
    )
    command.add_argument(
        "overrides",
        nargs="*",
        help="section.key=value overrides (Hydra's +key=value, ++key=value and ~key too)",
    )
    command.set_defaults(func=func)
    return command


def _verl_launch(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Hydra's options, as verl's scripts pass them to verl's main_ppo (a missing value is keel's
    coded error, not argparse's)."""
    command.add_argument(
        "--config-path",
        "-cp",
        nargs="?",
        const="",
        help="verl's launch form: the directory "
        "of the YAML --config-name names (composed with its defaults: list and hydra.searchpath)",
    )
    command.add_argument(
        "--config-name",
        "-cn",
        nargs="?",
        const="",
        help="verl's launch form: the YAML's name without .yaml (default ppo_trainer: verl's "
        "trainer config)",
    )
    return command


def _add_config_commands(sub) -> None:
    """train, check and sft."""
    _verl_launch(
        _config_command(
            sub, "train", "RL-train a policy (PPO, GRPO and relatives)", commands.cmd_train
        )
    ).add_argument(
        "--skip-check", action="store_true", help="do not run `keel check` first (logged)"
    )
    _verl_launch(
        _config_command(
            sub,
            "check",
            "check a config, its model, data, reward and memory without training",
            commands.cmd_check,
        )
    ).add_argument("--json", action="store_true", help="machine-readable output")
    _config_command(sub, "sft", "supervised fine-tuning on chat data", commands.cmd_sft)


# doctor, report, demo and export: commands about this machine, a run or a checkpoint.
# name: (help, handler, [(flags, options) of each argument])
MACHINE_COMMANDS = {
    "doctor": (
        "check this machine: versions, GPU, driver, disk",
        commands.cmd_doctor,
        [
            (["--json"], {"action": "store_true", "help": "machine-readable output"}),
            (
                ["--path"],
                {"default": ".", "help": "where checkpoints will go (for the disk check)"},
            ),
        ],
    ),
    "report": (
        "plot a run's metrics to report.png and report.html",
        commands.cmd_report,
        [(["run_dir"], {"help": "a run directory (holds metrics.jsonl)"})],
    ),
    "demo": (
        "SFT then GRPO on a tiny model that learns addition, or (--task tools) multiplication "
        "with a calculator tool (CPU, minutes)",
        commands.cmd_demo,
        [
            (
                ["--task"],
                {
                    "choices": ["arithmetic", "tools"],
                    "default": "arithmetic",
                    "help": "arithmetic: 2-digit addition; tools: multi-turn GRPO calling a "
                    "calculator",
                },
            ),
            (
                ["--out"],
                {
                    "help": "output directory (default: keel_demo, or keel_demo_tools for --task "
                    "tools)"
                },
            ),
            (
                ["--fresh"],
                {
                    "action": "store_true",
                    "help": "start over instead of resuming (a finished demo: instead of showing "
                    "its table again)",
                },
            ),
            (
                ["--smoke"],
                {
                    "action": "store_true",
                    "help": "a few SFT and GRPO steps, in seconds: checks a setup, "
                    "learns nothing (make demo DEMO_FLAGS=--smoke)",
                },
            ),
        ],
    ),
    "export": (
        "write a checkpoint's policy as a Hugging Face directory",
        commands.cmd_export,
        [
            (["checkpoint"], {"help": "a global_step_<N> directory"}),
            (["out"], {"help": "output directory"}),
            (
                ["--merged"],
                {
                    "action": "store_true",
                    "help": "LoRA: the base with the adapters merged in, a full Hugging Face model",
                },
            ),
        ],
    ),
}


def _add_machine_commands(sub) -> None:
    """The commands of MACHINE_COMMANDS, each with its arguments and handler."""
    for name, (help_text, handler, arguments) in MACHINE_COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        for flags, options in arguments:
            command.add_argument(*flags, **options)
        command.set_defaults(func=handler)


def _add_reward_server(sub) -> None:
    serve = sub.add_parser(
        "reward-server", help="serve a scorer over HTTP (POST /score, GET /health)"
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--scorer", help="a built-in scorer: " + ", ".join(sorted(_builtin_scorers()))
    )
    source.add_argument("--custom", help="PATH[:FUNCTION] of a reward function file")
    serve.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token", help="require `Authorization: Bearer TOKEN`")
    serve.add_argument("--max-request-bytes", type=int, default=8 << 20)
    serve.add_argument("--max-concurrency", type=int, default=8)
    serve.add_argument("--timeout-s", type=float, default=30.0, help="per-sample scoring limit")
    serve.add_argument(
        "--sandbox-require",
        choices=("isolation", "all", "none"),
        default="isolation",
        help="with --scorer code_exec: what the code jail must give (as reward.sandbox.require)",
    )
    serve.add_argument("--num-workers", type=int, default=0, help="scoring processes")
    serve.add_argument(
        "--inject",
        help="faults for the first /score requests, e.g. 500,malformed,slow (to test a client's "
        "retries)",
    )
    serve.set_defaults(func=commands.cmd_reward_server)


def _add_bench(sub) -> None:
    from keel.bench.distill import DISTILL_WORKLOADS
    from keel.bench.preference import PAIR_WORKLOADS
    from keel.bench.workloads import WORKLOADS

    bench = sub.add_parser(
        "bench",
        help="time a GRPO (or DPO: d1; on-policy distillation: o1) workload on a random-weight "
        "model; prints a JSON record",
    )
    names = {**WORKLOADS, **PAIR_WORKLOADS, **DISTILL_WORKLOADS}
    bench.add_argument(
        "workload",
        type=_list_of(str, names),
        help=f"one or more of {','.join(names)}, comma-separated",
    )
    bench.add_argument(
        "overrides", nargs="*", help="section.key=value overrides of the workload's config"
    )
    bench.add_argument("--steps", type=int, default=5, help="measured steps")
    bench.add_argument(
        "--warmup", type=int, default=2, help="steps run first and left out of the numbers"
    )
    bench.add_argument(
        "--gpus",
        type=_list_of(int),
        default=[1],
        help="workers (trainer.n_gpus_per_node); several, comma-separated, run one after another",
    )
    bench.add_argument("--out", help="append the record to this JSON-lines file")
    bench.add_argument(
        "--trl",
        action="store_true",
        help="DPO workloads: also run TRL's DPOTrainer (benchmarks/trl_dpo.py) on the same model "
        "and shapes; the record carries both",
    )
    bench.add_argument(
        "--profile",
        metavar="DIR",
        help="profile one more step after the measured ones (left "
        "out of their timings): its kernel and phase table to DIR, how busy the GPU was per phase "
        "to the record",
    )
    bench.set_defaults(func=commands.cmd_bench)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all(_is_override(word) for word in rest):
        # overrides after an option, as verl's `... $@` gives them
        args.overrides = [*args.overrides, *rest]
    elif rest:
        # argparse's own message for what it does not know
        parser.parse_args(argv)
    # `keel train key=value ...`, as verl's scripts
    if getattr(args, "config", None) and _is_override(args.config):
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.debug:
        # Synchronous kernels put a CUDA error's traceback at the op that caused it; DETAIL makes
        # collectives check their arguments. Set here, every process keel starts inherits them.
        os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    logging.basicConfig(level=logging.INFO, format="keel: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KeelError as e:
        if args.debug:
            raise
        print(e.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: checkpoints already written are complete; run the same command to resume "
            "(trainer.resume_mode=auto)",
            file=sys.stderr,
        )
        return 130
