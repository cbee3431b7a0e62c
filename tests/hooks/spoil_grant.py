"""A worker receives a spoiled grant for the sequences that carry a marker token.

``PAGEDKV_TEST_SPOIL_TOKEN`` names the token. At ``worker.step_begin``, before the grant check,
every sequence of the step whose token ids hold it gets its grant's signature zeroed: the check
refuses that sequence alone (PERMISSION_DENIED in its StepResult's error), as it would a grant a
caller forged, and the step's other sequences are computed.
"""

from __future__ import annotations

import os

#: The marker token (unset: nothing is spoiled).
TOKEN_ENV = "PAGEDKV_TEST_SPOIL_TOKEN"


def spoil(*, request) -> None:
    """Zero the grant signature of the sequences that hold the marker token."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        return
    for s in request.sequences:
        if int(token) in s.token_ids:
            s.grant.signature = bytes(len(s.grant.signature))


HOOKS = {"worker.step_begin": spoil}
