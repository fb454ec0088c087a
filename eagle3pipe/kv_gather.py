"""Copying one request's hidden states out of vLLM's hidden-state cache, in the stored dtype (the connector's
device work, kept free of vLLM imports so it is tested on a GPU without a server).

The cache the ``extract_hidden_states`` method fills holds, per block, ``block size`` slots of n states of H values,
in one of two layouts (``vllm_internals.states_block_dim`` tells which from what the server exposes):

- [blocks, block size, n states, H] (block dim 1): vLLM 0.26-0.28, whose example connector asks for "NHD";
- [blocks, n states, block size, H] (block dim 2): vLLM 0.29-0.34, "LBNHC" (the logical view of every
  layout from 0.29 on).

A request's rows are its blocks' slots, in order, cut at its token count: [T, n, H] either way.
"""

from __future__ import annotations

import torch

from .records import quantize_hidden_states


class Done:
    """Stands in for the CUDA event of a copy that already happened (CPU): callers ``query()`` or
    ``synchronize()`` it like an event."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def request_slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order. [len(block_ids) * block_size] int64 (CPU)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size, dtype=torch.long)[None, :]).flatten()


def cache_rows(cache: torch.Tensor, slots: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The rows of ``slots`` (slot = block * block size + offset) out of ``cache``, whose block offset is dimension
    ``block_dim`` (1 or 2): [len(slots), n, H], a copy."""
    block_size = cache.shape[block_dim]
    blocks, offsets = slots // block_size, slots % block_size
    if block_dim == 1:
        return cache[blocks, offsets]
    if block_dim == 2:
        return cache[blocks, :, offsets]  # the two index tensors, split by a slice, lead the result: [T, n, H]
    raise ValueError(f"block_dim must be 1 or 2, got {block_dim}")


def to_storage(states: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States in the stored dtype: bf16 (cast), or fp8 values and their per-(token, state) scales."""
    if dtype == "fp8":
        return quantize_hidden_states(states)
    return states.to(torch.bfloat16), None


def gather_states(cache: torch.Tensor, slots: torch.Tensor, num_tokens: int, dtype: str,
                  stream: "torch.cuda.Stream | None" = None, block_dim: int = 2):
    """(event, states [T, n, H], scales [T, n, 1] | None, finite [1] bool), all on the host; ``block_dim``: which
    dimension of ``cache`` is the offset inside a block (see the module docstring).

    On a GPU the gather, the fp8 quantisation (half the bytes to copy out) and the copy into pinned host memory run
    on ``stream`` after the work already queued on the cache's current stream; nothing waits here: the caller
    (a writer thread) synchronises the returned event before reading the host tensors. On CPU it is done at once.
    """
    if cache.device.type != "cuda":
        states = cache_rows(cache, slots[:num_tokens], block_dim)  # [T, n, H]
        finite = torch.isfinite(states).all().reshape(1)
        states, scales = to_storage(states, dtype)
        return Done(), states, scales, finite
    stream.wait_stream(torch.cuda.current_stream(cache.device))
    with torch.cuda.stream(stream):
        # allocated on this stream: the caching allocator reuses them only after this stream's copies are done
        slots = slots.to(cache.device, non_blocking=True)
        states = cache_rows(cache, slots[:num_tokens], block_dim)
        flag = torch.isfinite(states).all().reshape(1)
        states, scales = to_storage(states, dtype)
        out = []
        for t in (states, scales, flag):
            if t is None:
                out.append(None)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        event = torch.cuda.Event()
        event.record(stream)
    return event, out[0], out[1], out[2]
