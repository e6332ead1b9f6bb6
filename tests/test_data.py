"""Token shards, the data loader, the default corpus and `llmpy prepare` (all offline)."""
from __future__ import annotations

import argparse
import errno
import io
import json
import os
import re
import secrets
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpy import prepare as prep
from llmpy.data import (HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, DataLoader, EvalLoader, ShardFile, default_corpus,
                        default_dataset, read_shard, shard_num_tokens, write_shard)
from llmpy.errors import LlmpyError
from llmpy.tokenizer import ByteTokenizer


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"rng seed {seed}")  # shown by pytest when a test fails, to reproduce it
    return np.random.default_rng(seed)


def make_shards(folder: Path, sizes, rng, unique=False, vocab=65536, prefix="d"):
    """Shards with random tokens; with unique=True every token value occurs once over all shards,
    so a token identifies its position."""
    folder.mkdir(parents=True, exist_ok=True)
    pool = rng.permutation(vocab) if unique else None
    assert not unique or sum(sizes) <= vocab
    out, at = [], 0
    for i, n in enumerate(sizes):
        toks = pool[at:at + n] if unique else rng.integers(0, vocab, n)
        at += n
        write_shard(folder / f"{prefix}_train_{i:06d}.bin", toks)
        out.append(np.asarray(toks, dtype=np.uint16))
    return out


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def reference_windows(shards, B, T, world=1):
    """llm.c's sequential order, written out directly: per shard, each window of world*B*T tokens
    (while window + 1 token fits), the whole window plus one token."""
    W = world * B * T
    out = []
    for toks in shards:
        for w in range((len(toks) - 1) // W):
            out.append(toks[w * W: w * W + W + 1].astype(np.int64))
    return out


# ----------------------------------------------------------------------------------------------
# shard files

def test_shard_roundtrip_and_header(tmp_path, rng):
    n = int(rng.integers(1, 5000))
    toks = rng.integers(0, 65536, n)
    toks[0], toks[-1] = 65535, 0
    path = write_shard(tmp_path / "s.bin", toks)
    raw = path.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert (header[0], header[1], header[2]) == (SHARD_MAGIC, SHARD_VERSION, n) == (20240520, 1, n)
    assert not header[3:].any()
    assert len(raw) == 4 * HEADER_INTS + 2 * n
    assert np.array_equal(np.frombuffer(raw[1024:], dtype="<u2"), toks)
    back = read_shard(path)
    assert back.dtype == np.uint16 and np.array_equal(back, toks)
    assert shard_num_tokens(path) == n
    assert sorted(os.listdir(tmp_path)) == ["s.bin"]  # no temporary files left behind


def test_shard_file_written_in_parts_is_write_shards_file(tmp_path, rng):
    # appended a part at a time (empty parts too), closed: byte for byte the shard write_shard writes at once
    toks = rng.integers(0, 65536, int(rng.integers(1, 5000))).astype(np.uint16)
    cuts = np.sort(rng.integers(0, len(toks) + 1, 6))
    shard = ShardFile(tmp_path / "parts.bin")
    for a, b in zip([0, *cuts], [*cuts, len(toks)]):
        shard.append(toks[a:b])
    assert shard.close() == len(toks)
    write_shard(tmp_path / "whole.bin", toks)
    assert (tmp_path / "parts.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    # one left unfinished (abandoned mid-write) is no shard to a reader: its header's count is 0, its size is not
    unfinished = ShardFile(tmp_path / "unfinished.bin")
    unfinished.append(toks)
    unfinished.abandon()
    with pytest.raises(LlmpyError, match=r"unfinished\.bin"):
        shard_num_tokens(tmp_path / "unfinished.bin")
    with pytest.raises(LlmpyError, match=r"parts\.bin: cannot write \(File exists\)"):
        ShardFile(tmp_path / "parts.bin")  # never over an existing file


def test_write_shard_overwrites_atomically(tmp_path, rng):
    path = tmp_path / "s.bin"
    write_shard(path, rng.integers(0, 100, 50))
    new = rng.integers(0, 100, 7)
    write_shard(path, new)
    assert np.array_equal(read_shard(path), new)


@pytest.mark.parametrize("bad", [65536, -1, 70000])
def test_write_shard_refuses_ids_outside_uint16(tmp_path, rng, bad):
    toks = rng.integers(0, 65536, 100)
    pos = int(rng.integers(0, 100))
    toks[pos] = bad
    path = tmp_path / "out.bin"
    with pytest.raises(LlmpyError, match=rf"out\.bin.*{bad} at position {pos}"):
        write_shard(path, toks)
    assert not path.exists() and os.listdir(tmp_path) == []


def _corrupt(path: Path, case: str, rng):
    raw = bytearray(path.read_bytes())
    if case == "magic":
        raw[0:4] = np.int32(1234).tobytes()
    elif case == "version":
        raw[4:8] = np.int32(7).tobytes()
    elif case == "truncated":
        raw = raw[:len(raw) - 2 * int(rng.integers(1, 10))]
    elif case == "trailing":
        raw += b"\x00" * int(rng.integers(1, 9))
    elif case == "short_header":
        raw = raw[:int(rng.integers(0, 1024))]
    elif case == "odd_byte":
        raw = raw[:-1]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("case, message", [
    ("magic", r"bad magic 1234 \(expected 20240520\): not an llm\.c token shard"),
    ("version", r"version 7"),
    ("truncated", r"truncated"),
    ("trailing", r"trailing bytes"),
    ("short_header", r"shorter than the 1024-byte header"),
    ("odd_byte", r"truncated"),
])
def test_bad_shards_are_refused_by_reader_and_loader(tmp_path, rng, case, message):
    shards = make_shards(tmp_path, [300, 400, 500], rng)
    bad = tmp_path / "d_train_000001.bin"
    _corrupt(bad, case, rng)
    with pytest.raises(LlmpyError, match=message) as e:
        read_shard(bad)
    assert str(bad) in str(e.value)
    with pytest.raises(LlmpyError, match=message) as e:
        DataLoader(str(tmp_path / "*.bin"), 3, 5)
    assert str(bad) in str(e.value)
    assert len(shards) == 3


def test_a_shard_too_small_for_one_window_is_set_aside(tmp_path, rng):
    # llm.c stops at such a shard; `llmpy prepare` writes one whenever a split's last shard gets a short rest, so
    # the loader reads the others and names it in `skipped`
    B, T, world = 3, 7, 2
    W = B * T * world
    small = int(rng.integers(1, B * T + 1))  # up to B*T: one token short of one rank's window
    shards = make_shards(tmp_path, [5 * W, small, 3 * W], rng)
    loader = DataLoader(str(tmp_path / "*.bin"), B, T)
    assert loader.skipped == [(tmp_path / "d_train_000001.bin", small)]
    assert loader.files == [tmp_path / "d_train_000000.bin", tmp_path / "d_train_000002.bin"]
    ref = reference_windows([shards[0], shards[2]], B, T)
    assert len(loader) == len(ref) == 9 + 5  # (n - 1) // (B * T) windows with one rank
    for want in ref + ref[:3]:  # into the next epoch too
        x, y = loader.next_batch()
        assert np.array_equal(x.numpy().ravel(), want[:-1]) and np.array_equal(y.numpy().ravel(), want[1:])
    # one more token makes it exactly big enough
    write_shard(tmp_path / "d_train_000001.bin", rng.integers(0, 65536, W + 1))
    loader = DataLoader(str(tmp_path / "*.bin"), B, T, rank=1, world_size=world)
    assert len(loader) == 4 + 1 + 2 and loader.skipped == []


def test_every_shard_too_small_for_one_window_names_the_largest(tmp_path, rng):
    B, T = 3, 7
    make_shards(tmp_path, [5, B * T, 9], rng)
    with pytest.raises(LlmpyError, match=r"^\S*d_train_000001\.bin: 21 tokens \(the largest of 3 shards\) is too "
                                         r"small for one batch: B\*T\*world_size\+1 = 3\*7\*1\+1 = 22 tokens$"):
        DataLoader(str(tmp_path / "*.bin"), B, T)
    with pytest.raises(LlmpyError, match=r"^\S*d_train_000002\.bin: 9 tokens is too small for one batch"):
        DataLoader(str(tmp_path / "d_train_000002.bin"), B, T)


def test_a_shard_shortened_while_the_loader_reads_it_is_one_line(tmp_path, rng):
    # the loader mapped its shard: a file cut short under it (cp, rsync --inplace, llm.c's own scripts rewrite
    # in place) killed the process with SIGBUS at the next batch
    B, T = 4, 16
    path = make_shards(tmp_path, [40 * B * T], rng) and tmp_path / "d_train_000000.bin"
    loader = DataLoader(str(path), B, T, vocab_size=65536)
    loader.next_batch()
    with open(path, "r+b") as f:
        f.truncate(1024 + 2 * (3 * B * T))  # header and three batches' tokens stay
    loader.next_batch()  # batch 2 is still there
    with pytest.raises(LlmpyError, match=r"d_train_000000\.bin: changed on disk while training \(tokens 128 to 192 "):
        loader.next_batch()
    loader.close()
    with pytest.raises(LlmpyError, match=r"d_train_000000\.bin: truncated"):  # reopened: its header is read again
        loader.next_batch()


def test_token_beyond_vocab_names_shard_id_and_position(tmp_path, rng):
    vocab = 257
    make_shards(tmp_path, [500, 600], rng, vocab=vocab)
    toks = rng.integers(0, vocab, 700)
    pos = int(rng.integers(0, 700))
    toks[pos] = vocab + int(rng.integers(0, 1000))
    write_shard(tmp_path / "d_train_000002.bin", toks)
    loader = DataLoader(str(tmp_path / "*.bin"), 2, 9, vocab_size=vocab)
    # the first two shards are fine; the error comes when the bad shard is first opened
    n_ok = (499 // 18) + (599 // 18)
    take(loader, n_ok)
    with pytest.raises(LlmpyError, match=rf"d_train_000002\.bin: token id {toks[pos]} at position {pos}"):
        loader.next_batch()
    # without a vocab size the loader does not look (any uint16 is a valid shard token)
    assert len(take(DataLoader(str(tmp_path / "*.bin"), 2, 9), n_ok + 1)) == n_ok + 1


def test_a_shard_refused_for_its_ids_is_refused_again_on_the_next_call(tmp_path, rng):
    # the failed check left the shard open as if checked: a caller that went on got the out-of-vocabulary batch
    vocab = 257
    toks = rng.integers(0, vocab, 600)
    toks[int(rng.integers(0, 600))] = vocab
    write_shard(tmp_path / "d_train_000000.bin", toks)
    loader = DataLoader(str(tmp_path / "d_train_000000.bin"), 2, 9, vocab_size=vocab)
    for _ in range(2):
        with pytest.raises(LlmpyError, match=rf"token id {vocab} at position"):
            loader.next_batch()
    ev = EvalLoader(str(tmp_path / "d_train_000000.bin"), 2, 9, vocab_size=vocab)
    for _ in range(2):  # each validation starts again from the first batch
        with pytest.raises(LlmpyError, match=rf"token id {vocab} at position"):
            list(ev.batches(1))

def test_no_files_match(tmp_path):
    with pytest.raises(LlmpyError, match=r"nothing_\*\.bin: no files match"):
        DataLoader(str(tmp_path / "nothing_*.bin"), 2, 2)
    with pytest.raises(LlmpyError, match=r"missing\.bin: no such token shard"):
        DataLoader(tmp_path / "missing.bin", 2, 2)


def test_a_folder_or_file_name_with_brackets_is_its_own_name(tmp_path):
    # prepare -o "run[1]" prints "train on run[1]/x_train_*.bin": both that and a shard's own path must find the files
    folder = tmp_path / "run[1]"
    folder.mkdir()
    toks = np.random.default_rng().integers(0, 50, 300)
    write_shard(folder / "x_train_000000.bin", toks)
    for name in ("x_train_000000.bin", "x_train_*.bin"):
        assert torch.equal(DataLoader(str(folder / name), 2, 8).next_batch()[0].reshape(-1),
                           torch.from_numpy(toks[:16].astype(np.int64)))


def test_a_bracketed_folder_is_its_own_name_even_beside_the_folder_its_brackets_would_match(tmp_path, rng):
    # run[1]/x_train_*.bin read as a glob is run1/x_train_*.bin: with both folders there, it loaded run1's shards
    for folder in ("run1", "run[1]"):
        write_shard(tmp_path / folder / "x_train_000000.bin", rng.integers(0, 50, 300))
    own = read_shard(tmp_path / "run[1]" / "x_train_000000.bin")
    assert not np.array_equal(own, read_shard(tmp_path / "run1" / "x_train_000000.bin"))
    loader = DataLoader(str(tmp_path / "run[1]" / "x_train_*.bin"), 2, 8)
    assert loader.files == [tmp_path / "run[1]" / "x_train_000000.bin"]
    assert torch.equal(loader.next_batch()[0].reshape(-1), torch.from_numpy(own[:16].astype(np.int64)))
    # a pattern over folders still globs: nothing under a folder named literally "run[12]"
    assert DataLoader(str(tmp_path / "run[12]" / "x_train_*.bin"), 2, 8).files == [
        tmp_path / "run1" / "x_train_000000.bin"]


def test_a_pipe_is_no_shard(tmp_path):
    # reading a FIFO's header would wait for a writer for ever
    os.mkfifo(tmp_path / "x_train_000000.bin")
    with pytest.raises(LlmpyError, match=r"x_train_000000\.bin: not a regular file, so not a token shard"):
        DataLoader(str(tmp_path / "x_train_*.bin"), 2, 2)


# ----------------------------------------------------------------------------------------------
# loader order

def test_sequential_order_matches_llmc_and_wraps(tmp_path, rng):
    B, T = int(rng.integers(1, 4)) * 2 + 1, int(rng.integers(2, 9)) * 2 + 1  # odd
    sizes = [int(rng.integers(B * T + 1, 6 * B * T)) for _ in range(4)]
    shards = make_shards(tmp_path, sizes, rng)
    loader = DataLoader(str(tmp_path / "d_train_*.bin"), B, T)
    ref = reference_windows(shards, B, T)
    assert len(loader) == len(ref)
    assert loader.num_tokens == sum(sizes)
    assert loader.tokens_per_epoch == len(ref) * B * T
    for epoch in range(2):
        for k, want in enumerate(ref):
            x, y = loader.next_batch()
            assert x.dtype == torch.int64 and y.dtype == torch.int64
            assert x.shape == (B, T) and y.shape == (B, T)
            assert np.array_equal(x.numpy().ravel(), want[:-1]), (epoch, k)
            assert np.array_equal(y.numpy().ravel(), want[1:]), (epoch, k)
        assert loader.state_dict()["epoch"] == epoch + 1
    loader.reset()
    assert np.array_equal(loader.next_batch()[0].numpy().ravel(), ref[0][:-1])


def test_list_of_paths_keeps_given_order(tmp_path, rng):
    shards = make_shards(tmp_path, [40, 90], rng)
    paths = [tmp_path / "d_train_000001.bin", tmp_path / "d_train_000000.bin"]
    loader = DataLoader(paths, 1, 13)
    ref = reference_windows(shards[::-1], 1, 13)
    for want in ref:
        assert np.array_equal(loader.next_batch()[0].numpy().ravel(), want[:-1])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_are_disjoint_and_cover_the_single_rank_windows(tmp_path, rng, world, shuffle):
    B, T = 3, 5
    W = world * B * T
    sizes = [int(rng.integers(W + 1, 12 * W)) for _ in range(3)]
    make_shards(tmp_path, sizes, rng, unique=True)
    pattern = str(tmp_path / "*.bin")
    seed = int(rng.integers(0, 2**31))
    ranks = [DataLoader(pattern, B, T, rank=r, world_size=world, shuffle=shuffle, seed=seed) for r in range(world)]
    # a single rank with world*B rows reads the same windows of world*B*T tokens, in the same order
    whole = DataLoader(pattern, world * B, T, shuffle=shuffle, seed=seed)
    assert all(len(r) == len(whole) for r in ranks)
    for _ in range(len(whole) + 2):  # one pass and into the next epoch
        xs, ys = zip(*(r.next_batch() for r in ranks))
        X, Y = whole.next_batch()
        assert torch.equal(torch.cat(xs), X) and torch.equal(torch.cat(ys), Y)
        values = [set(x.numpy().ravel().tolist()) for x in xs]  # token values are unique positions
        assert sum(len(v) for v in values) == len(set().union(*values)) == W


def test_shuffle_is_a_permutation_deterministic_per_seed(tmp_path, rng):
    B, T = 3, 3
    sizes = [int(rng.integers(8 * B * T, 20 * B * T)) for _ in range(3)]
    shards = make_shards(tmp_path, sizes, rng)
    pattern = str(tmp_path / "*.bin")
    seed = int(rng.integers(0, 2**31))
    a = DataLoader(pattern, B, T, shuffle=True, seed=seed)
    b = DataLoader(pattern, B, T, shuffle=True, seed=seed)
    c = DataLoader(pattern, B, T, shuffle=True, seed=seed + 1)
    n = len(a)
    epoch_a = [a.next_batch() for _ in range(n)]
    epoch_b = [b.next_batch() for _ in range(n)]
    epoch_c = [c.next_batch() for _ in range(n)]
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(epoch_a, epoch_b))
    key = lambda batches: [tuple(x.numpy().ravel()) + tuple(y.numpy().ravel()[-1:]) for x, y in batches]
    ref = [tuple(w[:-1]) + (w[-1],) for w in reference_windows(shards, B, T)]
    # each epoch is a reordering of exactly the sequential windows, and the orders differ
    assert sorted(key(epoch_a)) == sorted(ref) == sorted(key(epoch_c))
    assert key(epoch_a) != ref
    assert key(epoch_a) != key(epoch_c)
    second = [a.next_batch() for _ in range(n)]
    assert sorted(key(second)) == sorted(ref) and key(second) != key(epoch_a)


def test_shuffle_orders_shards_and_windows_per_epoch_and_seed(tmp_path, rng):
    B, T = 3, 3
    W = B * T
    sizes = [int(rng.integers(10 * W + 1, 20 * W)) for _ in range(4)]
    shards = make_shards(tmp_path, sizes, rng, unique=True)
    where = {int(t): (s, i) for s, toks in enumerate(shards) for i, t in enumerate(toks)}
    pattern = str(tmp_path / "*.bin")

    def visits(seed, epochs):
        loader = DataLoader(pattern, B, T, shuffle=True, seed=seed)
        out = []
        for _ in range(epochs):
            epoch = [where[int(loader.next_batch()[0][0, 0])] for _ in range(len(loader))]
            shard_order = [s for k, (s, _) in enumerate(epoch) if k == 0 or epoch[k - 1][0] != s]
            # a shard is read whole before the next (llm.c), every window of every shard once
            assert sorted(shard_order) == list(range(len(shards)))
            windows = {s: [off // W for t, off in epoch if t == s] for s in range(len(shards))}
            assert all(sorted(w) == list(range((n - 1) // W)) for w, n in zip(windows.values(), sizes))
            out.append((shard_order, windows))
        return out

    seed = int(rng.integers(0, 2**31))
    # 10 epochs: the 4 shards' order (one of 24) is the same in all of them once in 24**9 seeds; in 5 it was
    # once in 24**4 = 330,000 (seed 6303)
    a, b = visits(seed, 10), visits(seed + 1, 10)
    assert len({tuple(order) for order, _ in a}) > 1  # the shard order changes between epochs
    assert [order for order, _ in a] != [order for order, _ in b]  # and between seeds
    for s in range(len(shards)):
        seq = list(range((sizes[s] - 1) // W))
        assert any(w[s] != seq for _, w in a)  # windows inside a shard are shuffled
        assert a[0][1][s] != a[1][1][s]  # differently in each epoch
        assert a[0][1][s] != b[0][1][s]  # and for each seed


def _same(batches1, batches2):
    return len(batches1) == len(batches2) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(batches1, batches2))


@pytest.mark.parametrize("where", ["mid", "last_of_epoch", "epoch_boundary", "later_epoch"])
def test_state_restore_gives_bitwise_equal_batches(tmp_path, rng, where):
    B, T, world = 3, 7, 2
    W = world * B * T
    make_shards(tmp_path, [int(rng.integers(W + 1, 6 * W)) for _ in range(3)], rng)
    pattern = str(tmp_path / "*.bin")
    seed = int(rng.integers(0, 2**31))
    rank = int(rng.integers(0, world))
    a = DataLoader(pattern, B, T, rank=rank, world_size=world, shuffle=True, seed=seed)
    n = len(a)
    k = {"mid": int(rng.integers(1, n)), "last_of_epoch": n - 1, "epoch_boundary": n,
         "later_epoch": 2 * n + int(rng.integers(0, n))}[where]
    take(a, k)
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON
    following = take(a, n + 3)  # crosses at least one epoch boundary
    b = DataLoader(pattern, B, T, rank=rank, world_size=world, shuffle=True, seed=seed)
    b.load_state_dict(state)
    assert _same(take(b, n + 3), following)
    # the state holds no rank: another rank restored from it continues where that rank would be
    other = (rank + 1) % world
    c = DataLoader(pattern, B, T, rank=other, world_size=world, shuffle=True, seed=seed)
    d = DataLoader(pattern, B, T, rank=other, world_size=world, shuffle=True, seed=seed)
    take(c, k)
    d.load_state_dict(state)
    assert _same(take(d, 4), take(c, 4))


def test_state_mismatch_and_malformed_state_are_refused(tmp_path, rng):
    make_shards(tmp_path, [500, 700], rng)
    pattern = str(tmp_path / "*.bin")
    a = DataLoader(pattern, 2, 8, shuffle=True, seed=5)
    take(a, 3)
    state = a.state_dict()
    with pytest.raises(LlmpyError, match=r"T=8.*T=9"):
        DataLoader(pattern, 2, 9, shuffle=True, seed=5).load_state_dict(state)
    with pytest.raises(LlmpyError, match=r"seed=5.*seed=6"):
        DataLoader(pattern, 2, 8, shuffle=True, seed=6).load_state_dict(state)
    # other shards: named by what tells them apart (the state holds only a hash of their names and sizes)
    with pytest.raises(LlmpyError, match=r"^the position was saved over other shards than these 1 "
                                         r"\(d_train_000000\.bin \.\.\.; 2 then, told apart by name and token count\): "
                                         r"resume with the data that run trained on$"):
        DataLoader(tmp_path / "d_train_000000.bin", 2, 8, shuffle=True, seed=5).load_state_dict(state)
    write_shard(tmp_path / "d_train_000001.bin", rng.integers(0, 65536, 701))  # the same names, one size changed
    with pytest.raises(LlmpyError, match=r"^the position was saved over other shards than these 2 "
                                         r"\(d_train_000000\.bin \.\.\.; 2 then,"):
        DataLoader(pattern, 2, 8, shuffle=True, seed=5).load_state_dict(state)
    make_shards(tmp_path, [500, 700], rng)
    with pytest.raises(LlmpyError, match="malformed"):
        DataLoader(pattern, 2, 8, shuffle=True, seed=5).load_state_dict({"version": 1})
    bad = dict(state, window_pos=10**6)
    with pytest.raises(LlmpyError, match="window 1000000"):
        DataLoader(pattern, 2, 8, shuffle=True, seed=5).load_state_dict(bad)


def test_eval_loader_repeats_the_first_batches(tmp_path, rng):
    B, T = 5, 3
    shards = make_shards(tmp_path, [int(rng.integers(B * T + 1, 10 * B * T)) for _ in range(2)], rng)
    ev = EvalLoader(str(tmp_path / "*.bin"), B, T, vocab_size=65536)
    ref = reference_windows(shards, B, T)
    m = int(rng.integers(1, len(ref) + 1))
    for _ in range(2):
        got = list(ev.batches(m))
        assert len(got) == m
        for (x, y), want in zip(got, ref):
            assert np.array_equal(x.numpy().ravel(), want[:-1]) and np.array_equal(y.numpy().ravel(), want[1:])
    assert len(list(ev.batches())) == len(ref)
    with pytest.raises(LlmpyError, match=rf"{len(ref) + 1} validation batches.*only {len(ref)}"):
        list(ev.batches(len(ref) + 1))


def test_bad_loader_arguments(tmp_path, rng):
    make_shards(tmp_path, [100], rng)
    p = str(tmp_path / "*.bin")
    for kwargs in ({"B": 0, "T": 4}, {"B": 2, "T": -1}, {"B": 2, "T": 2, "rank": 2, "world_size": 2}):
        with pytest.raises(LlmpyError):
            DataLoader(p, **kwargs)


# ----------------------------------------------------------------------------------------------
# default corpus

def test_default_corpus_and_dataset(tmp_path):
    cap = 300_000
    docs = default_corpus(max_bytes=cap)
    assert docs and docs == default_corpus(max_bytes=cap)
    assert sum(len(d.encode()) for d in docs) <= cap
    assert any("def " in d for d in docs)
    files = default_dataset(cache_dir=tmp_path, max_bytes=cap)
    assert files.vocab_size == 257 and files.tokenizer == "bytes"
    train, val = read_shard(files.train), read_shard(files.val)
    n_val = max(1, round(len(docs) * 0.05))
    tok = ByteTokenizer()
    assert np.array_equal(train, tok.encode_documents(docs[:-n_val]))
    assert np.array_equal(val, tok.encode_documents(docs[-n_val:]))
    # reused when valid, rebuilt when damaged
    mtime = os.stat(files.train).st_mtime_ns
    assert default_dataset(cache_dir=tmp_path, max_bytes=cap) == files
    assert os.stat(files.train).st_mtime_ns == mtime
    Path(files.val).write_bytes(Path(files.val).read_bytes()[:-2])
    default_dataset(cache_dir=tmp_path, max_bytes=cap)
    assert np.array_equal(read_shard(files.val), tok.encode_documents(docs[-n_val:]))
    DataLoader(files.train, 4, 64, vocab_size=257).next_batch()


def test_default_dataset_rebuilds_over_a_manifest_nested_too_deep(tmp_path):
    files = default_dataset(cache_dir=tmp_path, max_bytes=20_000)
    manifest = tmp_path / "bytes" / "manifest.json"
    good = manifest.read_text()
    manifest.write_text("[" * 100_000)  # json.loads raises RecursionError, not a ValueError
    assert default_dataset(cache_dir=tmp_path, max_bytes=20_000) == files
    assert manifest.read_text() == good


# ----------------------------------------------------------------------------------------------
# llmpy prepare

def run_prepare(argv) -> int:
    parser = argparse.ArgumentParser()
    prep.add_arguments(parser)
    return prep.run(parser.parse_args([str(a) for a in argv]))


def _split_tokens(outdir: Path, name: str, split: str):
    files = sorted(outdir.glob(f"{name}_{split}_*.bin"))
    return files, (np.concatenate([read_shard(f) for f in files]) if files else np.zeros(0, np.uint16))


def test_prepare_text_file_bytes(tmp_path, rng):
    text = "".join(rng.choice(list("abcdé \n🙂xyz."), int(rng.integers(2000, 5000))))
    src = tmp_path / "story.txt"
    src.write_text(text, encoding="utf-8")
    shard = int(rng.integers(100, 700))
    out = tmp_path / "out"
    assert run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-fraction", "0.2", "--shard-size", shard]) == 0
    stream = ByteTokenizer().encode_documents([text])
    n_val = round(len(stream) * 0.2)
    val_files, val = _split_tokens(out, "story", "val")
    train_files, train = _split_tokens(out, "story", "train")
    assert np.array_equal(val, stream[:n_val]) and np.array_equal(train, stream[n_val:])
    assert val_files[0].name == "story_val_000000.bin" and train_files[0].name == "story_train_000000.bin"
    for files in (val_files, train_files):
        assert all(shard_num_tokens(f) == shard for f in files[:-1]) and 0 < shard_num_tokens(files[-1]) <= shard
    assert not [p for p in os.listdir(out) if not p.endswith(".bin")]  # no temporaries left
    # a second run with bigger shards leaves no stale shards behind for the glob to pick up
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 10, "--shard-size", 10**6])
    assert sorted(os.listdir(out)) == ["story_train_000000.bin", "story_val_000000.bin"]
    assert np.array_equal(np.concatenate([read_shard(out / "story_val_000000.bin"),
                                          read_shard(out / "story_train_000000.bin")]), stream)


def test_prepare_folder_each_file_a_document(tmp_path, rng):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    names = ["b.txt", "a.txt", "sub/0.txt", "z.txt"]
    texts = {}
    for n in names:
        texts[n] = "".join(rng.choice(list("hello world\n"), int(rng.integers(50, 300))))
        (folder / n).write_text(texts[n])
    (folder / "ignored.md").write_text("not a txt file")
    out = tmp_path / "o"
    run_prepare([folder, "-o", out, "--tokenizer", "bytes", "--val-tokens", 0])
    _, train = _split_tokens(out, "corpus", "train")
    assert not list(out.glob("*_val_*"))
    order = ["a.txt", "b.txt", "sub/0.txt", "z.txt"]  # by relative path
    assert np.array_equal(train, ByteTokenizer().encode_documents([texts[n] for n in order]))
    assert int((train == 256).sum()) == 4


def test_prepare_with_gpt2_from_local_files(tmp_path, shared_data):
    gpt2_dir = shared_data("gpt2/encoder.json", "gpt2/vocab.bpe") / "gpt2"
    src = tmp_path / "t.txt"
    src.write_text("Hello world\n\nHello world")
    out = tmp_path / "o"
    run_prepare([src, "-o", out, "--tokenizer-dir", gpt2_dir, "--val-tokens", 1])
    _, val = _split_tokens(out, "t", "val")
    _, train = _split_tokens(out, "t", "train")
    assert val.tolist() == [50256]
    assert train.tolist() == [15496, 995, 198, 198, 15496, 995]


def test_prepare_of_a_long_text_in_pieces_writes_the_whole_texts_tokens(tmp_path, monkeypatch, shared_data):
    # a text file longer than a piece is encoded a piece at a time and a batch at a time: the same tokens as the
    # whole document encoded at once, one end-of-text before it, the val split where the whole stream puts it
    import llmpy.tokenizer as tk
    root = shared_data("gpt2/encoder.json", "gpt2/vocab.bpe", "tinyshakespeare/input.txt")
    text = (root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:60000]
    src = tmp_path / "t.txt"
    src.write_text(text, encoding="utf-8")
    gpt2 = tk.GPT2Tokenizer.from_files(root / "gpt2" / "encoder.json", root / "gpt2" / "vocab.bpe")
    expect = [50256] + gpt2.encode(text)
    batches = []
    monkeypatch.setattr(tk, "PIECE_CHARS", 500)
    monkeypatch.setattr(tk, "BATCH_CHARS", 4000)
    real = tk.GPT2Tokenizer.encode_arrays
    monkeypatch.setattr(tk.GPT2Tokenizer, "encode_arrays", lambda self, texts: batches.append(len(texts)) or
                        real(self, texts))
    out = tmp_path / "o"
    prep.prepare(str(src), out, tokenizer_dir=str(root / "gpt2"), val_tokens=777, shard_size=5000, log=lambda *_: None)
    _, val = _split_tokens(out, "t", "val")
    _, train = _split_tokens(out, "t", "train")
    assert val.tolist() + train.tolist() == expect and len(val) == 777
    assert len(batches) > 10 and max(batches) > 1  # it did go in pieces, several to a batch


def test_text_blocks_decode_a_file_as_a_whole_decode_does(tmp_path):
    # read in blocks that cut characters of two to four bytes anywhere: the same text, and a byte that is not
    # UTF-8 named at its offset in the file, as a whole-file decode names it
    rng = np.random.default_rng(secrets.randbits(32))
    text = "".join(rng.choice(list("ab \n") + ["é", "€", "🙂", "日本"], 300))
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    for block_bytes in (1, 2, 3, 5, 64, 1 << 20):
        blocks = list(prep._text_blocks(path, block_bytes))
        assert "".join(blocks) == text and all(blocks)
    data = text.encode("utf-8")
    for bad in (b"\xff", b"\xe2\x82", b"\xc3(", b"\xf0\x9f\x99"):
        for at in (0, int(rng.integers(1, len(data))), len(data)):
            at = len(data[:at].decode("utf-8", errors="ignore").encode("utf-8"))  # between characters
            broken = data[:at] + bad + data[at:]
            path.write_bytes(broken)
            with pytest.raises(UnicodeDecodeError) as whole:
                broken.decode("utf-8")
            for block_bytes in (1, 3, 7, 1 << 20):
                with pytest.raises(LlmpyError) as err:
                    list(prep._text_blocks(path, block_bytes))
                assert str(err.value) == f"{path}: not UTF-8 text (byte {whole.value.start}: {whole.value.reason})"


def test_prepare_reads_a_file_and_a_folder_in_blocks(tmp_path, monkeypatch, shared_data):
    # files read a few bytes at a time give the shards of the texts whole: a file, and a folder's files
    root = shared_data("gpt2/encoder.json", "gpt2/vocab.bpe", "tinyshakespeare/input.txt")
    text = (root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:20000] + " é€🙂 end"
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(text[i * 5000:(i + 1) * 5000 + 7], encoding="utf-8")
    (folder / "whole.txt").write_text(text, encoding="utf-8")
    import llmpy.tokenizer as tk
    gpt2 = tk.GPT2Tokenizer.from_files(root / "gpt2" / "encoder.json", root / "gpt2" / "vocab.bpe")
    docs = [(folder / n).read_text(encoding="utf-8") for n in ("0.txt", "1.txt", "2.txt", "whole.txt")]
    monkeypatch.setattr(tk, "PIECE_CHARS", 300)
    read = []
    real = prep._text_blocks
    monkeypatch.setattr(prep, "_text_blocks", lambda path: (b for b in real(path, 1001) if not read.append(len(b))))
    for src, expect_docs in ((folder / "whole.txt", [text]), (folder, docs)):
        out = tmp_path / "o" / src.name
        prep.prepare(str(src), out, tokenizer_dir=str(root / "gpt2"), val_tokens=333, shard_size=4000,
                     log=lambda *_: None)
        _, val = _split_tokens(out, src.stem, "val")
        _, train = _split_tokens(out, src.stem, "train")
        assert val.tolist() + train.tolist() == gpt2.encode_documents(expect_docs).tolist() and len(val) == 333
    assert len(read) > 40 and max(read) <= 1001  # it did read in blocks


class _FakeResponse(io.BytesIO):
    def __init__(self, data):
        super().__init__(data)
        self.headers = {"Content-Length": str(len(data))}


def test_prepare_tinyshakespeare_with_fake_download(tmp_path, monkeypatch, shared_data):
    data = (shared_data("tinyshakespeare/input.txt") / "tinyshakespeare" / "input.txt").read_bytes()
    urls = []
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: urls.append(url) or _FakeResponse(data))
    out, cache = tmp_path / "o", tmp_path / "cache"
    run_prepare(["tinyshakespeare", "-o", out, "--tokenizer", "bytes", "--cache-dir", cache])
    assert urls == [prep.TINYSHAKESPEARE_URL]
    text = data.decode()
    sections = text.split("\n\n")
    stream = ByteTokenizer().encode_documents([s + "\n\n" for s in sections[:-1]] + sections[-1:])
    _, val = _split_tokens(out, "tinyshakespeare", "val")
    _, train = _split_tokens(out, "tinyshakespeare", "train")
    assert len(val) == 32768  # llm.c's val split
    assert np.array_equal(np.concatenate([val, train]), stream)
    assert int((stream == 256).sum()) == len(sections)
    # the download is kept: a second run does not fetch again
    run_prepare(["tinyshakespeare", "-o", out, "--tokenizer", "bytes", "--cache-dir", cache])
    assert len(urls) == 1


@pytest.mark.parametrize("dataset", ["tinyshakespeare", "tinystories"])
def test_named_dataset_without_network_fails_cleanly(tmp_path, monkeypatch, dataset):
    def offline(url, timeout):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(prep, "_urlopen", offline)
    cache = tmp_path / "cache"
    with pytest.raises(LlmpyError, match=r"cannot download https://.*name resolution.*place the file at"):
        run_prepare([dataset, "-o", tmp_path / "o", "--tokenizer", "bytes", "--cache-dir", cache])
    leftovers = [p for p in cache.rglob("*") if p.is_file()]
    assert leftovers == []  # no partial download left behind


@pytest.mark.parametrize("body, reason", [
    pytest.param("[" * 100_000, "maximum recursion depth", id="nested-too-deep"),  # a RecursionError traceback
    pytest.param('[{"story": 5}]', "'int' object has no attribute 'strip'", id="story-not-text"),  # AttributeError
])
def test_a_bad_tinystories_json_is_one_line(tmp_path, body, reason):
    folder = tmp_path / "cache" / "TinyStories_all_data"  # as unpacked: no download
    folder.mkdir(parents=True)
    (folder / ".complete").write_text("ok\n")
    (folder / "data00.json").write_text(body)
    with pytest.raises(LlmpyError, match=rf"data00\.json: not a TinyStories JSON file \({reason}.*\); delete "
                                         rf"{re.escape(str(folder))} to unpack the archive again$"):
        run_prepare(["tinystories", "-o", tmp_path / "o", "--tokenizer", "bytes", "--cache-dir", tmp_path / "cache"])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_a_story_with_a_lone_surrogate_is_one_line(tmp_path, tokenizer, shared_data):
    # JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer encodes (was a traceback from it)
    folder = tmp_path / "cache" / "TinyStories_all_data"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text("ok\n")
    (folder / "data00.json").write_text('[{"story": "Once upon a time."}, {"story": "A \\ud800 b"}]')
    gpt2 = ["--tokenizer-dir", shared_data("gpt2/encoder.json", "gpt2/vocab.bpe") / "gpt2"] * (tokenizer == "gpt2")
    with pytest.raises(LlmpyError, match=r"^tinystories: a document holds a lone surrogate \('\\ud800'\), not Unicode"):
        run_prepare(["tinystories", "-o", tmp_path / "o", "--tokenizer", tokenizer, "--cache-dir", tmp_path / "cache",
                     *gpt2])
    assert not (tmp_path / "o").exists()


def test_download_checks_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: _FakeResponse(b"not shakespeare"))
    with pytest.raises(LlmpyError, match="sha256"):
        run_prepare(["tinyshakespeare", "-o", tmp_path / "o", "--tokenizer", "bytes", "--cache-dir", tmp_path / "c"])
    assert not list((tmp_path / "c").rglob("*.txt"))


def test_a_dataset_file_placed_by_hand_is_checked_against_its_sha256(tmp_path, monkeypatch, shared_data):
    """Offline, the error says to place the file in the cache; a wrong file placed there was then used as the dataset
    without a word (only the download was checked)."""
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: pytest.fail("nothing may be fetched"))
    placed = tmp_path / "cache" / "tinyshakespeare" / "input.txt"
    placed.parent.mkdir(parents=True)
    placed.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 2000)
    with pytest.raises(LlmpyError, match=rf"^{re.escape(str(placed))}: sha256 [0-9a-f]{{64}}, expected "
                                         rf"{prep.TINYSHAKESPEARE_SHA256}: not the file .* serves \(remove it to "):
        run_prepare(["tinyshakespeare", "-o", tmp_path / "o", "--tokenizer", "bytes",
                     "--cache-dir", tmp_path / "cache"])
    assert not (tmp_path / "o").exists() and placed.is_file()
    # the real file, placed by hand, is used
    placed.write_bytes((shared_data("tinyshakespeare/input.txt") / "tinyshakespeare" / "input.txt").read_bytes())
    run_prepare(["tinyshakespeare", "-o", tmp_path / "o", "--tokenizer", "bytes", "--cache-dir", tmp_path / "cache"])
    assert len(_split_tokens(tmp_path / "o", "tinyshakespeare", "val")[1]) == 32768


def test_download_removes_a_killed_downloads_partial_file_and_keeps_the_umasks_mode(tmp_path, monkeypatch):
    # a download killed mid-way (SIGKILL: no cleanup) leaves its temporary; the next download into the folder removes
    # it once its process is gone and it is old, and the file it writes has the umask's mode, not mkstemp's 0600
    import subprocess
    import sys
    import time
    from llmpy.files import ORPHAN_MIN_AGE_S
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "cache" / "tinyshakespeare"
    folder.mkdir(parents=True)
    orphan = folder / f".input.txt.{int(dead.stdout)}.0123abcd.part"
    orphan.write_bytes(b"half a download")
    old = time.time() - ORPHAN_MIN_AGE_S - 60
    os.utime(orphan, (old, old))
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: _FakeResponse(b"data"))
    previous = os.umask(0o022)
    try:
        got = prep.download("https://example.invalid/input.txt", folder / "input.txt")
    finally:
        os.umask(previous)
    assert got.read_bytes() == b"data" and os.stat(got).st_mode & 0o777 == 0o644
    assert sorted(os.listdir(folder)) == ["input.txt"]


class _CutShortResponse(_FakeResponse):
    """A dropped connection as http.client may report it: fewer bytes than Content-Length promised, and no error."""
    def __init__(self, data, promised):
        super().__init__(data)
        self.headers = {"Content-Length": str(promised)}


class _IncompleteReadResponse(_FakeResponse):
    """A dropped chunked transfer: its first chunk, then http.client.IncompleteRead (not an OSError)."""
    def read(self, size=-1):
        import http.client
        chunk = super().read(size)
        if not chunk:
            raise http.client.IncompleteRead(b"", 1 << 20)
        return chunk


def test_a_download_cut_short_is_an_error_and_keeps_no_file(tmp_path, monkeypatch, rng):
    # a short body was renamed into place as the complete file and then reused by every later prepare
    data = rng.bytes(int(rng.integers(1, 3 << 20)))
    promised = len(data) + int(rng.integers(1, 1 << 20))
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: _CutShortResponse(data, promised))
    folder = tmp_path / "cache"
    folder.mkdir()
    url = "https://example.invalid/hellaswag_val.jsonl"
    with pytest.raises(LlmpyError, match=rf"^{re.escape(url)}: download cut short \({len(data)} of {promised} "
                                         r"bytes\); run the command again$"):
        prep.download(url, folder / "hellaswag_val.jsonl")
    assert os.listdir(folder) == []  # neither the file nor its temporary
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: _IncompleteReadResponse(data))
    with pytest.raises(LlmpyError, match=rf"^cannot download {re.escape(url)} \(IncompleteRead\(0 bytes read, "
                                         r"1048576 more expected\)\); without network, place the file at "):
        prep.download(url, folder / "hellaswag_val.jsonl")
    assert os.listdir(folder) == []


