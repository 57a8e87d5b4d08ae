"""Agents in processes of their own (`actor_rollout_ref.rollout.agent.processes`), as vLLM keeps its
API server out of the engine's process: an agent's Python (the OpenAI client's requests and parsing,
an environment's code, a rubric) then never holds the GIL that the engine's run loop and the
endpoint need between decode steps. Each process builds the agent once, runs the samples of the
groups it is given (a group stays in one process: its rubric scores it at once) and reports each
sample as its agent returns (its KV row can go) and as it is scored.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue

from keel.errors import AGENT_FUNCTION, KeelError
from keel.rollout.agent.external.agents import Job, build_agent, run_agents

# how often a wait for the processes' reports looks whether they are still alive
POLL_S = 1.0


class AgentProcesses:
    def __init__(self, section, count: int):
        # not fork: the parent holds threads and CUDA
        context = multiprocessing.get_context("spawn")
        self.reports = context.Queue()
        self.inboxes = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(
                target=_serve,
                args=(i, section, inbox, self.reports),
                name=f"keel-agents-{i}",
                daemon=True,
            )
            for i, inbox in enumerate(self.inboxes)
        ]
        for process in self.processes:
            process.start()

    def run(
        self, urls: list[str], token: str, jobs: list[Job], at_once: int, timeout_s: float, on_ended
    ):
        """run_agents over the processes, a prompt's group in one of them, process p's requests to
        urls[p % len(urls)] (the endpoint's processes) -> every job's Outcome."""
        count = len(self.processes)
        shares = [[i for i, job in enumerate(jobs) if job.group % count == p] for p in range(count)]
        for p, (inbox, share) in enumerate(zip(self.inboxes, shares)):
            inbox.put(
                (
                    urls[p % len(urls)],
                    token,
                    [jobs[i] for i in share],
                    max(1, -(-at_once // count)),
                    timeout_s,
                )
            )
        outcomes: list = [None] * len(jobs)
        finished = 0
        while finished < count:
            kind, process, payload = self._next_report()
            if kind == "ended":
                on_ended(payload)
            elif kind == "outcomes":
                for i, outcome in zip(shares[process], payload):
                    outcomes[i] = outcome
                finished += 1
            # "failed": the agent could not be built there (KEEL-C023/C024) or the process broke
            else:
                raise payload
        return outcomes

    def _next_report(self):
        while True:
            try:
                return self.reports.get(timeout=POLL_S)
            except queue.Empty:
                dead = [p for p in self.processes if not p.is_alive()]
                if dead:
                    raise KeelError(
                        AGENT_FUNCTION,
                        f"agent process {dead[0].name} exited (code {dead[0].exitcode}) in "
                        "the middle of a rollout",
                        "run with actor_rollout_ref.rollout.agent.processes=0 to see the agent's "
                        "own error in this process",
                    ) from None

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def _serve(index: int, section, inbox, reports) -> None:
    """Agent process `index`: build the agent, then run each batch of jobs it is sent."""
    try:
        agent = build_agent(section)
    except BaseException as error:  # noqa: BLE001 - said to the engine's process, which raises it
        reports.put(
            ("failed", index, error if isinstance(error, KeelError) else RuntimeError(repr(error)))
        )
        return
    while (work := _next_work(inbox)) is not None:
        url, token, jobs, at_once, timeout_s = work
        # a callback, named for its job
        ended = lambda name: reports.put(("ended", index, name))  # noqa: E731
        outcomes = asyncio.run(run_agents(agent, url, token, jobs, at_once, timeout_s, ended))
        reports.put(("outcomes", index, outcomes))


def _next_work(inbox):
    """The next batch of jobs; None once told to stop, or once the engine's process is gone (a Ray
    worker killed at the end of a run gives no word, and a daemon outlives a killed parent)."""
    while True:
        try:
            return inbox.get(timeout=POLL_S)
        except queue.Empty:
            if not multiprocessing.parent_process().is_alive():
                return None
