"""`Status` objects, the error (and some success) bodies of the Kubernetes API server."""

from __future__ import annotations

from typing import Any


class StatusError(Exception):
    """An API error; ``body()`` is the `Status` object the server answers with."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, self.message, details=self.details)


def status_object(
    code: int,
    reason: str = "",
    message: str = "",
    *,
    success: bool = False,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if success else "Failure",
    }
    if message:
        body["message"] = message
    if reason:
        body["reason"] = reason
    if details:
        body["details"] = details
    body["code"] = code
    return body


def _details(resource: str, name: str, group: str = "") -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "kind": resource}
    if group:
        d["group"] = group
    return d


def _qualified(resource: str, group: str) -> str:
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, name: str, group: str = "") -> StatusError:
    return StatusError(
        404,
        "NotFound",
        f'{_qualified(resource, group)} "{name}" not found',
        details=_details(resource, name, group),
    )


def already_exists(resource: str, name: str, group: str = "") -> StatusError:
    return StatusError(
        409,
        "AlreadyExists",
        f'{_qualified(resource, group)} "{name}" already exists',
        details=_details(resource, name, group),
    )


STALE_MESSAGE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def conflict(resource: str, name: str, why: str = STALE_MESSAGE, group: str = "") -> StatusError:
    return StatusError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_qualified(resource, group)} "{name}": {why}',
        details=_details(resource, name, group),
    )


def bad_request(message: str) -> StatusError:
    return StatusError(400, "BadRequest", message)


def invalid(kind: str, name: str, causes: list[tuple[str, str]], group: str = "") -> StatusError:
    """422 Invalid; ``causes`` are (field, message) pairs."""
    text = "; ".join(f"{f}: {m}" for f, m in causes)
    details: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
    }
    if group:
        details["group"] = group
    return StatusError(422, "Invalid", f'{kind} "{name}" is invalid: {text}', details=details)


def unprocessable(message: str) -> StatusError:
    """422 as the server answers a JSON patch that does not apply."""
    return StatusError(
        422,
        "Invalid",
        "the server rejected our request due to an error in our request",
        details={"causes": [{"message": message}]},
    )


def expired(message: str) -> StatusError:
    return StatusError(410, "Expired", message)


def gone_resource_version(requested: int, oldest: int) -> StatusError:
    return expired(f"too old resource version: {requested} ({oldest})")


def method_not_allowed(
    message: str = "the server does not allow this method on the requested resource",
) -> StatusError:
    return StatusError(405, "MethodNotAllowed", message)


def unsupported_media_type(content_type: str) -> StatusError:
    accepted = (
        "application/json, application/json-patch+json, application/merge-patch+json, "
        "application/strategic-merge-patch+json, application/apply-patch+yaml"
    )
    return StatusError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        f"{accepted} (got {content_type!r})",
    )


def name_mismatch(body_name: str, url_name: str) -> StatusError:
    return bad_request(
        f"the name of the object ({body_name}) does not match the name on the URL ({url_name})"
    )


def namespace_mismatch() -> StatusError:
    return bad_request(
        "the namespace of the provided object does not match the namespace sent on the request"
    )


def uid_precondition(
    resource: str, name: str, want: str, have: str, group: str = ""
) -> StatusError:
    why = f"Precondition failed: UID in precondition: {want}, UID in object meta: {have}"
    return conflict(resource, name, why, group)


def rv_precondition(resource: str, name: str, want: str, have: str, group: str = "") -> StatusError:
    why = (
        f"Precondition failed: ResourceVersion in precondition: {want}, "
        f"ResourceVersion in meta: {have}"
    )
    return conflict(resource, name, why, group)


def internal(message: str) -> StatusError:
    return StatusError(
        500,
        "InternalError",
        f"Internal error occurred: {message}",
        details={"causes": [{"message": message}]},
    )


def unavailable(
    message: str = "the server is currently unable to handle the request",
) -> StatusError:
    return StatusError(503, "ServiceUnavailable", message, retry_after=1)


def too_many_requests(message: str = "please try again later") -> StatusError:
    return StatusError(
        429,
        "TooManyRequests",
        f"Too many requests: {message}",
        details={"retryAfterSeconds": 1},
        retry_after=1,
    )


def timeout(message: str) -> StatusError:
    return StatusError(
        504, "Timeout", f"Timeout: {message}", details={"retryAfterSeconds": 1}, retry_after=1
    )


def by_code(
    code: int, resource: str, name: str, group: str = "", note: str = "injected fault"
) -> StatusError:
    """The error the server would answer with this HTTP code (for fault injection)."""
    if code == 409:
        return conflict(resource, name or "", f"{STALE_MESSAGE} ({note})", group)
    if code == 404:
        return not_found(resource, name or "", group)
    if code == 410:
        return expired(f"too old resource version ({note})")
    if code == 429:
        return too_many_requests(note)
    if code == 500:
        return internal(note)
    if code == 503:
        return unavailable(f"the server is currently unable to handle the request ({note})")
    if code == 504:
        return timeout(f"request did not complete within the allowed duration ({note})")
    if code == 400:
        return bad_request(note)
    if code == 422:
        return unprocessable(note)
    return StatusError(
        code, "Unknown", f"the server responded with the status code {code} ({note})"
    )
