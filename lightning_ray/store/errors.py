"""Store errors: each names what was wrong and carries the HTTP status the store API answers with.

They keep a one-argument constructor so they pickle across Ray calls unchanged."""


class StoreError(Exception):
    status = 400
    code = "invalid_request"


class UnknownRollout(StoreError):
    status, code = 404, "rollout_not_found"


class UnknownAttempt(StoreError):
    status, code = 404, "attempt_not_found"


class InvalidTransition(StoreError):
    """A state change the rollout/attempt lifecycle does not allow (e.g. running → queued)."""

    status, code = 409, "invalid_transition"


class StaleAttempt(StoreError):
    """The attempt already ended (timed out, unresponsive, cancelled): its lease is lost, stop working on it."""

    status, code = 409, "stale_attempt"


class InvalidSpans(StoreError):
    status, code = 400, "invalid_spans"


class InvalidReward(StoreError):
    """A reward that is not a finite number: NaN or infinity would poison every advantage of its group."""

    status, code = 400, "invalid_reward"


class BatchTooLarge(StoreError):
    status, code = 413, "batch_too_large"


class InvalidLeaseToken(StoreError):
    """A verdict over HTTP without the lease token dequeue gave with its attempt (with serve.api_key set)."""

    status, code = 403, "invalid_lease_token"
