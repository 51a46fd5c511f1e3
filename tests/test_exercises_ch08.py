"""The chapter 08 checkers accept the right answers and catch the usual mistakes with a useful message."""

import math

import pytest
import torch
import torch.nn.functional as F
from hint_levels import first_then_second as _first_then_second

from minitp import comm
from minitp.exercises import ExerciseError, ch08


def _stub(*args):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


# -- capacity ------------------------------------------------------------------------------------
def capacity_right(seq_len, n_experts, top_k, capacity_factor):
    return min(seq_len, math.ceil(capacity_factor * seq_len * top_k / n_experts))


def test_capacity_accepts_the_answer(capsys):
    ch08.check_capacity(capacity_right)
    assert "[ok] expert capacity" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda s, e, k, c: min(s, math.floor(c * s * k / e)), "Round up"),
    (lambda s, e, k, c: min(s, math.ceil(c * s / e)), "k·S of them"),
    (lambda s, e, k, c: math.ceil(c * s * k / e), "cap at S"),
    (_stub, "not done yet"),
])
def test_capacity_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch08.check_capacity(answer)


# -- the capacity mask ---------------------------------------------------------------------------
def mask_right(expert, n_experts, capacity):
    B, S, k = expert.shape
    queue = F.one_hot(expert.transpose(1, 2).reshape(B, k * S), n_experts)
    place = ((queue.cumsum(1) - 1) * queue).sum(-1)
    return (place < capacity).view(B, k, S).transpose(1, 2)


def mask_token_major(expert, n_experts, capacity):
    B, S, k = expert.shape
    queue = F.one_hot(expert.reshape(B, S * k), n_experts)
    place = ((queue.cumsum(1) - 1) * queue).sum(-1)
    return (place < capacity).view(B, S, k)


def mask_over_the_whole_batch(expert, n_experts, capacity):
    B, S, k = expert.shape
    return mask_right(expert.reshape(1, B * S, k), n_experts, capacity).view(B, S, k)


def mask_off_by_one(expert, n_experts, capacity):
    return mask_right(expert, n_experts, capacity + 1)


def test_capacity_mask_accepts_the_answer(capsys):
    ch08.check_capacity_mask(mask_right)
    assert "[ok] capacity mask" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (mask_token_major, "slot-major"),
    (mask_over_the_whole_batch, "per sequence"),
    (mask_off_by_one, "place < capacity"),
    (lambda expert, e, c: expert, "wrong"),
    (_stub, "not done yet"),
])
def test_capacity_mask_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch08.check_capacity_mask(answer)


# -- dispatch with all_to_all --------------------------------------------------------------------
def dispatch_right(rows, counts, group):
    n = comm.group_size(group)
    incoming = torch.empty_like(counts)
    comm.all_to_all(incoming, counts, group=group)
    incoming = incoming.view(n, -1)
    send, recv = counts.view(n, -1).sum(1).tolist(), incoming.sum(1).tolist()
    received = rows.new_empty(sum(recv), rows.shape[1])
    comm.all_to_all(received, rows, recv, send, group=group)
    return received, incoming


def dispatch_splits_per_expert(rows, counts, group):
    n = comm.group_size(group)
    incoming = torch.empty_like(counts)
    comm.all_to_all(incoming, counts, group=group)
    received = rows.new_empty(int(incoming.sum()), rows.shape[1])
    comm.all_to_all(received, rows, incoming.tolist(), counts.tolist(), group=group)
    return received, incoming.view(n, -1)


def dispatch_without_the_counts(rows, counts, group):
    n = comm.group_size(group)
    send = counts.view(n, -1).sum(1).tolist()
    received = rows.new_empty(sum(send), rows.shape[1])
    comm.all_to_all(received, rows, send, send, group=group)  # assumes what comes equals what goes
    return received, counts.view(n, -1)


