"""Who may call what, once serve.api_key is set.

The operator's key (serve.api_key) reaches everything. An agent never gets it: its worker mints it a key of its own for
one attempt, which reaches the policy (/v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/models)
and span ingest for that attempt only, so an agent cannot score itself, queue work or read tasks and their answers. A
lease token, given with each lease by dequeue, is what heartbeats and the finish of that attempt must show: only the
worker holding the lease ends it.

Both are HMACs of the attempt under the operator's key: any replica of the policy or the store checks them with
nothing shared but that key, and no one without it can make one. Stdlib only: the runner (and so the HTTP client,
which needs no Ray) mints agent keys.
"""

from __future__ import annotations

import hashlib
import hmac

AGENT_PREFIX = "lra"  # agent keys read lra:<rollout_id>:<attempt_id>:<mac>; neither id holds a ":"


def _mac(api_key: str, purpose: str, rollout_id: str, attempt_id: str) -> str:
    message = f"{purpose}\0{rollout_id}\0{attempt_id}".encode()
    return hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()


def agent_key(api_key: str, rollout_id: str, attempt_id: str) -> str:
    """The key an agent gets for this attempt: it names the attempt, so the server needs no lookup to check it."""
    return f"{AGENT_PREFIX}:{rollout_id}:{attempt_id}:{_mac(api_key, 'agent', rollout_id, attempt_id)}"


def agent_of(api_key: str, authorization: bytes) -> tuple[str, str] | None:
    """The (rollout_id, attempt_id) of the agent key in an Authorization header's value; None if it holds none."""
    parts = authorization.removeprefix(b"Bearer ").split(b":")
    if len(parts) != 4 or parts[0] != AGENT_PREFIX.encode():
        return None
    try:
        rollout_id, attempt_id = parts[1].decode(), parts[2].decode()
    except UnicodeDecodeError:
        return None
    valid = hmac.compare_digest(parts[3], _mac(api_key, "agent", rollout_id, attempt_id).encode())
    return (rollout_id, attempt_id) if valid else None


def lease_token(api_key: str, rollout_id: str, attempt_id: str) -> str:
    """What the heartbeats and the finish of this attempt show (the X-Lease-Token header)."""
    return _mac(api_key, "lease", rollout_id, attempt_id)
