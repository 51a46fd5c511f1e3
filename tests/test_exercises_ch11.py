"""Chapter 11's checkers: the right answers pass, each planted mistake is caught and named, the stub
is "not done yet", minitp's own answer is refused, and the worked problems' numbers."""

import pytest
import torch
import torch.nn.functional as F

from minitp import comm
from minitp.exercises import ExerciseError, ch11, reset_tries


@pytest.fixture(autouse=True)
def _fresh_tries():
    reset_tries()


# -- exercise 1: the gather ring with its matmul ---------------------------------------------------
def ring(x_shard, weight, group, held_chunk=lambda r, k, n: (r - k) % n):
    """The gather ring with its matmul; ``held_chunk`` says whose rows step k's chunk fills."""
    n, r = comm.group_size(group), comm.group_rank(group)
    ranks = comm.group_ranks(group)
    right, left = ranks[(r + 1) % n], ranks[(r - 1) % n]
    local = x_shard.shape[1]
    out = x_shard.new_empty(x_shard.shape[0], n * local, weight.shape[0])
    held = x_shard
    for k in range(n):
        if k < n - 1:
            incoming = torch.empty_like(held)
            handles = [comm.isend(held, right, group), comm.irecv(incoming, left, group)]
        c = held_chunk(r, k, n)
        out[:, c * local:(c + 1) * local] = F.linear(held, weight)
        if k < n - 1:
            for h in handles:
                h.wait()
            held = incoming
    return out


def gather_matmul(x_shard, weight, group):
    return ring(x_shard, weight, group)


def gather_first(x_shard, weight, group):
    """Waits for each message before multiplying: the right values, nothing hidden."""
    n, r = comm.group_size(group), comm.group_rank(group)
    local = x_shard.shape[1]
    chunks, held = {r: x_shard}, x_shard
    for k in range(n - 1):
        incoming = torch.empty_like(held)
        handles = [comm.isend(held, (r + 1) % n, group), comm.irecv(incoming, (r - 1) % n, group)]
        for h in handles:
            h.wait()
        held = chunks[(r - k - 1) % n] = incoming
    out = x_shard.new_empty(x_shard.shape[0], n * local, weight.shape[0])
    for c, chunk in chunks.items():
        out[:, c * local:(c + 1) * local] = F.linear(chunk, weight)
    return out


def with_all_gather(x_shard, weight, group):
    n = comm.group_size(group)
    parts = [torch.empty_like(x_shard) for _ in range(n)]
    whole = torch.empty(n * x_shard.shape[0], *x_shard.shape[1:])
    comm.all_gather(whole, x_shard.contiguous(), group)
    parts = whole.chunk(n, dim=0)
    return F.linear(torch.cat(parts, dim=1), weight)


def rows_of_the_wrong_chunk(x_shard, weight, group):
    """Writes step k's chunk into the rows of chunk (r + k): wrong on 3 ranks."""
    return ring(x_shard, weight, group, held_chunk=lambda r, k, n: (r + k) % n)


def stub(*args):
    raise NotImplementedError


def test_the_ring_passes():
    ch11.check_gather_matmul(gather_matmul)


@pytest.mark.parametrize("answer, says", [
    (gather_first, "waited for before any matmul ran beside it"),
    (with_all_gather, "called all_gather"),
    (rows_of_the_wrong_chunk, "output is wrong in the rows of chunks"),
    (stub, "not done yet"),
])
def test_a_wrong_ring_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch11.check_gather_matmul(answer)


def test_minitps_own_ring_is_refused():
    from minitp import tp_overlap

    with pytest.raises(ExerciseError, match="exercise is to write it"):
        ch11.check_gather_matmul(lambda x, w, g: tp_overlap.all_gather_matmul(x, w, g))


# -- exercise 2: HSDP's groups ---------------------------------------------------------------------
def hsdp_ranks(world, replicate):
    shard = world // replicate
    shards = [list(range(i * shard, (i + 1) * shard)) for i in range(replicate)]
    replicas = [list(range(s, world, shard)) for s in range(shard)]
    return shards, replicas


def test_the_groups_pass():
    ch11.check_hsdp_ranks(hsdp_ranks)


@pytest.mark.parametrize("answer, says", [
    (lambda w, r: hsdp_ranks(w, r)[::-1], "swapped"),
    (lambda w, r: (hsdp_ranks(w, r)[0], [list(range(w))]), "replicate groups are"),
    (lambda w, r: ([[i] for i in range(w)], hsdp_ranks(w, r)[1]), "shard groups are"),
    (lambda w, r: None, "return a pair"),
])
def test_wrong_groups_are_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch11.check_hsdp_ranks(answer)


