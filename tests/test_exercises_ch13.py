"""Chapter 13's checkers: the right answers pass, each wrong answer is named, and the worked problems'
answers are minitp.cost's and the GPT-2 shapes'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minitp import comm
from minitp.exercises import ExerciseError, ch13
from minitp.exercises.grade import load_project

PROJECT = load_project(str(Path(__file__).parent.parent / "notebooks" / "project.py"))


# -- exercise 1 --------------------------------------------------------------------------------------
def test_the_projects_split_passes(capsys):
    ch13.check_shard(PROJECT.shard)
    assert "[ok] the split of GPT-2: correct" in capsys.readouterr().out


def contiguous_qkv(name, whole, tp, rank):
    if "c_attn." in name:
        return whole.chunk(tp)[rank].clone()
    return PROJECT.shard(name, whole, tp, rank)


def split_layernorm(name, whole, tp, rank):
    if ".ln_" in name:
        return whole.chunk(tp)[rank].clone()
    return PROJECT.shard(name, whole, tp, rank)


def row_by_rows(name, whole, tp, rank):
    if name.endswith("c_proj.weight"):
        return whole.chunk(tp)[rank].clone()
    return PROJECT.shard(name, whole, tp, rank)


def row_bias_split(name, whole, tp, rank):
    if name.endswith("c_proj.bias"):
        return whole.chunk(tp)[rank].clone()
    return PROJECT.shard(name, whole, tp, rank)


@pytest.mark.parametrize("answer, said", [
    (contiguous_qkv, "all of them q's"),
    (split_layernorm, "h.0.ln_1.weight at tp=2: rank 0's slice is (64,); it is whole on every rank"),
    (row_by_rows, "split along its columns (dim 1: a row-parallel layer's inputs)"),
    (row_bias_split, "h.0.attn.c_proj.bias at tp=2: rank 0's slice is (64,); it is whole"),
])
def test_a_wrong_split_is_named(answer, said):
    with pytest.raises(ExerciseError, match=None) as caught:
        ch13.check_shard(answer)
    assert said in str(caught.value)


# -- exercise 2 --------------------------------------------------------------------------------------
def row_parallel(x, weight, bias, group):
    partial = torch.nn.functional.linear(x, weight)
    comm.all_reduce(partial, group)
    return partial + bias


def row_parallel_bias_before(x, weight, bias, group):
    partial = torch.nn.functional.linear(x, weight, bias)
    comm.all_reduce(partial, group)
    return partial


def row_parallel_no_sum(x, weight, bias, group):
    return torch.nn.functional.linear(x, weight, bias)


def test_a_stub_on_the_ranks_is_not_done_yet():
    def stub(x, weight, bias, group):
        raise NotImplementedError("Exercise: write this part, then run the checker below")

    with pytest.raises(ExerciseError, match="not done yet"):
        ch13.check_row_parallel(stub)


def test_the_row_parallel_layer_passes(capsys):
    ch13.check_row_parallel(row_parallel)
    assert "[ok] the row-parallel layer with a bias: correct" in capsys.readouterr().out


@pytest.mark.parametrize("answer, said", [
    (row_parallel_bias_before, "holds the bias 2 times"),
    (row_parallel_no_sum, "its own partial product"),
])
def test_a_wrong_row_parallel_layer_is_named(answer, said):
    with pytest.raises(ExerciseError) as caught:
        ch13.check_row_parallel(answer)
    assert said in str(caught.value)


# -- exercise 3 --------------------------------------------------------------------------------------
def exchange(grad, peer, group):
    theirs = torch.empty_like(grad)
    sent = comm.isend(grad.clone(), peer, group)
    comm.recv(theirs, peer, group)
    sent.wait()
    grad += theirs


def add_own(grad, peer, group):
    grad += grad.clone()


def one_side(grad, peer, group):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        theirs = torch.empty_like(grad)
        comm.recv(theirs, peer, group)
        grad += theirs
    else:
        comm.send(grad, peer, group)


def receive_first(grad, peer, group):
    theirs = torch.empty_like(grad)
    comm.recv(theirs, peer, group)  # both ranks wait here
    comm.send(grad, peer, group)
    grad += theirs


def exchange_twice(grad, peer, group):
    for _ in range(2):
        theirs = torch.empty_like(grad)
        sent = comm.isend(grad.clone(), peer, group)
        comm.recv(theirs, peer, group)
        sent.wait()
    grad += theirs


def test_a_hanging_exchange_is_named_with_what_both_ranks_wait_in():
    with pytest.raises(ExerciseError) as caught:
        ch13.check_tied_gradients(receive_first, timeout=6)
    said = str(caught.value)
    assert "hung and was stopped after 6 s" in said and "Both ranks waiting to receive first" in said


def test_the_exchange_passes(capsys):
    ch13.check_tied_gradients(exchange)
    assert "[ok] the tied embedding's gradients: correct" in capsys.readouterr().out


@pytest.mark.parametrize("answer, said", [
    (add_own, "added its own gradient again"),
    (one_side, "rank 1 does not hold the sum"),
    (exchange_twice, "each sends its gradient once"),
])
def test_a_wrong_exchange_is_named(answer, said):
    with pytest.raises(ExerciseError) as caught:
        ch13.check_tied_gradients(answer)
    assert said in str(caught.value)


# -- exercise 4 --------------------------------------------------------------------------------------
def counts_right(name, dp_rank, tp_rank):
    if dp_rank or name == "lm_head.weight":
        return False
    split = any(part in name for part in ("c_attn.", "c_fc.", "c_proj.weight", "wte."))
    return split or tp_rank == 0


def test_the_rule_passes(capsys):
    ch13.check_counts_in_norm(counts_right)
    assert "[ok] what counts in the global norm: correct" in capsys.readouterr().out


@pytest.mark.parametrize("answer, said", [
    (lambda name, dp, tp: dp == 0 and name != "lm_head.weight", "counted on tp rank 0 only"),
    (lambda name, dp, tp: counts_right(name, 0, tp), "a dp replica holds the same gradient"),
    (lambda name, dp, tp: counts_right(name, dp, tp) or (dp == 0 and name == "lm_head.weight"),
     "counted there already"),
    (lambda name, dp, tp: dp == 0 and tp == 0 and name != "lm_head.weight", "every slice counts"),
])
def test_a_wrong_rule_is_named(answer, said):
    with pytest.raises(ExerciseError) as caught:
        ch13.check_counts_in_norm(answer)
    assert said in str(caught.value)


def test_the_answer_itself_is_refused():
    with pytest.raises(ExerciseError, match="minitp's own answer"):
        ch13.check_counts_in_norm(ch13.counts)


# -- the worked problems ---------------------------------------------------------------------------
def test_the_problems_answers():
    assert ch13.PROBLEMS[1].want() == pytest.approx(31.0, abs=0.05)
    assert ch13.PROBLEMS[2].want() == pytest.approx(50257 * 768 / 4 * 4 / 2**20)
    assert ch13.PROBLEMS[3].want() == pytest.approx(1.758, abs=0.001)
