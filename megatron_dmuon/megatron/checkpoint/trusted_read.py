"""A checkpoint is data: reading one never runs code.

torch DCP writes its ``.metadata`` as a plain pickle and reads it back with ``pickle.load``
(``FileSystemReader.read_metadata``), which runs whatever callable the file names: a downloaded
checkpoint could run code the moment a loader, or a start-up check, looks at it. Here the same file
is read by an unpickler that builds only the checkpoint metadata types torch DCP and megatron-core
write (``DCP_METADATA_GLOBALS``) and refuses anything else by name, before any other reader sees the
file: ``trusted_dcp_metadata`` for the checks, ``check_checkpoint_is_data`` before a load
(Megatron's and torch's readers then read a file already known to hold data only). Torch files go
through ``torch.load(weights_only=True)`` (``trusted_torch_load``), torch's own allow-listed
unpickler.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Optional

from ...files import check_regular_file, read_bounded_bytes

METADATA_FILE = ".metadata"
METADATA_LIMIT = 8 << 30  # the .metadata of a 1000-rank 70B checkpoint is a few hundred MB
TORCH_FILE_LIMIT = 1 << 44  # optimizer state files: size is not the danger there, their type is

# module -> names an honest .metadata refers to (torch 2.6-2.13's DCP, megatron-core 0.15-0.19's
# torch_dist strategy), every one a dataclass, an Enum or a pure lookup; 'torch' adds its dtypes
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
        "BytesIOWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UntrustedCheckpointError(ValueError):
    """A checkpoint file that holds something other than checkpoint data (pickled code, an object of a
    type no checkpoint holds): refused before anything else reads it."""


def _refusal(file: str, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"{file} holds {what}, which no checkpoint holds: refused unread (a checkpoint is data; reading one must "
        "never run code). Use a checkpoint from a source you trust, or one written by Megatron or DMuon")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file: str):
        super().__init__(io.BytesIO(data))
        self.file = file

    def find_class(self, module: str, name: str):
        import importlib

        import torch

        allowed = DCP_METADATA_GLOBALS.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name not in allowed:
            raise _refusal(self.file, f"a pickled reference to {module}.{name}")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise _refusal(self.file, "a persistent reference (a torch tensor file, not DCP metadata)")


def trusted_dcp_metadata(checkpoint_dir: str):
    """torch DCP's ``Metadata`` of ``checkpoint_dir``, read with the allow-list: the same object
    ``FileSystemReader(checkpoint_dir).read_metadata()`` returns for an honest file.
    ``UntrustedCheckpointError`` names the file and the global it refers to otherwise; ``ValueError``
    (from files.py) a missing, special or oversized file; ``pickle.UnpicklingError`` / ``EOFError``
    a damaged one."""
    file = os.path.join(checkpoint_dir, METADATA_FILE)
    data = read_bounded_bytes(file, "torch DCP's checkpoint metadata", METADATA_LIMIT)
    metadata = _MetadataUnpickler(data, file).load()
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise _refusal(file, f"a {type(metadata).__name__} where torch DCP's Metadata belongs")
    return metadata


def check_checkpoint_is_data(checkpoint_dir: str) -> None:
    """Before a reader that unpickles (torch DCP, Megatron's dist_checkpointing) opens
    ``checkpoint_dir``: its ``.metadata``, where there is one, holds checkpoint metadata only (raises
    ``UntrustedCheckpointError`` otherwise). A damaged or missing file is left to the reader's own
    error."""
    if not os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILE)):
        return
    try:
        trusted_dcp_metadata(checkpoint_dir)
    except UntrustedCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - damaged, not dangerous: the loader names it in its own words
        return


_CHECKED = set()  # (path, size, mtime) of the .metadata files found to hold data: a load reads them twice


def check_load_dir_is_data(load_dir, iteration: Optional[int] = None) -> None:
    """``check_checkpoint_is_data`` for the directory a Megatron-LM or Megatron-Bridge load reads under
    ``load_dir`` (``iteration_dir_of``), once per file version."""
    if not load_dir:
        return
    target = iteration_dir_of(str(load_dir), iteration if isinstance(iteration, int) else None)
    if target is None:
        return
    try:
        info = os.stat(os.path.join(target, METADATA_FILE))
    except OSError:
        return
    key = (os.path.realpath(os.path.join(target, METADATA_FILE)), info.st_size, info.st_mtime_ns)
    if key not in _CHECKED:
        check_checkpoint_is_data(target)
        _CHECKED.add(key)


def trusted_torch_load(file: str, what: str = "torch checkpoint file"):
    """``torch.load(file, weights_only=True)`` on the CPU: tensors and plain containers only (torch's
    allow-listed unpickler); a file that needs any other type is refused naming it."""
    import torch

    check_regular_file(file, what, TORCH_FILE_LIMIT)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _refusal(file, f"an object torch's weights-only reader refuses ({first})") from None


def iteration_dir_of(load_dir: str, iteration: Optional[int] = None) -> Optional[str]:
    """The checkpoint directory Megatron-LM's load reads under ``load_dir``: ``iteration``'s, else the
    one its tracker names (``iter_NNNNNNN`` or ``release``); ``load_dir`` itself when it is one
    (it has a ``.metadata``); None where none can be named (Megatron's load then says why)."""
    if os.path.isfile(os.path.join(load_dir, METADATA_FILE)):
        return load_dir
    if iteration is None:
        tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
        try:
            text = read_bounded_bytes(tracker, "checkpoint tracker", 4096).decode("utf-8", "replace").strip()
        except ValueError:
            return None
        if text == "release":
            return os.path.join(load_dir, "release")
        if not text.isdigit():
            return None
        iteration = int(text)
    return os.path.join(load_dir, f"iter_{iteration:07d}")
