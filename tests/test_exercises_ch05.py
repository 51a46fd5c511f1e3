"""The chapter 05 checkers accept the right answers and catch the usual mistakes with a useful message."""

import re

import pytest
import torch

from minitp import comm
from minitp.exercises import ExerciseError, ch05


# -- the 1F1B order of one stage ------------------------------------------------------------------
def order_right(stage, num_stages, microbatches):
    warmup = min(num_stages - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", i + warmup), ("B", i)]
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def order_one_warmup_too_many(stage, num_stages, microbatches):
    warmup = min(num_stages - stage, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", i + warmup), ("B", i)]
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def order_one_warmup_too_few(stage, num_stages, microbatches):
    warmup = max(min(num_stages - stage - 2, microbatches), 0)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", i + warmup), ("B", i)]
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def order_backward_before_forward(stage, num_stages, microbatches):
    warmup = min(num_stages - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("B", i), ("F", i + warmup)]  # B first: on the last stage, B0 before F0
    return order + [("B", i) for i in range(microbatches - warmup, microbatches)]


def order_gpipe(stage, num_stages, microbatches):
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def order_stub(stage, num_stages, microbatches):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_one_f_one_b_accepts_the_answer(capsys):
    ch05.check_one_f_one_b(order_right)
    assert "[ok] 1F1B order" in capsys.readouterr().out


def test_one_f_one_b_accepts_pp_actions():
    from minitp import pp

    ch05.check_one_f_one_b(lambda s, p, m: [pp.Action(kind, i) for kind, i in order_right(s, p, m)])


def test_one_f_one_b_refuses_minitps_own_schedule():
    from minitp import pp

    with pytest.raises(ExerciseError, match=r"your code calls minitp\.pp\w*\.one_f_one_b, minitp's own answer"):
        ch05.check_one_f_one_b(lambda s, p, m: pp.one_f_one_b(p, m)[s])

    from minitp.pp import one_f_one_b

    def by_its_global_name(stage, num_stages, microbatches):
        return one_f_one_b(num_stages, microbatches)[stage]

    with pytest.raises(ExerciseError, match=r"your code calls minitp\.pp\w*\.one_f_one_b"):
        ch05.check_one_f_one_b(by_its_global_name)


def test_bubble_refuses_minitps_own_formula():
    from minitp import cost

    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch05.check_bubble(cost.pp_bubble_fraction)


@pytest.mark.parametrize("answer, message", [
    (order_one_warmup_too_many, "too many warm-up forwards"),
    (order_one_warmup_too_few, "too few warm-up forwards"),
    (order_backward_before_forward, "comes before its forward"),
    (order_gpipe, "every forward before any backward"),
    (order_stub, "not done yet"),
])
def test_one_f_one_b_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=re.escape(message)):
        ch05.check_one_f_one_b(answer)


def test_one_f_one_b_shows_the_expected_order_from_the_second_try():
    with pytest.raises(ExerciseError) as first:
        ch05.check_one_f_one_b(order_one_warmup_too_many)
    assert "you gave F0 F1 F2 F3 F4 B0" in str(first.value)
    assert "F0 F1 F2 F3 B0" not in str(first.value).replace("F0 F1 F2 F3 F4 B0", "")
    assert "Expected" not in str(first.value)
    assert "show_expected('1F1B order')" in str(first.value)
    with pytest.raises(ExerciseError) as second:
        ch05.check_one_f_one_b(order_one_warmup_too_many)
    assert "Expected: F0 F1 F2 F3 B0 F4 B1" in str(second.value)


def test_one_f_one_b_shows_the_expected_order_after_show_expected(capsys):
    from minitp.exercises import show_expected

    show_expected("1F1B order")
    with pytest.raises(ExerciseError, match="Expected: F0 F1 F2 F3 B0 F4 B1"):
        ch05.check_one_f_one_b(order_one_warmup_too_many)


# -- a stage's send/recv loop (real processes) ----------------------------------------------------
def loop_right(stage, inputs, rank, world_size, microbatches, shape):
    outputs = []
    for i in range(microbatches):
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(shape)
            comm.recv(x, rank - 1, label=f"mb{i}")
        y = stage(x)
        if rank < world_size - 1:
            comm.send(y, rank + 1, label=f"mb{i}")
        outputs.append(y)
    return outputs


def loop_wrong_neighbour(stage, inputs, rank, world_size, microbatches, shape):
    outputs = []
    for i in range(microbatches):
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(shape)
            comm.recv(x, rank - 1, label=f"mb{i}")
        y = stage(x)
        if rank < world_size - 1:
            comm.send(y, (rank + 2) % world_size, label=f"mb{i}")  # skips a rank
        outputs.append(y)
    return outputs


def loop_recv_from_next(stage, inputs, rank, world_size, microbatches, shape):
    outputs = []
    for i in range(microbatches):
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(shape)
            comm.recv(x, (rank + 1) % world_size, label=f"mb{i}")
        y = stage(x)
        if rank < world_size - 1:
            comm.send(y, rank + 1, label=f"mb{i}")
        outputs.append(y)
    return outputs


def loop_untraced(stage, inputs, rank, world_size, microbatches, shape):
    import torch.distributed as dist

    outputs = []
    for i in range(microbatches):
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(shape)
            dist.recv(x, rank - 1)
        y = stage(x)
        if rank < world_size - 1:
            dist.send(y, rank + 1)
        outputs.append(y)
    return outputs


def loop_stub(stage, inputs, rank, world_size, microbatches, shape):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_send_recv_loop_accepts_the_answer(capsys):
    ch05.check_send_recv_loop(loop_right)
    assert "[ok] send/recv loop" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (loop_wrong_neighbour, "receives its input from rank r - 1"),
    (loop_recv_from_next, "receives its input from rank r - 1"),
    (loop_untraced, "through minitp.comm"),
    (loop_stub, "not done yet"),
])
def test_send_recv_loop_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=re.escape(message)):
        ch05.check_send_recv_loop(answer, nprocs=(4,), timeout=8)


# -- predict the bubble ---------------------------------------------------------------------------
def test_bubble_accepts_the_answer(capsys):
    ch05.check_bubble(lambda p, m: (p - 1) / (m + p - 1))
    assert "[ok] bubble fraction" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda p, m: (m - 1) / (m + p - 1), "m and p are swapped"),
    (lambda p, m: (p - 1) / m, "idle time over the compute time"),
    (lambda p, m: m / (m + p - 1), "busy share"),
    (lambda p, m: 0.5, "you gave 0.5000"),
])
def test_bubble_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=re.escape(message)):
        ch05.check_bubble(answer)


def test_bubble_shows_the_expected_fraction_from_the_second_try():
    # the first case: p=4, m=8, (p-1)/(m+p-1) = 3/11
    with pytest.raises(ExerciseError) as first:
        ch05.check_bubble(lambda p, m: 0.5)
    assert "0.2727" not in str(first.value) and "Expected" not in str(first.value)
    with pytest.raises(ExerciseError, match=re.escape(f"Expected: {3 / 11:.4f}")):
        ch05.check_bubble(lambda p, m: 0.5)


def test_bubble_stub_is_not_done_yet():
    def stub(p, m):
        raise NotImplementedError("Exercise")

    with pytest.raises(ExerciseError, match="not done yet"):
        ch05.check_bubble(stub)
