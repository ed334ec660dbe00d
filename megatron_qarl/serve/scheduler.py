"""The embedded engine's queue and KV-cache slots: which requests wait, which run in which slot, and the pause
states SGLang's scheduler has (sglang/srt/managers/scheduler.py: pause_generation, continue_generation,
abort_request, is_fully_idle).

Thread-safe: the HTTP handlers submit and pause from their threads, the engine thread admits and releases; every
change happens under one condition variable, which also wakes the engine thread when there is work.
"""

from __future__ import annotations

import collections
import threading

from megatron_qarl.serve.request import Request


class Scheduler:
    """Waiting requests (FIFO), running ones by KV-cache slot, the free slots, and the paused / stopped flags."""

    def __init__(self, slots: int):
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: dict[int, Request] = {}  # slot -> request
        self._free_slots = list(range(slots))
        self._paused = False
        self._stopped = False

    def add(self, req: Request) -> None:
        with self._cv:
            self._waiting.append(req)
            self._cv.notify()

    def wait_for_work(self) -> bool:
        """Block until there is something to step (not paused, a request waiting or running); False once stopped."""
        with self._cv:
            while not self._stopped and (self._paused or not (self._waiting or self._active)):
                self._cv.wait()
            return not self._stopped

    @property
    def paused(self) -> bool:
        return self._paused

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots, in arrival order; returns the ones admitted."""
        admitted = []
        with self._cv:
            while self._waiting and self._free_slots:
                req = self._waiting.popleft()
                req.slot = self._free_slots.pop(0)
                self._active[req.slot] = req
                admitted.append(req)
        return admitted

    def running(self) -> list[Request]:
        """The requests holding a slot, in slot-admission order."""
        with self._cv:
            return list(self._active.values())

    def live(self) -> list[Request]:
        """Every request not finished: waiting, then running."""
        with self._cv:
            return list(self._waiting) + list(self._active.values())

    def release(self, req: Request) -> None:
        """A finished request gives its slot back."""
        with self._cv:
            self._active.pop(req.slot, None)
            self._free_slots.append(req.slot)
            req.slot = None

    def num_pending(self) -> int:
        with self._cv:
            return len(self._waiting) + len(self._active)

    def num_unflushable(self) -> int:
        """The requests that keep /flush_cache from flushing: SGLang's ``is_fully_idle(ignore_waiting=paused)``:
        the running ones, plus the waiting ones unless generation is paused (a retracted request waits without a
        cache and is re-prefilled on continue)."""
        with self._cv:
            return len(self._active) + (0 if self._paused else len(self._waiting))

    def pause(self) -> int:
        """Stop admitting and stepping; returns how many requests were pending."""
        with self._cv:
            self._paused = True
            return len(self._waiting) + len(self._active)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def retract_all(self) -> list[Request]:
        """Every running request back to the front of the queue without its slot (``Request.reset_for_retract``),
        in its admission order; returns them."""
        with self._cv:
            retracted = list(self._active.values())
            for slot, req in sorted(self._active.items(), reverse=True):
                req.reset_for_retract()
                self._waiting.appendleft(req)
                self._free_slots.append(slot)
            self._active.clear()
        return retracted

    def take_all(self) -> list[Request]:
        """Remove every request, waiting and running (their slots freed); returns them, to be finished."""
        with self._cv:
            reqs = list(self._waiting) + list(self._active.values())
            self._waiting.clear()
            self._free_slots.extend(self._active)
            for req in self._active.values():
                req.slot = None
            self._active.clear()
        return reqs
