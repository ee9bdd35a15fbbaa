"""The tensor codec of the Tinker wire: numpy arrays to and from the protobuf encodings.

Owns: token bytes, ``Tensor`` (dense and sparse CSR), ``BatchedTensor`` (the per-datum outputs of
forward/backward) and the JSON ``TensorData`` form. Does not own: torch conversions, which live in
the services that use torch. All byte buffers are raw little-endian numpy arrays.
"""

from __future__ import annotations

import itertools
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
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequest(f"{what} has dtype {tensor.dtype}; accepted are float32, int64, int32")
    shape = tuple(int(d) for d in tensor.shape)
    encoding = tensor.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = tensor.sparse_csr
        values = _frombuffer(csr.values, dtype, what)
        crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), what)
        cols = _frombuffer(csr.col_indices, np.dtype("<i8"), what)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(cols) != len(values):
            raise InvalidRequest(f"{what} is a malformed sparse CSR tensor of shape {list(shape)}")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, cols] = values
        return dense
    values = _frombuffer(tensor.dense, dtype, what)
    if not shape:
        shape = (len(values),)
    if int(np.prod(shape)) != len(values):
        raise InvalidRequest(f"{what} has {len(values)} values but shape {list(shape)}")
    return values.reshape(shape)


def tensor_from_json(data: Mapping[str, Any], what: str) -> npt.NDArray[Any]:
    """The JSON ``TensorData`` form (``{"data", "dtype", "shape", sparse indices...}``)."""
    dtype = _JSON_DTYPES.get(str(data.get("dtype")))
    if dtype is None:
        raise InvalidRequest(f"{what}.dtype must be 'float32' or 'int64'")
    values = np.asarray(data.get("data", []), dtype=dtype)
    shape = tuple(int(d) for d in data.get("shape") or (len(values),))
    if "sparse_crow_indices" in data:
        crow = np.asarray(data["sparse_crow_indices"], np.int64)
        cols = np.asarray(data.get("sparse_col_indices", []), np.int64)
        dense: npt.NDArray[Any] = np.zeros(shape, dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(crow)), cols] = values
        return dense
    reshaped: npt.NDArray[Any] = values.reshape(shape)
    return reshaped


def tensor_proto_from_json(data: Mapping[str, Any], what: str) -> tp.Tensor:
    """The JSON ``TensorData`` form as a wire ``Tensor`` in the same layout (dense, or sparse
    CSR, whose absent cells stay absent)."""
    dtype = _JSON_DTYPES.get(str(data.get("dtype")))
    if dtype is None:
        raise InvalidRequest(f"{what}.dtype must be 'float32' or 'int64'")
    try:
        values = np.asarray(data.get("data", []), dtype=dtype)
        shape = [int(d) for d in data.get("shape") or (len(values),)]
        if "sparse_crow_indices" not in data:
            if int(np.prod(shape)) != len(values):
                raise InvalidRequest(f"{what} has {len(values)} values but shape {shape}")
            return tp.Tensor(dense=values.tobytes(), dtype=_WIRE[dtype], shape=shape)
        crow = np.asarray(data["sparse_crow_indices"], "<i8")
        cols = np.asarray(data.get("sparse_col_indices", []), "<i8")
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{what} is not a valid TensorData: {exc}") from exc
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
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) != 2:
        raise InvalidRequest(f"{what} must be 2-D, got shape {list(shape)}")
    if tensor.WhichOneof("encoding") != "sparse_csr":
        dense = decode_tensor(tensor, what)
        rows, cols = np.indices(shape).reshape(2, -1)
        return rows.astype(np.int64), cols.astype(np.int64), dense.reshape(-1)
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequest(f"{what} has dtype {tensor.dtype}; accepted are float32, int64, int32")
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


def _frombuffer(data: bytes, dtype: np.dtype[Any], what: str) -> npt.NDArray[Any]:
    if len(data) % dtype.itemsize:
        raise InvalidRequest(f"{what}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype)
