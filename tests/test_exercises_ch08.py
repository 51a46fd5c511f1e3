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


def dispatch_rows_reversed(rows, counts, group):
    received, incoming = dispatch_right(rows, counts, group)
    return received.flip(0), incoming  # the right counts, the rows in the wrong order


def test_dispatch_shows_the_expected_rows_only_from_the_second_try():
    rows = ch08._expected_dispatch(2, 0)[0]  # rank 0 of 2
    want = f"{tuple(rows.shape)} rows, the first {rows[:4].int().tolist()} as (source, expert, i)"
    _first_then_second(ch08.check_dispatch, dispatch_rows_reversed, expected=want, nprocs=(2,))


# -- combine, and the backward -------------------------------------------------------------------
def _send_back(done, output_splits, input_splits, group):
    out = done.new_empty(sum(output_splits), done.shape[1])
    comm.all_to_all(out, done.contiguous(), output_splits, input_splits, group=group)
    return out


class Combine(torch.autograd.Function):
    """The outputs back to their tokens' ranks; backward: their gradients out to the experts."""

    @staticmethod
    def forward(ctx, done, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _send_back(done, send_splits, recv_splits, group)  # (A, D): the dispatch reversed

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _send_back(grad, recv_splits, send_splits, ctx.group), None, None, None  # (R, D)


def _weighted_sum(back, order, gate, gate_power=1):
    T, k = gate.shape
    slots = back.new_zeros(T * k, back.shape[1]).index_copy(0, order, back)  # (T·k, D), zero where dropped
    return (gate.unsqueeze(-1) ** gate_power * slots.view(T, k, -1)).sum(1)  # (T, D)


def combine_right(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(Combine.apply(done, send_splits, recv_splits, group), order, gate)


def combine_splits_swapped(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(Combine.apply(done, recv_splits, send_splits, group), order, gate)


def combine_without_gates(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(Combine.apply(done, send_splits, recv_splits, group), order, gate, gate_power=0)


def combine_gates_twice(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(Combine.apply(done, send_splits, recv_splits, group), order, gate, gate_power=2)


def combine_not_summed(done, order, gate, send_splits, recv_splits, group):
    back = Combine.apply(done, send_splits, recv_splits, group)
    T, k = gate.shape
    slots = back.new_zeros(T * k, back.shape[1]).index_copy(0, order, back)
    return gate.unsqueeze(-1) * slots.view(T, k, -1)  # (T, k, D): the k copies never added


def combine_last_copy_wins(done, order, gate, send_splits, recv_splits, group):
    back = Combine.apply(done, send_splits, recv_splits, group)
    T, k = gate.shape
    weighted = gate.reshape(-1)[order].unsqueeze(-1) * back  # (A, D)
    first = order % k == 0
    return back.new_zeros(T, back.shape[1]).index_copy(0, order[first] // k, weighted[first])  # slot 0 only


class NoGradientBack(Combine):
    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None


class GradientKeptHere(Combine):
    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None  # (A, D) where (R, D) is due: never sent


class BackwardSplitsNotSwapped(Combine):
    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _send_back(grad, send_splits, recv_splits, ctx.group), None, None, None


def combine_no_gradient_back(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(NoGradientBack.apply(done, send_splits, recv_splits, group), order, gate)


def combine_gradient_kept_here(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(GradientKeptHere.apply(done, send_splits, recv_splits, group), order, gate)


def combine_backward_splits_not_swapped(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(BackwardSplitsNotSwapped.apply(done, send_splits, recv_splits, group), order, gate)


def combine_gate_detached(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(Combine.apply(done, send_splits, recv_splits, group), order, gate.detach())


class Untraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, done, send_splits, recv_splits, group):
        import torch.distributed as dist

        ctx.splits = (send_splits, recv_splits)
        out = done.new_empty(sum(send_splits), done.shape[1])
        dist.all_to_all_single(out, done.contiguous(), send_splits, recv_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        send_splits, recv_splits = ctx.splits
        out = grad.new_empty(sum(recv_splits), grad.shape[1])
        dist.all_to_all_single(out, grad.contiguous(), recv_splits, send_splits)
        return out, None, None, None


def combine_untraced(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(Untraced.apply(done, send_splits, recv_splits, group), order, gate)


def test_combine_accepts_the_answer_on_2_and_4_ranks(capsys):
    ch08.check_combine(combine_right)
    assert "[ok] combine and its backward" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (combine_splits_swapped, "the dispatch's two split sizes trade places"),
    (combine_without_gates, "The gates are never applied"),
    (combine_gates_twice, "The gates are applied twice"),
    (combine_not_summed, r"returned shape \(\d+, 2, 3\).*sum over the slots"),
    (combine_last_copy_wins, "Only one of each token's k outputs counts"),
    (combine_no_gradient_back, "experts got no gradient. The gradient was not sent back"),
    (combine_gradient_kept_here, "backward sends the gradients the way the rows first went"),
    (combine_backward_splits_not_swapped, "backward sends the gradients the way the rows first went"),
    (combine_gate_detached, "the gates' gradient must flow too"),
    (combine_untraced, "minitp.comm.all_to_all"),
    (_stub, "not done yet"),
])
def test_combine_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch08.check_combine(answer, nprocs=(4,))


def test_combine_shows_the_expected_output_from_the_second_try():
    reference = ch08._combine_reference(2)["y"][0][0]
    _first_then_second(ch08.check_combine, combine_gates_twice, nprocs=(2,),
                       expected=f"y[0] = {[round(v, 5) for v in reference.tolist()]}")


def test_combine_refuses_minitps_own_all_to_all_and_combine():
    from minitp import regions
    from minitp.models import moe

    def with_the_library(done, order, gate, send_splits, recv_splits, group):
        back = regions.all_to_all_rows(done, send_splits, recv_splits, group)
        return _weighted_sum(back, order, gate)

    class LibraryInside(torch.autograd.Function):
        @staticmethod
        def forward(ctx, done, send_splits, recv_splits, group):
            return regions.all_to_all_rows(done, send_splits, recv_splits, group)

    def with_the_library_inside_a_function(done, order, gate, send_splits, recv_splits, group):
        return _weighted_sum(LibraryInside.apply(done, send_splits, recv_splits, group), order, gate)

    def with_moe_combine(done, order, gate, send_splits, recv_splits, group):
        return moe.combine(Combine.apply(done, send_splits, recv_splits, group), gate)

    for answer in (with_the_library, with_moe_combine):
        with pytest.raises(ExerciseError, match="the exercise is to write it"):
            ch08.check_combine(answer)
    with pytest.raises(ExerciseError, match="your code calls minitp.regions.all_to_all_rows"):
        ch08.check_combine(with_the_library_inside_a_function)

    def send_back(done, send_splits, recv_splits, group):  # a helper of the answer's own
        return regions.all_to_all_rows(done, send_splits, recv_splits, group)

    def with_the_library_in_a_helper(done, order, gate, send_splits, recv_splits, group):
        return _weighted_sum(send_back(done, send_splits, recv_splits, group), order, gate)

    with pytest.raises(ExerciseError, match="your code calls minitp.regions.all_to_all_rows"):
        ch08.check_combine(with_the_library_in_a_helper)


def test_the_combine_data_is_exercise_3s_dispatch_with_two_different_experts_per_token():
    for rank in range(4):
        x, order, experts, counts = ch08._combine_data(rank)
        rows, want_counts = ch08._dispatch_data(rank)
        assert torch.equal(counts, want_counts) and len(order) == len(rows) == int(counts.sum())
        assert (experts[:, 0] != experts[:, 1]).all()  # a token's k experts differ
        assert len(set(order.tolist())) == len(order) < experts.numel()  # each slot once; some dropped
        # row a of the dispatch (grouped by expert) is the slot order[a], whose expert is the row's
        assert torch.equal(experts.reshape(-1)[order], torch.repeat_interleave(torch.arange(8), counts))


class LibraryCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, done, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return done.new_empty(sum(send_splits), done.shape[1])

    @staticmethod
    def backward(ctx, grad):
        from minitp import regions

        send_splits, recv_splits = ctx.splits
        return regions.all_to_all_rows(grad, recv_splits, send_splits, ctx.group), None, None, None


def combine_library_in_a_global_function(done, order, gate, send_splits, recv_splits, group):
    return _weighted_sum(LibraryCombine.apply(done, send_splits, recv_splits, group), order, gate)


def test_combine_reads_the_autograd_function_it_uses_by_a_global_name():
    with pytest.raises(ExerciseError, match="your code calls minitp.regions.all_to_all_rows"):
        ch08.check_combine(combine_library_in_a_global_function)
