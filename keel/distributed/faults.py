"""Fault injection for tests of the failure paths: KEEL_INJECT_FAULT="<kind>:<phase>:<rank>".

kind is `raise`, `hang` or `die` (the process ends as if the system killed it). The variable is
read by workers only; it is how CI checks that a failure anywhere ends the run with a code and a
rank, the way `keel reward-server --inject` checks the reward client.
"""

from __future__ import annotations

import os
import time

ENV = "KEEL_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


def maybe_inject(phase: str, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    kind, where, target = spec.split(":")
    if where != phase or int(target) != rank:
        return
    if kind == "raise":
        raise InjectedFault(f"fault injected by {ENV}={spec}")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "die":
        # what an out-of-memory kill looks like from outside
        os._exit(137)
