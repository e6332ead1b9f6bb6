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

import contextlib
import datetime
import os
import select
import signal
import sys
import threading
import time
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


def _all_gather_single(dist):
    """torch's gather of equal-sized tensors into one: all_gather_single where torch has it (its
    all_gather_into_tensor, the same call, warns there that it is deprecated), else all_gather_into_tensor."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
        _all_gather_single(dist)(recv, send, group=self.group)
        for r, (lo, hi) in enumerate(bounds):
            out[lo:hi].copy_(recv[r * longest:r * longest + hi - lo])
        return out

    def all_gather_scalars(self, mine: torch.Tensor) -> torch.Tensor:
        """(N, k) of every rank's k-element tensor, rank order (small: loss sums)."""
        import torch.distributed as dist
        out = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_single(dist)(out, mine.contiguous().view(-1), group=self.group)
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
        count = torch.cuda.device_count()
        if local >= count and count == 1:  # a launcher that shows each process its own GPU (CUDA_VISIBLE_DEVICES)
            local = 0
        elif local >= count:
            name = "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "RANK (no LOCAL_RANK given)"
            raise LlmpyError(f"{name}={local} but this node has {count} GPU(s): --nproc_per_node must be at most "
                             "the GPU count")
        torch.cuda.set_device(local)
    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": torch.device("cuda", local)} if device == "cuda" else {}
        # a rank waits for the others inside C++, where Python's signal handlers never run: when another rank
        # failed first, torchrun's SIGTERM went unanswered for its 30 s grace, until SIGKILL, and a Ctrl-C (which
        # torchrun passes on as SIGINT) until the group's timeout. Nothing is written yet, so the signals' default
        # action (exit at once) is right while the group forms.
        in_main_thread = threading.current_thread() is threading.main_thread()
        stopping = (signal.SIGINT, signal.SIGTERM)
        old_handlers = [signal.signal(sig, signal.SIG_DFL) for sig in stopping] if in_main_thread else []
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
        except (RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LlmpyError(f"joining the torchrun group ({backend}, rank {rank} of {world}) failed: "
                             f"{first[:200]}") from None
        finally:
            for sig, handler in zip(stopping, old_handlers):
                signal.signal(sig, handler)
    _watch_for_a_stuck_wait(rank, world)
    return DataParallel(rank=rank, world_size=world, zero_stage=zero_stage)


# How long the main thread may sit in one call after SIGINT/SIGTERM before StuckRankWatch ends the process: under
# torchrun's 30 s grace before SIGKILL, and above any wait of a healthy run outside the stretches marked patient(),
# or STEP_WAIT_FACTOR times the longest step seen (note_step_seconds), if longer: a graphed step is one wait.
STUCK_AFTER_SIGNAL_S = 10.0
STEP_WAIT_FACTOR = 3.0
# The same inside patient(): above rank 0's write of a large checkpoint, which the others wait for at the barrier.
PATIENT_STUCK_AFTER_SIGNAL_S = 120.0


class StuckRankWatch:
    """Ends a rank that waits for a peer which will never come, when a signal asks it to stop.

    Python runs a signal's handler in the main thread, between bytecodes; a rank inside a collective waits in
    C++ (gloo, NCCL, a CUDA synchronisation behind a graph of NCCL kernels), where it never gets there. When
    another rank has failed, torchrun's SIGTERM then goes unanswered until its SIGKILL 30 s later, and a
    SIGTERM or Ctrl-C sent to a hung job waits out the group's timeout (30 min). Python also writes the number
    of every signal it catches to the file given to signal.set_wakeup_fd, from the C handler, whatever the main
    thread is doing: a thread reads it here. From the first SIGINT or SIGTERM inside signals_watched() (the
    trainer's run, whose handler is to act on it) on, it samples where the main thread is (its innermost Python
    frame and instruction); once that has stayed put for grace_s (patient_grace_s in the stretches marked
    patient(), where long waits are expected; either at least STEP_WAIT_FACTOR times the longest step seen), the
    thread writes one line and ends the process with the shell's 128 + signal. A signal outside signals_watched()
    is not its business, and leaving that stretch forgets the one heard in it. Files are written atomically
    (files.atomic_path), so nothing saved is damaged: what is lost is the step in flight and its checkpoint."""

    def __init__(self, rank: int, world_size: int, grace_s: float | None = None, patient_grace_s: float | None = None,
                 poll_s: float = 0.25):
        self.rank, self.world_size, self.poll_s = rank, world_size, poll_s
        self.grace_s = STUCK_AFTER_SIGNAL_S if grace_s is None else grace_s
        self.patient_grace_s = PATIENT_STUCK_AFTER_SIGNAL_S if patient_grace_s is None else patient_grace_s
        self._thread = None

    def start(self) -> None:
        """From the main thread (signal.set_wakeup_fd's rule)."""
        self._signals_r, signals_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(signals_w, False)  # the C handler must never block on a full pipe
        self._signals_w = signals_w
        self._old_wakeup_fd = signal.set_wakeup_fd(signals_w, warn_on_full_buffer=False)
        self._main_id = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="llmpy-stuck-rank-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """From the main thread, the wakeup fd it replaced goes back and its pipe is closed. From another thread
        (set_wakeup_fd's rule again) only the watching thread ends: the pipe stays registered and open, since
        Python's C handler would otherwise write the signal numbers into whatever file took its number next."""
        if self._thread is None:
            return
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread:
            signal.set_wakeup_fd(self._old_wakeup_fd)
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self._signals_r, self._signals_w, self._stop_r, self._stop_w) if in_main_thread else ():
            os.close(fd)
        self._thread = None

    def _main_thread_place(self):
        """(frame id, instruction) of the main thread's innermost Python frame: unchanged while it sits in one call."""
        frame = sys._current_frames().get(self._main_id)
        return None if frame is None else (id(frame), frame.f_lasti)

    def _main_thread_where(self) -> str:
        """That frame in words and, inside torch, the frame of ours that called it."""
        frame = sys._current_frames().get(self._main_id)
        if frame is None:
            return "outside Python"
        where = f"{frame.f_code.co_name} ({_short_path(frame.f_code.co_filename)}:{frame.f_lineno})"
        caller = frame
        while caller is not None and not caller.f_code.co_filename.startswith(_PACKAGE_DIR):
            caller = caller.f_back
        if caller is not None and caller is not frame:
            where += f" from {caller.f_code.co_name} ({_short_path(caller.f_code.co_filename)}:{caller.f_lineno})"
        return where

    def _limit(self) -> float:
        return max(self.patient_grace_s if _patient_depth else self.grace_s, STEP_WAIT_FACTOR * _longest_step_s)

    def _watch(self) -> None:
        signum = None       # the last stopping signal seen inside signals_watched()
        heard_in = None     # the stretch (_watched_stretch) it came in
        place = since = None
        while True:
            ready, _, _ = select.select([self._signals_r, self._stop_r], [], [], self.poll_s if signum else None)
            if self._stop_r in ready:
                return
            if self._signals_r in ready:
                data = os.read(self._signals_r, 64)
                if self._old_wakeup_fd >= 0:  # an asyncio loop's, say: it still hears of its signals
                    try:
                        os.write(self._old_wakeup_fd, data)
                    except OSError:
                        pass
                stopping = next((n for n in reversed(data) if n in (signal.SIGINT, signal.SIGTERM)), None)
                if stopping is not None and _watched_depth:
                    signum, heard_in = stopping, _watched_stretch
            if signum is not None and heard_in != _watched_stretch:  # the stretch ended: its signal was handled
                signum = place = since = None
            if signum is None:
                continue
            now_place = self._main_thread_place()
            limit = self._limit()
            if since is None or now_place != place:
                place, since = now_place, time.monotonic()
            elif time.monotonic() - since >= limit:
                self._end(signum, self._main_thread_where(), limit)

    def _end(self, signum: int, where: str, waited_s: float) -> None:
        name = signal.Signals(signum).name
        line = (f"llmpy: rank {self.rank} of {self.world_size}: {name} came while this process waited in {where}, "
                f"and it has not moved for {waited_s:.0f} s: another process has stopped or hangs; ending "
                "without saving (checkpoints already written are whole)\n")
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - the line and the exit below matter more than stdout's last lines
            pass
        try:  # stderr may be gone (a `| tee` ended by the same Ctrl-C): the exit must come all the same
            os.write(2, line.encode())
        except OSError:
            pass
        os._exit(128 + signum)


_patient_depth = 0
_watched_depth = 0      # inside signals_watched()
_watched_stretch = 0    # counts entries to and exits from signals_watched(): a signal belongs to one stretch
_longest_step_s = 0.0   # of the current stretch, from note_step_seconds


@contextlib.contextmanager
def signals_watched():
    """The stretch in which a stopping signal is this process's to act on: a training run, from the group's
    forming to its return. Only there does StuckRankWatch count SIGINT/SIGTERM; a signal heard in it is forgotten
    when it ends (the run has acted on it), and so are the steps' times."""
    global _watched_depth, _watched_stretch, _longest_step_s
    _watched_depth += 1
    _watched_stretch += 1
    _longest_step_s = 0.0
    try:
        yield
    finally:
        _watched_depth -= 1
        _watched_stretch += 1
        _longest_step_s = 0.0


def note_step_seconds(seconds: float) -> None:
    """A training step's wall time (not the first, which compiles and captures): a wait of a few steps' length
    is not a hang, however long steps are (a large model, many accumulation steps, one graph)."""
    global _longest_step_s
    _longest_step_s = max(_longest_step_s, seconds)


@contextlib.contextmanager
def patient():
    """A stretch in which this rank may rightly wait long for another, or work long alone: rank 0 writing a
    checkpoint, scoring HellaSwag or sampling, and the others at the barrier after it. StuckRankWatch gives it
    PATIENT_STUCK_AFTER_SIGNAL_S instead of STUCK_AFTER_SIGNAL_S."""
    global _patient_depth
    _patient_depth += 1
    try:
        yield
    finally:
        _patient_depth -= 1


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _short_path(filename: str) -> str:
    """llmpy/trainer.py for our files, the base name for others'."""
    if filename.startswith(_PACKAGE_DIR):
        return "llmpy/" + filename[len(_PACKAGE_DIR):]
    return os.path.basename(filename)


_stuck_watch: StuckRankWatch | None = None


def _watch_for_a_stuck_wait(rank: int, world: int) -> None:
    """Start this process's StuckRankWatch (once; from the main thread only, as set_wakeup_fd requires)."""
    global _stuck_watch
    if _stuck_watch is None and threading.current_thread() is threading.main_thread():
        _stuck_watch = StuckRankWatch(rank, world)
        _stuck_watch.start()


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
    global _stuck_watch
    if _stuck_watch is not None:
        _stuck_watch.stop()
        _stuck_watch = None
