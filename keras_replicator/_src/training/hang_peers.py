"""What the other workers are at, for the hang watchdog's messages.

Each watchdog thread publishes its step and saves in TensorFlow's
coordination-service key-value store and reads the others' when it warns
or fires: a warning names the laggard, and waiting for another's save is
not counted as a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

# Bound on all reads of the other workers' states at one check.
_READ_SECONDS = 3.0

_KEY_PREFIX = "keras_replicator/watchdog/"


class Cluster:
    """This worker's and the others' states in the coordination service."""

    def __init__(self, task: str, tasks: list[str]):
        self.task = task
        self.peers = [t for t in tasks if t != task]

    @classmethod
    def of(cls, strategy: Any) -> Cluster | None:
        config = getattr(strategy, "cluster_config", None)
        if config is None or getattr(strategy, "num_workers", 1) < 2:
            return None
        tasks = [
            f"{job}:{i}"
            for job in ("chief", "worker")
            for i in range(len(config.cluster.get(job, ())))
        ]
        return cls(f"{config.task_type}:{config.task_index}", tasks)

    def publish(self, state: dict) -> None:
        from keras_replicator._src.upstream import context

        key = _KEY_PREFIX + self.task
        # The store never overwrites: delete, then insert (readers wait).
        with contextlib.suppress(Exception):  # no key yet, or no service
            context.context().delete_config_key_value(key)
        with contextlib.suppress(Exception):  # reported as "no report"
            context.context().set_config_key_value(key, json.dumps(state))

    def read(self) -> dict[str, dict | None]:
        from keras_replicator._src.upstream import context

        deadline = time.monotonic() + _READ_SECONDS
        states: dict[str, dict | None] = {}
        for peer in self.peers:
            # 0 would mean "wait forever".
            left = int((deadline - time.monotonic()) * 1000)
            states[peer] = None
            if left < 1:
                continue
            with contextlib.suppress(Exception):  # not published, or no service
                text = context.context().get_config_key_value(
                    _KEY_PREFIX + peer, timeout_in_ms=left
                )
                states[peer] = json.loads(text)
        return states


def task_of(strategy: Any) -> str:
    config = getattr(strategy, "cluster_config", None)
    if config is not None:
        return f"{config.task_type}:{config.task_index}"
    return f"local (pid {os.getpid()})"


def fresh(state: dict | None, idle: float) -> bool:
    """Whether `state` was published since this worker's stall began."""
    return bool(state) and state.get("time", 0) >= time.time() - idle


def peer_progress(peers, idle: float, untimed: float) -> float | None:
    """Seconds since another worker was last in a save, if within `idle`.

    A save lasting `untimed` s no longer counts: it may wait for us.
    """
    now = time.time()
    since = None
    for state in peers.values():
        if not state:
            continue
        if state.get("paused"):
            if now - state.get("paused_since", now) < untimed:
                return 0.0
            continue
        ago = now - state.get("resumed", 0)
        if ago < idle and (since is None or ago < since):
            since = ago
    return since


def steps_text(frame, peers, idle: float) -> str:
    """Every worker's step and who lags; `frame` is a `hang_watchdog._Frame`."""
    if not peers:
        return ""
    steps = {frame.task: frame.steps + 1}
    missing = []
    for task, state in peers.items():
        if fresh(state, idle):
            steps[task] = int(state["step"])
        else:
            missing.append(task)
    if frame.stepless:
        # Outside a loop there are no steps to compare.
        return f" No report from: {', '.join(missing)}." if missing else ""
    lowest = min(steps.values())
    behind = max(steps.values()) > lowest
    parts = [
        f"{task} {step}" + (" (behind)" if behind and step == lowest else "")
        for task, step in sorted(steps.items())
    ]
    text = " Steps the workers are at: " + ", ".join(parts) + "."
    if behind:
        late = ", ".join(t for t, s in sorted(steps.items()) if s == lowest)
        text += f" Workers that have not finished step {lowest}: {late}."
    if missing:
        text += f" No report from: {', '.join(missing)}."
    return text
