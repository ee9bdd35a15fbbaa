"""The tensor codec of the Tinker wire: numpy arrays to and from the protobuf encodings.

Owns: token bytes, ``Tensor`` (dense and sparse CSR), ``BatchedTensor`` (the per-datum outputs of
forward/backward) and the JSON ``TensorData`` form. Does not own: torch conversions, which live in
the services that use torch. All byte buffers are raw little-endian numpy arrays.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest

_NUMPY: dict[int, np.dtype[Any]] = {
    tp.DTYPE_FLOAT32: np.dtype("<f4"),
    tp.DTYPE_INT64: np.dtype("<i8"),
    tp.DTYPE_INT32: np.dtype("<i4"),
}
_WIRE = {
    np.dtype("<f4"): tp.DTYPE_FLOAT32,
    np.dtype("<i8"): tp.DTYPE_INT64,
    np.dtype("<i4"): tp.DTYPE_INT32,
}
_JSON_DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}
# The most cells a decoded tensor may have (a sparse one's declared shape included): far beyond
# what a request's loss inputs or target ids need (tokens x K), and 64 MiB of float32 at most.
MAX_CELLS = 1 << 24


def tokens_from_bytes(data: bytes) -> npt.NDArray[np.int32]:
    if len(data) % 4:
        raise InvalidRequest(f"token bytes must be int32 little-endian; got {len(data)} bytes")
    return np.frombuffer(data, dtype="<i4").astype(np.int32)


def tokens_to_bytes(tokens: Iterable[int] | npt.NDArray[Any]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def model_input_tokens(chunks: Sequence[tp.Chunk]) -> npt.NDArray[np.int32]:
    """The token ids of a ModelInput. Image and dmel chunks are refused: the built-in models
    are text-only."""
    parts = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequest(
                f"model_input chunk {i} is {kind or 'empty'}; only encoded_text chunks are "
                "accepted by the text models this server hosts"
            )
        parts.append(tokens_from_bytes(chunk.encoded_text.tokens))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def decode_tensor(tensor: tp.Tensor, what: str) -> npt.NDArray[Any]:
    """A wire ``Tensor`` as a dense numpy array with its declared shape."""
    dtype = _dtype(tensor, what)
    encoding = tensor.WhichOneof("encoding")
    if encoding == "sparse_csr":
        rows, cols, values = sparse_cells(tensor, what)
        dense = np.zeros(_shape(tensor.shape, what), dtype=dtype)
        dense[rows, cols] = values
        return dense
    values = _frombuffer(tensor.dense, dtype, what)
    shape = _shape(tensor.shape or [len(values)], what)
    if math.prod(shape) != len(values):
        raise InvalidRequest(f"{what} has {len(values)} values but shape {list(shape)}")
    return values.reshape(shape)


def tensor_proto_from_json(data: Mapping[str, Any], what: str) -> tp.Tensor:
    """The JSON ``TensorData`` form (``{"data", "dtype", "shape", sparse indices...}``, as the
    SDK writes it) as a wire ``Tensor`` in the same layout (dense, or sparse CSR, whose absent
    cells stay absent)."""
    dtype = _JSON_DTYPES.get(str(data.get("dtype")))
    if dtype is None:
        raise InvalidRequest(f"{what}.dtype must be 'float32' or 'int64'")
    values = _json_array(data.get("data", []), dtype, f"{what}.data")
    raw_shape = data.get("shape") or [len(values)]
    if not isinstance(raw_shape, list):
        raise InvalidRequest(f"{what}.shape must be a list of sizes")
    shape = list(_shape(raw_shape, what))
    if "sparse_crow_indices" not in data:
        if math.prod(shape) != len(values):
            raise InvalidRequest(f"{what} has {len(values)} values but shape {shape}")
        return tp.Tensor(dense=values.tobytes(), dtype=_WIRE[dtype], shape=shape)
    crow = _json_array(data["sparse_crow_indices"], np.dtype("<i8"), f"{what}.sparse_crow_indices")
    cols = _json_array(
        data.get("sparse_col_indices", []), np.dtype("<i8"), f"{what}.sparse_col_indices"
    )
    csr = tp.SparseCsr(
        values=values.tobytes(), crow_indices=crow.tobytes(), col_indices=cols.tobytes()
    )
    tensor = tp.Tensor(sparse_csr=csr, dtype=_WIRE[dtype], shape=shape)
    sparse_cells(tensor, what)  # checks the indices
    return tensor


def sparse_cells(
    tensor: tp.Tensor, what: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[Any]]:
    """The (row, column, value) of every cell a 2-D tensor stores: all of a dense one's, the
    present ones of a CSR one's."""
    shape = _shape(tensor.shape, what)
    if len(shape) != 2:
        raise InvalidRequest(f"{what} must be 2-D, got shape {list(shape)}")
    if tensor.WhichOneof("encoding") != "sparse_csr":
        dense = decode_tensor(tensor, what)
        rows, cols = np.indices(shape).reshape(2, -1)
        return rows.astype(np.int64), cols.astype(np.int64), dense.reshape(-1)
    dtype = _dtype(tensor, what)
    csr = tensor.sparse_csr
    values = _frombuffer(csr.values, dtype, what)
    crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), what)
    cols = _frombuffer(csr.col_indices, np.dtype("<i8"), what)
    if (
        len(crow) != shape[0] + 1
        or len(cols) != len(values)
        or crow[0] != 0
        or crow[-1] != len(values)
        or (np.diff(crow) < 0).any()
        or (len(cols) and (cols.min() < 0 or cols.max() >= shape[1]))
    ):
        raise InvalidRequest(f"{what} is a malformed sparse CSR tensor of shape {list(shape)}")
    rows = np.repeat(np.arange(shape[0], dtype=np.int64), np.diff(crow))
    return rows, cols.astype(np.int64), values


