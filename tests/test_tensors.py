"""The tensor codec: numpy arrays to and from the Tinker wire encodings."""

from __future__ import annotations

import numpy as np
import pytest

from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest
from tinsmith.tensors import (
    batched,
    decode_tensor,
    model_input_tokens,
    tensor_proto_from_json,
    tokens_to_bytes,
    unbatch,
)


def test_dense_tensor_round_trip_with_shape() -> None:
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = tp.Tensor(dense=values.tobytes(), dtype=tp.DTYPE_FLOAT32, shape=[2, 3])
    np.testing.assert_array_equal(decode_tensor(tensor, "x"), values)


def test_sparse_csr_tensor_becomes_dense() -> None:
    tensor = tp.Tensor(dtype=tp.DTYPE_INT64, shape=[2, 3])
    tensor.sparse_csr.values = np.array([7, 8, 9], "<i8").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1, 3], "<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array([2, 0, 1], "<i8").tobytes()
    np.testing.assert_array_equal(decode_tensor(tensor, "x"), [[0, 0, 7], [8, 9, 0]])


def test_malformed_tensors_are_refused_with_the_reason() -> None:
    with pytest.raises(InvalidRequest, match="3 values but shape"):
        decode_tensor(tp.Tensor(dense=b"\0" * 12, dtype=tp.DTYPE_FLOAT32, shape=[4]), "w")
    with pytest.raises(InvalidRequest, match="whole number"):
        decode_tensor(tp.Tensor(dense=b"\0" * 5, dtype=tp.DTYPE_FLOAT32), "w")


def test_batched_tensor_uses_byte_offsets_and_round_trips() -> None:
    arrays = [
        np.array([1.0, 2.0], np.float32),
        np.array([3.0], np.float32),
        np.zeros(0, np.float32),
    ]
    encoded = batched(arrays)
    assert np.frombuffer(encoded.offsets, "<i8").tolist() == [0, 8, 12, 12]
    assert [a.tolist() for a in unbatch(encoded)] == [[1.0, 2.0], [3.0], []]


def test_the_sdk_decodes_our_forward_backward_output() -> None:
    """What the trainer returns is what tinker's own decoder expects."""
    from tinker.proto.response_conv import deserialize_forward_backward_output

    out = tp.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=2)
    record.fields["logprobs"].CopyFrom(
        batched([np.array([-1.0, -2.0], np.float32), np.array([-3.0], np.float32)])
    )
    out.metrics["loss:sum"] = 6.0
    decoded = deserialize_forward_backward_output(out.SerializeToString())
    assert decoded.metrics == {"loss:sum": 6.0}
    assert decoded.loss_fn_outputs[1]["logprobs"].tolist() == [-3.0]


def test_model_input_tokens_concatenates_text_chunks_and_refuses_images() -> None:
    chunks = [tp.Chunk(), tp.Chunk()]
    chunks[0].encoded_text.tokens = tokens_to_bytes([1, 2])
    chunks[1].encoded_text.tokens = tokens_to_bytes([3])
    assert model_input_tokens(chunks).tolist() == [1, 2, 3]
    image = tp.Chunk()
    image.image.format = "png"
    with pytest.raises(InvalidRequest, match="only encoded_text"):
        model_input_tokens([image])


def test_json_tensor_data_as_the_sdk_writes_it() -> None:
    data = {"data": [1, -1, 2, 3], "dtype": "int64", "shape": [2, 2]}
    dense = tensor_proto_from_json(data, "t")
    np.testing.assert_array_equal(decode_tensor(dense, "t"), [[1, -1], [2, 3]])
    sparse = {
        "data": [5],
        "dtype": "float32",
        "shape": [2, 2],
        "sparse_crow_indices": [0, 0, 1],
        "sparse_col_indices": [1],
    }
    csr = tensor_proto_from_json(sparse, "t")
    assert csr.WhichOneof("encoding") == "sparse_csr"
    np.testing.assert_array_equal(decode_tensor(csr, "t"), [[0, 0], [0, 5]])


@pytest.mark.parametrize(
    "shape", [[-1, -1], [-1], [2**62, 2**62], [2**40], [1] * 9, [2**13, 2**13, 2**13]]
)
def test_shapes_with_negative_or_overflowing_sizes_are_refused(shape: list[int]) -> None:
    """A weights tensor of shape [-1, -1] holding one value used to fail inside numpy, as an
    internal error that left its seq_id neither accepted nor rejected."""
    dense = tp.Tensor(dense=np.ones(1, "<f4").tobytes(), dtype=tp.DTYPE_FLOAT32, shape=shape)
    with pytest.raises(InvalidRequest, match="shape"):
        decode_tensor(dense, "weights")
    sparse = tp.Tensor(dtype=tp.DTYPE_FLOAT32, shape=shape)
    sparse.sparse_csr.crow_indices = np.zeros(1, "<i8").tobytes()
    with pytest.raises(InvalidRequest, match="shape"):
        decode_tensor(sparse, "weights")


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        ({"data": [2**70], "dtype": "int64"}, "int64"),
        ({"data": [float("nan")], "dtype": "float32"}, "finite"),
        ({"data": [[1, 2]], "dtype": "int64"}, "flat list"),
        ({"data": "12", "dtype": "int64"}, "flat list"),
        ({"data": [1], "dtype": "int64", "shape": [-1]}, "non-negative"),
        ({"data": [1], "dtype": "int64", "shape": "1"}, "list of sizes"),
        ({"data": [1], "dtype": "int64", "shape": [1], "sparse_crow_indices": [2**64]}, "int64"),
    ],
)
def test_json_tensor_data_that_does_not_fit_is_refused(
    data: dict[str, object], detail: str
) -> None:
    with pytest.raises(InvalidRequest, match=detail):
        tensor_proto_from_json(data, "t")