@pytest.mark.parametrize("response", [
    pytest.param(lambda data: _CutShortResponse(data, len(data) * 2), id="short-body"),
    pytest.param(_IncompleteReadResponse, id="incomplete-read"),  # was a traceback
])
def test_cli_prepare_a_cut_download_is_one_line(tmp_path, monkeypatch, capsys, rng, response):
    from llmpy import cli
    from llmpy.hellaswag import HELLASWAG_VAL_URL
    data = rng.bytes(int(rng.integers(1, 1 << 16)))
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: response(data))
    out, cache = tmp_path / "o", tmp_path / "c"
    assert cli.main(["prepare", "hellaswag", "-o", str(out), "--tokenizer", "bytes", "--cache-dir", str(cache)]) == 1
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and err[0].startswith("llmpy prepare: error: ") and HELLASWAG_VAL_URL in err[0]
    assert "Traceback" not in captured.err + captured.out
    assert [p for p in cache.rglob("*") if p.is_file()] == [] and not (out / "hellaswag_val.bin").exists()


def test_fineweb_without_datasets_package(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    with pytest.raises(LlmpyError, match=r"fineweb needs the `datasets` package"):
        run_prepare(["fineweb", "-o", tmp_path / "o", "--tokenizer", "bytes"])


def test_fineweb_through_a_stand_in_datasets_package(tmp_path, monkeypatch):
    # the rows `datasets` streams, in order, one document each; val = the first shard by default (llm.c), or a
    # fraction of the whole stream, counted on disk
    import importlib.util
    import sys
    import types
    rng = np.random.default_rng(secrets.randbits(32))
    texts = ["".join(rng.choice(list("abc dé\n"), int(rng.integers(1, 300)))) for _ in range(2500)]
    asked = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda repo, **kw: asked.append((repo, kw)) or iter({"text": t} for t in texts)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "datasets" else real(n, *a))
    stream = ByteTokenizer().encode_documents(texts)
    for flags, n_val in (([], 4000), (["--val-fraction", "0.25"], round(len(stream) * 0.25))):
        out = tmp_path / f"o{len(flags)}"
        run_prepare(["fineweb-edu", "-o", out, "--tokenizer", "bytes", "--shard-size", 4000, *flags])
        assert _split_tokens(out, "fineweb-edu", "val")[1].tolist() == stream[:n_val].tolist()
        assert _split_tokens(out, "fineweb-edu", "train")[1].tolist() == stream[n_val:].tolist()
        assert not [p for p in os.listdir(out) if not p.endswith(".bin")]
    assert asked[0] == ("HuggingFaceFW/fineweb-edu", {"name": "sample-10BT", "split": "train", "streaming": True})


