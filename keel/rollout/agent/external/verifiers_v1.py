"""A verifiers v1 environment (verifiers >= 0.4, `verifiers.v1`) as keel's rollout: `verifiers:NAME`
names an installed taskset package, loaded by verifiers' own loader
(`load_environment(resolve_env_config(...))`); each sample is one Episode of its Env, its Harness
playing the task against keel's engine, and the Episode's reward and metrics are the sample's.

The model calls reach keel's endpoint through the verifiers client `environment_args.client` names:
`train` (default) verifiers' TrainClient, which renders the prompt itself and calls keel's
token-level `/inference/v1/generate`, so the trace is the exact tokens, never re-tokenised (a later
turn continues them where its renderer bridges turns, Qwen3's and the like; one that renders each
turn whole, the default renderer, may not: a prefix break, counted); `eval` its EvalClient, which
forwards chat requests to `/v1/chat/completions`, where keel continues a conversation's sampled
tokens itself. The Episode runs on an event
loop of its own (a thread), so an environment that blocks its loop costs its samples their
timeout (`agent.timeout_s`), never the step.

What keel reads of an Episode: an episode or trace error, a timeout, no trace, or a reward that is
not a finite number is a sample not scored (counted in agent/errors or agent/timeouts), never a
zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import threading

from keel.rollout.agent.external.outcome import Outcome, environment_error

# extra_info's key holding the task's wire data
DATA_KEY = "verifiers"
# environment_args.client: which verifiers client reaches keel's endpoint (keel reads it and
# environment_args.renderer; the rest is verifiers' EnvConfig's own: taskset, agent, timeout, ...)
CLIENTS = ("train", "eval")


def load_v1_agent(name: str, args: dict) -> VerifiersV1Agent:
    """The taskset package `name` through verifiers' loader, or KEEL-C024 saying why not."""
    import verifiers
    import verifiers.v1 as vf

    spec = f"verifiers:{name}"
    args = dict(args)
    client = args.pop("client", "train")
    renderer = args.pop("renderer", None)
    if client not in CLIENTS:
        raise environment_error(spec, f"environment_args.client={client!r} is not one of {CLIENTS}")
    try:
        # the renderer config, checked before any sample needs it
        vf.TrainClientConfig(api_key_var="KEEL_ENDPOINT_KEY", renderer=renderer)
    except Exception as error:  # noqa: BLE001 - pydantic's, said whole
        raise environment_error(spec, f"environment_args.renderer is not one: {error}") from None
    taskset = args.pop("taskset", {})
    agent = args.pop("agent", {})
    if not isinstance(taskset, dict) or not isinstance(agent, dict):
        raise environment_error(spec, "environment_args.taskset and .agent must be mappings")
    # a local process by default: verifiers' own default is a remote sandbox
    agent = {"runtime": {"type": "subprocess"}, **agent}
    config = {"taskset": {**taskset, "id": name}, "agent": agent, **args}
    try:
        env = vf.load_environment(vf.resolve_env_config(config))
    # the environment's own code and config: missing, invalid or raising, named
    except Exception as error:  # noqa: BLE001
        raise environment_error(
            spec,
            f"verifiers {verifiers.__version__}'s loader raised {type(error).__name__}: {error}",
        ) from None
    return VerifiersV1Agent(env, name, client, renderer, verifiers.__version__)


