"""Validating admission webhooks for the fake API server: before a matching write is stored,
the server POSTs an ``admission.k8s.io/v1`` AdmissionReview to each registered webhook, as
kube-apiserver does, and refuses the write when one denies it (or fails, under the ``Fail``
policy). Mutating webhooks are not supported."""

from __future__ import annotations

import ssl
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from . import status as st
from .resources import ResourceType

OPERATIONS = {
    "create": "CREATE",
    "update": "UPDATE",
    "patch": "UPDATE",
    "delete": "DELETE",
    "deletecollection": "DELETE",
}


@dataclass
class ValidatingWebhook:
    """One webhook: ``resources`` like ``pods``, ``pods/binding`` or ``*``; ``operations``
    among CREATE, UPDATE, DELETE or ``*``; ``ca_file`` to trust an HTTPS webhook."""

    name: str
    url: str
    resources: frozenset[str] = frozenset({"*"})
    operations: frozenset[str] = frozenset({"*"})
    ca_file: Path | None = None
    failure_policy: str = "Fail"  # or "Ignore"
    timeout: float = 10.0
    reviews: list[dict[str, Any]] = field(default_factory=list)  # requests sent, for tests

    def matches(self, operation: str, resource: str) -> bool:
        op_ok = "*" in self.operations or operation in self.operations
        return op_ok and ("*" in self.resources or resource in self.resources)


def review_request(
    *,
    operation: str,
    rtype: ResourceType,
    sub: str | None,
    name: str,
    namespace: str | None,
    obj: Any,
    old: Any,
    dry_run: bool,
) -> dict[str, Any]:
    kind = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}
    if sub == "binding":
        kind = {"group": "", "version": "v1", "kind": "Binding"}
    resource = {"group": rtype.group, "version": rtype.version, "resource": rtype.plural}
    options_kind = {"CREATE": "CreateOptions", "UPDATE": "UpdateOptions", "DELETE": "DeleteOptions"}
    request: dict[str, Any] = {
        "uid": str(uuid.uuid4()),
        "kind": kind,
        "resource": resource,
        "requestKind": kind,
        "requestResource": resource,
        "name": name,
        "operation": operation,
        "userInfo": {"username": "system:fake-client", "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": {"kind": options_kind[operation], "apiVersion": "meta.k8s.io/v1"},
    }
    if sub:
        request["subResource"] = sub
    if namespace:
        request["namespace"] = namespace
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def _denied(hook: ValidatingWebhook, result: dict[str, Any] | None) -> st.StatusError:
    result = dict(result or {})
    code = int(result.get("code") or 0)
    if code < 400:
        code = 400
    denied_by = f'admission webhook "{hook.name}" denied the request'
    if result.get("message"):
        message = f"{denied_by}: {result['message']}"
    elif result.get("reason"):
        message = f"{denied_by}: {result['reason']}"
    else:
        message = f"{denied_by} without explanation"
    return st.StatusError(code, str(result.get("reason") or ""), message,
                          details=result.get("details"))  # fmt: skip


async def admit(hooks: list[ValidatingWebhook], review: dict[str, Any]) -> None:
    """Send ``review`` to every hook; raise the StatusError the real server answers with when
    one denies it, or fails under the ``Fail`` policy."""
    uid = review["request"]["uid"]
    for hook in hooks:
        hook.reviews.append(review)
        ctx = ssl.create_default_context(cafile=str(hook.ca_file)) if hook.ca_file else None
        try:
            timeout = aiohttp.ClientTimeout(total=hook.timeout)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(hook.url, json=review, ssl=ctx if ctx is not None else True) as resp,
            ):
                if resp.status != 200:
                    raise RuntimeError(f"the server responded with status {resp.status}")
                answer = await resp.json(content_type=None)
            response = answer.get("response") or {}
            if response.get("uid") != uid:
                raise RuntimeError(f"expected response.uid={uid!r}, got {response.get('uid')!r}")
            if not isinstance(response.get("allowed"), bool):
                raise RuntimeError("response.allowed must be a boolean")
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
            if hook.failure_policy == "Ignore":
                continue
            raise st.internal(f'failed calling webhook "{hook.name}": {e}') from None
        if not response["allowed"]:
            raise _denied(hook, response.get("status"))
