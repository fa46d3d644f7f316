"""Loading DCP metadata without unpickling arbitrary objects: an exact allow-list of DCP's own classes,
and a reader that refuses non-tensor entries (which DCP would ``torch.load(weights_only=False)``)."""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

__all__ = ["safe_reader"]


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``.metadata`` contains: its dataclasses, torch sizes/dtypes, paths.

    Names are matched exactly (an allowlist of ``(module, name)``): a dotted name would walk from an
    allowed module to anything it imports (``...filesystem`` -> ``subprocess.Popen``).
    """

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which tplayers does not load")


def safe_reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(os.path.join(str(self.path), ".metadata"), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP Metadata")
            for key, md in metadata.state_dict_metadata.items():
                # DCP loads non-tensor ("bytes") entries with torch.load(weights_only=False): refuse them
                if not isinstance(md, TensorStorageMetadata):
                    raise pickle.UnpicklingError(f"entry '{key}' is not a tensor ({type(md).__name__}); "
                                                 "tplayers checkpoints hold tensors only")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)
