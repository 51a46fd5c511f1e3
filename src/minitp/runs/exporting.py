"""``minitp export``: a ``minitp train`` checkpoint (any layout, sharded over its ranks) as one file
of whole tensors in the safetensors format, which a plain ``Transformer`` loads (``load_exported``)
and so does any safetensors reader (Hugging Face's ``safetensors.torch.load_file``).

The format, written here in a few lines: 8 bytes, the little-endian length N of a JSON header; the
header, N bytes (padded with spaces to a multiple of 8): for each tensor its dtype, shape and
[begin, end) byte offsets into the data, plus a ``__metadata__`` of strings (here the model's
config and the checkpoint's step); then the tensors' bytes, C order, little-endian, one after
another. Nothing in it is code: reading it runs nothing.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from minitp import checkpoint
from minitp.checkpoint.disk import write_atomic
from minitp.models import ModelConfig, Transformer
from minitp.models.moe import MoEConfig

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
MAX_HEADER = 100 * 2**20  # a header larger than this is not one minitp (or anyone) wrote


def to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors encoding of ``tensors`` (name -> whole CPU tensor), with ``metadata``."""
    header, data, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here; expected one "
                             f"of {', '.join(map(str, DTYPES))}")
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()  # (numel·b,)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    return struct.pack("<Q", len(text)) + text + b"".join(data)


def read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; a ValueError names what is wrong with it."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: {len(blob)} bytes, not a safetensors file (8 bytes of header "
                         "length first)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > min(MAX_HEADER, len(blob) - 8):
        raise ValueError(f"{path}: its header would be {n} bytes of a {len(blob)}-byte file: not a "
                         "safetensors file, or cut short")
    header = json.loads(blob[8:8 + n])
    metadata = header.pop("__metadata__", {})
    names = {v: k for k, v in DTYPES.items()}
    data, tensors = memoryview(blob)[8 + n:], {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in names or not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']} and bytes "
                             f"[{begin}, {end}) of {len(data)}: not a file minitp can read")
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8)
        tensors[name] = flat.view(names[entry["dtype"]]).reshape(entry["shape"])
    return tensors, metadata


def export(checkpoint_dir: str, out: str) -> dict:
    """Write ``out`` from the checkpoint in ``checkpoint_dir`` (every check ``checkpoint.load_full``
    makes, first); returns what was written: {"step", "tensors", "bytes", "config"}."""
    saved = checkpoint.load_full(checkpoint_dir)
    metadata = {"format": "pt", "minitp_config": json.dumps(saved["config"]),
                "minitp_step": str(saved["step"])}
    blob = to_bytes(saved["params"], metadata)
    write_atomic(out, blob)  # a crash leaves the old file or the new one, never half of one
    return {"step": saved["step"], "tensors": len(saved["params"]), "bytes": len(blob),
            "config": saved["config"]}


def load_exported(path: str) -> Transformer:
    """The plain one-process model of an exported file (a MoE's when its config says so)."""
    from minitp.trainer import build

    tensors, metadata = read(path)
    if "minitp_config" not in metadata:
        raise ValueError(f"{path}: no minitp_config in its metadata: not a file minitp export "
                         "wrote")
    config = json.loads(metadata["minitp_config"])
    cfg = (MoEConfig if "n_experts" in config else ModelConfig)(**config)
    model = build(cfg, 0)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def check_out(out: str, overwrite: bool) -> None:
    """Refuse an ``out`` that would overwrite a file (unless asked) or cannot be written."""
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a folder; expected a file name, e.g. model.safetensors")
    if os.path.lexists(out) and not overwrite:
        raise ValueError(f"--out {out} exists: add --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: its folder {parent} is not writable")