def test_prepare_jsonl_one_document_a_line(tmp_path):
    # a .jsonl file and its gzipped copy: the documents of the non-blank lines, in order, the text under "text" or
    # --text-field; escapes, non-ASCII and other fields as JSON has them
    import gzip
    rng = np.random.default_rng(secrets.randbits(32))
    texts = ["".join(rng.choice(list('ab "\\\n\té€🙂'), int(rng.integers(0, 80)))) for _ in range(300)]
    lines = [json.dumps({"id": i, "text": t, "content": t[::-1]}, ensure_ascii=bool(i % 2))
             for i, t in enumerate(texts)]
    body = "\n".join(lines[:100]) + "\n\n  \n" + "\n".join(lines[100:]) + "\n"
    (tmp_path / "web.jsonl").write_text(body, encoding="utf-8")
    with gzip.open(tmp_path / "web.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(body)
    for src, flags, docs in (("web.jsonl", [], texts), ("web.jsonl.gz", [], texts),
                             ("web.jsonl", ["--text-field", "content"], [t[::-1] for t in texts])):
        out = tmp_path / "o" / src / str(len(flags))
        run_prepare([tmp_path / src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 50, *flags])
        stream = ByteTokenizer().encode_documents(docs)
        assert _split_tokens(out, "web", "val")[1].tolist() == stream[:50].tolist()
        assert _split_tokens(out, "web", "train")[1].tolist() == stream[50:].tolist()


def test_prepare_folder_of_text_and_jsonl_files(tmp_path):
    # .txt files are a document each, .jsonl / .jsonl.gz files a document a line, all in the order of their paths;
    # other files are not read
    import gzip
    folder = tmp_path / "mixed"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("first text")
    (folder / "b" / "c.jsonl").write_text(json.dumps({"body": "line one"}) + "\n" + json.dumps({"body": "two"}))
    (folder / "b" / "d.jsonl.gz").write_bytes(gzip.compress(json.dumps({"body": "zipped é"}).encode() + b"\n"))
    (folder / "b" / "e.txt").write_text("last text")
    (folder / "notes.md").write_text("not read")
    out = tmp_path / "o"
    run_prepare([folder, "-o", out, "--tokenizer", "bytes", "--val-tokens", 0, "--text-field", "body"])
    expect = ByteTokenizer().encode_documents(["first text", "line one", "two", "zipped é", "last text"])
    assert _split_tokens(out, "mixed", "train")[1].tolist() == expect.tolist()
    with pytest.raises(LlmpyError, match=r"c\.jsonl: line 1: not an object with a string 'text' field"):
        run_prepare([folder, "-o", tmp_path / "o2", "--tokenizer", "bytes"])  # the default field


def test_prepare_jsonl_errors_name_the_line(tmp_path, capsys):
    from llmpy import cli
    good = json.dumps({"text": "fine"})
    cases = {
        "broken.jsonl": (f"{good}\n{{\"text\": \"cut", r"line 2: not JSON \(Unterminated string"),
        "array.jsonl": (f"{good}\n\n[1, 2]\n", r"line 3: not an object with a string 'text' field"),
        "number.jsonl": (json.dumps({"text": 5}), r"line 1: not an object with a string 'text' field"),
        "other.jsonl": (json.dumps({"body": "x"}), r"line 1: not an object with a string 'text' field "
                                                   r"\(--text-field names the field\)"),
        "blank.jsonl": ("\n  \n\n", r"blank\.jsonl: no documents to tokenize"),
    }
    for name, (body, message) in cases.items():
        (tmp_path / name).write_text(body)
        assert cli.main(["prepare", str(tmp_path / name), "-o", str(tmp_path / "o"), "--tokenizer", "bytes"]) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and re.search(message, err[0]) and str(tmp_path / name) in err[0], err
        assert not (tmp_path / "o").exists()
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(LlmpyError, match=r"latin1\.jsonl: line 1: not UTF-8 text \(byte 13 of the line: invalid "
                                         r"continuation byte\)$"):
        run_prepare([tmp_path / "latin1.jsonl", "-o", tmp_path / "o", "--tokenizer", "bytes"])
    import gzip
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress((good + "\n").encode() * 1000)[:-30])
    with pytest.raises(LlmpyError, match=r"cut\.jsonl\.gz: cannot read \(Compressed file ended"):
        run_prepare([tmp_path / "cut.jsonl.gz", "-o", tmp_path / "o", "--tokenizer", "bytes"])
    (tmp_path / "plain.jsonl.gz").write_text(good)
    with pytest.raises(LlmpyError, match=r"plain\.jsonl\.gz: cannot read \(Not a gzipped file"):
        run_prepare([tmp_path / "plain.jsonl.gz", "-o", tmp_path / "o", "--tokenizer", "bytes"])
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(LlmpyError, match=r"--text-field 'body': only a \.jsonl source \(or a folder of them\) has"):
        run_prepare([tmp_path / "a.txt", "-o", tmp_path / "o", "--tokenizer", "bytes", "--text-field", "body"])
    with pytest.raises(LlmpyError, match=r"--text-field '': name the field"):
        run_prepare([tmp_path / "other.jsonl", "-o", tmp_path / "o", "--tokenizer", "bytes", "--text-field", ""])
    with pytest.raises(LlmpyError, match=r"hellaswag: .*--text-field do not apply"):
        run_prepare(["hellaswag", "-o", tmp_path / "o", "--text-field", "body"])
    assert not (tmp_path / "o").exists()


