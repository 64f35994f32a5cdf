"""``lattica demo``: a local swarm of real daemons training the default GPT with DiLoCo.

It starts ``--nodes`` ``lattica join --train`` processes on loopback (the first starts the
swarm, the others join through its address), each on its share of the machine's cores (torch
threads: several processes with every core each would wait for each other at every step),
follows their control sockets to show live progress, and ends with a summary table and a check
that every replica holds the same outer weights. The default workload (``DEMO_ROUNDS`` rounds of
the default H) is a newcomer's first run and fits in two minutes on two CPU cores; ``--long``
and ``--rounds`` train more. Every process it started is stopped on the way out: SIGTERM to all
at once (each says goodbye to its peers), then SIGKILL to any still running after a grace period.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from lattica.cli.progress import ProgressDisplay, render_summary
from lattica.config import DEMO_LONG_ROUNDS, DEMO_ROUNDS
from lattica.control import client
from lattica.decoding import exact_int, finite_float, str_list, str_map
from lattica.errors import ConfigError, LatticaError

_POLL_S = 1.0
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lattica_command(*args: str) -> list[str]:
    """``lattica ARGS...`` run by this interpreter (the CLI of the installed package)."""
    return [sys.executable, "-m", "lattica.cli.main", *args]


@dataclass
class DaemonProcess:
    """One ``lattica join`` process of the demo swarm, started the way a user starts it.

    Its output goes to ``daemon.log`` in its data dir; it is asked over its control socket; it
    is ended by PID (SIGTERM, then SIGKILL after a grace period). ``join_args``, ``command`` and
    ``environment`` say what is run, so a variant changes only the part it needs.
    """

    data_dir: Path
    port: int = field(default_factory=free_port)
    peers: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    listen_ip: str = "127.0.0.1"
    torch_threads: int | None = None  # the daemon's intra-op threads; None: torch's default
    _terminated: bool = field(default=False, init=False, repr=False)  # SIGTERM sent to this process

    @property
    def log_path(self) -> Path:
        return self.data_dir / "daemon.log"

    def join_args(self) -> list[str]:
        args = [
            "join",
            "--data-dir", str(self.data_dir),
            "--listen", f"/ip4/{self.listen_ip}/tcp/{self.port}",
            "--metrics-addr", "off",
            "--bootstrap-timeout", "20",
            *self.extra_args,
        ]
        for peer in self.peers:
            args += ["--peer", peer]
        return args

    def command(self) -> list[str]:
        return lattica_command(*self.join_args())

    def environment(self) -> dict[str, str] | None:
        """The daemon's environment; None: this process's own. ``torch_threads`` sets
        ``OMP_NUM_THREADS`` unless this process's environment already does (the user's choice)."""
        if self.torch_threads is None or "OMP_NUM_THREADS" in os.environ:
            return None
        return {**os.environ, "OMP_NUM_THREADS": str(self.torch_threads)}

    def start(self) -> Self:
        self._terminated = False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:  # a restarted daemon's log follows the one before
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.environment(),
            )
        return self

    def wait_ready(self, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log()}")
            try:
                return str_map(self.call("status")) or {}
            except LatticaError:
                time.sleep(0.2)
        raise TimeoutError(f"daemon in {self.data_dir} not ready after {timeout} s: {self.log()}")

    def call(self, method: str) -> object:
        return client.call(self.data_dir / "control.sock", method, timeout=10.0)

    @property
    def addr(self) -> str:
        addrs = str_list((str_map(self.call("id")) or {}).get("addrs"))
        if not addrs:
            raise RuntimeError(f"daemon in {self.data_dir} reports no address")
        return addrs[0]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """Ask the daemon to shut down (SIGTERM), once: a second signal would make it exit
        at once, without its goodbyes."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            os.kill(self.proc.pid, signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> int | None:
        """End the process (SIGTERM, then SIGKILL after ``timeout``); its exit status."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


def stop_all(daemons: Sequence[DaemonProcess], timeout: float = _STOP_TIMEOUT_S) -> None:
    """Stop every daemon, side by side: all are asked first, then each is waited for (each
    says goodbye to its peers; one after the other, the waits would add up)."""
    for d in daemons:
        d.terminate()
    for d in daemons:
        d.stop(timeout)


def run_demo(args: argparse.Namespace) -> int:
    if not 1 <= args.nodes <= 16:
        raise ConfigError("--nodes must be between 1 and 16")
    rounds = demo_rounds(args)
    if rounds < 1 or args.inner_steps < 1:
        raise ConfigError("--rounds and --inner-steps must be positive")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lattica-demo-") as tmp:
        workdir = args.workdir or Path(tmp)
        daemons = _start_swarm(args, workdir, rounds=rounds)
        try:
            statuses = _follow(daemons, json_output=args.json)
        finally:
            stop_all(daemons)
    return _report(statuses, json_output=args.json, seconds=time.monotonic() - started)


def demo_rounds(args: argparse.Namespace) -> int:
    """The outer rounds to train: ``--rounds``, else the default or ``--long`` workload."""
    if args.rounds is not None:
        return int(args.rounds)
    return DEMO_LONG_ROUNDS if args.long else DEMO_ROUNDS


def threads_per_node(nodes: int) -> int:
    """Each daemon's share of this machine's cores (at least one). The daemons train side by
    side: with torch's default (every core for each process) their threads outnumber the
    cores and wait for each other at every operation, which makes each step several times
    slower than with one thread per core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nodes)


