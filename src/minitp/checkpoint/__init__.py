"""Sharded checkpoints of a 3D run that load into any other layout, and that a crash cannot destroy.

**What is saved.** Every rank writes only what it holds (nothing is gathered), as pieces of
parameters (``minitp.fsdp_units.LocalPiece``): elements [start, stop) of one flattened tp slice,
with AdamW's two moments for them. Under FSDP the wrapper lists them (``fsdp.local_pieces``); a
plain stage is read through PyTorch's public optimizer state (``module_pieces``). Data-parallel
replicas under DDP hold the same tensors, so only the first replica writes; replicated (norm)
weights are written by the first tp rank only.

**The folder**, switched atomically::

    ckpt/index.json                  names the save folder below; checked by its own SHA-256
    ckpt/save-000002/rank00000.pt    each rank's pieces (and rank00000.json, its note to rank 0)
    ckpt/save-000002/minitp-save.json  the mark: minitp made this folder (written first)

A save writes a new ``save-N`` folder beside the current one; once every file is on disk (fsync),
rank 0 writes the new index under a temporary name and renames it over ``index.json`` (atomic on
POSIX). So ``index.json`` always names a whole checkpoint: the old one until the rename, the new one
after. A crash at any moment leaves one of the two. The old folder is removed after the switch;
what a crashed save left at the start of the next. A save that fails with an error (a full disk)
removes its own new folder and says which file it could not write.

**Only what minitp wrote is removed.** Each ``save-N`` folder is born with its mark
(``save-N/minitp-save.json``, written under a temporary folder name that is then renamed), and every
temporary name ends in ``.minitp-tmp-<pid>``. Clean-up removes a marked folder no index names and
those temporary names, nothing else. A folder to save into must be new, empty or a minitp
checkpoint: one that holds anything else (a learner's files) is refused before anything is written
(``check_save_folder``; ``minitp run`` asks it in the parent, before any process starts).

**The index** holds the model config, the layout (dp, pp, tp, data_parallel, zero), the step and
AdamW's step, every parameter's whole shape, every piece, each file's size and SHA-256, and the
SHA-256 of all that. **Loading** into a ``Parallel3D`` on any mesh checks, before it copies
anything: the index's checksum, every shape, the config, that every tensor of the model is in the
checkpoint and every saved tensor is taken by the model; then each file's checksum and that the
file agrees with the index on the steps. The index may name only plain file names inside its own
save folder (never ``../x`` or ``/x``). Any mismatch is a ``CheckpointError`` naming the file
("checkpoint ckpt/index.json was saved from n_layers=4, this model has n_layers=2"). The pieces
of each tensor are put back together (checking they cover it exactly once), then cut for the new
layout: copies only, bit for bit. Files are read with ``torch.load(weights_only=True)``: tensors and
plain containers, never pickled code. ``load_full`` does the same on one process, and
``check_before_launch`` all the checks, in the parent, before any rank starts.

The files, one job each: ``index`` names what minitp writes, and reads and checks the index;
``disk`` keeps the folder safe on disk (atomic writes, marks, removing only what minitp wrote);
``saving`` is what each rank writes, and the switch; ``loading`` reads back into any layout.
"""

from minitp.checkpoint.disk import check_save_folder
from minitp.checkpoint.index import (
    FORMAT,
    INDEX,
    KINDS,
    MARK,
    PLAIN_NAME,
    SAVE_FOLDER,
    TEMPORARY,
    CheckpointError,
    check_fits,
    read_index,
)
from minitp.checkpoint.loading import check_before_launch, load, load_full, load_module_pieces
from minitp.checkpoint.saving import module_pieces, save

__all__ = ["FORMAT", "INDEX", "KINDS", "MARK", "PLAIN_NAME", "SAVE_FOLDER", "TEMPORARY",
           "CheckpointError", "check_before_launch", "check_fits", "check_save_folder", "load",
           "load_full", "load_module_pieces", "module_pieces", "read_index", "save"]