def test_prepare_jsonl_lines_not_utf8_nested_too_deep_or_with_a_lone_surrogate(tmp_path, capsys, shared_data):
    from llmpy import cli
    gpt2_dir = shared_data("gpt2/encoder.json", "gpt2/vocab.bpe") / "gpt2"
    good = json.dumps({"text": "fine"}).encode()
    cases = {
        # json.loads(bytes) guessed UTF-16 from FF FE and said "not JSON ('utf-16-le' codec ...)"
        "bom16.jsonl": (good + b"\n\xff\xfe" + good + b"\n", r"line 2: not UTF-8 text \(byte 0 of the line: "
                                                          r"invalid start byte\)$"),
        # a RecursionError traceback
        "deep.jsonl": (good + b"\n" + b"[" * 100_000 + b"\n", r"line 2: not JSON \(maximum recursion depth"),
        # a UnicodeEncodeError traceback from the tokenizer
        "surrogate.jsonl": (b'{"text": "a \\ud800 b"}\n', r"line 1: field 'text' holds a lone surrogate "
                                                          r"\('\\ud800' at character 2\), not Unicode text$"),
    }
    for name, (body, message) in cases.items():
        (tmp_path / name).write_bytes(body)
        for tokenizer in (["--tokenizer", "bytes"], ["--tokenizer-dir", str(gpt2_dir)]):
            assert cli.main(["prepare", str(tmp_path / name), "-o", str(tmp_path / "o"), *tokenizer]) == 1
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and re.search(message, err[0]) and str(tmp_path / name) in err[0], err
            assert not (tmp_path / "o").exists()
    # a UTF-8 byte-order mark is still skipped, as json.loads(bytes) skipped it
    (tmp_path / "bom8.jsonl").write_bytes(b"\xef\xbb\xbf" + good + b"\n")
    run_prepare([tmp_path / "bom8.jsonl", "-o", tmp_path / "o", "--tokenizer", "bytes", "--val-tokens", 0])
    assert _split_tokens(tmp_path / "o", "bom8", "train")[1].tolist() == [256, *b"fine"]


