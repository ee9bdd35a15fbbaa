"""Reading the SDK's bodies: the run and seq_id from the first bytes of a body too large to
read, and numbers that are not finite refused by the field that holds them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.gateway import wire
from services.gateway.config import GatewayConfig
from services.gateway.rest import download_base
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest


def _forward_backward(model_id: str, seq_id: int, tokens: int) -> bytes:
    request = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.zeros(tokens, "<i4").tobytes()
    return request.SerializeToString()


@pytest.mark.parametrize("seq_id", [1, 300, 2**31 - 1])
def test_a_forward_backwards_run_and_seq_id_are_in_its_first_bytes(seq_id: int) -> None:
    body = _forward_backward("S:train:0", seq_id, tokens=100_000)
    assert wire.protobuf_ids(body[:1024]) == ("S:train:0", seq_id)


@pytest.mark.parametrize("prefix", [b"", b"\xff\xff\xff", b"\x0a\x50S:train", b"\x10\x05"])
def test_first_bytes_that_do_not_name_both_name_nothing(prefix: bytes) -> None:
    assert wire.protobuf_ids(prefix) is None


def test_a_json_requests_run_and_seq_id_are_found_in_its_first_bytes() -> None:
    body = json.dumps(
        {"model_id": "S:train:0", "path": "x", "seq_id": 12, "user_metadata": {"k": "v" * 99}}
    ).encode()
    assert wire.json_ids(body[:60]) == ("S:train:0", 12)
    assert wire.json_ids(b'{"path": "x", "user_metadata": {"k": "vvvv') is None


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_json_number_is_refused_by_its_field(literal: str) -> None:
    body = json.loads(f'{{"learning_rate": {literal}}}', parse_constant=wire.NonFinite)
    with pytest.raises(InvalidRequest, match=f"'learning_rate' must be a finite number.*{literal}"):
        wire.number(body, "learning_rate")


def test_numbers_beyond_a_float_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="'learning_rate' must be a finite number"):
        wire.number({"learning_rate": 10**400}, "learning_rate")
    with pytest.raises(InvalidRequest, match="'seq_id' must be <= "):
        wire.req_int({"seq_id": 2**64}, "seq_id")


@pytest.mark.parametrize(
    ("public_url", "host", "header", "base"),
    [
        ("https://tinsmith.example", "0.0.0.0", "evil.example", "https://tinsmith.example"),
        ("", "127.0.0.1", "evil.example:80", "http://127.0.0.1:8000"),
        ("", "::1", "evil.example", "http://[::1]:8000"),
        ("", "0.0.0.0", "gateway.tinsmith.svc:8000", "http://gateway.tinsmith.svc:8000"),
        ("", "0.0.0.0", "10.0.0.7", "http://10.0.0.7"),
    ],
)
def test_download_urls_name_a_configured_or_well_formed_host(
    public_url: str, host: str, header: str, base: str
) -> None:
    config = GatewayConfig(host=host, port=8000, public_url=public_url)
    assert download_base(config, header) == base


@pytest.mark.parametrize(
    "header", ["evil.example/x?", "user@evil.example", "a b", "x" * 300, "", "[::1", "h:port"]
)
def test_a_host_header_that_is_not_a_host_is_refused(header: str) -> None:
    with pytest.raises(InvalidRequest, match="TINSMITH_PUBLIC_URL"):
        download_base(GatewayConfig(host="0.0.0.0"), header)
