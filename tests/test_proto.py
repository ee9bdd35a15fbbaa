"""proto/ is the single source of wire truth: our Tinker schema is wire-identical to the SDK's,
and the committed generated code is what proto/generate.py makes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from google.protobuf import descriptor_pb2
from tinker.proto import tinker_public_pb2 as sdk

from tinsmith._proto import tinker_public_pb2 as ours

ROOT = Path(__file__).resolve().parent.parent


def _wire(file: object) -> dict[str, object]:
    """Everything about a file's messages and enums that the bytes on the wire depend on."""
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)  # type: ignore[attr-defined]

    def message(m: descriptor_pb2.DescriptorProto) -> object:
        fields = {
            f.number: (f.name, f.type, f.label, f.type_name.rsplit(".", 1)[-1], f.proto3_optional)
            for f in m.field
        }
        return fields, {n.name: message(n) for n in m.nested_type}

    return {
        "messages": {m.name: message(m) for m in proto.message_type},
        "enums": {e.name: [(v.name, v.number) for v in e.value] for e in proto.enum_type},
    }


def test_tinker_schema_is_wire_identical_to_the_sdk() -> None:
    assert _wire(ours.DESCRIPTOR) == _wire(sdk.DESCRIPTOR)


def test_bytes_cross_between_the_two_schemas() -> None:
    request = sdk.ForwardBackwardRequest(model_id="S:train:0", seq_id=3, loss_fn="cross_entropy")
    request.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00"
    parsed = ours.ForwardBackwardRequest.FromString(request.SerializeToString())
    assert parsed.seq_id == 3 and parsed.data[0].model_input[0].encoded_text.tokens[0] == 1


def test_generated_code_is_current(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    for fresh in generate.generate(tmp_path):
        committed = ROOT / "tinsmith" / "_proto" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run make proto"
