"""The taskset: "count to N" tasks, each scored by its reply's numbers (a reward) and its length (a
metric)."""

import re

import verifiers.v1 as vf


class CountData(vf.TaskData):
    target: int = 3


class CountTask(vf.Task[CountData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def counted(self, task, trace) -> float:
        """The share of 1..target the reply names (0 for an empty reply)."""
        said = {int(n) for n in re.findall(r"\d+", trace.last_reply or "")}
        return len(said & set(range(1, task.target + 1))) / task.target

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply or ""))


class CountTasksetConfig(vf.TasksetConfig):
    tasks: int = 16


class CountTaskset(vf.Taskset[CountTask, CountTasksetConfig]):
    def load(self):
        for i in range(self.config.tasks):
            target = 2 + i % 4
            data = CountData(prompt=f"Count to {target}.", target=target)
            yield CountTask(data, self.config.task)
