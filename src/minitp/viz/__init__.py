"""Figures drawn from what a run recorded: each function takes a trace, a report or tensors that a
run returned, and gives back a matplotlib Figure. None of them runs anything, except ``explore``:
the chapters' live controls, which call the run a chapter gives them and draw with the others."""
