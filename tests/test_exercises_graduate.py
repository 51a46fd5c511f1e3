"""Chapter 13's graduation exercise: chapter 09's run in PyTorch's own API (``minitp.exercises.graduate``)
passes with the solution and names each planted mistake: tensor parallel after FSDP, no FSDP, PyTorch's own
clip_grad_norm_ on two meshes, a norm of the local shards, a checkpoint without the optimizer, a load that
loads nothing."""

import functools

import pytest
import torch

from minitp.exercises import ExerciseError, graduate


def parallelize(model, mesh, tp_first=True, shard=True):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh["tp"]
    def split():
        if tp.size() > 1:
            parallelize_module(model, tp, {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
            for block in model.layers:
                parallelize_module(block, tp, {
                    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel()})
                for linear in (block.attention.wq, block.attention.wk, block.attention.wv):
                    linear.out_features //= tp.size()
    if tp_first:
        split()
    if shard:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if not tp_first:
        split()
    return model


def clip(model, max_norm, whole=True):
    squares = torch.zeros(())
    for p in model.parameters():
        if p.grad is not None:
            n = torch.linalg.vector_norm(p.grad)
            if hasattr(n, "full_tensor"):
                n = n.full_tensor() if whole else n.to_local()
            squares = squares + n ** 2
    total = squares.sqrt().item()
    scale = min(1.0, max_norm / (total + 1e-6))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return total


def torch_clip(model, max_norm):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()


def save(model, optimizer, folder, with_optimizer=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd} if with_optimizer else {"model": msd}, checkpoint_id=folder)


def load(model, optimizer, folder, with_optimizer=True, put_back=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd} if with_optimizer else {"model": msd}
    dcp.load(state, checkpoint_id=folder)
    if put_back:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"] if with_optimizer else {})


def save_model_only(model, optimizer, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)


def load_model_only(model, optimizer, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])


def load_nothing(model, optimizer, folder):
    pass


def _stub(*args):
    raise NotImplementedError("Exercise: write this part, then run the checker below")


def test_the_solution_passes(capsys):
    graduate.check_torch_run(parallelize, clip, save, load)
    assert "[ok] the run in PyTorch's API: correct (4 steps equal one process" in capsys.readouterr().out


@pytest.mark.parametrize("answers, message", [
    ((functools.partial(parallelize, tp_first=False), clip, save, load),
     "Cannot distribute a DTensor with device mesh"),
    ((functools.partial(parallelize, shard=False), clip, save, load), r"are not sharded over mesh\['dp'\]"),
    ((parallelize, torch_clip, save, load), "clip_grad_norm_ stacks every gradient's norm"),
    ((parallelize, functools.partial(clip, whole=False), save, load), "this rank's shards only"),
    ((parallelize, clip, save_model_only, load_model_only), "AdamW's state did not"),
    ((parallelize, clip, save, load_nothing), "are not the ones saved on dp2×tp2"),
    ((_stub, clip, save, load), "not done yet"),
])
def test_each_mistake_is_named(answers, message):
    with pytest.raises(ExerciseError, match=message):
        graduate.check_torch_run(*answers)
