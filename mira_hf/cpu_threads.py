"""torch's CPU thread count for one thread, without changing the count every later thread starts with.

`torch.set_num_threads` sets the calling thread's count and also the process-wide one that each thread started
afterwards begins with. Called in a worker thread (the host-compute worker, the record encoders), it would hand the
worker's count to every thread the user starts later (a server's request threads): slower where it is smaller, and
rounding otherwise than the main thread where a CPU kernel splits its sums by thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_lock = threading.Lock()  # workers starting at once: each reads the process-wide count before any of them sets it


def own_cpu_threads(n: int) -> None:
    """torch's CPU threads for the calling thread only: the process-wide count is read before and set back after,
    each in a thread of its own that then ends (a thread's first use of torch takes that count)."""
    with _lock:
        before: list[int] = []
        _in_new_thread(lambda: before.append(torch.get_num_threads()))
        torch.get_num_threads()  # this thread's first use takes the process-wide count: now, not after n is set
        torch.set_num_threads(n)
        _in_new_thread(lambda: torch.set_num_threads(before[0]))


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """torch's CPU threads for the calling thread set to `n` for the block, then restored; threads started
    meanwhile get the process's count, not `n`."""
    before = torch.get_num_threads()
    own_cpu_threads(n)
    try:
        yield
    finally:
        own_cpu_threads(before)


def _in_new_thread(fn: Callable[[], object]) -> None:
    thread = threading.Thread(target=fn, name="mira-threads")
    thread.start()
    thread.join()
