"""The device waits for the host, and the thread that drives the device does not.

A host job's outputs (`host_compute`) join the block's device work at its combine. Waiting for them on the thread
that drives the device holds back everything that thread would queue meanwhile: the combine, the next layer's
launches, the staging of the next layers' guesses. Instead, the stream is told to wait until a counter in
page-locked host memory reaches the job's number (the CUDA driver's `cuStreamWaitValue32`); the host worker writes
the number once the job's outputs are in their page-locked buffer, and the copy of those outputs to the device,
queued right after the wait, reads them then. The arithmetic is the same; only who waits changes.

`HostFlag.open(device)` gives the counter of one device, or None where the driver lacks the call or refuses a wait
on host memory (a CPU build, another vendor's device): jobs are then collected on the host as before.
"""

from __future__ import annotations

import ctypes
import threading

import torch

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, a cyclic comparison (wraparound is fine)
_MASK = 2**32 - 1

_driver_lock = threading.Lock()
_driver: tuple | None | bool = False  # False: not looked up yet


def _driver_calls():
    """(cuStreamWaitValue32, cuMemHostGetDevicePointer) of the CUDA driver, or None."""
    global _driver
    with _driver_lock:
        if _driver is False:
            _driver = None
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                return None
            wait = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
            devptr = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or getattr(lib, "cuMemHostGetDevicePointer", None)
            if wait is not None and devptr is not None:
                wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                wait.restype = ctypes.c_int
                devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
                devptr.restype = ctypes.c_int
                _driver = (wait, devptr)
        return _driver


class HostFlag:
    """A job counter in page-locked host memory that one device's streams can wait on.

    `next()` numbers a job (on the thread that drives the device); `device_waits(n)` makes the current stream
    wait until job n is done; `done(n)` (on the worker, after the job's outputs are written, whatever happened)
    releases every wait up to n. Jobs are done in the order they are numbered (one worker)."""

    def __init__(self, device: torch.device, wait, address: int, counter: torch.Tensor) -> None:
        self.device, self._wait, self._address, self._counter = device, wait, address, counter
        self._view = counter.numpy()  # written from the worker without a torch op
        self._issued = 0

    @classmethod
    def open(cls, device: torch.device) -> HostFlag | None:
        """The flag of CUDA `device`, or None where its streams cannot wait on host memory."""
        if device.type != "cuda" or torch.version.cuda is None:
            return None
        calls = _driver_calls()
        if calls is None:
            return None
        wait, devptr = calls
        counter = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # mapped into the device's address space
        address = ctypes.c_uint64()
        if devptr(ctypes.byref(address), ctypes.c_void_p(counter.data_ptr()), 0) != 0:
            return None
        flag = cls(device, wait, address.value, counter)
        with torch.cuda.device(device):
            if flag._queue(0) != 0:  # met at once (the counter is 0): only whether the stream accepts it
                return None
        return flag

    def next(self) -> int:
        """The number of the next job."""
        self._issued = (self._issued + 1) & _MASK
        return self._issued

    def device_waits(self, job: int) -> None:
        """The current stream of the device waits (without the host waiting) until job `job` is done."""
        if self._queue(job) != 0:
            raise RuntimeError(f"cuStreamWaitValue32 refused a wait on {self.device}")

    def done(self, job: int) -> None:
        """Job `job` is done (its outputs written, or it failed): the device may go on."""
        self._view[0] = job if job < 2**31 else job - 2**32  # the same 32 bits, as int32

    def _queue(self, job: int) -> int:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        return self._wait(ctypes.c_void_p(stream), self._address, job, WAIT_GEQ)
