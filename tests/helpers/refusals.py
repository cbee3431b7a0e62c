"""What a refused Step says, whichever way it was refused: a sequence outside its grant is refused
alone (its StepResult carries a google.rpc.Status error; the step's other sequences are computed),
a fault of the whole step fails the call."""

from __future__ import annotations

import grpc
from google.rpc import code_pb2

from compute_service.grant_check import CheckedStep


def refusal(fn) -> str:
    """The PERMISSION_DENIED message of ``fn()``, a check or Step of one sequence: the error its
    sequence was refused with (a :class:`CheckedStep`'s ``refused``, or the StepResult's ``error``,
    with no receipt and no token), or the error the call raised. Fails an assertion when it was
    not refused, or with another code."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the whole step was refused
        code = e.code() if isinstance(e, grpc.RpcError) else getattr(e, "code", None)
        assert code == grpc.StatusCode.PERMISSION_DENIED, e
        return e.details() if isinstance(e, grpc.RpcError) else getattr(e, "message", str(e))
    if isinstance(out, CheckedStep):
        (error,) = out.refused.values()
        assert error.code == grpc.StatusCode.PERMISSION_DENIED and out == [None], out.refused
        return error.message
    (result,) = out.results
    assert result.error.code == code_pb2.PERMISSION_DENIED, result
    assert not result.HasField("receipt") and not result.HasField("token_id"), result
    return result.error.message
