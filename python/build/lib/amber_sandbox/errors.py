"""Exceptions a caller can catch by kind; each carries the node's message."""

from __future__ import annotations


class AmberError(Exception):
    """Any error answered by an amber node (or reaching it)."""

    kind = "internal"

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


class BadRequest(AmberError):
    kind = "bad_request"


class Unauthorized(AmberError):
    kind = "unauthorized"


class NotFound(AmberError):
    """No such sandbox, process or file."""

    kind = "not_found"


class ImageNotFound(AmberError):
    """The image reference or env digest is not in the registry."""

    kind = "image_not_found"


class SandboxNotRunning(AmberError):
    """The sandbox exists but is not running; the message says why (deleted, lifetime, lost…)."""

    kind = "not_running"


class CapacityError(AmberError):
    """The node (or every node given) has no room: HTTP 429."""

    kind = "capacity"


class IntegrityError(AmberError):
    """A chunk or manifest failed verification against its digest."""

    kind = "integrity"


class CommandTimeout(AmberError):
    """A command ran past its timeout and was killed."""

    kind = "timeout"

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


class Unavailable(AmberError):
    kind = "unavailable"


class NodeUnreachable(AmberError):
    """The node did not answer at all (connection refused, socket missing)."""

    kind = "unreachable"


BY_KIND = {
    c.kind: c
    for c in (
        BadRequest,
        Unauthorized,
        NotFound,
        ImageNotFound,
        SandboxNotRunning,
        CapacityError,
        IntegrityError,
        CommandTimeout,
        Unavailable,
        AmberError,
    )
}
