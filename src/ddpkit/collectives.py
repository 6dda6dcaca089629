"""The collectives of `torch.distributed`: calls that every rank of a group must make.

One list for both users of it: hang diagnosis records which of them a rank is in, and
`ddpkit check` reports one that only some ranks reach. It imports nothing, so the
checker (which never imports torch) can use it.
"""

from __future__ import annotations

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        # Creating a group is collective too: every rank of the world takes part.
        "new_group",
    }
)

# Point-to-point calls block until the peer answers: a rank can wait in them forever too.
POINT_TO_POINT = frozenset({"send", "recv"})
