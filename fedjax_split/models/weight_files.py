"""A checkpoint directory's weight files read as numpy arrays, names as stored: model.safetensors,
sharded safetensors with an index, or pytorch_model.bin read by a restricted unpickler that never
executes pickled code (no torch needed, and a checkpoint cannot run code here)."""

from __future__ import annotations

import collections
import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from fedjax_split.errors import UserError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # the library raises several types for truncated/garbled files
        raise UserError(
            f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "the file is corrupt or truncated: download or export it again"
        ) from None


_TORCH_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}  # fmt: skip


class _StorageType:
    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage, offset, size, stride, *_args) -> np.ndarray:
    item = storage.dtype.itemsize
    if not size:
        return storage[offset : offset + 1].reshape(()).copy()
    return np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size), strides=tuple(s * item for s in stride)
    ).copy()


def _rebuild_parameter(data, *_args) -> np.ndarray:
    return data


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles a torch state dict allowing only tensors, storages and OrderedDict: a checkpoint
    cannot run code here (unlike `torch.load(weights_only=False)`)."""

    def __init__(self, file, load_storage: Callable[[str, np.dtype, int], np.ndarray]) -> None:
        super().__init__(file)
        self._load_storage = load_storage

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _TORCH_DTYPES:
            return _StorageType(_TORCH_DTYPES[name])
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        return self._load_storage(str(key), storage_type.dtype, int(numel))


def _read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    """Reads a torch.save zip checkpoint (torch >= 1.6) of tensors without importing torch."""
    bad = (
        f"cannot read {path} safely; convert it to model.safetensors (e.g. with transformers' "
        "save_pretrained(safe_serialization=True))"
    )
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise UserError(f"{bad}: no data.pkl in the archive")
            prefix = pkl[0][: -len("data.pkl")]
            order = (
                zf.read(prefix + "byteorder").decode()
                if prefix + "byteorder" in zf.namelist()
                else "little"
            )
            if order != "little":
                raise UserError(f"{bad}: big-endian checkpoints are not supported")
            cache: dict[str, np.ndarray] = {}

            def load_storage(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
                if key not in cache:
                    raw = zf.read(f"{prefix}data/{key}")
                    cache[key] = np.frombuffer(raw, dtype=dtype, count=numel)
                return cache[key]

            with zf.open(pkl[0]) as f:
                obj = _SafeUnpickler(f, load_storage).load()
    except zipfile.BadZipFile:
        raise UserError(f"{bad}: not a zip checkpoint (legacy torch format or corrupt)") from None
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"{bad}: {e}") from None
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        raise UserError(f"{bad}: it does not hold a plain state dict of tensors")
    return dict(obj)


def read_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory as numpy arrays, names as stored."""
    st, index, pt = (model_dir / f for f in WEIGHT_FILES)
    if st.is_file():
        return _read_safetensors(st)
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"{index} is not a valid safetensors index; download it again"
            ) from None
        out: dict[str, np.ndarray] = {}
        for s in shards:
            out.update(_read_safetensors(model_dir / s))
        return out
    if pt.is_file():
        return _read_torch_bin(pt)
    raise UserError(
        f"no weights in {model_dir} (looked for {', '.join(WEIGHT_FILES)}); point to a directory "
        "with model.safetensors or pytorch_model.bin"
    )
