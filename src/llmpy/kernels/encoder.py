"""Token + position embedding forward, and its backward without atomics, as llm.c's llmc/encoder.cuh.

Forward: out[b, t] = wte[inp[b, t]] + wpe[t], a gather and an add over [ROWS, BLOCK_C] tiles (the x128
loads of llm.c become vectorised loads of contiguous column ranges), fp32 add, one store.

Backward, accumulating (dwte += ..., dwpe += ..., as gradient accumulation needs), bitwise reproducible:

- dwpe[t] += sum over b of dout[b, t]: one program per [ROWS_T, BLOCK_C] tile of positions, summing the
  batch in order (a few batches loaded per iteration so loads overlap).
- dwte: llm.c sorts the positions into buckets by token id on the CPU and gives each bucket a block.
  Here the sort runs on the device (torch.sort, stable, into preallocated outputs), so there is no host
  sync and the step can be captured in a CUDA graph (torch.sort's temporary storage comes from the
  caching allocator, which capture supports). The sorted positions are then cut into pieces: a piece starts at the
  first position of a run of equal ids, and again at every multiple of PIECE inside a run, so no piece is
  longer than PIECE rows. A common token (hundreds or thousands of occurrences in a batch) is therefore
  summed by many programs in parallel instead of one long serial walk.
  * kernel 1, one program per sorted position (only piece heads work): sums the dout rows of its piece in
    a fixed order (TILE rows loaded at once, accumulated per lane, then reduced). A run that fits in one
    piece is finished here: dwte[id] = dwte[id] + sum, written once. Otherwise the piece's sum goes to a
    small fp32 scratch: each PIECE-aligned block of sorted positions has two slots, slot 0 for the
    continuation piece that starts exactly at the block boundary, slot 1 for the first piece of a run
    that starts inside the block and runs past its end (at most one of each per block).
  * kernel 2, one program per block: if a run starts in the block and crosses its end, adds the run's
    first partial and the slot-0 partials of the following blocks it covers (fixed order), plus the
    existing dwte row, and writes the row once.
  Columns are split over a second grid axis (blocks of up to 256 channels), so a big C needs no loop
  and the work of one long run is spread further. Every output row is written by exactly one program,
  in a fixed order of additions: no atomics, same bits run after run.

bf16 gradients are written with stochastic rounding keyed by (seed, element index in the [wte; wpe]
concatenation, as in llm.c's flat parameter buffer), fp32 ones with a plain store.

The seed may be a Python int or a 1-element int64 device tensor (read inside the kernel, so a captured
graph picks up a fresh seed written into it each step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import cdiv, store_rounded

# longest run of equal ids one program sums in kernel 1; runs longer than this are split
ENC_PIECE = 256
# rows of a piece loaded at once (the gather is TILE independent row loads in flight)
ENC_TILE = 16
# kernel 2 adds this many slot-0 partials per iteration
ENC_COMBINE_TILE = 8
# batches loaded per iteration of the dwpe loop
ENC_WPE_UNROLL = 4


# ----------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _load_seed(seed, SEED_IS_PTR: tl.constexpr):
    if SEED_IS_PTR:
        return tl.load(seed)
    else:
        return seed


@triton.jit
def _encoder_forward_kernel(out_ptr, inp_ptr, wte_ptr, wpe_ptr, N, T, C,
                            ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < N
    col_ok = cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    tok = tl.load(inp_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    t = (rows % T).to(tl.int64)
    # wpe rows are shared by every batch element: keep them in cache
    w = tl.load(wte_ptr + tok[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.load(wpe_ptr + t[:, None] * C + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_last").to(tl.float32)
    out_offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    tl.store(out_ptr + out_offs, (w + p).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wpe_backward_kernel(dwpe_ptr, dout_ptr, seed, B, T, C, stride_b, wte_numel,
                         ROWS_T: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
                         STOCHASTIC: tl.constexpr, SEED_IS_PTR: tl.constexpr):
    t = tl.program_id(0) * ROWS_T + tl.arange(0, ROWS_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (t < T)[:, None] & (cols < C)[None, :]
    offs = t.to(tl.int64)[:, None] * C + cols[None, :]
    acc = tl.zeros([ROWS_T, BLOCK_C], dtype=tl.float32)
    for b0 in range(0, B, UNROLL):
        # UNROLL independent loads per iteration, then added in batch order: sum over b in order
        for k in tl.static_range(UNROLL):
            b = b0 + k
            # b < B tested as row b*T + t < B*T: a full-shaped mask (the interpreter mis-types
            # a scalar condition and-ed into a tensor mask)
            bt = b * T + t
            x = tl.load(dout_ptr + b.to(tl.int64) * stride_b + offs, mask=(bt < B * T)[:, None] & mask,
                        other=0.0, eviction_policy="evict_first")
            acc += x.to(tl.float32)
    old = tl.load(dwpe_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = _load_seed(seed, SEED_IS_PTR)
    # wpe follows wte in the flat parameter buffer: distinct random streams for the two
    store_rounded(dwpe_ptr + offs, old + acc, mask, s, wte_numel + offs, STOCHASTIC)


@triton.jit
def _wte_backward_pieces_kernel(dwte_ptr, partial_ptr, dout_ptr, sorted_ptr, perm_ptr, seed, N, C,
                                PIECE: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr,
                                STOCHASTIC: tl.constexpr, SEED_IS_PTR: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    tok = tl.load(sorted_ptr + i)
    prev = tl.load(sorted_ptr + i - 1, mask=i > 0, other=-1)
    is_start = tok != prev
    is_cont = (tok == prev) & (i % PIECE == 0)
    if is_start | is_cont:
        # the piece ends at the run's end or at the next multiple of PIECE, whichever is first
        limit = tl.minimum(N, (i // PIECE + 1) * PIECE)
        acc = tl.zeros([TILE, BLOCK_C], dtype=tl.float32)
        j = i
        more = j < limit
        while more:
            js = j + tl.arange(0, TILE)
            ok = js < limit
            ids = tl.load(sorted_ptr + js, mask=ok, other=-1)
            ok = ok & (ids == tok)  # sorted ids: the rows of the run are a prefix of the tile
            src = tl.load(perm_ptr + js, mask=ok, other=0).to(tl.int64)
            x = tl.load(dout_ptr + src[:, None] * C + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
            acc += x.to(tl.float32)
            j += TILE
            more = (tl.sum(ok.to(tl.int32), axis=0) == TILE) & (j < limit)
        total = tl.sum(acc, axis=0)
        # does the run go on past this piece? (ids are sorted, so sorted[limit] == tok means it does)
        nxt = tl.load(sorted_ptr + limit, mask=limit < N, other=-1)
        if is_start & (nxt != tok):
            # the whole run is this piece: finish the row now
            row = tok.to(tl.int64) * C + cols
            old = tl.load(dwte_ptr + row, mask=col_ok, other=0.0).to(tl.float32)
            store_rounded(dwte_ptr + row, old + total, col_ok, _load_seed(seed, SEED_IS_PTR), row, STOCHASTIC)
        else:
            # a continuation piece (slot 0), or the first piece of a run that crosses the block's end (slot 1)
            slot = 2 * (i // PIECE) + tl.where(is_cont, 0, 1)
            tl.store(partial_ptr + slot.to(tl.int64) * C + cols, total, mask=col_ok)


@triton.jit
def _wte_backward_combine_kernel(dwte_ptr, partial_ptr, sorted_ptr, seed, N, C,
                                 PIECE: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr,
                                 STOCHASTIC: tl.constexpr, SEED_IS_PTR: tl.constexpr):
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    first = blk * PIECE
    end = (blk + 1) * PIECE
    tok = tl.load(sorted_ptr + tl.minimum(N, end) - 1)  # the run holding the block's last position
    before = tl.load(sorted_ptr + first - 1, mask=blk > 0, other=-1)
    after = tl.load(sorted_ptr + end, mask=end < N, other=-1)
    # that run started inside this block and goes on past its end: this program owns it
    if (before != tok) & (after == tok):
        acc = tl.zeros([TILE, BLOCK_C], dtype=tl.float32)
        b = blk + 1
        more = b * PIECE < N
        while more:
            bs = b + tl.arange(0, TILE)
            pos = bs * PIECE
            ids = tl.load(sorted_ptr + pos, mask=pos < N, other=-1)
            ok = (pos < N) & (ids == tok)  # block bs holds a continuation piece of the run in slot 0
            x = tl.load(partial_ptr + (2 * bs).to(tl.int64)[:, None] * C + cols[None, :],
                        mask=ok[:, None] & col_ok[None, :], other=0.0)
            acc += x
            b += TILE
            more = (tl.sum(ok.to(tl.int32), axis=0) == TILE) & (b * PIECE < N)
        head = tl.load(partial_ptr + (2 * blk + 1).to(tl.int64) * C + cols, mask=col_ok, other=0.0)
        total = head + tl.sum(acc, axis=0)
        row = tok.to(tl.int64) * C + cols
        old = tl.load(dwte_ptr + row, mask=col_ok, other=0.0).to(tl.float32)
        store_rounded(dwte_ptr + row, old + total, col_ok, _load_seed(seed, SEED_IS_PTR), row, STOCHASTIC)


# ----------------------------------------------------------------------------------------------------
# launchers

def _tiles(C: int, elems: int = 2048):
    """(ROWS, BLOCK_C) for a [ROWS, BLOCK_C] tile of about `elems` elements over rows of C channels."""
    block_c = min(triton.next_power_of_2(C), 256)
    return max(1, elems // block_c), block_c


def _seed_args(seed):
    if isinstance(seed, torch.Tensor):
        assert seed.numel() == 1 and seed.dtype in (torch.int32, torch.int64), "seed: a 1-element int tensor"
        return seed, True
    return int(seed), False


def encoder_forward(out: torch.Tensor, inp: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor):
    """out (B, T, C) = wte[inp] + wpe[:T]; inp (B, T) int32/int64 ids, wte (Vp, C), wpe (maxT, C). Returns out."""
    B, T = inp.shape
    C = wte.shape[1]
    assert out.shape == (B, T, C) and wpe.shape[1] == C and wpe.shape[0] >= T
    assert out.dtype == wte.dtype == wpe.dtype and out.dtype in (torch.float32, torch.bfloat16)
    assert inp.dtype in (torch.int32, torch.int64)
    assert all(x.is_contiguous() for x in (out, inp, wte, wpe))
    N = B * T
    rows, block_c = _tiles(C)
    _encoder_forward_kernel[(cdiv(N, rows), cdiv(C, block_c))](out, inp, wte, wpe, N, T, C,
                                                                ROWS=rows, BLOCK_C=block_c, num_warps=4)
    return out


@dataclass
class EncoderBackwardScratch:
    """Preallocated work buffers of encoder_backward (so a captured step allocates nothing)."""
    sorted_ids: torch.Tensor  # (B*T,) the ids sorted, dtype of inp
    perm: torch.Tensor        # (B*T,) int64: position of each sorted id
    partial: torch.Tensor     # (2 * cdiv(B*T, piece), C) fp32 piece sums of long runs


def encoder_backward_scratch(B: int, T: int, C: int, device, ids_dtype=torch.int32,
                             piece: int = ENC_PIECE) -> EncoderBackwardScratch:
    N = B * T
    return EncoderBackwardScratch(
        sorted_ids=torch.empty(N, dtype=ids_dtype, device=device),
        perm=torch.empty(N, dtype=torch.int64, device=device),
        partial=torch.empty(2 * cdiv(N, piece), C, dtype=torch.float32, device=device),
    )


def encoder_backward(dwte: torch.Tensor, dwpe: torch.Tensor, dout: torch.Tensor, inp: torch.Tensor, seed,
                     scratch: EncoderBackwardScratch | None = None, stochastic: bool = True,
                     piece: int = ENC_PIECE):
    """dwte (Vp, C) += scatter of dout (B, T, C) by the ids inp (B, T); dwpe (maxT, C)[:T] += dout summed over B.

    Deterministic and atomic-free (see the module docstring). seed: int or 1-element int64 device tensor
    for the stochastic rounding of bf16 gradients (stochastic=False: round to nearest). scratch: from
    encoder_backward_scratch (allocated here when None, which a captured step must avoid). The sort is
    torch.sort on the device: no host sync. piece: the longest run one program sums (the
    tests make it small to reach the split path on tiny inputs). Returns (dwte, dwpe).
    """
    B, T, C = dout.shape
    N = B * T
    assert inp.shape == (B, T) and inp.dtype in (torch.int32, torch.int64)
    assert dwte.shape[1] == C and dwpe.shape[1] == C and dwpe.shape[0] >= T
    assert dwte.dtype == dwpe.dtype == dout.dtype and dout.dtype in (torch.float32, torch.bfloat16)
    assert all(x.is_contiguous() for x in (dwte, dwpe, dout, inp))
    if scratch is None:
        scratch = encoder_backward_scratch(B, T, C, dout.device, inp.dtype, piece)
    assert scratch.sorted_ids.shape == (N,) and scratch.sorted_ids.dtype == inp.dtype
    assert scratch.perm.shape == (N,) and scratch.partial.shape == (2 * cdiv(N, piece), C)
    assert piece >= 1
    seed_arg, seed_is_ptr = _seed_args(seed)
    sr = stochastic and dout.dtype == torch.bfloat16
    rows, block_c = _tiles(C)
    n_col = cdiv(C, block_c)

    _wpe_backward_kernel[(cdiv(T, rows), n_col)](
        dwpe, dout, seed_arg, B, T, C, T * C, dwte.numel(), ROWS_T=rows, BLOCK_C=block_c, UNROLL=ENC_WPE_UNROLL,
        STOCHASTIC=sr, SEED_IS_PTR=seed_is_ptr, num_warps=4)

    # stable: equal ids keep position order, so every run is summed in the same order every time
    torch.sort(inp.reshape(-1), stable=True, out=(scratch.sorted_ids, scratch.perm))
    _wte_backward_pieces_kernel[(N, n_col)](
        dwte, scratch.partial, dout, scratch.sorted_ids, scratch.perm, seed_arg, N, C,
        PIECE=piece, TILE=ENC_TILE, BLOCK_C=block_c, STOCHASTIC=sr, SEED_IS_PTR=seed_is_ptr, num_warps=4)
    _wte_backward_combine_kernel[(cdiv(N, piece), n_col)](
        dwte, scratch.partial, scratch.sorted_ids, seed_arg, N, C,
        PIECE=piece, TILE=ENC_COMBINE_TILE, BLOCK_C=block_c, STOCHASTIC=sr, SEED_IS_PTR=seed_is_ptr,
        num_warps=4)
    return dwte, dwpe
