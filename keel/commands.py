"""What each `keel` command does, given its parsed arguments (keel/cli.py defines the arguments and
calls them). Each imports what it needs when it runs, so `keel --help` stays quick."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from keel.errors import CATALOGUE, KeelError, explain


def _config_source(args):
    """The positional YAML file, or verl's launch form (`--config-path DIR --config-name NAME`)."""
    if args.config_path is None and args.config_name is None:
        return args.config
    from keel.config.hydra_compose import VerlLaunch
    from keel.errors import LAUNCH_CONFIG_PATH

    if args.config:
        raise KeelError(
            LAUNCH_CONFIG_PATH,
            f"a config file ({args.config}) and --config-path/--config-name were both given; "
            "keel reads one config",
            f"remove `{args.config}` (the command names its config with --config-path and "
            "--config-name)",
        )
    return VerlLaunch(args.config_path, args.config_name)


def cmd_train(args) -> int:
    from keel.api import train

    result = train(_config_source(args), args.overrides, check=not args.skip_check)
    print(f"done: {result.last_step} steps; run directory {result.run_dir}")
    return 0


def cmd_check(args) -> int:
    import json

    from keel.check.preference import check_preference
    from keel.check.preflight import render, run_checks
    from keel.config.load import load_config, load_run, objective_of
    from keel.config.preference import PreferenceConfig

    source = _config_source(args)
    if objective_of(source, args.overrides) is not None:
        report = check_preference(load_config(source, args.overrides, schema=PreferenceConfig))
    else:
        report = run_checks(*load_run(source, args.overrides))
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return 1 if report.failures else 0


def cmd_sft(args) -> int:
    from keel.trainer.sft import sft

    result = sft(args.config, args.overrides)
    print(
        f"done: {result.last_step} steps; the fine-tuned model is {result.run_dir} "
        "(use it as actor_rollout_ref.model.path)"
    )
    return 0


def cmd_report(args) -> int:
    from keel.observe.report import write_report

    png, page = write_report(args.run_dir)
    print(f"wrote {png} and {page}")
    return 0


def cmd_demo(args) -> int:
    from keel.demo import DemoSettings, run_demo, smoke_settings
    from keel.demo_result import print_summary
    from keel.demo_tools import TOOLS, ToolDemoSettings

    settings, task, out = (
        (ToolDemoSettings(), TOOLS, "keel_demo_tools")
        if args.task == "tools"
        else (DemoSettings(), None, "keel_demo")
    )
    # a directory of its own: a smoke run never clears a finished demo (other settings)
    if args.smoke:
        settings, out = smoke_settings(settings), f"{out}_smoke"
    print_summary(run_demo(args.out or out, settings, fresh=args.fresh, task=task))
    return 0


def cmd_doctor(args) -> int:
    import json

    from keel.check.doctor import as_json, collect, render

    checks = collect(args.path)
    print(json.dumps(as_json(checks), indent=2) if args.json else render(checks))
    return 1 if any(c.level == "fail" for c in checks) else 0


def cmd_reward_server(args) -> int:
    from keel.rewards.custom_fn import load_custom_reward_fn
    from keel.rewards.reward_fn import RewardScorer
    from keel.rewards.service import make_server

    if args.custom:
        path, _, name = (
            args.custom.rpartition(":")
            if ":" in args.custom.removeprefix("pkg:").removeprefix("file:")
            else (args.custom, "", "")
            # FILE:NAME, or pkg://module:NAME
        )
        scorer_fn = load_custom_reward_fn(path, name or "compute_score")
    else:
        scorer_fn = ("builtin", args.scorer)
    # the responses run here: this machine's jail is the one that counts
    if args.scorer in ("code_exec", "prime_code"):
        from keel.rewards.jail.sandbox import require_jail

        print("\n".join(require_jail(args.sandbox_require).describe()), flush=True)
    scorer = RewardScorer(
        scorer_fn, timeout_s=args.timeout_s, num_workers=args.num_workers, max_not_scored_ratio=1.0
    )
    server = make_server(
        scorer,
        args.host,
        args.port,
        args.token,
        args.max_request_bytes,
        args.max_concurrency,
        args.inject.split(",") if args.inject else None,
    )
    print(
        f"keel reward-server on http://{args.host}:{server.server_address[1]} (POST /score, "
        "GET /health)",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        scorer.close()
    return 0


def cmd_export(args) -> int:
    from keel.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, merged=args.merged)
    how = (
        "a PEFT adapter: PeftModel.from_pretrained(base, path)"
        if (Path(out) / "adapter_config.json").exists()
        else "AutoModelForCausalLM.from_pretrained"
    )
    print(f"exported {args.checkpoint} -> {out} (loads with {how})")
    return 0


def cmd_bench(args) -> int:
    """Every workload on every worker count, one record each; models are built once per shape."""
    import tempfile

    from keel.bench.distill import DISTILL_WORKLOADS, run_distill_bench
    from keel.bench.preference import PAIR_WORKLOADS, run_pair_bench
    from keel.bench.run import run_bench

    workdir = Path(tempfile.mkdtemp(prefix="keel_bench_"))
    out = Path(args.out) if args.out else None
    for workload in args.workload:
        if workload in PAIR_WORKLOADS:
            record = run_pair_bench(
                workload, args.steps, args.warmup, args.overrides, out, workdir, args.trl
            )
            print(json.dumps(record, indent=2), flush=True)
            continue
        for gpus in args.gpus:
            run = run_distill_bench if workload in DISTILL_WORKLOADS else run_bench
            record = run(
                workload,
                steps=args.steps,
                warmup=args.warmup,
                gpus=gpus,
                overrides=args.overrides,
                out=Path(args.out) if args.out else None,
                workdir=workdir,
                profile_dir=Path(args.profile) if args.profile else None,
            )
            print(json.dumps(record, indent=2), flush=True)
    return 0


def cmd_explain(args) -> int:
    if args.list or not args.code:
        for entry in CATALOGUE.values():
            print(f"{entry.code}  {entry.title}")
        return 0
    code = args.code.upper()
    code = code if code.startswith("KEEL-") else f"KEEL-{code}"
    if code not in CATALOGUE:
        print(
            f"unknown code {args.code!r}; `keel explain --list` shows every code", file=sys.stderr
        )
        return 2
    print(explain(code))
    return 0
