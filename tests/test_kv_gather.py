"""The connector's device work (kv_gather.py): a request's rows out of vLLM's hidden-state cache, in the stored
dtype, on CPU and on a GPU (side stream, pinned host copies, an event the writer waits on), in both layouts vLLM
uses: [blocks, n states, block size, H] (0.29-0.34) and [blocks, block size, n states, H] (0.26-0.28), with the
layout chosen as the connector chooses it (``vllm_internals.states_block_dim``: the layout name the parent asks vLLM
for, checked against the cache's shape).

The reference is written independently: token t of a request sits in block ``block_ids[t // block_size]`` at
offset ``t % block_size``, all states of that slot, read with plain per-token indexing of a cache built in each
layout from the same values. The GPU test is marked ``gpu`` and runs on the device machine
(`pytest -m gpu tests/test_kv_gather.py`); on a machine without CUDA it is reported as skipped, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from eagle3pipe.kv_gather import gather_states, request_slots
from eagle3pipe.records import FP8_MAX
from eagle3pipe.vllm_internals import VllmInternalsError, states_block_dim

BLOCKS, STATES, BLOCK_SIZE, HIDDEN = 9, 4, 16, 64
BLOCK_IDS, NUM_TOKENS = [7, 2, 5], 37  # the last block is partly used


def reference(cache: torch.Tensor) -> torch.Tensor:
    """From a cache in the 0.29-0.34 layout [blocks, n, block size, H]."""
    rows = [cache[BLOCK_IDS[t // BLOCK_SIZE], :, t % BLOCK_SIZE] for t in range(NUM_TOKENS)]
    return torch.stack(rows)  # [T, n, H]


def reference_026(cache: torch.Tensor) -> torch.Tensor:
    """From a cache in the 0.26-0.28 layout [blocks, block size, n, H]."""
    rows = [cache[BLOCK_IDS[t // BLOCK_SIZE], t % BLOCK_SIZE] for t in range(NUM_TOKENS)]
    return torch.stack(rows)


def _check(cache: torch.Tensor, expected_cache: torch.Tensor, stream=None, block_dim: int = 2) -> None:
    slots = request_slots(BLOCK_IDS, BLOCK_SIZE)
    ref = (reference if block_dim == 2 else reference_026)(expected_cache).float()
    event, states, scales, finite = gather_states(cache, slots, NUM_TOKENS, "bf16", stream, block_dim)
    event.synchronize()
    assert states.device.type == "cpu" and states.dtype == torch.bfloat16 and scales is None and bool(finite)
    assert torch.equal(states, ref.bfloat16())
    event, states, scales, finite = gather_states(cache, slots, NUM_TOKENS, "fp8", stream, block_dim)
    event.synchronize()
    assert states.dtype == torch.float8_e4m3fn and scales.shape == (NUM_TOKENS, STATES, 1)
    torch.testing.assert_close(scales, ref.abs().amax(-1, keepdim=True) / FP8_MAX)  # one scale per token and state
    restored = states.float() * scales
    assert ((restored - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.05


def _cache(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-1, 2, STATES).view(1, STATES, 1, 1)  # states of very different size, as in DeepSeek
    return (torch.randn(BLOCKS, STATES, BLOCK_SIZE, HIDDEN, generator=g) * scale).bfloat16().to(device)


def _cache_026(cache: torch.Tensor) -> torch.Tensor:
    """The same values laid out as vLLM 0.26-0.28 keep them: [blocks, block size, n, H], contiguous."""
    return cache.transpose(1, 2).contiguous()


def test_gather_on_cpu():
    cache = _cache("cpu")
    _check(cache, cache)
    cache[BLOCK_IDS[1], 2, 3, 0] = float("nan")
    assert not bool(gather_states(cache, request_slots(BLOCK_IDS, BLOCK_SIZE), NUM_TOKENS, "bf16")[3])


@pytest.mark.parametrize("layout", ["NHD", "LBNHC"])
def test_each_vllm_layout_is_read_as_that_version_lays_it_out(layout):
    """vLLM 0.26-0.28 (its example connector asks for "NHD") keeps [blocks, block size, n, H]; 0.29-0.34 ("LBNHC")
    [blocks, n, block size, H]. The dimension the connector picks for each must give the request's own rows (an
    independent per-token indexing of that layout); the other layout's dimension must not (the bug seen on the H200
    with vLLM 0.26: [T, 16, H] files instead of [T, 4, H])."""
    values = _cache("cpu")
    cache = values if layout == "LBNHC" else _cache_026(values)
    assert cache.shape == ((BLOCKS, STATES, BLOCK_SIZE, HIDDEN) if layout == "LBNHC"
                           else (BLOCKS, BLOCK_SIZE, STATES, HIDDEN))
    dim = states_block_dim(layout, tuple(cache.shape), BLOCK_SIZE, STATES)
    _check(cache, cache, block_dim=dim)
    assert torch.equal(reference(values), reference_026(_cache_026(values)))  # the same rows in both layouts
    # read as the other layout (a cache with enough blocks that no index runs out): the states dimension is taken
    # for the block size, and [T, block size, H] comes out, as the 0.32-only gather wrote on vLLM 0.26
    big = torch.randn((64,) + tuple(cache.shape[1:])).bfloat16()
    states = gather_states(big, request_slots(BLOCK_IDS, BLOCK_SIZE), NUM_TOKENS, "bf16", None, 3 - dim)[1]
    assert tuple(states.shape) == (NUM_TOKENS, BLOCK_SIZE, HIDDEN)


def test_layout_choice_is_checked_against_the_cache_shape():
    new, old = (BLOCKS, STATES, BLOCK_SIZE, HIDDEN), (BLOCKS, BLOCK_SIZE, STATES, HIDDEN)
    assert states_block_dim("LBNHC", new, BLOCK_SIZE, STATES) == 2
    assert states_block_dim("NHD", old, BLOCK_SIZE, STATES) == 1
    for layout, shape in (("LBNHC", old), ("NHD", new), ("HND", new), (None, new), ("NHD", (BLOCKS, 64, HIDDEN))):
        with pytest.raises(VllmInternalsError, match="cannot read vLLM's hidden-state cache"):
            states_block_dim(layout, shape, BLOCK_SIZE, STATES)
    with pytest.raises(VllmInternalsError, match="4 states per token"):  # other state count than the server's ids
        states_block_dim("LBNHC", (BLOCKS, 3, BLOCK_SIZE, HIDDEN), BLOCK_SIZE, STATES)


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
    # vLLM 0.26-0.28's layout on the GPU path
    old = _cache_026(values).cuda()
    torch.cuda.synchronize()
    _check(old, old.cpu(), side, block_dim=states_block_dim("NHD", tuple(old.shape), BLOCK_SIZE, STATES))
