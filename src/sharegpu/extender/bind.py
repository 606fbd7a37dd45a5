"""Bind: reserve GPUs with the core, record them on the pod, then create the binding.

Order, under a per-node lock:
1. read the pod (its uid, whether it is already bound, its resourceVersion);
2. choose GPUs with the core's policy and hold them in the view (in flight);
3. write the annotations of both generations with a resourceVersion precondition;
4. create the binding (a raw POST; the API server answers with a ``Status``).
Any failure after 2 releases the hold and answers an ``Error``, so kube-scheduler retries. A
binding that failed on the wire may still have been made: the pod is read back before the hold is
given up. A bind for a pod already bound to the same node is answered as a success.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..annotations import encode
from ..errors import PlacementError, ValidationError
from ..request import parse_pod
from .kube import ApiError, KubeApi
from .view import ClusterView
from .wire import BindingArgs


class BindError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason  # short label for metrics
        super().__init__(message)


@dataclass
class BindOutcome:
    node: str
    gpus: tuple[int, ...]
    already: bool = False


class Binder:
    def __init__(self, api: KubeApi, view: Callable[[], ClusterView],
                 may_bind: Callable[[], bool] = lambda: True) -> None:
        self.api = api
        self.view = view
        self.may_bind = may_bind
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def bind(self, args: BindingArgs) -> BindOutcome:
        if not self.may_bind():
            raise BindError("not-leader", "this sharegpu extender replica is not the leader")
        path = f"/api/v1/namespaces/{args.pod_namespace}/pods/{args.pod_name}"
        try:
            pod = await self.api.get(path)
        except ApiError as e:
            raise BindError("read-pod", f"cannot read pod {args.key}: {e}") from None
        meta = pod.get("metadata") or {}
        if args.pod_uid and meta.get("uid") and meta["uid"] != args.pod_uid:
            raise BindError("uid", f"pod {args.key} has uid {meta['uid']}, not {args.pod_uid}")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            if bound_to == args.node:
                return BindOutcome(args.node, (), already=True)
            raise BindError("bound-elsewhere", f"pod {args.key} is already bound to {bound_to}")
        try:
            req = parse_pod(pod)
        except ValidationError as e:
            raise BindError("invalid-request", str(e)) from None

        async with self.locks[args.node]:
            view = self.view()
            try:
                r = view.reserve(req, args.node)
            except PlacementError as e:
                raise BindError("no-fit", str(e)) from None
            try:
                st = view.state
                anns = encode(r.alloc, assume_time_ns=time.time_ns(),
                              gpu_capacity=st.gpu_capacity(args.node))
                await self.api.patch_pod_annotations(
                    args.pod_namespace, args.pod_name, anns, str(meta.get("resourceVersion", ""))
                )
                if not self.may_bind():
                    raise BindError("not-leader", "lost the leader lease before binding")
                await self.api.bind(args.pod_namespace, args.pod_name,
                                    args.pod_uid or str(meta.get("uid", "")), args.node)
            except BaseException as e:
                if isinstance(e, ApiError | BindError) and await self._bound_anyway(path, args):
                    self.view().bound(req.key)
                    return BindOutcome(args.node, r.alloc.gpus)
                self.view().release_inflight(req.key)
                if isinstance(e, BindError):
                    raise
                if isinstance(e, ApiError):
                    raise BindError(f"api-{e.status}", f"binding {args.key} failed: {e}") from None
                raise
            self.view().bound(req.key)
            return BindOutcome(args.node, r.alloc.gpus)

    async def _bound_anyway(self, path: str, args: BindingArgs) -> bool:
        """Whether the pod ended up bound to the node with our annotations despite an error."""
        try:
            pod = await self.api.get(path)
        except ApiError:
            return False
        return (pod.get("spec") or {}).get("nodeName") == args.node