def batched(arrays: Sequence[npt.NDArray[Any]]) -> tp.BatchedTensor:
    """Concatenate one array per datum into a ``BatchedTensor`` with int64 *byte* offsets. Every
    array shares a dtype and trailing shape; the leading dimension may differ."""
    if not arrays:
        return tp.BatchedTensor(offsets=np.zeros(1, "<i8").tobytes(), dtype=tp.DTYPE_FLOAT32)
    dtype = np.dtype(arrays[0].dtype).newbyteorder("<")
    parts = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype("<i8")
    return tp.BatchedTensor(
        data=b"".join(p.tobytes() for p in parts),
        offsets=offsets.tobytes(),
        dtype=_WIRE[dtype],
        trailing_shape=list(parts[0].shape[1:]),
    )


def unbatch(tensor: tp.BatchedTensor) -> list[npt.NDArray[Any]]:
    """The inverse of ``batched``: one array per datum."""
    dtype = _NUMPY[tensor.dtype]
    offsets = np.frombuffer(tensor.offsets, "<i8")
    trailing = tuple(int(d) for d in tensor.trailing_shape)
    out = []
    for start, end in itertools.pairwise(offsets):
        flat = np.frombuffer(tensor.data[start:end], dtype)
        out.append(flat.reshape((-1, *trailing)) if trailing else flat)
    return out


def _dtype(tensor: tp.Tensor, what: str) -> np.dtype[Any]:
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequest(f"{what} has dtype {tensor.dtype}; accepted are float32, int64, int32")
    return dtype


def _shape(sizes: Iterable[object], what: str) -> tuple[int, ...]:
    """A declared shape, refused unless every size is a non-negative integer and the whole
    holds at most ``MAX_CELLS`` cells (a sparse tensor's shape costs memory once dense)."""
    shape = []
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
            raise InvalidRequest(
                f"{what} has shape {list(sizes)!r:.200}; sizes must be non-negative integers"
            )
        shape.append(int(size))
    if len(shape) > 8 or math.prod(shape) > MAX_CELLS:
        raise InvalidRequest(
            f"{what} has shape {shape!r:.200}: at most 8 dimensions and {MAX_CELLS} cells"
        )
    return tuple(shape)


def _json_array(data: object, dtype: np.dtype[Any], what: str) -> npt.NDArray[Any]:
    """A JSON list of numbers as a 1-D array of ``dtype``; anything else (nested lists, strings,
    integers beyond the dtype, non-finite floats) is refused."""
    if not isinstance(data, list) or len(data) > MAX_CELLS:
        raise InvalidRequest(f"{what} must be a flat list of at most {MAX_CELLS} numbers")
    try:
        array = np.asarray(data, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequest(f"{what} must be a flat list of {dtype.name} numbers: {exc}") from exc
    if array.ndim != 1 or (array.dtype.kind == "f" and not np.isfinite(array).all()):
        raise InvalidRequest(f"{what} must be a flat list of finite {dtype.name} numbers")
    return array


def _frombuffer(data: bytes, dtype: np.dtype[Any], what: str) -> npt.NDArray[Any]:
    if len(data) % dtype.itemsize:
        raise InvalidRequest(f"{what}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype)
