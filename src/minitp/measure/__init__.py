"""What a run measures on this machine: memory held (``memory``), activations saved for backward
(``activations``), compute spans around the messages (``spans``), and the calibration of this
machine's compute and links that the time model reads (``calibrate``, with its file)."""
