"""Page-locked host memory of exactly the size asked for.

torch's pinned allocator (`pin_memory=True`) rounds every block up to the next power of two and keeps
freed blocks cached for reuse (pytorch#95823, #150517): a 2.8 GB layer of Mixtral experts locks 4 GB
of RAM, and a whole store up to twice its size, which stays locked after the model is gone. Expert
slabs are allocated once and live as long as the model, so they are page-locked in place instead
(`cudaHostRegister` on ordinary memory): exactly their size, unlocked and returned to the OS when the
last view of them is freed. Where registering is not available, torch's allocator is the fallback.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

PAGE = 4096
# Below this, torch's allocator wastes little and caches well (small staging buffers).
REGISTER_MIN_BYTES = 8 * 2**20


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in page-locked host memory (a CUDA build with a device is needed)."""
    cudart = _cudart() if nbytes >= REGISTER_MIN_BYTES else None
    if cudart is None:
        return _torch_pinned(nbytes)
    owner = np.empty(nbytes + PAGE, dtype=np.uint8)  # pageable, not touched yet: registering faults it in
    start = -owner.ctypes.data % PAGE  # page-aligned start: the copy engine reads whole pages
    ptr = owner.ctypes.data + start
    if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:  # 0: cudaSuccess
        del owner
        return _torch_pinned(nbytes)
    # Unlocked when numpy frees the memory: the tensor's storage holds `owner` until its last view is gone.
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
    return torch.from_numpy(owner)[start : start + nbytes]


def _torch_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _cudart():
    """torch's CUDA runtime bindings, or None on a build or machine without them."""
    try:
        cudart = torch.cuda.cudart()
    except Exception:  # CPU build, no driver, or no device
        return None
    if not hasattr(cudart, "cudaHostRegister") or not hasattr(cudart, "cudaHostUnregister"):
        return None
    return cudart