def dispatch_flat_incoming(rows, counts, group):
    received, incoming = dispatch_right(rows, counts, group)
    return received, incoming.reshape(-1)  # (E,): the right counts, not laid out (n, E/n)


def dispatch_untraced(rows, counts, group):
    import torch.distributed as dist

    n = comm.group_size(group)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts)
    incoming = incoming.view(n, -1)
    send, recv = counts.view(n, -1).sum(1).tolist(), incoming.sum(1).tolist()
    received = rows.new_empty(sum(recv), rows.shape[1])
    dist.all_to_all_single(received, rows, recv, send)
    return received, incoming


def test_dispatch_accepts_the_answer(capsys):
    ch08.check_dispatch(dispatch_right)
    assert "[ok] dispatch with all_to_all" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (dispatch_splits_per_expert, "rows per \\*rank\\*"),
    (dispatch_without_the_counts, "exchange the counts first"),
    (dispatch_untraced, "minitp.comm.all_to_all"),
    (dispatch_flat_incoming, r"rank 0's incoming counts have shape \(8,\), expected \(4, 2\) \(n, E/n\)"),
    (_stub, "not done yet"),
])
def test_dispatch_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch08.check_dispatch(answer, nprocs=(4,))


# -- the bytes of one layer ----------------------------------------------------------------------
def layer_bytes_right(tokens, rank, dim, dtype_bytes):
    n = len(tokens)
    out_rows = sum(tokens[rank][j] for j in range(n) if j != rank)
    in_rows = sum(tokens[i][rank] for i in range(n) if i != rank)
    return 2 * (out_rows + in_rows) * dim * dtype_bytes


def test_layer_bytes_accepts_the_answer(capsys):
    ch08.check_layer_bytes(layer_bytes_right)
    assert "[ok] bytes of one MoE layer" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda t, r, d, b: layer_bytes_right(t, r, d, b) / 2, "forward only"),
    (lambda t, r, d, b: 2 * (sum(t[r]) + sum(row[r] for row in t)) * d * b, "diagonal"),  # rows to itself too
    (lambda t, r, d, b: 4 * sum(t[r][j] for j in range(len(t)) if j != r) * d * b, "received"),
    (lambda t, r, d, b: layer_bytes_right(t, r, d, b) / b, "bytes per element"),
    (_stub, "not done yet"),
])
def test_layer_bytes_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch08.check_layer_bytes(answer)


# -- hints in levels: the expected value shows from the second wrong try on ----------------------------
def test_capacity_shows_the_expected_capacity_from_the_second_try():
    # the first case: S=16, E=8, k=2, c=1.25: ceil(1.25·16·2/8) = 5
    _first_then_second(ch08.check_capacity, lambda s, e, k, c: 99, expected="5")


def test_layer_bytes_show_the_expected_bytes_from_the_second_try():
    # the first case: T = [[5, 3], [2, 6]], rank 0, D=4, b=4: 2·(3 + 2)·4·4 = 160
    _first_then_second(ch08.check_layer_bytes, lambda t, r, d, b: 1, expected="160 bytes")


def dispatch_counts_off_by_one(rows, counts, group):
    received, incoming = dispatch_right(rows, counts, group)
    return received, incoming + 1


def test_dispatch_shows_the_expected_counts_from_the_second_try():
    want = str(ch08._expected_dispatch(2, 0)[1].tolist())  # rank 0 of 2
    _first_then_second(ch08.check_dispatch, dispatch_counts_off_by_one, expected=want, nprocs=(2,))


def test_capacity_mask_refuses_minitps_own_mask():
    from minitp.models import moe

    def calls_the_library(expert, n_experts, capacity):
        return moe.capacity_mask(expert, n_experts, capacity)

    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch08.check_capacity_mask(moe.capacity_mask)
    with pytest.raises(ExerciseError, match="your code calls minitp.models.moe.capacity_mask"):
        ch08.check_capacity_mask(calls_the_library)
