import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a run gets as far as starting processes: a refusal must come from the parent."""
    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for input that should have been refused")
    for module in ("data_parallel", "tensor_parallel", "pipeline", "threed", "context_parallel", "expert_parallel"):
        monkeypatch.setattr(f"minitp.runs.{module}.launch", refuse)


@pytest.fixture(autouse=True)
def fresh_exercise_tries():
    """Each test starts as a fresh kernel: no wrong try counted, no expected value asked for."""
    from minitp.exercises import reset_tries
    reset_tries()
    yield
    reset_tries()
