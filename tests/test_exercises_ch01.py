"""The chapter 01 checkers accept the right answers and catch the usual mistakes with a useful message."""

import pytest
import torch
from hint_levels import first_then_second as _first_then_second

from minitp import comm, ddp
from minitp.exercises import ExerciseError, ch01


# -- exercise 1: split the batch ------------------------------------------------------------------
def split_right(batch, rank, world_size):
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows]


def split_whole_batch(batch, rank, world_size):  # every rank sees everything
    return batch


def split_same_rows(batch, rank, world_size):  # every rank reads the first m/n rows (duplicated shards)
    return batch[:batch.shape[0] // world_size]


def split_overlapping(batch, rank, world_size):  # one row too many: neighbours overlap
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows + 1]


def split_wrong_rank(batch, rank, world_size):
    return split_right(batch, (rank + 1) % world_size, world_size)


def split_strided(batch, rank, world_size):
    return batch[rank::world_size]


def split_columns(batch, rank, world_size):
    cols = batch.shape[1]
    return batch[:, rank * cols // world_size:(rank + 1) * cols // world_size]


def split_in_place(batch, rank, world_size):
    batch.zero_()
    return split_right(batch, rank, world_size)


def stub(*args):
    raise NotImplementedError


def test_split_right_passes(capsys):
    ch01.check_split_batch(split_right)
    assert "[ok] split the batch" in capsys.readouterr().out


@pytest.mark.parametrize("fn, message", [
    (split_whole_batch, "whole batch"),
    (split_same_rows, "rank 0's rows"),
    (split_overlapping, "an equal share, m/n rows"),
    (split_wrong_rank, "you returned rank 1's rows"),
    (split_strided, "like cards"),
    (split_columns, "slice along dim 0"),
    (split_in_place, "changed the batch"),
    (stub, "not done yet"),
])
def test_split_mistakes_caught(fn, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_split_batch(fn)


# -- exercise 2: average a bucket (runs on 2 and 4 processes) -------------------------------------
def average_right(bucket):
    bucket /= comm.group_size()
    comm.all_reduce(bucket)
    return bucket


def average_after(bucket):  # divide after the sum: also right, and returns nothing (in place)
    comm.all_reduce(bucket)
    bucket /= comm.group_size()


def average_sums(bucket):
    comm.all_reduce(bucket)
    return bucket


def average_missing_all_reduce(bucket):
    return bucket / comm.group_size()


def average_local_only(bucket):
    return bucket


def average_result_dropped(bucket):
    out = bucket.clone()
    comm.all_reduce(bucket)
    return out / comm.group_size()


def average_twice_divided(bucket):
    n = comm.group_size()
    bucket /= n
    comm.all_reduce(bucket)
    return bucket / n


def average_per_element(bucket):  # right values, one message per element
    n = comm.group_size()
    for i in range(bucket.numel()):
        piece = bucket[i:i + 1].clone()
        comm.all_reduce(piece)
        bucket[i] = piece[0] / n
    return bucket


def average_untraced(bucket):
    import torch.distributed as dist

    dist.all_reduce(bucket)
    return bucket / dist.get_world_size()


def average_with_gather(bucket):  # right values from an all-gather: wrong collective
    n = comm.group_size()
    out = torch.empty(n * bucket.numel())
    comm.all_gather(out, bucket)
    return out.view(n, -1).mean(0)


def test_average_right_passes(capsys):
    ch01.check_average_bucket(average_right)
    assert "[ok] average a bucket" in capsys.readouterr().out


def test_average_in_place_passes(capsys):
    ch01.check_average_bucket(average_after, nprocs=(2,))
    assert "[ok]" in capsys.readouterr().out


@pytest.mark.parametrize("fn, message", [
    (average_sums, "SUM over the ranks"),
    (average_missing_all_reduce, "never summed over the ranks"),
    (average_local_only, "still holds this rank's own gradient"),
    (average_result_dropped, "never summed over the ranks"),
    (average_twice_divided, "divided by n once more"),
    (average_per_element, "exactly one of the whole bucket"),
    (average_untraced, "no message was traced"),
    (average_with_gather, "one comm.all_reduce"),
    (stub, "not done yet"),
])
def test_average_mistakes_caught(fn, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_average_bucket(fn, nprocs=(2,))


def test_average_checked_on_four_ranks_too():
    def sums_only_on_four(bucket):  # right on 2 ranks, wrong on 4
        n = comm.group_size()
        comm.all_reduce(bucket)
        return bucket / (n if n == 2 else 1)

    with pytest.raises(ExerciseError, match="on 4 ranks"):
        ch01.check_average_bucket(sums_only_on_four)


# -- exercise 3: DDP bytes per step ---------------------------------------------------------------
def bytes_right(num_params, world_size, grad_bytes):
    return 2 * (world_size - 1) / world_size * num_params * grad_bytes


@pytest.mark.parametrize("fn, message", [
    (lambda p, n, b: p * b, "2\\(n-1\\)/n"),                       # forgot the factor: the gradient's size
    (lambda p, n, b: 2 * p * b, "not 2"),                          # forgot (n-1)/n
    (lambda p, n, b: (n - 1) / n * p * b, "one half of the all-reduce"),
    (lambda p, n, b: 2 * (n - 1) / n * p, "counted elements"),
    (lambda p, n, b: 2 * (n - 1) * p * b, "n-1 chunks of B/n"),
    (lambda p, n, b: None, "returned None"),
    (stub, "not done yet"),
])
def test_bytes_mistakes_caught(fn, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_ddp_bytes(fn)


def test_bytes_right_passes(capsys):
    ch01.check_ddp_bytes(bytes_right)
    assert "[ok] DDP bytes per step" in capsys.readouterr().out


# -- exercise 4: bucketed DDP with gradient hooks (runs on 2 processes) ----------------------------
class BucketedDDP:
    """The answer the notebook gives: a bucket is all-reduced from the hook of its last gradient."""

    mean, launch_in_hook, skip_bucket = True, True, None

    def __init__(self, model, bucket_bytes):
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = ddp.make_buckets(params[::-1], bucket_bytes)
        self.launched = []
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def on_grad_ready(self, param):
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]) and self.launch_in_hook:
            self.launch(i)

    def launch(self, i):
        if i == self.skip_bucket:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
        if self.mean:
            flat /= comm.group_size()
        self.launched.append((i, flat, comm.all_reduce(flat, label=f"bucket{i}", async_op=True)))

    def finish(self):
        if not self.launch_in_hook:
            for i in range(len(self.buckets)):
                self.launch(i)
        for i, flat, handle in self.launched:
            handle.wait()
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.launched.clear()
        self.ready = [0] * len(self.buckets)


class SumsDDP(BucketedDDP):
    mean = False


class BucketNeverLaunched(BucketedDDP):
    skip_bucket = 1


class AllReduceAfterBackward(BucketedDDP):
    launch_in_hook = False


class NeverResets(BucketedDDP):
    def finish(self):
        ready = self.ready
        super().finish()
        self.ready = ready  # the next step's counts start where this one's ended: no bucket fires


class LaunchesAtFirstGradient(BucketedDDP):
    def on_grad_ready(self, param):
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == 1:  # the bucket's first gradient: the others are still None
            self.launch(i)


class OnePerParameter(BucketedDDP):
    def on_grad_ready(self, param):
        flat = param.grad.reshape(-1) / comm.group_size()
        self.launched.append((None, flat, comm.all_reduce(flat, async_op=True)))
        self.pending = getattr(self, "pending", []) + [param]

    def finish(self):
        for (_, flat, handle), p in zip(self.launched, self.pending):
            handle.wait()
            p.grad.copy_(flat.view_as(p))
        self.launched.clear()
        self.pending = []


class StubDDP:
    def __init__(self, model, bucket_bytes):
        raise NotImplementedError


def test_bucketed_ddp_passes(capsys):
    ch01.check_bucketed_ddp(BucketedDDP, nprocs=(2,))
    assert "[ok] bucketed DDP" in capsys.readouterr().out


@pytest.mark.parametrize("cls, message", [
    (SumsDDP, "SUM over the ranks"),
    (BucketNeverLaunched, "never all-reduced"),
    (AllReduceAfterBackward, "after backward ended"),
    (NeverResets, r"step 1: step 0 launched its all-reduces from the hooks, step 1 none: .* Reset the counts in "
                  r"finish\(\)\.$"),
    (LaunchesAtFirstGradient, r"rank 0, step 0: a bucket was launched too early: a bucket is ready when its last "
                              r"gradient arrives\. .*NoneType"),
    (OnePerParameter, "one per bucket"),
    (StubDDP, "not done yet"),
])
def test_bucketed_ddp_mistakes_caught(cls, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_bucketed_ddp(cls, nprocs=(2,))


# -- hints in levels: the expected value shows from the second wrong try on ----------------------------
def test_split_shows_the_expected_rows_from_the_second_try():
    # 8 rows on 2 ranks: rank 0 keeps rows 0..3; the wrong answer gives it rank 1's, 4..7
    _first_then_second(ch01.check_split_batch, split_wrong_rank, expected="rows [0, 1, 2, 3]")


def test_split_shows_the_expected_rows_after_show_expected():
    from minitp.exercises import show_expected

    show_expected("split the batch")
    with pytest.raises(ExerciseError, match=r"Expected: rows \[0, 1, 2, 3\]"):
        ch01.check_split_batch(split_wrong_rank)


def average_plus_one(bucket):
    return average_right(bucket) + 1


def test_average_shows_the_expected_values_from_the_second_try():
    with pytest.raises(ExerciseError) as first:
        ch01.check_average_bucket(average_plus_one, nprocs=(2,))
    assert "not the mean over the ranks" in str(first.value) and "Expected:" not in str(first.value)
    with pytest.raises(ExerciseError, match=r"Expected: \[-?\d"):
        ch01.check_average_bucket(average_plus_one, nprocs=(2,))


def test_bytes_show_the_expected_bytes_from_the_second_try():
    # the first case: the tiny model's Ψ = 164,416 on 4 ranks, fp32 gradients: 2·3/4·Ψ·4 bytes
    _first_then_second(ch01.check_ddp_bytes, lambda p, n, b: 1.0, expected=f"{2 * 3 * 164_416 * 4 // 4:,} bytes")


def test_bytes_refuse_minitps_own_formula():
    from minitp import cost

    with pytest.raises(ExerciseError, match="the exercise is to write it"):
        ch01.check_ddp_bytes(cost.ddp_step_bytes)


def test_a_wrong_share_of_rows_shows_its_size_from_the_second_try():
    # the first case: m = 8 rows on 2 ranks
    _first_then_second(ch01.check_split_batch, split_overlapping, expected="8/2 = 4 rows")
