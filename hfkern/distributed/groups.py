"""Process groups that stand for the machines ("nodes") of a data-parallel job.

Hierarchical communication reduces densely inside a node, where the links are
fast (NVLink, shared memory), and sends only sparse messages between nodes.
It needs two groups per rank: the ranks of its own node (``intra``), and the
ranks that hold the same local rank on every node (``inter``, one rank per node).

Nodes are runs of consecutive ranks of the group, as ``torchrun`` numbers them
(node j holds group ranks ``j * node_size ... (j + 1) * node_size - 1``). On one
machine, any split into equal runs stands for nodes, which is how the tests and
the benchmark exercise the hierarchical code on Gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["NodeGroups", "node_groups"]


@dataclass(frozen=True)
class NodeGroups:
    """This rank's view of a job split into ``num_nodes`` nodes of ``node_size`` ranks.

    ``group``: the whole group (every node). ``intra``: this rank's node; its
    group rank is ``local_rank``. ``inter``: the ranks with this ``local_rank``,
    one per node; its group rank is ``node``. ``ranks``: the global ranks of
    ``group`` in group-rank order.
    """

    group: dist.ProcessGroup
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    node: int
    local_rank: int
    node_size: int
    num_nodes: int
    ranks: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return self.node_size * self.num_nodes


def node_groups(node_size: int, group: dist.ProcessGroup | None = None, *,
                backend: str | None = None) -> NodeGroups:
    """Split ``group`` (default: the world) into nodes of ``node_size`` consecutive ranks.

    Creates ``num_nodes`` intra-node groups and ``node_size`` inter-node groups
    with :func:`torch.distributed.new_group`, which is collective: every rank of
    the default group must call this function, with the same arguments, in the
    same order relative to its other ``new_group`` calls. ``backend`` is passed
    to ``new_group`` (None: the default group's backend).

    Raises ValueError when ``node_size`` does not divide the group's size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("node_groups: torch.distributed is not initialized; "
                           "call torch.distributed.init_process_group first")
    if isinstance(node_size, bool) or not isinstance(node_size, int):
        raise TypeError(f"node_groups: node_size must be an int, got {type(node_size).__name__}")
    group = dist.group.WORLD if group is None else group
    ranks = tuple(dist.get_process_group_ranks(group))
    world = len(ranks)
    if node_size < 1 or world % node_size != 0:
        raise ValueError(f"node_groups: node_size must be a positive divisor of the group size "
                         f"{world}, got {node_size}")
    num_nodes = world // node_size
    me = dist.get_rank(group)
    intra = inter = None
    # Every rank creates every group (new_group is collective over the default
    # group) and keeps the two it belongs to.
    for j in range(num_nodes):
        g = dist.new_group([ranks[j * node_size + l] for l in range(node_size)], backend=backend)
        if me >= 0 and me // node_size == j:
            intra = g
    for l in range(node_size):
        g = dist.new_group([ranks[j * node_size + l] for j in range(num_nodes)], backend=backend)
        if me >= 0 and me % node_size == l:
            inter = g
    if me < 0:
        raise ValueError("node_groups: this rank is not a member of the group it split")
    return NodeGroups(group=group, intra=intra, inter=inter, node=me // node_size,
                      local_rank=me % node_size, node_size=node_size, num_nodes=num_nodes,
                      ranks=ranks)
