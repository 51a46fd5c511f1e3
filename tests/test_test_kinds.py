"""Every test file has one kind (``KINDS`` in tests/conftest.py): a new file fails here until it is
classified, a removed one until its entry goes, and each kind is a marker pytest knows."""

import multiprocessing
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from conftest import IN_ONE_PROCESS, KINDS

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def misfiled(files: set[str], kinds: dict[str, tuple[str, ...]]) -> list[str]:
    """What keeps each test file from being in exactly one kind: nothing when all is well."""
    listed = Counter(name for names in kinds.values() for name in names)
    return ([f"in more than one kind: {name}" for name, n in sorted(listed.items()) if n > 1]
            + [f"in no kind (add it to one): {name}" for name in sorted(files - set(listed))]
            + [f"in a kind but not in tests/: {name}" for name in sorted(set(listed) - files)])


def test_every_test_file_is_in_exactly_one_kind():
    files = {path.name for path in TESTS.glob("test_*.py")}
    assert misfiled(files, KINDS) == [], "KINDS in tests/conftest.py"


def test_a_new_file_a_file_in_two_kinds_and_a_gone_file_are_caught():
    planted = {"unit": ("test_a.py", "test_b.py"), "oracle": ("test_b.py", "test_gone.py")}
    assert misfiled({"test_a.py", "test_b.py", "test_new.py"}, planted) == [
        "in more than one kind: test_b.py", "in no kind (add it to one): test_new.py",
        "in a kind but not in tests/: test_gone.py"]


def test_every_kind_is_a_registered_marker_and_the_fast_kinds_are_kinds():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = {line.split(":")[0] for line in ini["markers"]}
    assert set(KINDS) | {"notebook"} <= markers
    assert set(IN_ONE_PROCESS) <= set(KINDS)


def test_make_test_fast_runs_the_kinds_of_one_process():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-fast:", 1)[1].split("\n\n", 1)[0]
    assert f'-m "{" or ".join(IN_ONE_PROCESS)}"' in recipe and "--nbval" not in recipe


def test_each_collected_test_has_one_kind(request):
    """Over the tests of this session (all of tests/ under `make test`): one kind each, its file's."""
    by_file = {name: kind for kind, names in KINDS.items() for name in names}
    for item in request.session.items:
        if item.path.parent == TESTS:
            kinds = {m.name for m in item.iter_markers() if m.name in KINDS}
            assert kinds == {by_file.get(item.path.name)}, f"{item.nodeid}: kinds {sorted(kinds)}"


def test_a_unit_test_that_starts_a_process_fails_naming_the_table():
    rank = multiprocessing.get_context("fork").Process(target=print, name="planted-rank")
    with pytest.raises(AssertionError, match=r"planted-rank.*oracle kind \(KINDS in tests/conftest.py\)"):
        rank.start()


def test_the_notebooks_kernel_start_is_tried_again_when_a_kernel_dies_before_answering():
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    calls = []

    def flaky(fails: int):
        def start(**kwargs):
            calls.append(kwargs)
            if len(calls) <= fails:
                raise RuntimeError("Kernel died before replying to kernel_info")
            return "manager", "client"
        return start

    assert root.retrying(flaky(2), tries=3)(kernel_name="python3") == ("manager", "client")
    assert len(calls) == 3 and all(c == {"kernel_name": "python3"} for c in calls)  # the same arguments each try
    calls.clear()
    with pytest.raises(RuntimeError, match="Kernel died"):  # every try failed: the last failure, not a hang
        root.retrying(flaky(5), tries=3)()
    assert len(calls) == 3
    import nbval.kernel  # pytest_configure wrapped nbval's own once
    root.pytest_configure(None)
    assert nbval.kernel.start_new_kernel.retrying and not hasattr(nbval.kernel.start_new_kernel.__wrapped__,
                                                                   "retrying")
