"""A pool of transfer threads that no one peer can take over.

A consumer pulls encoder outputs and KV from many peers through one bounded
pool of threads. A plain pool serves its queue first come, first served, so
eight pulls from one slow or dripping peer hold all of its threads until their
deadlines pass, and a pull from any other peer waits behind them.

:class:`PeerPool` bounds what one peer may hold: at most ``per_peer`` tasks of
one peer run at once. The others wait in that peer's own queue, never in front
of another peer's task. A thread that comes free goes to the peers with waiting
tasks in turn (round robin), so a peer with a long queue does not take every
free thread either. With ``per_peer`` below ``workers``, a task for a peer that
has nothing running starts at once as long as fewer than
``workers - per_peer`` threads are busy for other peers.

Tasks are submitted with the peer they talk to (any hashable key, such as
``(host, port)``) and return ordinary :class:`concurrent.futures.Future`
objects; a future cancelled while it waits never runs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]


class PeerPool:
    """``workers`` threads, at most ``per_peer`` of them on one peer's tasks."""

    def __init__(self, workers: int, per_peer: int, name: str) -> None:
        if not 0 < per_peer <= workers:
            raise ValueError(f"per_peer must lie in [1, workers]: {per_peer}, {workers}")
        self.workers = workers
        self.per_peer = per_peer
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._cond = threading.Condition()
        self._running: dict[Hashable, int] = {}
        self._queued: dict[Hashable, deque[_Task]] = {}
        self._busy = 0
        self._closed = False

    def submit(self, peer: Hashable, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a thread once ``peer`` is under its bound and a thread
        is free; raises ``RuntimeError`` after :meth:`shutdown`."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            if self._busy < self.workers and self._running.get(peer, 0) < self.per_peer:
                self._start(peer, (future, fn, args))
            else:
                self._queued.setdefault(peer, deque()).append((future, fn, args))
        return future

    def running(self, peer: Hashable) -> int:
        """Tasks of ``peer`` running now."""
        with self._cond:
            return self._running.get(peer, 0)

    def queued(self, peer: Hashable) -> int:
        """Tasks of ``peer`` waiting for a thread."""
        with self._cond:
            return len(self._queued.get(peer, ()))

    def _start(self, peer: Hashable, task: _Task) -> None:
        # Under the lock; the executor never queues: at most ``workers`` are submitted.
        self._running[peer] = self._running.get(peer, 0) + 1
        self._busy += 1
        self._executor.submit(self._run, peer, task)

    def _run(self, peer: Hashable, task: _Task) -> None:
        future, fn, args = task
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            with self._cond:
                left = self._running[peer] - 1
                if left:
                    self._running[peer] = left
                else:
                    del self._running[peer]
                self._busy -= 1
                self._dispatch()
                self._cond.notify_all()
                last = self._closed and not self._busy and not self._queued
            if last:
                self._executor.shutdown(wait=False)

    def _dispatch(self) -> None:
        """Start waiting tasks, one peer at a time in turn (under the lock)."""
        started = True
        while started and self._busy < self.workers:
            started = False
            for peer in list(self._queued):
                if self._busy >= self.workers:
                    break
                if self._running.get(peer, 0) >= self.per_peer:
                    continue
                queue = self._queued.pop(peer)
                self._start(peer, queue.popleft())
                if queue:
                    self._queued[peer] = queue  # to the back of the turn
                started = True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more tasks. ``cancel_futures``: waiting tasks are cancelled (else they
        still run, in turn); ``wait``: return once every task has ended."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for queue in self._queued.values():
                    for future, _, _ in queue:
                        future.cancel()
                self._queued.clear()
            while wait and (self._busy or self._queued):
                self._cond.wait()
            drained = not self._busy and not self._queued
        if drained:
            self._executor.shutdown(wait=wait)
