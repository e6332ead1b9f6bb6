"""Token ids handed to a model (GPT2Model, the CPU reference): integers, as a numpy array on the host, inside the
vocabulary. The checks run in numpy: torch's CPU ops would wake its intra-op thread pool (see GPT2Model._stage)."""
from __future__ import annotations

import numpy as np
import torch

from .errors import LlmpyError


def check_integer_ids(dtype, what: str) -> None:
    """Token ids must be integers (a float would be truncated to another token, a NaN to anything)."""
    if isinstance(dtype, torch.dtype):
        integer = not (dtype.is_floating_point or dtype.is_complex)
    else:
        integer = dtype.kind in "iub"
    if not integer:
        raise LlmpyError(f"{what} of dtype {dtype}: token ids must be integers")


def check_id_tensor(ids: torch.Tensor, what: str) -> None:
    """A tensor of token ids must be integers with values to read: a sparse tensor (numpy's TypeError) or one on
    the meta device (torch's NotImplementedError) was a raw error on the way to numpy or the device."""
    check_integer_ids(ids.dtype, what)
    if ids.layout != torch.strided:
        raise LlmpyError(f"{what} of layout {ids.layout}: token ids must be a dense tensor (to_dense() makes one)")
    if ids.device.type == "meta":
        raise LlmpyError(f"{what} on the meta device: token ids must be a tensor with values (a meta tensor has "
                         "only a shape)")


def host_ids(ids, what: str) -> np.ndarray:
    """Token ids as a numpy array of integers on the host (a torch tensor's own memory when it is on the CPU)."""
    if isinstance(ids, torch.Tensor):
        check_id_tensor(ids, what)
        return ids.detach().cpu().numpy()
    try:
        ids = np.asarray(ids)
    except (ValueError, TypeError) as e:  # a ragged list
        raise LlmpyError(f"{what}: not an array of token ids ({(str(e).splitlines() or [type(e).__name__])[0]})") \
            from None
    if ids.size:  # numpy makes an empty list float64: its shape is what is wrong
        check_integer_ids(ids.dtype, what)
    return ids


def check_vocabulary(ids: np.ndarray, vocab_size: int, what: str) -> None:
    """Raise, in both models' one message, for an id outside [0, vocab_size): the first such id and its index."""
    if _outside_vocabulary(ids, vocab_size):
        # only on the way to an error: the index search costs a valid batch nothing
        where = [int(i) for i in np.argwhere((ids < 0) | (ids >= vocab_size))[0]]
        raise LlmpyError(f"{what} hold token id {int(ids[tuple(where)])} at {where}, outside the model's vocabulary "
                         f"[0, {vocab_size})")


def _outside_vocabulary(ids: np.ndarray, vocab_size: int) -> bool:
    """Whether an id lies outside [0, vocab_size). Signed integers are read as unsigned, where a negative id is a
    huge one: one pass over the ids, not two (GPT2Model checks every step's batch while the GPU waits for it)."""
    if not ids.size:
        return False
    # only where every negative id, read so, lands at or past vocab_size: int8's -1 is 255, int16's -20000 is 45536
    if ids.dtype.kind == "i" and vocab_size <= 2 ** (8 * ids.dtype.itemsize - 1):
        return int(ids.view(ids.dtype.str.replace("i", "u")).max()) >= vocab_size
    return int(ids.min()) < 0 or int(ids.max()) >= vocab_size
