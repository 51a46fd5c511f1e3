"""The chapters' kind for pytest: nbval's cells of notebooks/*.ipynb are marked `notebook`. Here, as
`pytest notebooks --nbval` (make test's second run) does not load tests/conftest.py, which gives
every other test its kind.

And nbval's kernel start, tried again when the kernel dies before it answers: two pytest-xdist
workers starting kernels at the same moment can be handed the same free port (jupyter_client picks
the ports before the kernel binds them), and the kernel that loses exits. nbval then errors every
cell of that chapter with "Kernel died before replying to kernel_info" (seen once in a fresh-clone
run of make test, on chapter 00, which both workers start beside another chapter)."""

import functools

KERNEL_STARTS = 3  # tries; each failed one has shut its kernel down before raising


def retrying(start, tries: int = KERNEL_STARTS):
    """``start`` (nbval.kernel.start_new_kernel) tried up to ``tries`` times while it raises
    RuntimeError (a kernel that died or did not answer in time); the last failure is raised."""
    @functools.wraps(start)
    def start_new_kernel(*args, **kwargs):
        for attempt in range(1, tries + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError:
                if attempt == tries:
                    raise
    start_new_kernel.retrying = True
    return start_new_kernel


def pytest_configure(config):
    try:
        import nbval.kernel
    except ImportError:  # nbval is a dev dependency: without it there is nothing to retry
        return
    if not getattr(nbval.kernel.start_new_kernel, "retrying", False):
        nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebook")
