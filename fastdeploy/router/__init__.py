"""The FastDeploy router: load balancing over mixed instances and prefill/decode pairing.

``fastdeploy router --port 9000`` or ``python -m fastdeploy.router.launch --port 9000``.
"""

from fastdeploy.router.instance import InstanceInfo, InstanceRole, InstanceState
from fastdeploy.router.policies import POLICIES, LoadBalancePolicy, RequestFeatures, make_policy
from fastdeploy.router.router import Router, RouterArgs

__all__ = ["POLICIES", "InstanceInfo", "InstanceRole", "InstanceState", "LoadBalancePolicy", "RequestFeatures",
           "Router", "RouterArgs", "make_policy"]
