"""Chapter 05's zero-bubble-table and 1F1B-runtime checkers accept the answer and catch the typical
mistakes, each with a message that says which (planted-mistake tests)."""

import time

import pytest
import torch

from minitp import comm, pp
from minitp.exercises import ExerciseError, ch05


# -- the zero-bubble table --------------------------------------------------------------------------
def zb_right(stage, num_stages, microbatches):
    p, m = num_stages, microbatches
    first = min(p - stage, m)
    out = [("F", i) for i in range(first)]
    for i in range(m):
        out.append(("B", i))
        if i >= stage:
            out.append(("W", i - stage))
        if i + first < m:
            out.append(("F", i + first))
    return out + [("W", i) for i in range(max(m - stage, 0), m)]


def zb_no_w(stage, num_stages, microbatches):
    return [(a.kind, a.microbatch) for a in pp.one_f_one_b(num_stages, microbatches)[stage]]


def zb_w_at_the_end(stage, num_stages, microbatches):
    return zb_no_w(stage, num_stages, microbatches) + [("W", i) for i in range(microbatches)]


def zb_w_right_after_b(stage, num_stages, microbatches):
    out = []
    for kind, i in zb_no_w(stage, num_stages, microbatches):
        out += [(kind, i)] + ([("W", i)] if kind == "B" else [])
    return out


def zb_stub(stage, num_stages, microbatches):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_zero_bubble_accepts_the_answer(capsys):
    ch05.check_zero_bubble(zb_right)
    out = capsys.readouterr().out
    assert "[ok] zero-bubble table" in out and "0.111" in out and "0.273" in out


@pytest.mark.parametrize("answer, message", [
    (zb_no_w, "There is no W"),
    (zb_w_at_the_end, "Every W waits until the end"),
    (zb_w_right_after_b, "runs W\\(i - s\\) right after B\\(i\\)"),
    (zb_stub, "not done yet"),
])
def test_zero_bubble_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch05.check_zero_bubble(answer)


def test_zero_bubble_shows_the_expected_table_from_the_second_try():
    want = " ".join(f"{a.kind}{a.microbatch}" for a in pp.zero_bubble_h1(4, 8)[0])  # the first case: stage 0
    with pytest.raises(ExerciseError) as first:
        ch05.check_zero_bubble(zb_no_w)
    assert want not in str(first.value) and "show_expected('zero-bubble table')" in str(first.value)
    with pytest.raises(ExerciseError) as second:
        ch05.check_zero_bubble(zb_no_w)
    assert f"Expected: {want}" in str(second.value)


# -- a 1F1B runtime (real processes) --------------------------------------------------------------
def runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn, send_gradient=True,
                  gradient_from=lambda rank, world_size: rank + 1, blocking_send=False, input_requires_grad=True):
    m = len(actions) // 2
    kept, sends = {}, []

    def send(tensor, dst, label):
        if blocking_send:
            comm.send(tensor, dst, label=label)
        else:
            sends.append(comm.isend(tensor, dst, label=label))

    for kind, i in actions:
        if kind == "F":
            if rank == 0:
                x = inputs[i]
            else:
                x = torch.empty(shape)
                comm.irecv(x, rank - 1, label=f"F{i}").wait()
                if input_requires_grad:
                    x.requires_grad_()
            y = stage(x)
            if rank == world_size - 1:
                y = loss_fn(y, targets[i]) / m
            else:
                send(y.detach(), rank + 1, f"F{i}")
            kept[i] = (x, y)
        else:
            x, y = kept.pop(i)
            grad = None
            if rank < world_size - 1:
                grad = torch.empty(shape)
                comm.irecv(grad, gradient_from(rank, world_size), label=f"B{i}").wait()
            torch.autograd.backward(y, grad)
            if rank > 0 and send_gradient:
                send(x.grad, rank - 1, f"B{i}")
    for handle in sends:
        handle.wait()


