"""What a training step costs beyond its matmuls, measured at two shapes for ``minitp calibrate``.

A step of ``minitp train``'s byte model at a rank's share of its default batch (8 x 128) beside the
tiny one's. The tiny step's fixed costs do not grow with tokens or width, but norms, RoPE, SwiGLU's
gate, residuals and the softmax do, and at 128 positions they take about as long as the matmuls.
With the matmuls at the large rate, the two steps' remainders draw a line in the elements their
activations hold (``minitp.cost.activation_elements``): its slope is what one element costs
(``element_s``), its value at the tiny model what a step costs once (``element_step_overhead_s``,
``fit_element_cost``). A calibration with them predicts every model at the large rate plus its
elements; one without (stored before) keeps the tiny rate.
"""

from __future__ import annotations

# the second shape: a rank's share of ``minitp train``'s default batch (16 x 128 at dp = 2) on its
# byte model, whose matmuls reach the large rate and whose step is mostly not its FLOPs' time
SHAPES = {"tiny": (8, 16), "byte": (8, 128)}


def fit_element_cost(steps_s: dict[str, float], flops: dict[str, float], elements: dict[str, float],
                     flops_per_s: float, microbatch_s: float) -> dict:
    """What a step costs beyond its matmuls, as a line in the elements its activations hold
    (``minitp.cost.activation_elements``), through two models' one-micro-batch steps (``steps_s``,
    their ``flops`` at the large rate ``flops_per_s``, less the micro-batch's fixed cost): the slope
    is each element's cost (``element_s``), what is left at the smaller one the step's fixed cost
    (``element_step_overhead_s``, at least 0)."""
    small, large = sorted(steps_s, key=lambda name: elements[name])
    beyond = {name: steps_s[name] - flops[name] / flops_per_s - microbatch_s for name in steps_s}
    per_element = max(0.0, (beyond[large] - beyond[small]) / (elements[large] - elements[small]))
    return {"element_s": per_element,
            "element_step_overhead_s": max(0.0, beyond[small] - per_element * elements[small])}


def element_costs(flops_per_s_large: float, fixed: dict, byte_step_s: float) -> dict:
    """``fit_element_cost`` on the byte model's step at its shape (``byte_step_s``: one micro-batch,
    one thread, the fastest of a few) beside the tiny one's (``fixed``, from
    ``minitp.measure.calibrate.fixed_costs``)."""
    from minitp.cost import activation_elements, training_flops_per_token
    from minitp.models import BYTE, TINY

    configs = {"tiny": TINY, "byte": BYTE}
    steps_s = {"tiny": fixed["tiny_step_s"], "byte": byte_step_s}
    flops = {name: b * s * training_flops_per_token(configs[name], s)
             for name, (b, s) in SHAPES.items()}
    elements = {name: activation_elements(configs[name], b * s, s)
                for name, (b, s) in SHAPES.items()}
    return {**fit_element_cost(steps_s, flops, elements, flops_per_s_large,
                               fixed["microbatch_overhead_s"]), "byte_step_s": byte_step_s}


def describe(cal: dict) -> str:
    """What ``format_calibration`` says of these figures ("" where not measured)."""
    if cal.get("element_s") is None:
        return ""
    return (f"; at the 512^3 rate, a step costs {cal['element_s'] * 1e9:.2f} ns per activation "
            f"element beyond its matmuls, and {cal['element_step_overhead_s'] * 1e3:.1f} ms once"
            + (f" (the byte model's step at 8x128: {cal['byte_step_s'] * 1e3:.0f} ms)"
               if cal.get("byte_step_s") else ""))

