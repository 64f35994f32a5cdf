"""A standalone data-plane peer for multi-process tests and benchmarks.

Run ``python -m lattica_lab.peer_main [--no-fast]``. It starts a host and a
``TensorService`` on 127.0.0.1, prints ``{"peer_id", "addr"}`` as one JSON line, then obeys JSON
commands, one per stdin line, answering each with one JSON line on stdout:

- ``{"op": "connect", "addrs": [...]}``
- ``{"op": "allreduce", "group": [...], "tag": str, "numel": int, "seed": int, "codec": str,
  "deadline_s": float, "out": path|null}``: the input is ``randn(numel)`` from ``seed``; the
  result's raw fp32 bytes are written to ``out``. With ``"barrier": true`` the group first runs
  a one-element all-reduce, so every member starts the timed one together (like gloo's barrier);
  ``"inplace": true`` writes the mean over the input (like gloo's ``all_reduce``).
- ``{"op": "send_then_hang", "group": [...], "tag": str, "numel": int, "seed": int}``: send the
  reduce-scatter parts of an all-reduce, report, and never finish it (a peer about to die).
- ``{"op": "blob_send", "peer": id, "tag": str, "nbytes": int}`` / ``{"op": "blob_recv", ...}``:
  one raw uint8 tensor and a tiny acknowledgement back; the sender reports the round trip and
  both report their process CPU seconds (the receiver's from ``blob_post``). The sender reuses
  one pre-touched tensor per size; ``{"op": "blob_post", ...}`` (before the send) lets the
  payload land in one reused, pre-touched buffer per size, like a collective's posted receive.
- ``{"op": "stats"}``, ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import multiaddr
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.net.host import build_host
from lattica.net.tensors import collectives
from lattica.net.tensors.collectives import CollectiveAbortedError
from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
from lattica.numerics import codecs


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_input(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


async def _allreduce(service: TensorService, cmd: dict) -> dict:
    x = make_input(cmd["numel"], cmd["seed"])
    start = time.perf_counter()
    try:
        with trio.fail_after(cmd.get("deadline_s", 60.0)):
            if cmd.get("barrier"):
                await service.allreduce([torch.zeros(1)], group=cmd["group"], tag=cmd["tag"] + "/barrier")
            start, cpu_start = time.perf_counter(), time.process_time()
            sent_before = service.stats.total_sent()
            (out,) = await service.allreduce([x], group=cmd["group"], tag=cmd["tag"],
                                             codec=cmd.get("codec", "fp32"),
                                             out=[x] if cmd.get("inplace") else None)
    except CollectiveAbortedError as exc:
        return {"ok": False, "error": "aborted", "failed_peers": list(exc.failed_peers),
                "seconds": time.perf_counter() - start}
    except trio.TooSlowError:
        return {"ok": False, "error": "deadline", "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    if cmd.get("out"):
        await trio.Path(cmd["out"]).write_bytes(_raw_bytes(out))
    return {"ok": True, "seconds": seconds, "cpu_s": time.process_time() - cpu_start,
            "bytes_sent": service.stats.total_sent() - sent_before}


def _raw_bytes(t: torch.Tensor) -> bytes:
    _, payload = codecs.encode(t, "raw")
    return bytes(payload)


async def _send_then_hang(service: TensorService, cmd: dict) -> None:
    x = make_input(cmd["numel"], cmd["seed"])
    group = cmd["group"]
    bounds = collectives._part_bounds(x.numel(), len(group))
    for j, peer in enumerate(group):
        if peer != service.peer_id:
            a, b = bounds[j]
            await service.send(peer, cmd["tag"] + "/rs", [x[a:b]], part=j)
    _reply({"ok": True, "hanging": True})
    await trio.sleep_forever()


_BLOBS: dict[tuple[str, int], torch.Tensor] = {}
_CPU_FROM: dict[str, float] = {}  # blob tag -> process CPU time when its buffer was posted


def _blob(role: str, nbytes: int) -> torch.Tensor:
    """One tensor per role and size, reused across reps, its pages touched before any timing."""
    if (role, nbytes) not in _BLOBS:
        _BLOBS[(role, nbytes)] = torch.ones(nbytes, dtype=torch.uint8)
    return _BLOBS[(role, nbytes)]


async def _blob_send(service: TensorService, cmd: dict) -> dict:
    blob = _blob("send", cmd["nbytes"])
    start, cpu_start = time.perf_counter(), time.process_time()
    await service.send(cmd["peer"], cmd["tag"], [blob], codec="raw")
    await service.receive(cmd["peer"], cmd["tag"] + "/ack")
    return {"ok": True, "seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start}


def _blob_post(service: TensorService, cmd: dict) -> dict:
    buffer = codecs.encode(_blob("recv", cmd["nbytes"]), "raw")[1]
    service.post_receive(cmd["peer"], cmd["tag"], 0, buffer)
    _CPU_FROM[cmd["tag"]] = time.process_time()
    return {"ok": True}


async def _blob_recv(service: TensorService, cmd: dict) -> dict:
    cpu_start = _CPU_FROM.pop(cmd["tag"], time.process_time())
    ((_, blob),) = await service.receive(cmd["peer"], cmd["tag"])
    await service.send(cmd["peer"], cmd["tag"] + "/ack", [torch.zeros(1)])
    return {"ok": True, "nbytes": blob.numel(), "cpu_s": time.process_time() - cpu_start}


async def _serve(fast: bool) -> None:
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    service = TensorService(host, key_pair, config=TensorServiceConfig(fast_path=fast))
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        _reply({"peer_id": service.peer_id, "addr": str(host.get_addrs()[0])})
        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                break
            if op == "connect":
                for addr in cmd["addrs"]:
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                _reply({"ok": True})
            elif op == "allreduce":
                _reply(await _allreduce(service, cmd))
            elif op == "send_then_hang":
                await _send_then_hang(service, cmd)
            elif op == "blob_send":
                _reply(await _blob_send(service, cmd))
            elif op == "blob_post":
                _reply(_blob_post(service, cmd))
            elif op == "blob_recv":
                _reply(await _blob_recv(service, cmd))
            elif op == "stats":
                _reply({"ok": True, **service.stats.snapshot()})
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-fast", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(_serve, not args.no_fast)


if __name__ == "__main__":
    main()
