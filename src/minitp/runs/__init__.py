"""Whole training runs of a strategy, checked against its oracles, as ``minitp run`` reports them.

A run trains the tiny model on N ranks with one strategy, trains the same model on one process
with the full batch (``minitp.runs.references``), and returns a ``minitp.runs.report.Report``: the
same fields for every strategy (losses beside the reference's, the largest parameter difference,
bytes sent per rank traced beside the formula's, memory held beside the formula's, step times), the
strategy's own numbers in ``details``, and the launched run with its traces in ``results``.

One module per family of strategies; each registers its runner and options in
``minitp.runs.registry``, which the command line reads.
"""

from minitp.runs.common import train_steps
from minitp.runs.context_parallel import run_cp
from minitp.runs.data_parallel import run_ddp, run_fsdp, run_hsdp
from minitp.runs.expert_parallel import run_ep
from minitp.runs.pipeline import run_pp
from minitp.runs.references import max_abs_diff
from minitp.runs.report import PARAM_TOLERANCE, Report, check, format_report
from minitp.runs.tensor_parallel import run_swiglu, run_tp
from minitp.runs.threed import run_3d

__all__ = ["Report", "check", "format_report", "max_abs_diff", "PARAM_TOLERANCE", "train_steps",
           "run_ddp", "run_fsdp", "run_hsdp", "run_tp", "run_swiglu", "run_pp", "run_3d",
           "run_ep", "run_cp"]