class VerifiersV1Agent:
    """Runs each sample as an Episode of the environment, on the environment's own event loop."""

    def __init__(self, env, name: str, client: str, renderer: dict | None, version: str):
        self.env, self.name, self.client, self.renderer = env, name, client, renderer
        harnesses = sorted({h.id for h in env.config.agent_harnesses().values()})
        self.api = (
            f"verifiers {version}, v1 API: {type(env).__name__} of taskset {name}, harness "
            f"{', '.join(harnesses)}, {client} client ("
            + ("token ids through /inference/v1/generate" if client == "train" else "chat")
            + ")"
        )
        # the environment's loop, and its serving() entered there (a concurrent Future)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving = self._started = None
        self._lock = threading.Lock()
        self._tokenizer_path: str | None = None

    def rows(self, split: str) -> list[dict] | None:
        """The taskset's tasks as prompt rows in verl's schema (train); the task's wire data rides
        in extra_info. None for val: a taskset has one split (data.val_files gives one)."""
        if split != "train":
            return None
        if not self.env.taskset.bounded:
            raise environment_error(
                f"verifiers:{self.name}",
                "its taskset is infinite: keel reads a taskset's tasks as the prompts",
            )
        return [
            {
                "prompt": _messages(task.data),
                "data_source": f"verifiers:{self.name}",
                "extra_info": {DATA_KEY: task.data.model_dump(mode="json", exclude_defaults=True)},
            }
            for task in self.env.taskset
        ]

    async def run(self, client, row: dict, extra_info: dict) -> Outcome:
        """One Episode of the row's task, its model calls named by this sample."""
        data = extra_info.get(DATA_KEY)
        if not isinstance(data, dict):
            raise ValueError(
                f"this row is not from verifiers:{self.name}'s taskset: leave data.train_files "
                "empty for the taskset's own"
            )
        sample = client.default_headers.get("X-Keel-Sample")
        if self._tokenizer_path is None and self.client == "train":
            # keel's /v1/models names the policy's tokenizer (vLLM's `root`)
            self._tokenizer_path = (await client.models.list()).data[0].root
        context = self._context(str(client.base_url), client.api_key, sample)
        # shielded: one sample's timeout must not cancel the serving every sample waits on
        await asyncio.shield(asyncio.wrap_future(self._start()))
        episode = asyncio.run_coroutine_threadsafe(self._episode(data, context), self._loop)
        return episode_outcome(await asyncio.wrap_future(episode))

    def _context(self, url: str, token: str, sample: str):
        import verifiers.v1 as vf

        # verifiers' clients read their key from the variable a config names; one a token, so a
        # client verifiers keeps by its config never carries an earlier rollout's
        variable = f"KEEL_ENDPOINT_KEY_{hashlib.sha256(token.encode()).hexdigest()[:12]}"
        os.environ[variable] = token
        common = {"base_url": url.rstrip("/"), "api_key_var": variable}
        # the sample is the model's name: keel's endpoint keeps each sample's trace by it
        if self.client == "eval":
            return vf.ModelContext(sample, vf.EvalClientConfig(**common))
        # renderer None: verifiers' auto (the model's own renderer where `renderers` knows it by
        # name, else one that renders each turn whole)
        config = vf.TrainClientConfig(
            **common, renderer=self.renderer, renderer_model_name=self._tokenizer_path
        )
        return vf.ModelContext(sample, config)

    async def _episode(self, data: dict, context):
        task_type = type(self.env.taskset).task_type()
        task = task_type(task_type.data_type().model_validate(data), self.env.taskset.config.task)
        return await self.env.run_episode(task, context)

    def _start(self):
        """The environment's loop (a thread) with the environment serving there (its interception
        server and shared tools up) for the life of the process -> the start's Future."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="keel-verifiers", daemon=True
                ).start()
            failed = (
                self._started is not None
                and self._started.done()
                and (self._started.cancelled() or self._started.exception() is not None)
            )
            # a start that failed is tried again by the next sample (each failed one says why)
            if self._started is None or failed:
                self._serving = self.env.serving()
                self._started = asyncio.run_coroutine_threadsafe(
                    self._serving.__aenter__(), self._loop
                )
        return self._started


def _messages(data) -> list[dict]:
    """A task's prompt as chat messages (a system prompt first where it has one)."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if data.prompt is None or isinstance(data.prompt, str):
        return system + [{"role": "user", "content": data.prompt or ""}]
    return system + [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]


def episode_outcome(episode) -> Outcome:
    """An Episode -> the sample's Outcome: its trainable traces' reward (their mean where an
    environment runs several) and metrics, or why it is not scored."""
    import verifiers.v1 as vf

    if not isinstance(episode, vf.Episode):
        return Outcome(
            status="error",
            error=f"the environment returned {type(episode).__name__}, not an Episode",
        )
    if episode.is_timeout:
        return Outcome(status="timeout", error=_said(episode.errors))
    traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
    if episode.errors or not traces:
        return Outcome(status="error", error=_said(episode.errors) or "the episode ran no agent")
    failed = [t for t in traces if not t.ok]
    if failed:
        status = "timeout" if any(t.is_timeout for t in failed) else "error"
        return Outcome(status=status, error=_said(failed[0].errors) or failed[0].stop_condition)
    metrics: dict[str, list[float]] = {}
    for trace in traces:
        for key, value in trace.metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics.setdefault(key, []).append(float(value))
    means = {key: sum(values) / len(values) for key, values in metrics.items()}
    if not all(t.rewards for t in traces):
        # verifiers sums no rewards to 0.0: a trace nothing scored is not one scored zero
        return Outcome(status="error", error="the episode recorded no reward", metrics=means)
    unscored = [k for t in traces for k, r in t.rewards.items() if r is None]
    if unscored:
        return Outcome(
            status="error", error=f"reward {unscored[0]!r} was never recorded", metrics=means
        )
    reward = sum(t.reward for t in traces) / len(traces)
    if not math.isfinite(reward):
        return Outcome(status="error", error=f"the episode's reward is {reward}", metrics=means)
    return Outcome(reward, metrics=means)


def _said(errors) -> str | None:
    return f"{errors[-1].type}: {errors[-1].message}"[:500] if errors else None