def _train_args(args: argparse.Namespace, rounds: int) -> tuple[str, ...]:
    return (
        "--train", "--strategy", args.strategy, "--model", args.model,
        "--rounds", str(rounds), "--inner-steps", str(args.inner_steps),
        "--min-peers", str(args.nodes), "--run-id", "demo",
    )


def _start_swarm(args: argparse.Namespace, workdir: Path, *, rounds: int) -> list[DaemonProcess]:
    threads = threads_per_node(args.nodes)

    def make(i: int, peers: tuple[str, ...]) -> DaemonProcess:
        daemon = DaemonProcess(
            workdir / f"node{i}", peers=peers, extra_args=_train_args(args, rounds), torch_threads=threads,
        )
        if args.base_port:
            daemon.port = args.base_port + i
        return daemon

    started = time.monotonic()
    _say(
        f"starting {args.nodes} daemons in {workdir} ({rounds} rounds of {args.inner_steps} inner steps, "
        f"{threads} thread(s) each) ...",
        args.json,
    )
    first = make(0, ()).start()
    daemons = [first]
    try:
        first.wait_ready(timeout=_START_TIMEOUT_S)
        bootstrap = first.addr
        _say(f"swarm bootstrap: {bootstrap}", args.json)
        daemons += [make(i, (bootstrap,)).start() for i in range(1, args.nodes)]
        for d in daemons[1:]:
            d.wait_ready(timeout=_START_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        stop_all(daemons)
        raise ConfigError(f"demo swarm failed to start: {str(exc).splitlines()[0]}") from None
    _say(f"{args.nodes} daemons up in {time.monotonic() - started:.1f} s; each loads the model and corpus, "
         "then training starts", args.json)
    return daemons


def _section(record: Mapping[str, object], key: str) -> dict[str, object]:
    """``record[key]`` when it is a JSON object, else an empty one (a daemon's status as JSON)."""
    return str_map(record.get(key)) or {}


def _follow(daemons: list[DaemonProcess], *, json_output: bool) -> list[dict[str, object]]:
    """Poll every daemon until all are done (or failed, or gone), showing their progress; the
    statuses at the end."""
    display = ProgressDisplay(stream=sys.stderr if json_output else sys.stdout)
    statuses: list[dict[str, object]] = [{} for _ in daemons]
    try:
        while True:
            for i, d in enumerate(daemons):
                try:
                    statuses[i] = str_map(d.call("status")) or {}
                except LatticaError:
                    if d.proc is not None and d.proc.poll() is not None:
                        statuses[i] = {"training": {"phase": "exited", "error": d.log().strip().splitlines()[-1:]}}
                    continue
                t = _section(statuses[i], "training")
                phase = t.get("phase")
                display.update(
                    f"node{i}",
                    round=exact_int(t.get("rounds_completed")),
                    step=exact_int(t.get("step")),
                    phase=phase if isinstance(phase, str) else None,
                    loss=finite_float(t.get("val_loss")) or finite_float(t.get("loss")),
                    tokens_per_s=finite_float(t.get("tokens_per_s")),
                    peers=exact_int(statuses[i].get("connected_peers")),
                    bytes_sent=exact_int(t.get("bytes_sent")),
                    bytes_received=exact_int(t.get("bytes_received")),
                )
            phases = [_section(s, "training").get("phase") for s in statuses]
            if all(p in ("done", "failed", "exited") for p in phases):
                _attach_weights_hashes(daemons, statuses)
                return statuses
            time.sleep(_POLL_S)
    finally:
        display.close()


def _attach_weights_hashes(daemons: list[DaemonProcess], statuses: list[dict[str, object]]) -> None:
    """Each node's published (round, weights hash), read from its replicated state."""
    for d, status in zip(daemons, statuses, strict=True):
        try:
            progress = _section(str_map(d.call("state")) or {}, "progress")
        except LatticaError:
            continue
        peer_id = status.get("peer_id")
        mine = _section(progress, peer_id) if isinstance(peer_id, str) else {}
        training = _section(status, "training")
        training["weights_hash"] = mine.get("weights_hash")
        status["training"] = training


def _report(statuses: list[dict[str, object]], *, json_output: bool, seconds: float) -> int:
    rows: dict[str, dict[str, object]] = {}
    hashes: set[str | None] = set()
    for i, status in enumerate(statuses):
        t = _section(status, "training")
        summary = _section(t, "summary")
        node_seconds = finite_float(summary.get("seconds"))
        weights_hash = t.get("weights_hash")
        weights_hash = weights_hash if isinstance(weights_hash, str) else None
        rows[f"node{i}"] = {
            "phase": t.get("phase"),
            "rounds": t.get("rounds_completed"),
            "first_loss": summary.get("first_loss"),
            "val_loss": summary.get("val_loss"),
            "tokens": summary.get("tokens"),
            "seconds": round(node_seconds, 1) if node_seconds is not None else None,
            "bytes_sent": summary.get("bytes_sent"),
            "bytes_received": t.get("bytes_received"),
            "weights": (weights_hash or "")[:12],
        }
        hashes.add(weights_hash)
    identical = len(hashes) == 1 and None not in hashes
    # NoLoCo and eager DiLoCo keep replicas apart by design; the others must agree bit for bit
    must_agree = all(_section(s, "training").get("replicas_agree", True) for s in statuses)
    ok = all(r["phase"] == "done" for r in rows.values()) and (identical or not must_agree)
    strategy = _section(statuses[0], "training").get("strategy", "diloco") if statuses else "diloco"
    if json_output:
        print(json.dumps({
            "nodes": rows, "strategy": strategy, "replicas_identical": identical, "ok": ok,
            "seconds": round(seconds, 1),
        }))
    else:
        print(render_summary(rows, title=f"Lattica demo: {strategy} on the Python standard library"))
        verdict = "yes" if identical else ("no (expected: replicas differ by design)" if not must_agree else "NO")
        print(f"replicas identical: {verdict}")
        print(f"demo finished in {seconds:.0f} s")
        for label, status in zip(rows, statuses, strict=True):
            error = _section(status, "training").get("error")
            message = error if isinstance(error, str) else " ".join(str_list(error) or [])
            if message:
                print(f"{label}: {message}")
    return 0 if ok else 1


def _say(text: str, quiet: bool) -> None:
    print(text, file=sys.stderr if quiet else sys.stdout, flush=True)
