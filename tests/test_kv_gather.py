"""The connector's device work (kv_gather.py): a request's rows out of vLLM's hidden-state cache, in the stored
dtype, on CPU and on a GPU (side stream, pinned host copies, an event the writer waits on).

The reference is written independently: token t of a request sits in block ``block_ids[t // block_size]`` at
offset ``t % block_size``, all states of that slot. The GPU test is marked ``gpu`` and runs on the device machine
(`pytest -m gpu tests/test_kv_gather.py`); on a machine without CUDA it is reported as skipped, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from eagle3pipe.kv_gather import gather_states, request_slots
from eagle3pipe.records import FP8_MAX

BLOCKS, STATES, BLOCK_SIZE, HIDDEN = 9, 4, 16, 64
BLOCK_IDS, NUM_TOKENS = [7, 2, 5], 37  # the last block is partly used


def reference(cache: torch.Tensor) -> torch.Tensor:
    rows = [cache[BLOCK_IDS[t // BLOCK_SIZE], :, t % BLOCK_SIZE] for t in range(NUM_TOKENS)]
    return torch.stack(rows)  # [T, n, H]


def _check(cache: torch.Tensor, expected_cache: torch.Tensor, stream=None) -> None:
    slots = request_slots(BLOCK_IDS, BLOCK_SIZE)
    ref = reference(expected_cache).float()
    event, states, scales, finite = gather_states(cache, slots, NUM_TOKENS, "bf16", stream)
    event.synchronize()
    assert states.device.type == "cpu" and states.dtype == torch.bfloat16 and scales is None and bool(finite)
    assert torch.equal(states, ref.bfloat16())
    event, states, scales, finite = gather_states(cache, slots, NUM_TOKENS, "fp8", stream)
    event.synchronize()
    assert states.dtype == torch.float8_e4m3fn and scales.shape == (NUM_TOKENS, STATES, 1)
    torch.testing.assert_close(scales, ref.abs().amax(-1, keepdim=True) / FP8_MAX)  # one scale per token and state
    restored = states.float() * scales
    assert ((restored - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.05


def _cache(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-1, 2, STATES).view(1, STATES, 1, 1)  # states of very different size, as in DeepSeek
    return (torch.randn(BLOCKS, STATES, BLOCK_SIZE, HIDDEN, generator=g) * scale).bfloat16().to(device)


def test_gather_on_cpu():
    cache = _cache("cpu")
    _check(cache, cache)
    cache[BLOCK_IDS[1], 2, 3, 0] = float("nan")
    assert not bool(gather_states(cache, request_slots(BLOCK_IDS, BLOCK_SIZE), NUM_TOKENS, "bf16")[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on the device machine")
def test_gather_on_gpu_waits_for_the_forward_and_copies_on_a_side_stream():
    cache = torch.zeros(BLOCKS, STATES, BLOCK_SIZE, HIDDEN, dtype=torch.bfloat16, device="cuda")
    values = _cache("cpu")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    # the "forward" fills the cache on the current stream behind a long wait: the gather, on its own stream, must
    # see those writes (it waits for the current stream) and the host copies must be complete after its event
    torch.cuda._sleep(200_000_000)
    cache.copy_(values.pin_memory(), non_blocking=True)  # from pinned memory: queued, not done, when this returns
    assert not torch.cuda.current_stream().query()  # the writes are still queued when the gather is issued
    _check(cache, values, side)