# -- exercise 3: HSDP's gradient reduction ---------------------------------------------------------
def hsdp_reduce(grad, shard_group, replicate_group):
    s = comm.group_size(shard_group)
    shard = torch.empty(grad.numel() // s)
    comm.reduce_scatter(shard, grad, shard_group)
    comm.all_reduce(shard, replicate_group)
    return shard / (s * comm.group_size(replicate_group))


def replicas_first(grad, shard_group, replicate_group):
    """All-reduces the whole gradient across the replicas, then reduce-scatters: the right
    values, S times the bytes across machines."""
    s = comm.group_size(shard_group)
    comm.all_reduce(grad, replicate_group)
    shard = torch.empty(grad.numel() // s)
    comm.reduce_scatter(shard, grad, shard_group)
    return shard / (s * comm.group_size(replicate_group))


def mean_over_the_shard_only(grad, shard_group, replicate_group):
    s = comm.group_size(shard_group)
    shard = torch.empty(grad.numel() // s)
    comm.reduce_scatter(shard, grad, shard_group)
    comm.all_reduce(shard, replicate_group)
    return shard / s


def over_the_world(grad, shard_group, replicate_group):
    import torch.distributed as dist

    comm.all_reduce(grad)
    s = comm.group_size(shard_group)
    return grad.chunk(s)[comm.group_rank(shard_group)] / dist.get_world_size()


def the_whole_gradient(grad, shard_group, replicate_group):
    import torch.distributed as dist

    comm.all_reduce(grad, replicate_group)
    comm.all_reduce(grad, shard_group)
    return grad / dist.get_world_size()


def test_the_reduction_passes():
    ch11.check_hsdp_reduce(hsdp_reduce)


@pytest.mark.parametrize("answer, says", [
    (replicas_first, "reduce-scatter first"),
    (mean_over_the_shard_only, "divided by one group.s size only"),
    (over_the_world, "sent over the world"),
    (the_whole_gradient, "returned the whole gradient"),
])
def test_a_wrong_reduction_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch11.check_hsdp_reduce(answer)


# -- exercise 4: the V -----------------------------------------------------------------------------
def v_placement(p):
    return [k if k < p else 2 * p - 1 - k for k in range(2 * p)]


def test_the_v_passes():
    ch11.check_v_placement(v_placement)


@pytest.mark.parametrize("answer, says", [
    (lambda p: [k % p for k in range(2 * p)], "interleaved 1F1B's placement"),
    (lambda p: [k if k < p else 2 * p - k for k in range(2 * p)], "back up on the second"),
    (lambda p: list(range(p)), "the model is cut in 2p"),
])
def test_a_wrong_v_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch11.check_v_placement(answer)


# -- exercise 5: what stays exposed ----------------------------------------------------------------
def exposed(chunk_s, message_s, n):
    return (n - 1) * message_s, (n - 1) * max(0.0, message_s - chunk_s)


def test_the_exposed_time_passes():
    ch11.check_exposed(exposed)


@pytest.mark.parametrize("answer, says", [
    (lambda c, m, n: (n * m, n * max(0.0, m - c)), "counts n messages"),
    (lambda c, m, n: ((n - 1) * m, max(0.0, (n - 1) * m - n * c)), "hide behind any chunk"),
    (lambda c, m, n: ((n - 1) * m, 0.0), "beyond its chunk"),
])
def test_a_wrong_exposed_time_is_caught(answer, says):
    with pytest.raises(ExerciseError, match=says):
        ch11.check_exposed(answer)


# -- worked problems -------------------------------------------------------------------------------
def test_the_worked_problems_numbers():
    assert ch11.PROBLEMS[1].want() == pytest.approx(4.79, abs=0.01)
    assert ch11.PROBLEMS[2].want() == pytest.approx(7.42, abs=0.01)
    assert ch11.PROBLEMS[3].want() == pytest.approx(7 / 199)


def test_a_slip_in_a_worked_problem_is_named():
    with pytest.raises(ExerciseError, match="1F1B"):
        ch11.check_problem(3, lambda: 7 / 39)
    with pytest.raises(ExerciseError, match="whole gradient"):
        ch11.check_problem(2, lambda: 8 * ch11.PROBLEMS[2].want())
    ch11.check_problem(1, lambda: 4.8)
