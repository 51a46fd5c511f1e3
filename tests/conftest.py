import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import multiprocessing.process  # noqa: E402
from pathlib import Path  # noqa: E402

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


# Each test file's kind, one per file (tests/test_test_kinds.py checks that every tests/test_*.py is in
# exactly one). pytest marks each test with its file's kind: `pytest -m unit tests` runs one kind;
# `make test-fast` runs the kinds of one process (IN_ONE_PROCESS). The chapters themselves (nbval's cells of
# notebooks/*.ipynb) are marked `notebook` by ../conftest.py, as the notebooks run does not load this file.
KINDS = {
    # in one process, no rank started (a fresh interpreter that reads an import graph is allowed): the
    # formulas, the models, the data, layout and plan checks, the source's house rules
    "unit": (
        "test_activations_llama.py", "test_cost.py", "test_cost_structure.py", "test_data.py",
        "test_gpt2.py", "test_layout.py", "test_models.py", "test_parallel_dims.py", "test_plan_cp.py", "test_plan_ep.py", "test_structure.py",
        "test_test_kinds.py", "test_trace.py", "test_units.py", "test_viz_imports.py",
    ),
    # the stored chapters read from notebooks/, in one process: the numbers their prose states, stored
    # outputs that hold on any CPU, the stored twins of the live controls, exercises and words per chapter
    "chapters": (
        "test_chapter_numbers.py", "test_chapter_numbers_06_10.py", "test_chapter_numbers_07.py",
        "test_chapter_numbers_08.py", "test_chapter_numbers_11.py", "test_chapter_numbers_12.py", "test_chapters.py", "test_explore_ch07.py", "test_explore_ch08.py",
        "test_stored_outputs.py",
    ),
    # the checkers of the chapters' exercises and worked problems, and the learner copies: chapters
    # 00-09's checkers run the answer on 2-4 ranks (hangs included, named after their timeout)
    "exercises": (
        "test_exercises_ch00.py", "test_exercises_ch01.py", "test_exercises_ch02.py",
        "test_exercises_ch03.py", "test_exercises_ch04.py", "test_exercises_ch05.py",
        "test_exercises_ch05_runtime.py", "test_exercises_ch06.py", "test_exercises_ch07.py",
        "test_exercises_ch08.py", "test_exercises_ch09.py", "test_exercises_ch10.py", "test_exercises_ch11.py", "test_exercises_ch12.py", "test_exercises_ch13.py", "test_exercises_graduate.py",
        "test_grade.py", "test_problems.py",
        "test_problems_ch07.py", "test_problems_ch08.py", "test_student.py",
    ),
    # start ranks (minitp.launch, `minitp run` / `train`, torchrun), in at least one test: each strategy
    # against one process, PyTorch's own and the formulas; the launcher, its guards and its failures;
    # checkpoints and the trainer; the planner and calibration against measured runs; the figures drawn
    # from a real run's trace
    "oracle": (
        "test_activations.py", "test_bench_harness.py", "test_calibrate.py", "test_checkpoint.py",
        "test_checkpoint_cp_ep.py", "test_checkpoint_refusals.py", "test_chrome_trace.py", "test_cli.py",
        "test_cli_input.py", "test_comm.py", "test_cost_time.py", "test_cp.py", "test_cp_allgather.py",
        "test_cp_attention_kinds.py", "test_cp_ulysses.py", "test_ddp.py", "test_env_and_messages.py",
        "test_ep.py", "test_ep_gradients.py", "test_export.py", "test_fp8.py", "test_fsdp.py", "test_hsdp.py", "test_launch.py", "test_mesh.py",
        "test_multinode.py", "test_offload.py", "test_parallel3d.py", "test_parallel3d_hsdp.py", "test_torchrun_engine.py", "test_parallel3d_ep.py",
        "test_parallel3d_interleaved.py", "test_plan.py", "test_pp.py", "test_pp_bubble_decomposition.py",
        "test_pp_schedules.py", "test_pp_v_schedules.py", "test_pytorch_impl.py", "test_readme.py", "test_reliability_checkpoint.py",
        "test_reliability_launch.py", "test_replicas.py", "test_ring.py", "test_tp.py", "test_tp_overlap.py",
        "test_trace_fields.py", "test_trainer.py", "test_trainer_hardening.py", "test_trainer_moe_loss.py",
        "test_viz_collectives.py", "test_viz_explore.py", "test_viz_fsdp.py", "test_viz_mesh.py",
        "test_viz_pipeline.py", "test_viz_text_sizes.py", "test_viz_timeline.py", "test_viz_tp.py",
    ),
    # the website: `mkdocs build --strict` and its pages in Chromium (the file's own pytestmark too)
    "site": ("test_site.py",),
}
KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}
IN_ONE_PROCESS = ("unit", "chapters")  # start no rank (checked as each test runs); make test-fast runs them


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        kind = KIND_OF.get(item.path.name) if item.path.parent == here else None
        if kind and not item.get_closest_marker(kind):  # test_site.py marks itself `site`
            item.add_marker(kind)


@pytest.fixture(autouse=True)
def starts_no_rank_in_one_process_kinds(request, monkeypatch):
    """A unit or chapters test that starts a process (a rank, a multiprocessing worker) fails, naming
    the table to change: the kinds that say one process stay in one process."""
    kind = next((k for k in IN_ONE_PROCESS if request.node.get_closest_marker(k)), None)
    if kind is None:
        return
    def refuse(process, *args, **kwargs):
        raise AssertionError(f"a {kind} test started a process ({process.name}): its file belongs to the "
                             "oracle kind (KINDS in tests/conftest.py), or the run to a file of its own")
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
