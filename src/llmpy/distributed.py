"""Data parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU), launched by torchrun.

One process a GPU. Every rank holds the whole model and runs its own slice of each batch (llm.c's
DataLoader convention: rank r's micro-step m reads window m*N + r of the step). The gradients are then
reduced in a FIXED order, so that N GPUs give bitwise the result of one GPU that runs the same global
batch as N accumulation steps:

- The flat parameter buffer is cut into chunks of NORM_CHUNK elements (the global norm's level-1
  blocks); rank r owns the contiguous chunks [r*C//N, (r+1)*C//N) (C chunks in all): its shard.
- all-to-all: every rank sends each owner that owner's shard of its local gradient; the owner adds the
  N pieces in rank order in fp32 - the same additions, in the same order, that one GPU makes when it
  accumulates N micro-steps into its fp32 accumulator (model.GPT2Model.train_step).
- `-z 0`: the reduced shards are all-gathered, every rank computes the norm and the AdamW update of the
  whole buffer exactly as one GPU does. `-z 1` (ZeRO-1): every rank keeps AdamW's m, v and the master
  weights of its shard only, computes the squared-norm partials of its chunks (all-gathered and summed
  in chunk order: the same bits as one GPU's two-level norm), updates its shard (stochastic rounding
  drawn by global element index) and all-gathers the updated parameters.

NCCL's own all-reduce would add in an order that depends on N and the algorithm; this scheme costs one
all-to-all plus one all-gather (the bytes of a ring all-reduce) and keeps bit-exactness across N.
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .errors import LlmpyError


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from the environment torchrun sets, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise LlmpyError("RANK / WORLD_SIZE / LOCAL_RANK must be integers (as torchrun sets them)") from None
    if world < 1 or not 0 <= rank < world:
        raise LlmpyError(f"RANK={rank} is not in 0..{world - 1} (WORLD_SIZE={world})")
    return rank, world, local


def shard_bounds(n: int, world: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's shard of an n-element buffer: whole chunks of `chunk` elements, rank r
    the chunks [r*C//N, (r+1)*C//N) of C = ceil(n / chunk); the last shard ends at n."""
    C = -(-n // chunk)
    return [(min(r * C // world * chunk, n), min((r + 1) * C // world * chunk, n)) for r in range(world)]


@dataclass
class DataParallel:
    """This process's place in the data-parallel group and the collectives the model needs."""
    rank: int
    world_size: int
    zero_stage: int = 0
    group: object = None
    _gather_buffers: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.zero_stage not in (0, 1):
            raise LlmpyError(f"-z {self.zero_stage}: must be 0 (all-reduce) or 1 (ZeRO-1 optimizer shards)")

    # -- collectives (every rank calls them in the same order)
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   async_op: bool = False):
        """inp's consecutive pieces of in_splits[r] elements to rank r; out gets out_splits[r] from rank r
        (async_op: returns the work to wait on; the wait orders the current stream after it)."""
        import torch.distributed as dist
        return dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=self.group, async_op=async_op)

    def all_gather_uneven(self, out: torch.Tensor, mine: torch.Tensor, bounds: list[tuple[int, int]],
                          keep: bool = True):
        """out[lo_r:hi_r] = rank r's `mine` for every r (the pieces may differ in length by a chunk: they
        travel padded to the longest, then are copied into place). keep: hold the padded buffers for the
        next call (every step); False for one-off gathers (checkpoints)."""
        import torch.distributed as dist
        longest = max(hi - lo for lo, hi in bounds)
        key = (out.dtype, out.device, longest)
        bufs = self._gather_buffers.get(key)
        if bufs is None:
            bufs = (torch.empty(longest, dtype=out.dtype, device=out.device),
                    torch.empty(self.world_size * longest, dtype=out.dtype, device=out.device))
            if keep:
                self._gather_buffers[key] = bufs
        send, recv = bufs
        send[:mine.numel()].copy_(mine)
        dist.all_gather_into_tensor(recv, send, group=self.group)
        for r, (lo, hi) in enumerate(bounds):
            out[lo:hi].copy_(recv[r * longest:r * longest + hi - lo])
        return out

    def all_gather_scalars(self, mine: torch.Tensor) -> torch.Tensor:
        """(N, k) of every rank's k-element tensor, rank order (small: loss sums)."""
        import torch.distributed as dist
        out = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(out, mine.contiguous().view(-1), group=self.group)
        return out.view(self.world_size, -1)

    def barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.group)


def init_data_parallel(device: str, zero_stage: int, timeout_s: float = 1800.0) -> DataParallel | None:
    """Join the torchrun group (NCCL for cuda, gloo for cpu) and pick this rank's GPU; None outside
    torchrun or with WORLD_SIZE=1 (plain single-process training)."""
    env = torchrun_env()
    if env is None:
        return None
    rank, world, local = env
    if world == 1:
        return None
    import torch.distributed as dist
    if device == "cuda":
        if not torch.cuda.is_available():
            raise LlmpyError("torchrun with --device cuda: no CUDA GPU is visible to torch")
        if local >= torch.cuda.device_count():
            raise LlmpyError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} GPU(s): "
                             f"--nproc_per_node must be at most the GPU count")
        torch.cuda.set_device(local)
    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": torch.device("cuda", local)} if device == "cuda" else {}
        # a rank waits for the others inside C++, where Python's signal handlers never run: when another rank
        # failed first, torchrun's SIGTERM went unanswered for its 30 s grace, until SIGKILL. Nothing is written
        # yet, so SIGTERM's default action (exit at once) is right while the group forms.
        in_main_thread = threading.current_thread() is threading.main_thread()
        old_sigterm = signal.signal(signal.SIGTERM, signal.SIG_DFL) if in_main_thread else None
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LlmpyError(f"joining the torchrun group ({backend}, rank {rank} of {world}) failed: "
                             f"{first[:200]}") from None
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, old_sigterm)
    return DataParallel(rank=rank, world_size=world, zero_stage=zero_stage)


# CUDA graphs that captured NCCL collectives hold the communicator: they must be freed before it is
# destroyed, or destroy_process_group waits forever. Models register their release here.
_release_before_shutdown: list = []


def release_before_shutdown(method) -> None:
    """Call the bound `method` (held weakly) before leaving the group."""
    _release_before_shutdown.append(weakref.WeakMethod(method))


def shutdown():
    import torch.distributed as dist
    try:  # on the way out of an error the device may be unusable: the error already raised is the one to see
        for ref in _release_before_shutdown:
            method = ref()
            if method is not None:
                method()
        if dist.is_available() and dist.is_initialized() and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except RuntimeError:
        pass
    _release_before_shutdown.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
