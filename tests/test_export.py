"""``minitp export``: a sharded ``minitp train`` checkpoint as one safetensors file; the plain model
loaded from it gives the validation loss the run logged, and a safetensors reader reads the same
tensors."""

import json

import pytest
import torch

from minitp import cli
from minitp.data import Sampler, load_corpus
from minitp.models import loss_fn
from minitp.runs import exporting


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    # tensor parallel: every matrix is saved in two slices, which the export puts back together
    assert cli.main(["train", "--tp", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
                     "--eval-every", "2", "--eval-batches", "1", "--out", str(out)]) == 0
    return out


def test_the_exported_model_gives_the_validation_loss_the_run_logged(trained, capsys):
    path = trained.parent / "model.safetensors"
    assert cli.main(["export", "--checkpoint", str(trained / "checkpoint"), "--out", str(path)]) == 0
    assert "step 2, 39 tensors" in capsys.readouterr().out
    logged = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()][-1]
    model = exporting.load_exported(str(path))
    tokens, targets = Sampler(load_corpus(None).val, 4, 32).batch(0)  # evaluate's first batch
    with torch.no_grad():
        loss = loss_fn(model(tokens), targets).item()
    assert abs(loss - logged["val_loss"]) <= 1e-5, (loss, logged["val_loss"])


def test_a_safetensors_reader_reads_the_same_tensors_and_a_damaged_file_is_named(trained, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    path = tmp_path / "m.safetensors"
    exporting.export(str(trained / "checkpoint"), str(path))
    theirs = safetensors.load_file(str(path))
    ours, metadata = exporting.read(str(path))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert json.loads(metadata["minitp_config"])["n_layers"] == exporting.load_exported(
        str(path)).config.n_layers
    path.write_bytes(path.read_bytes()[:100])  # cut short
    with pytest.raises(ValueError, match="not a safetensors file, or cut short"):
        exporting.read(str(path))


def test_export_refuses_to_overwrite_and_names_what_it_needs(trained, tmp_path, capsys):
    there = tmp_path / "mine.safetensors"
    there.write_text("a learner's file")
    args = ["export", "--checkpoint", str(trained / "checkpoint"), "--out", str(there)]
    assert cli.main(args) == 2
    assert "exists: add --overwrite to replace it" in capsys.readouterr().err
    assert there.read_text() == "a learner's file"
    assert cli.main(["export", "--out", str(there)]) == 2
    assert "--checkpoint DIR and --out FILE are required" in capsys.readouterr().err