@pytest.mark.parametrize("block_bytes", [1, 2, 4, None])
def test_a_text_files_byte_order_mark_is_not_text(tmp_path, monkeypatch, block_bytes):
    """A .txt saved with a UTF-8 byte-order mark (Notepad's habit) put its three bytes (or GPT-2's tokens for
    U+FEFF) at the head of the document, where a .jsonl file's was dropped; read in blocks of any size."""
    if block_bytes is not None:
        monkeypatch.setattr(prep, "READ_BYTES", block_bytes)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bom.txt").write_bytes(b"\xef\xbb\xbfhello \xef\xbb\xbf")  # only the first is no text
    (tmp_path / "docs" / "plain.txt").write_bytes(b"caf\xc3\xa9")
    run_prepare([tmp_path / "docs" / "bom.txt", "-o", tmp_path / "o", "--tokenizer", "bytes", "--val-tokens", 0])
    assert _split_tokens(tmp_path / "o", "bom", "train")[1].tolist() == [256, *b"hello \xef\xbb\xbf"]
    run_prepare([tmp_path / "docs", "-o", tmp_path / "f", "--tokenizer", "bytes", "--val-tokens", 0])
    assert _split_tokens(tmp_path / "f", "docs", "train")[1].tolist() == [256, *b"hello \xef\xbb\xbf", 256,
                                                                          *b"caf\xc3\xa9"]
    # the mark alone is an empty file, not a shard of one end-of-text token
    (tmp_path / "mark.txt").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(LlmpyError, match=r"mark\.txt: empty file, no text to tokenize"):
        run_prepare([tmp_path / "mark.txt", "-o", tmp_path / "m", "--tokenizer", "bytes"])
    # a byte that is not UTF-8 is still named at its offset in the file, the mark counted
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbfab\xff")
    with pytest.raises(LlmpyError, match=r"bad\.txt: not UTF-8 text \(byte 5: invalid start byte\)"):
        run_prepare([tmp_path / "bad.txt", "-o", tmp_path / "b", "--tokenizer", "bytes"])


