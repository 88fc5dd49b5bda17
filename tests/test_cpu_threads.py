"""torch's CPU thread count set for one thread (`mira_hf.cpu_threads`): the host-compute worker, the record encoders,
calibration and replay each set their own, and a thread the user starts meanwhile or afterwards still gets the
process's count."""

from concurrent.futures import ThreadPoolExecutor

import torch
from conftest import new_thread_cpu_threads, torch_threads

from mira_hf.cpu_threads import cpu_threads, own_cpu_threads


def test_a_block_sets_the_callers_count_only_and_restores_it():
    with torch_threads(3):
        with cpu_threads(1):
            assert torch.get_num_threads() == 1
            assert new_thread_cpu_threads() == 3  # a thread started meanwhile
        assert torch.get_num_threads() == 3 == new_thread_cpu_threads()


def test_workers_starting_at_once_each_keep_their_own_count_and_leave_the_process_count():
    with torch_threads(3):
        with ThreadPoolExecutor(4, initializer=own_cpu_threads, initargs=(1,)) as pool:
            counts = list(pool.map(lambda _: torch.get_num_threads(), range(16)))
        assert counts == [1] * 16
        assert new_thread_cpu_threads() == 3 == torch.get_num_threads()
