"""The Kubernetes scheduler extender: filter, prioritize and bind for GPU-sharing pods.

Modules: :mod:`.wire` (kube-scheduler's wire format), :mod:`.view` (the cluster view over the
core's state), :mod:`.informer` (list + watch feeding the view), :mod:`.kube` (API calls),
:mod:`.bind`, :mod:`.leader` (Lease election), :mod:`.events`, :mod:`.metrics`,
:mod:`.server` (HTTP) and :mod:`.replica` (all of them started together).
"""