def test_prepare_refuses_empty_and_contradictory_folders(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(prep, "_urlopen", lambda url, timeout: fetched.append(url) or _FakeResponse(b"x"))
    monkeypatch.chdir(tmp_path)  # Path("") is this folder: nothing may land in it
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(LlmpyError, match=r"^--cache-dir '': an empty folder name \(leave it out for "):
        run_prepare(["tinyshakespeare", "-o", tmp_path / "o", "--tokenizer", "bytes", "--cache-dir", ""])
    with pytest.raises(LlmpyError, match=r"^-o '': an empty output folder name"):  # hellaswag wrote into ./
        run_prepare(["hellaswag", "-o", "", "--tokenizer", "bytes", "--cache-dir", tmp_path / "c"])
    # the bytes tokenizer has no files: a --tokenizer-dir with it was ignored, even a missing one
    for source in ("a.txt", "hellaswag"):
        with pytest.raises(LlmpyError, match=r"^--tokenizer-dir '/nonexistent': the bytes tokenizer has no files"):
            run_prepare([source, "-o", tmp_path / "o", "--tokenizer", "bytes", "--tokenizer-dir", "/nonexistent",
                         "--cache-dir", tmp_path / "c"])
    with pytest.raises(LlmpyError, match=r"^--tokenizer-dir '': an empty folder name"):
        run_prepare(["a.txt", "-o", tmp_path / "o", "--tokenizer-dir", ""])
    # SOURCE "" was Path("") too: this folder's .txt files were tokenized into shards named after it
    for source in ("", "  "):
        with pytest.raises(LlmpyError, match=rf"^SOURCE '{source}': an empty name \(give a text or \.jsonl file, a "
                                             "folder of them, or a named dataset: tinyshakespeare, "):
            run_prepare([source, "-o", tmp_path / "o", "--tokenizer", "bytes"])
    assert fetched == [] and os.listdir(tmp_path) == ["a.txt"]


def test_prepare_bad_inputs(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("some text")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LlmpyError, match=rf"{blocker / 'out'}: cannot create or write the output folder"):
        run_prepare([src, "-o", blocker / "out", "--tokenizer", "bytes"])
    with pytest.raises(LlmpyError, match=r"nope\.txt: no such file or folder, and not a named dataset"):
        run_prepare([tmp_path / "nope.txt", "--tokenizer", "bytes"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(LlmpyError, match=r"latin1\.txt: not UTF-8"):
        run_prepare([tmp_path / "latin1.txt", "-o", tmp_path / "o", "--tokenizer", "bytes"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmpyError, match=r"empty: folder holds no \.txt, \.jsonl or \.jsonl\.gz files"):
        run_prepare([tmp_path / "empty", "-o", tmp_path / "o", "--tokenizer", "bytes"])
    # empty text: refused, not a shard of one end-of-text token that no run can train on
    (tmp_path / "empty" / "nothing.txt").write_text("")
    with pytest.raises(LlmpyError, match=r"nothing\.txt: empty file, no text to tokenize"):
        run_prepare([tmp_path / "empty" / "nothing.txt", "-o", tmp_path / "o2", "--tokenizer", "bytes"])
    with pytest.raises(LlmpyError, match=r"empty: every \.txt or \.jsonl file in the folder is empty"):
        run_prepare([tmp_path / "empty", "-o", tmp_path / "o2", "--tokenizer", "bytes"])
    assert not (tmp_path / "o2").exists()
    with pytest.raises(LlmpyError, match="--shard-size 0"):
        run_prepare([src, "-o", tmp_path / "o", "--tokenizer", "bytes", "--shard-size", 0])
    with pytest.raises(LlmpyError, match="nothing left to train on"):
        run_prepare([src, "-o", tmp_path / "o", "--tokenizer", "bytes", "--val-tokens", 1000])
    assert not (tmp_path / "o").exists()  # each failed prepare removed the folder it had made
    with pytest.raises(SystemExit):  # argparse: the two val options exclude each other
        run_prepare([src, "--val-tokens", 5, "--val-fraction", "0.1"])
    # a path that exists but holds no text of its own: not reported as missing
    with pytest.raises(LlmpyError, match=rf"^{os.devnull}: not a regular file or folder"):
        run_prepare([os.devnull, "-o", tmp_path / "o", "--tokenizer", "bytes"])
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(LlmpyError, match=r"pipe\.txt: not a regular file or folder"):
        run_prepare([tmp_path / "pipe.txt", "-o", tmp_path / "o", "--tokenizer", "bytes"])
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(LlmpyError, match=r"^-o '': an empty output folder name"):
        run_prepare([tmp_path / "a.txt", "-o", "", "--tokenizer", "bytes"])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_failed_prepare_leaves_earlier_shards_unchanged(tmp_path, monkeypatch):
    src = tmp_path / "corpus.txt"
    src.write_text("hello world, some text here.\n" * 200)
    out = tmp_path / "pp" / "X"
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--shard-size", 1000])
    before = _snapshot(out)
    assert "corpus_val_000000.bin" in before and "corpus_train_000005.bin" in before
    # fails after writing its only (val) shard: the old val shard is not replaced beside the old train shards
    with pytest.raises(LlmpyError, match="all 5801 tokens went to the val split"):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 999999999, "--shard-size", 10**6])
    assert _snapshot(out) == before  # same files, same bytes, no temporaries

    # interrupted (Ctrl-C) after some shards of the new run are written, in the middle of the third: likewise
    calls = []

    class InterruptedShardFile(prep.ShardFile):
        def append(self, tokens):
            calls.append(self.path)
            if len(calls) == 3:
                super().append(tokens[:5])
                raise KeyboardInterrupt
            super().append(tokens)
    monkeypatch.setattr(prep, "ShardFile", InterruptedShardFile)
    with pytest.raises(KeyboardInterrupt):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 10, "--shard-size", 700])
    assert len(calls) == 3 and all(p.parent == out and p.name.startswith(".") for p in calls)
    assert _snapshot(out) == before


def test_a_full_disk_mid_shard_is_one_line_and_leaves_the_earlier_dataset(tmp_path, monkeypatch, capsys):
    # the disk fills while a shard is being written (ENOSPC at a write): one line naming the shard's file, exit 1,
    # the earlier dataset as it was, no temporaries (the spilled stream's included)
    import errno
    from llmpy import cli
    src = tmp_path / "corpus.txt"
    src.write_text("hello world, some text here.\n" * 300)
    out = tmp_path / "o"
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--shard-size", 1000])
    before = _snapshot(out)
    writes = []

    class FillingFile:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            writes.append(len(data))
            if len(writes) == 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    class FullDiskShardFile(prep.ShardFile):
        def __init__(self, path):
            super().__init__(path)
            self._file = FillingFile(self._file)
    monkeypatch.setattr(prep, "ShardFile", FullDiskShardFile)
    assert cli.main(["prepare", str(src), "-o", str(out), "--tokenizer", "bytes", "--shard-size", "700"]) == 1
    err = capsys.readouterr().err.splitlines()
    shard_temporary = rf"{re.escape(str(out))}/\.corpus_(val|train)_\d+\.bin\.\d+\.[0-9a-f]{{8}}\.part"
    assert len(err) == 1, err
    assert re.fullmatch(rf"llmpy prepare: error: {shard_temporary}: cannot write \(No space left on device\)", err[0])
    assert _snapshot(out) == before
    # likewise while the stream is spilled to be counted (the default split)
    monkeypatch.undo()
    writes.clear()
    monkeypatch.setattr(prep, "open", lambda path, mode, **kw: FillingFile(open(path, mode, **kw)), raising=False)
    monkeypatch.setattr(prep, "READ_BYTES", 1000)  # the stream in several chunks, so several writes
    import llmpy.tokenizer as tk
    monkeypatch.setattr(tk, "BATCH_CHARS", 1000)
    assert cli.main(["prepare", str(src), "-o", str(out), "--tokenizer", "bytes", "--shard-size", "700"]) == 1
    err = capsys.readouterr().err.splitlines()
    spill = rf"{re.escape(str(out))}/\.corpus_tokens\.\d+\.[0-9a-f]{{8}}\.part"
    assert len(err) == 1 and re.fullmatch(rf"llmpy prepare: error: {spill}: cannot write the token stream to count "
                                          r"it \(No space left on device\)", err[0]), err
    assert len(writes) == 4 and _snapshot(out) == before


@pytest.mark.parametrize("split", [[], ["--val-tokens", "10"]], ids=["spilling", "writing-shards"])
def test_sigterm_during_prepare_cleans_up_as_ctrl_c_does(tmp_path, split):
    """`kill` (SIGTERM) mid-prepare: one line, exit 143, the earlier shards as they were, no temporaries; while the
    token stream is spilled to be counted (the default split, a fraction) or while shards are written."""
    import signal
    import subprocess
    import sys
    import time
    src = tmp_path / "big.txt"
    rng = np.random.default_rng()
    src.write_bytes(rng.integers(32, 127, 4_000_000, dtype=np.uint8).tobytes())
    out = tmp_path / "out"
    run_prepare([tmp_path / "big.txt", "-o", out, "--tokenizer", "bytes", "--val-tokens", 10, "--shard-size", 10**6])
    before = _snapshot(out)
    proc = subprocess.Popen([sys.executable, "-m", "llmpy", "prepare", str(src), "-o", str(out), "--tokenizer", "bytes",
                             "--shard-size", "300", *split], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    stage = "_tokens." if not split else "_train_"  # the spilled stream, or a staged shard: mid-write
    while not any(p.name.endswith(".part") and stage in p.name for p in out.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it was signalled"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and err == "llmpy prepare: terminated (SIGTERM)\n", err
    assert _snapshot(out) == before


def test_prepare_split_by_fraction_spills_the_stream_and_leaves_no_trace(tmp_path, monkeypatch):
    # the default split counts the stream on disk, read back in pieces: the split of the whole stream, and no spill
    # file left after success or after a bad byte deep in the file (the earlier dataset as it was)
    rng = np.random.default_rng(secrets.randbits(32))
    text = "".join(rng.choice(list("abc é\n🙂"), 5000))
    src = tmp_path / "t.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "o"
    monkeypatch.setattr(prep, "SPILL_READ_TOKENS", 333)
    monkeypatch.setattr(prep, "READ_BYTES", 1000)
    import llmpy.tokenizer as tk
    monkeypatch.setattr(tk, "BATCH_CHARS", 500)
    spilled = []
    real_spill = prep._spill
    monkeypatch.setattr(prep, "_spill", lambda chunks, path: spilled.append(path) or real_spill(chunks, path))
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--shard-size", 1000])
    stream = ByteTokenizer().encode_documents([text])
    n_val = round(len(stream) * prep.DEFAULT_VAL_FRACTION)
    assert _split_tokens(out, "t", "val")[1].tolist() == stream[:n_val].tolist()
    assert _split_tokens(out, "t", "train")[1].tolist() == stream[n_val:].tolist()
    assert len(spilled) == 1 and spilled[0].parent == out and not spilled[0].exists()
    assert not [p for p in os.listdir(out) if not p.endswith(".bin")]
    before = _snapshot(out)
    head = text[:3000].encode("utf-8")  # some batches are in the spill file by then
    src.write_bytes(head + b"\xff" + text[3000:].encode("utf-8"))
    with pytest.raises(LlmpyError, match=rf"t\.txt: not UTF-8 text \(byte {len(head)}: invalid start byte\)"):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--shard-size", 1000])
    assert len(spilled) == 2 and _snapshot(out) == before


def test_a_prepare_that_fails_while_moving_its_shards_in_leaves_the_earlier_ones(tmp_path, monkeypatch):
    # the new shards replace the old ones all together or not at all: a train must never read a mix of two prepares
    src = tmp_path / "c.txt"
    src.write_text("".join(np.random.default_rng().choice(list("abc \n"), 4000)))
    out = tmp_path / "o"
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    before = _snapshot(out)
    real_replace, moves = os.replace, []

    def failing_third_move(a, b):
        if Path(a).name.endswith(".part"):
            moves.append(b)
            if len(moves) == 3:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(a, b)
    monkeypatch.setattr(os, "replace", failing_third_move)
    with pytest.raises(LlmpyError, match=r"c_train_000001\.bin: cannot move the new shard into place \(Input/output "
                                         r"error\); the shards already there are as they were"):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 300, "--shard-size", 1000])
    monkeypatch.undo()
    assert len(moves) == 3 and _snapshot(out) == before  # no temporaries either
    # a folder where a new shard goes is refused before anything moves
    (out / "c_train_000002.bin").unlink()
    (out / "c_train_000002.bin").mkdir()
    files = lambda: {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}  # noqa: E731
    before = files()
    with pytest.raises(LlmpyError, match=r"c_train_000002\.bin: not a file, where a new shard goes; move it away"):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 300, "--shard-size", 1000])
    assert files() == before and len(os.listdir(out)) == len(before) + 1


