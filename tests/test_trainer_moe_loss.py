"""``minitp train`` logs a mixture of experts' loss as one process computes it on every layout: the
cross-entropy plus the auxiliary (load-balancing) loss, though under a pipeline each stage holds its
own layers' part of the auxiliary loss. Its validation loss is the cross-entropy alone, on every
layout: how well the model predicts files it never trained on."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from minitp import trainer
from minitp.data import COURSE_CORPUS, Sampler, load_corpus
from minitp.launcher import LaunchError
from minitp.models import loss_fn
from minitp.models.moe import aux_loss
from minitp.runs import training
from minitp.runs.train_log import read_log

MOE = trainer.Settings(model="byte-moe", steps=3, batch_size=8, seq_len=32, corpus=COURSE_CORPUS, eval_every=0,
                       eval_batches=2, warmup=1, clip=0.5)
LAYOUTS = [dict(), dict(pp=2, microbatches=2), dict(dp=2, ep=2), dict(dp=2, ep=2, pp=2, microbatches=2)]


@pytest.fixture(scope="module")
def one_process():
    """One process's losses and norms, and its validation: the cross-entropy of the trained model on
    the validation batches, and the auxiliary term the training loss adds to it."""
    losses, norms, model = trainer.reference(MOE)
    val = Sampler(load_corpus(MOE.corpus).val, MOE.batch_size, MOE.seq_len)
    cross_entropy, aux = [], []
    with torch.no_grad():
        for i in range(MOE.eval_batches):
            tokens, targets = val.batch(i)
            cross_entropy.append(loss_fn(model(tokens), targets).item())
            aux.append(MOE.config.aux_loss_coef * aux_loss(model).item())
    return losses, norms, sum(cross_entropy) / len(cross_entropy), sum(aux) / len(aux)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()) or "pp1")
def test_moe_loss_equals_one_process_on_every_layout(layout, one_process, tmp_path):
    ref_losses, ref_norms, ref_val, ref_aux = one_process
    out = str(tmp_path / "run")
    results = training.train(replace(MOE, out=out, **layout), echo=False)
    for r in results:  # every rank logs the same: cross-entropy + coef · aux, as one process
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
    log = read_log(os.path.join(out, "log.jsonl"))
    assert [r["loss"] for r in log if "loss" in r] == pytest.approx(ref_losses, abs=1e-5)
    (val,) = [r["val_loss"] for r in log if "val_loss" in r]  # after the last step
    assert ref_aux > 0.01  # large enough that the check below tells the two apart
    assert val == pytest.approx(ref_val, abs=1e-5)  # the cross-entropy alone, as on one process


def test_a_moe_run_resumed_from_one_stage_onto_a_pipeline_continues_its_curve(tmp_path):
    """The symptom the pipeline's missing auxiliary loss showed: a step of 0.045 in the curve where a
    run moved from pp = 1 to pp = 2. One curve, one process's, across the move."""
    s = replace(MOE, steps=5, save_every=2, eval_every=2, out=str(tmp_path / "moved"))
    ref_losses, _, _ = trainer.reference(s)
    with pytest.raises(LaunchError, match="SIGKILL"):  # the one rank dies at step 3: the checkpoint of step 2 is left
        training.train(replace(s, kill_at=3), echo=False)
    training.train(replace(s, pp=2, microbatches=2, resume=True), echo=False)
    log = read_log(os.path.join(s.out, "log.jsonl"))
    assert [(r["step"], r["world"]) for r in log if r.get("event") == "start"] == [(0, 1), (2, 2)]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in steps] == pytest.approx(ref_losses, abs=1e-5)
