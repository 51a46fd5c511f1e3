"""minitp: data, fully sharded, tensor and pipeline parallelism from scratch on torch.distributed."""

from minitp import comm, cost, trace
from minitp.launch import LaunchError, LaunchTimeout, RankError, Results, device, launch

__all__ = ["comm", "cost", "trace", "launch", "device", "Results", "LaunchError", "RankError", "LaunchTimeout"]
__version__ = "0.1.0"