def _prepared_twice_over(tmp_path, first: int, second: int):
    """A folder prepared from a text of `first` characters (shards of 1000 tokens, 100 for val), and the source
    rewritten with `second` other characters for the prepare a test runs next: (source, folder)."""
    rng = np.random.default_rng()
    src = tmp_path / "c.txt"
    src.write_text("".join(rng.choice(list("abc \n"), first)))
    out = tmp_path / "o"
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    src.write_text("".join(rng.choice(list("xyz \n"), second)))
    return src, out


KILLED_PREPARE = """
import os, sys
from llmpy import prepare as prep
stop_at = sys.argv[1]
if stop_at == "remove_stale":  # every new shard in place, the earlier prepare's extra ones not yet removed
    prep._remove_stale = lambda *a: os._exit(9)
else:  # the second new shard's move: the new val shard in place, train's first set aside, the rest the earlier's
    moves, replace = [], os.replace
    def killed_mid_commit(src, dst):
        if os.fspath(src).endswith(".part"):
            moves.append(src)
            if len(moves) == 2:
                os._exit(9)
        return replace(src, dst)
    prep.os.replace = killed_mid_commit
prep.prepare(sys.argv[2], sys.argv[3], tokenizer="bytes", val_tokens=100, shard_size=1000, log=lambda m: None)
"""


