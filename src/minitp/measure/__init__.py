"""What a run measures on this machine: memory held (``memory``), activations saved for backward
(``activations``), compute spans around the messages (``spans``), and the calibration of this
machine's compute and links that the time model reads (``calibrate``, with its file).

Measuring imports no strategy: what builds a strategy to measure it (``minitp calibrate``'s runs
under DDP, FSDP, tensor, context and expert parallel; the activations kept per rank of tensor
parallel) is a runner, in ``minitp.runs.measuring``."""
