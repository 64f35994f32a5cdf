"""One error taxonomy for the whole runtime.

- ``ConfigError``: the user gave bad input (flag, env var, file). The CLI prints one line.
- ``StorageError``: a file of the node's own could not be written (disk full, quota, I/O
  error); one line naming the file, the reason and the space left.
- ``LocalProtocolError``: *we* tried to do something the protocol forbids (a bug or misuse).
- ``RemoteProtocolError``: a peer sent something malformed, oversized or hostile. It carries
  the peer id; the caller logs it, drops or penalizes the peer, and carries on.
- ``ClosedError`` vs ``BrokenError``: "you closed it" vs "the other side (or the network)
  broke it", as trio distinguishes ``ClosedResourceError`` and ``BrokenResourceError``.
- ``PeerUnavailableError``: a peer could not be reached or vanished mid-operation;
  ``PeerBusyError``: it answered that it is over its serving budget (try later).
- ``RankFailedError``: one of this node's own rank processes (one per local device) died,
  failed or hung; it names the rank, its device and why.
"""

from __future__ import annotations


class LatticaError(Exception):
    """Base of every error Lattica raises on purpose."""


class ConfigError(LatticaError):
    """Invalid user input: flags, environment, config or key files."""


class StorageError(LatticaError):
    """A file in the data dir could not be written: disk full, over quota, an I/O error."""


class LocalProtocolError(LatticaError):
    """This node attempted something the protocol does not allow."""


class RemoteError(LatticaError):
    """Base for failures attributed to a specific remote peer."""

    def __init__(self, message: str, *, peer_id: str | None = None) -> None:
        super().__init__(message)
        self.peer_id = peer_id

    def __str__(self) -> str:
        base = super().__str__()
        if self.peer_id:
            return f"{base} (peer {self.peer_id})"
        return base


class RemoteProtocolError(RemoteError):
    """A peer sent malformed, oversized or otherwise invalid data."""


class PeerUnavailableError(RemoteError):
    """A peer could not be reached, or disconnected during an operation."""


class PeerBusyError(PeerUnavailableError):
    """A peer refused to serve for now (over its serving budget): try again later."""


class ClosedError(LatticaError):
    """The resource was closed locally."""


class BrokenError(RemoteError):
    """The resource was broken by the remote side or the network."""


class DaemonNotRunningError(LatticaError):
    """No daemon answers on the control socket of the given data dir."""


class RankFailedError(LatticaError):
    """A rank process of this node (one per local device) died, failed or stopped answering."""

    def __init__(self, reason: str, *, rank: int, device: str) -> None:
        super().__init__(f"rank {rank} ({device}): {reason}")
        self.rank, self.device, self.reason = rank, device, reason
