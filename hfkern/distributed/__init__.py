"""Communication-efficient data-parallel training on ``torch.distributed``.

:func:`topk_hook` with a :class:`TopKState` is a DDP communication hook that
sends the top-k entries of each gradient bucket (error feedback keeps what was
not sent for the next step), flat or hierarchically (dense inside a node,
sparse between nodes: :func:`node_groups`). It runs on any backend
``torch.distributed`` runs (NCCL on GPUs, Gloo on CPUs).
"""

from .groups import NodeGroups, node_groups
from .topk import BucketStats, TopKState, k_for, topk_hook

__all__ = ["BucketStats", "NodeGroups", "TopKState", "k_for", "node_groups", "topk_hook"]