def runtime_no_division(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    m = len(actions) // 2
    return runtime_right(stage, actions, inputs, targets, rank, world_size, shape,
                         lambda y, t: loss_fn(y, t) * m)  # the loss is never divided by m


def runtime_gpipe_order(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    m = len(actions) // 2
    order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return runtime_right(stage, order, inputs, targets, rank, world_size, shape, loss_fn)


def runtime_forgets_to_send_the_gradient(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    return runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn, send_gradient=False)


def runtime_gradient_from_the_ring_neighbour(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    # chapter 00's ring habit: (rank - 1) % n is rank + 1 on 2 ranks, but rank 0's "previous" is rank 3 on 4
    return runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn,
                         gradient_from=lambda rank, world_size: (rank - 1) % world_size)


def runtime_gradient_from_rank_minus_one(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    return runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn,
                         gradient_from=lambda rank, world_size: rank - 1)  # rank 0 asks rank -1


def runtime_blocking_send(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    return runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn, blocking_send=True)


def runtime_input_without_requires_grad(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    # x.grad stays None: the gradient sent back is None
    return runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn, input_requires_grad=False)


def runtime_stub(stage, actions, inputs, targets, rank, world_size, shape, loss_fn):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_pipeline_runtime_accepts_the_answer(capsys):
    ch05.check_pipeline_runtime(runtime_right)
    assert "[ok] 1F1B runtime" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (runtime_no_division, "4 times the right one: divide each micro-batch's loss by m"),
    (runtime_gpipe_order, "another order than the table"),
    (runtime_stub, "not done yet"),
])
def test_pipeline_runtime_catches_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        ch05.check_pipeline_runtime(answer)


def _hang_message(answer, timeout=8) -> str:
    with pytest.raises(ExerciseError) as info:
        ch05.check_pipeline_runtime(answer, timeout=timeout)
    return str(info.value)


def test_pipeline_runtime_names_a_hang():
    # rank 0 waits for the gradient of micro-batch 0 that rank 1 never sends; rank 1 for rank 0's next forward
    message = _hang_message(runtime_forgets_to_send_the_gradient)
    assert message.startswith("1F1B runtime: the run on 2 ranks hung and was stopped after 8 s.\n"), message
    assert '  rank 0: in irecv(...).wait() from rank 1, label "answer/B0", shape (2, 8, 64)' in message
    assert '  rank 1: in irecv(...).wait() from rank 0, label "answer/F2"' in message
    assert message.endswith("Every stuck rank waits to receive: a send is missing or goes the wrong way."), message
    assert len(message.splitlines()) == 4 and len(message) < 400, message


def test_pipeline_runtime_names_the_wrong_neighbour_a_gradient_is_awaited_from():
    message = _hang_message(runtime_gradient_from_the_ring_neighbour)
    assert "the run on 4 ranks hung" in message
    assert '  rank 0: in irecv(...).wait() from rank 3, label "answer/B0"' in message
    assert message.endswith("a send is missing or goes the wrong way."), message
    assert len(message.splitlines()) == 6, message


def test_pipeline_runtime_names_a_blocking_send_both_ways():
    message = _hang_message(runtime_blocking_send)
    assert '  rank 0: in send to rank 1, label "answer/F1"' in message
    assert '  rank 1: in send to rank 0, label "answer/B0"' in message
    assert message.endswith("Rank 0's send waits for rank 1 to receive it, but rank 1 is in send to rank 0: a "
                            "blocking send returns only once the other side receives, so post one side with isend "
                            "(or receive first on one side)."), message


@pytest.mark.parametrize("answer, message", [
    (runtime_gradient_from_rank_minus_one,
     r"rank 0 raised ValueError: comm.irecv: src=-1 is not a rank of the group; expected one of \(0, 1\)"),
    (runtime_input_without_requires_grad,
     r"rank 1 raised TypeError: comm.isend: tensor must be a torch.Tensor, got None \(a gradient that was never "
     r"computed\?\)"),
])
def test_pipeline_runtime_refuses_a_bad_message_at_once(answer, message):
    t0 = time.perf_counter()
    with pytest.raises(ExerciseError, match=message) as info:
        ch05.check_pipeline_runtime(answer, timeout=60)
    assert time.perf_counter() - t0 < 30  # refused at the call, not after the timeout
    frames = [line for line in str(info.value).splitlines() if line.startswith("  File ")]
    assert "comm.py" not in str(info.value) and __file__.rsplit("/", 1)[-1] in frames[-1]  # ends in the answer


def test_zero_bubble_refuses_minitps_own_table():
    with pytest.raises(ExerciseError, match=r"your code calls minitp\.pp\w*\.zero_bubble_h1"):
        ch05.check_zero_bubble(lambda s, p, m: pp.zero_bubble_h1(p, m)[s])
