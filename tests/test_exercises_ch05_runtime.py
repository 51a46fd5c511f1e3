"""Chapter 05's zero-bubble-table and 1F1B-runtime checkers accept the answer and catch the typical
mistakes, each with a message that says which (planted-mistake tests)."""

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


# -- a 1F1B runtime (real processes) --------------------------------------------------------------
def runtime_right(stage, actions, inputs, targets, rank, world_size, shape, loss_fn, send_gradient=True):
    m = len(actions) // 2
    kept, sends = {}, []
    for kind, i in actions:
        if kind == "F":
            if rank == 0:
                x = inputs[i]
            else:
                x = torch.empty(shape)
                comm.irecv(x, rank - 1, label=f"F{i}").wait()
                x.requires_grad_()
            y = stage(x)
            if rank == world_size - 1:
                y = loss_fn(y, targets[i]) / m
            else:
                sends.append(comm.isend(y.detach(), rank + 1, label=f"F{i}"))
            kept[i] = (x, y)
        else:
            x, y = kept.pop(i)
            grad = None
            if rank < world_size - 1:
                grad = torch.empty(shape)
                comm.irecv(grad, rank + 1, label=f"B{i}").wait()
            torch.autograd.backward(y, grad)
            if rank > 0 and send_gradient:
                sends.append(comm.isend(x.grad, rank - 1, label=f"B{i}"))
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


def test_pipeline_runtime_names_a_hang():
    # rank 0 waits for the gradient of micro-batch 0 that rank 1 never sends
    with pytest.raises(ExerciseError, match=r"the run on 2 ranks hung \(rank 0.*never finished\).*A rank waited for a "
                       "message that never came"):
        ch05.check_pipeline_runtime(runtime_forgets_to_send_the_gradient, timeout=8)