@pytest.mark.parametrize("stop_at", ["commit", "remove_stale"])
def test_a_prepare_killed_while_its_shards_move_in_leaves_them_refused_until_it_runs_again(tmp_path, stop_at):
    # SIGKILL (the OOM killer, a preemption) between the first move and the last removal left a mix of two prepares'
    # shards that train read without a word
    import subprocess
    import sys
    rng = np.random.default_rng()
    src, out = _prepared_twice_over(tmp_path, 5000, 3000)  # fewer shards: the last ones are stale after it
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    r = subprocess.run([sys.executable, "-c", KILLED_PREPARE, stop_at, str(src), str(out)], env=env, timeout=120)
    assert r.returncode != 0
    journal = out / ".c.prepare-commit"
    assert journal.exists()
    message = (rf"^{re.escape(str(out))}/c_(train|val)_\d{{6}}\.bin: a prepare of 'c' was stopped while it moved its "
               rf"shards into place \({re.escape(str(journal))} is left\), so they may mix two prepares; run that "
               r"llmpy prepare again$")
    with pytest.raises(LlmpyError, match=message):
        DataLoader(str(out / "c_train_*.bin"), 2, 8, vocab_size=257)
    with pytest.raises(LlmpyError, match=message):
        EvalLoader(str(out / "c_val_*.bin"), 2, 8, vocab_size=257)
    # a shard named on its own too, and a glob of two prepares' names, one of them whole
    write_shard(out / "d_train_000000.bin", rng.integers(0, 257, 100))
    with pytest.raises(LlmpyError, match=message):
        DataLoader([str(out / "d_train_*.bin"), str(out / "c_train_000001.bin")], 2, 8, vocab_size=257)
    assert len(DataLoader(str(out / "d_train_*.bin"), 2, 8, vocab_size=257).files) == 1
    # a glob that matches nothing (its only shard set aside when the process died) says why it may
    with pytest.raises(LlmpyError, match=r"c_none_\*\.bin: no files match this pattern \(a prepare was stopped here "
                                         r"while it moved its shards into place: \.c\.prepare-commit is left; run it "
                                         r"again\)$"):
        DataLoader(str(out / "c_none_*.bin"), 2, 8, vocab_size=257)
    # a link to one of the folder's shards, from elsewhere
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "l_train_000000.bin").symlink_to(out / "c_train_000001.bin")
    with pytest.raises(LlmpyError, match=r"l_train_000000\.bin: a prepare of 'c' was stopped"):
        DataLoader(str(tmp_path / "links" / "l_train_*.bin"), 2, 8, vocab_size=257)
    # the prepare again, failing in its own commit: rolled back to the mix the killed one left, which stays refused
    real_replace, moves = os.replace, []

    def failing_second_move(a, b):
        if os.fspath(a).endswith(".part"):
            moves.append(b)
            if len(moves) == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(a, b)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "replace", failing_second_move)
        with pytest.raises(LlmpyError, match=r"cannot move the new shard into place \(Input/output error\); the "
                                             r"shards already there are as they were$"):
            run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    assert journal.exists()
    with pytest.raises(LlmpyError, match=message):
        DataLoader(str(out / "c_train_*.bin"), 2, 8, vocab_size=257)
    # the same prepare again: the dataset whole, the journal gone
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    assert not journal.exists()
    fresh = tmp_path / "fresh"
    run_prepare([src, "-o", fresh, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    shards = lambda folder: {p.name: p.read_bytes() for p in folder.glob("c_*.bin")}  # noqa: E731
    assert shards(out) == shards(fresh) and len(shards(out)) == 4  # the earlier prepare's 4th and 5th train gone
    assert not [p for p in os.listdir(out) if p.endswith(".prepare-commit")]
    DataLoader(str(out / "c_train_*.bin"), 2, 8, vocab_size=257)


def test_two_prepares_into_one_folder_commit_one_after_the_other(tmp_path, monkeypatch):
    # their moves and removals interleaved: a prepare committing while another was half-way through its own left a
    # mix of the two (one's stale removal could also delete the other's new shards), and they shared one journal
    import threading
    rng = np.random.default_rng()
    out = tmp_path / "o"
    first, second = tmp_path / "first" / "c.txt", tmp_path / "second" / "c.txt"
    for src, n in ((first, 5000), (second, 3000)):  # 5 and 3 train shards
        src.parent.mkdir()
        src.write_text("".join(rng.choice(list("abc \n"), n)))
    real_replace, paused, resume = os.replace, threading.Event(), threading.Event()
    first_thread_moves = []

    def first_pauses_after_two_moves(a, b):
        real_replace(a, b)
        if threading.current_thread().name == "first" and os.fspath(a).endswith(".part"):
            first_thread_moves.append(b)
            if len(first_thread_moves) == 2:
                paused.set()
                assert resume.wait(60)
    monkeypatch.setattr(os, "replace", first_pauses_after_two_moves)
    logs, errors = {"first": [], "second": []}, []

    def run(src, name):
        try:
            prep.prepare(str(src), out, tokenizer="bytes", val_tokens=100, shard_size=1000, log=logs[name].append)
        except BaseException as e:
            errors.append(e)
    threads = {n: threading.Thread(target=run, args=(src, n), name=n) for n, src in (("first", first),
                                                                                       ("second", second))}
    threads["first"].start()
    assert paused.wait(60)
    threads["second"].start()
    deadline = time.monotonic() + 60
    while not logs["second"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert logs["second"] == [f"waiting for another llmpy prepare to finish moving its shards into {out}"]
    resume.set()
    for t in threads.values():
        t.join(60)
    assert not errors
    monkeypatch.undo()
    # the second committed last, whole: its shards and none of the first's
    fresh = tmp_path / "fresh"
    run_prepare([second, "-o", fresh, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    assert _snapshot(out) == _snapshot(fresh) and len(_snapshot(out)) == 4


def test_a_prepare_on_a_file_system_without_locks_commits_with_a_note(tmp_path, monkeypatch):
    import fcntl
    src = tmp_path / "c.txt"
    src.write_text("".join(np.random.default_rng().choice(list("abc \n"), 3000)))

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    logs = []
    result = prep.prepare(str(src), tmp_path / "o", tokenizer="bytes", val_tokens=100, shard_size=1000,
                          log=logs.append)
    assert logs[0] == (f"note: {tmp_path / 'o'}: the file system takes no locks ({os.strerror(errno.ENOLCK)}); a "
                       "second prepare into this folder at the same time could mix its shards with these")
    assert len(result["train"]) == 3 and sorted(os.listdir(tmp_path / "o")) == sorted(
        p.name for files in result.values() for p, _ in files)


@pytest.mark.parametrize("after", ["set_aside", "move_in"])
def test_a_ctrl_c_just_after_a_move_undoes_it_too(tmp_path, monkeypatch, after):
    # a move made but not yet noted when the KeyboardInterrupt came was left out of the undoing: a new shard beside
    # the earlier ones, or an earlier one left under its temporary name
    # val 0, train 0 and 1; then val 0, train 0 to 3
    before = _snapshot(_prepared_twice_over(tmp_path, 2000, 4000)[1])
    src, out = tmp_path / "c.txt", tmp_path / "o"
    real_replace, moves = os.replace, []
    # the third set-aside (train 1's), or the fourth move-in (train 2's, a shard with no earlier one)
    suffix, nth = (".bin", 3) if after == "set_aside" else (".part", 4)

    def interrupted_just_after(a, b):
        real_replace(a, b)
        if os.fspath(a).endswith(suffix):
            moves.append(b)
            if len(moves) == nth:
                raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", interrupted_just_after)
    with pytest.raises(KeyboardInterrupt):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    monkeypatch.undo()
    assert len(moves) == nth and _snapshot(out) == before  # the earlier shards, no temporaries, no journal


def test_an_earlier_shard_prepare_cannot_remove_keeps_its_folder_refused(tmp_path, monkeypatch):
    # the new shards in place and one of the earlier prepare's extra ones left (its unlink failed silently): train
    # read it with the new ones
    src, out = _prepared_twice_over(tmp_path, 5000, 3000)
    unlink = Path.unlink

    def refused(self, *a, **k):
        if self.name == "c_train_000004.bin":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return unlink(self, *a, **k)
    monkeypatch.setattr(Path, "unlink", refused)
    with pytest.raises(LlmpyError, match=r"c_train_000004\.bin: cannot remove this shard of an earlier prepare "
                                         r"\(Permission denied\); train refuses the folder's shards until it is gone "
                                         r"and the prepare has run again$"):
        run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    monkeypatch.undo()
    assert (out / ".c.prepare-commit").exists() and (out / "c_train_000004.bin").exists()
    with pytest.raises(LlmpyError, match=r"was stopped while it moved its shards into place"):
        DataLoader(str(out / "c_train_*.bin"), 2, 8, vocab_size=257)
    run_prepare([src, "-o", out, "--tokenizer", "bytes", "--val-tokens", 100, "--shard-size", 1000])
    assert not (out / ".c.prepare-commit").exists() and len(list(out.glob("c_train_*.bin"))) == 3


def test_prepare_reads_gzip_and_folders_whatever_their_case_and_names_what_it_cannot_read(tmp_path, monkeypatch):
    import gzip
    good = json.dumps({"text": "fine"}) + "\n"
    (tmp_path / "UPPER.JSONL.GZ").write_bytes(gzip.compress(good.encode()))
    run_prepare([tmp_path / "UPPER.JSONL.GZ", "-o", tmp_path / "o1", "--tokenizer", "bytes", "--val-tokens", 0])
    assert _split_tokens(tmp_path / "o1", "UPPER", "train")[1].tolist() == [256, *b"fine"]
    # damaged compressed data: zlib's own error, a traceback before
    (tmp_path / "damaged.jsonl.gz").write_bytes(gzip.compress(b"")[:10] + b"\xff" * 20)  # a reserved block type
    with pytest.raises(LlmpyError, match=r"damaged\.jsonl\.gz: cannot read \("):
        run_prepare([tmp_path / "damaged.jsonl.gz", "-o", tmp_path / "o2", "--tokenizer", "bytes"])
    # a subfolder that cannot be listed (root may list any; so the refusal is simulated): Path.rglob skipped it
    folder = tmp_path / "docs"
    (folder / "locked").mkdir(parents=True)
    (folder / "a.TXT").write_text("first")
    (folder / "locked" / "b.txt").write_text("second")
    real_scandir = os.scandir

    def refuse_locked(path="."):
        if os.fspath(path).endswith("locked"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_scandir(path)
    monkeypatch.setattr(os, "scandir", refuse_locked)
    locked = re.escape(str(folder / "locked"))
    with pytest.raises(LlmpyError, match=rf"^{locked}: cannot list this folder \(Permission"):
        run_prepare([folder, "-o", tmp_path / "o3", "--tokenizer", "bytes"])
    monkeypatch.undo()
    run_prepare([folder, "-o", tmp_path / "o3", "--tokenizer", "bytes", "--val-tokens", 0])
    assert _split_tokens(tmp_path / "o3", "docs", "train")[1].tolist() == [256, *b"first", 256, *b"second"]
    # a ~user that has no home folder: a RuntimeError traceback before
    for flags in (["~no_such_user_llmpy/a.txt"], [folder / "a.TXT", "-o", "~no_such_user_llmpy/o"]):
        with pytest.raises(LlmpyError, match=r"~no_such_user_llmpy/[\w.]+: no home folder is known for the user"):
            run_prepare([*flags, "--tokenizer", "bytes"])


def test_failed_prepare_removes_only_the_folders_it_made(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("some text")
    huge_val = ["--tokenizer", "bytes", "--val-tokens", 10**6]
    # a fresh folder: no lone val shard, no empty folders (nested ones included)
    with pytest.raises(LlmpyError, match="nothing left to train on"):
        run_prepare([src, "-o", tmp_path / "new" / "a" / "b", *huge_val])
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]
    with pytest.raises(LlmpyError, match="GPT-2 tokenizer folder not found"):
        run_prepare([src, "-o", tmp_path / "o", "--tokenizer-dir", tmp_path / "no_gpt2"])
    assert not (tmp_path / "o").exists()
    # a folder that was there before stays, even empty, and so does what it holds
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.md").write_text("mine")
    for folder in ("empty", "full"):
        with pytest.raises(LlmpyError, match="nothing left to train on"):
            run_prepare([src, "-o", tmp_path / folder / "sub", *huge_val])
        with pytest.raises(LlmpyError, match="nothing left to train on"):
            run_prepare([src, "-o", tmp_path / folder, *huge_val])
    assert os.listdir(tmp_path / "empty") == [] and os.listdir(tmp_path / "full") == ["notes.md"]


def test_cli_prepare_errors_are_one_line(tmp_path, capsys):
    from llmpy import cli
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    out = tmp_path / "o"
    assert cli.main(["prepare", str(tmp_path / "latin1.txt"), "-o", str(out), "--tokenizer", "bytes"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"llmpy prepare: error: {tmp_path / 'latin1.txt'}: not UTF-8 text "
                                "(byte 3: invalid continuation byte)"]
    assert not out.exists()
    assert cli.main(["prepare", os.devnull, "-o", str(out), "--tokenizer", "bytes"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"llmpy prepare: error: {os.devnull}: not a regular file or folder "
        "(give a text or .jsonl file, or a folder of them)"]


@pytest.mark.parametrize("split", ["val_tokens", "val_fraction"])
def test_a_long_prepare_keeps_its_waiting_temporaries_fresh(tmp_path, monkeypatch, split):
    """A finished shard waits unchanged until the commit (and with --val-fraction the spilled stream while it is read
    back). A prepare on another host of a shared folder cannot see this process and removes temporaries by their
    age alone: this prepare must touch its own, or the other removes them and this one's commit fails. Here time
    passes by ageing the folder's files while the shards are written, and the other host's cleanup runs after that."""
    import time
    from llmpy import files
    out = tmp_path / "o"
    text = "hello world, some text here.\n" * 20  # 580 bytes a group

    def meanwhile(i):  # before the i-th piece of the stream that the shards are cut from
        if i == 2:  # ten minutes and more with no write to the waiting files
            for p in out.iterdir():
                os.utime(p, (time.time() - files.ORPHAN_MIN_AGE_S - 5,) * 2)
        if i == 4:  # the other host's cleanup, for which no process of this one runs
            with monkeypatch.context() as m:
                m.setattr(files, "_process_exists", lambda pid: False)
                files.remove_orphaned_temporaries(out)

    def groups():
        for i in range(6):
            if split == "val_tokens":
                meanwhile(i)
            yield False, [text]
    unspill = prep._unspill

    def unspill_slowly(path):  # the second pass: the spill read back
        for i, piece in enumerate(unspill(path)):
            meanwhile(i)
            yield piece
    monkeypatch.setattr(prep, "resolve_source", lambda *a, **k: prep.Source(name="long", groups=groups))
    monkeypatch.setattr(prep, "_unspill", unspill_slowly)
    monkeypatch.setattr(prep, "SPILL_READ_TOKENS", 580)
    monkeypatch.setattr(prep, "KEEP_FRESH_S", 0.0)
    kw = {"val_tokens": 100} if split == "val_tokens" else {"val_fraction": 0.05}
    result = prep.prepare("long", out, tokenizer="bytes", shard_size=500, log=lambda line: None, **kw)
    total = sum(n for files_ in result.values() for _, n in files_)
    assert total == 6 * (len(text) + 1) and len(result["train"]) > 2  # every document with its end-of-text
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for files_ in result.values() for p, _ in files_)


def test_a_killed_prepares_temporaries_go_once_aged_while_the_next_one_runs(tmp_path, monkeypatch):
    """A prepare killed and run again at once finds the dead one's spill and shards too new to remove (a live writer
    on another host of the folder looks the same), and the spill is as large as the dataset's tokens: the rerun
    removes them once they have aged, not only a prepare started ten minutes later."""
    import time
    from llmpy import files
    out = tmp_path / "o"
    out.mkdir()
    dead_pid = 2**22 + 17  # above Linux's pid_max: no process has it
    rng = np.random.default_rng()
    dead = [out / f".long_tokens.{dead_pid}.{rng.bytes(4).hex()}.part",
            out / f".long_train_000000.bin.{dead_pid}.{rng.bytes(4).hex()}.part"]
    for p in dead:
        p.write_bytes(rng.bytes(100))  # written just now, as by a prepare killed a moment ago
    text = "hello world, some text here.\n" * 20
    logged = []

    def groups():
        for i in range(6):
            if i == 3:  # ten minutes and more into this prepare
                assert all(p.exists() for p in dead)  # too new at the start to tell from a live writer's
                for p in dead:
                    os.utime(p, (time.time() - files.ORPHAN_MIN_AGE_S - 5,) * 2)
            yield False, [text]
    monkeypatch.setattr(prep, "resolve_source", lambda *a, **k: prep.Source(name="long", groups=groups))
    monkeypatch.setattr(prep, "KEEP_FRESH_S", 0.0)
    result = prep.prepare("long", out, tokenizer="bytes", shard_size=500, val_fraction=0.05, log=logged.append)
    assert not any(p.exists() for p in dead)
    assert f"note: removed 2 temporary file(s) in {out} left by a killed llmpy process" in logged
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for files_ in result.values() for p, _ in files_)


def test_a_shard_set_aside_by_the_commit_stays_until_it_is_put_back(tmp_path, monkeypatch):
    """The commit renames each old shard to a temporary name before the new one takes its place, and puts the old ones
    back if a later move fails. A rename keeps a file's time: an old shard set aside looked to a prepare on another
    host of the folder (which tells a live writer's temporaries only by their age) like a killed run's, and its
    cleanup in the middle of the commit deleted it, so the put-back lost it."""
    import time
    from llmpy import files
    old = {}
    staging = prep.Staging()
    for k in range(2):
        final = tmp_path / f"t_train_{k:06d}.bin"
        old[final] = np.random.default_rng().bytes(64)
        final.write_bytes(old[final])
        os.utime(final, (time.time() - 2 * files.ORPHAN_MIN_AGE_S,) * 2)  # written long ago
        staging.temporary(final).write_bytes(b"new")
    last_tmp = staging.pending[-1][0]
    replace = os.replace

    def failing_last_move(src, dst):
        if Path(src) == last_tmp:  # both old shards set aside by now: the other host cleans up, then the disk fails
            with monkeypatch.context() as m:
                m.setattr(files, "_process_exists", lambda pid: False)
                files.remove_orphaned_temporaries(tmp_path)
            raise OSError(errno.EIO, "Input/output error")
        return replace(src, dst)
    monkeypatch.setattr(prep.os, "replace", failing_last_move)
    with pytest.raises(LlmpyError, match="the shards already there are as they were"):
        staging.commit()
    monkeypatch.setattr(prep.os, "replace", replace)
    assert {final: final.read_bytes() for final in old} == old
