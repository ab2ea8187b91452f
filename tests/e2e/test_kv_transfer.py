"""A real worker serves KV transfers and says where in its hello: the control plane shows the address
in GetServerInfo (to authenticated callers: those of --api-key), and a transfer sent there arrives."""

from __future__ import annotations

import re

import pytest
import torch

from clients.client import StepwiseClient
from data_plane.kv_transfer_grpc import GrpcKvTransport

pytestmark = pytest.mark.timeout(120)

KEY = "s3cret-key-for-tests"


async def test_a_worker_announces_its_transfer_address_and_takes_transfers(start_control) -> None:
    plane = await start_control("--api-key", KEY)
    plane.add_worker("w0", sim=False)
    plane.add_worker("w1", "--transfer-port", "-1", sim=False)
    plane.add_worker("sim")  # the sim moves zeros of its model's K/V shape: it serves a link too
    await plane.wait_workers(3, api_key=KEY)
    async with StepwiseClient(plane.address, api_key=KEY) as client:
        info = await client.server_info()
    addresses = {w.worker_id: w.transfer_address for w in info.workers}
    for worker in ("w0", "sim"):
        assert re.fullmatch(r"127\.0\.0\.1:\d+", addresses[worker]), addresses
    assert addresses["w1"] == ""

    sender = GrpcKvTransport("127.0.0.1", 0, 0)
    try:
        k = torch.randn(2, 8, 2, 4)
        assert await sender.send(addresses["w0"], "e2e", k, k) == 2 * k.numel() * 4
    finally:
        await sender.stop()
