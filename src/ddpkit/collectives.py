"""The collectives of `torch.distributed`: calls that every rank of a group must make.

One list for both users of it: hang diagnosis records which of them a rank is in, and
`ddpkit check` reports one that only some ranks reach. It imports nothing, so the
checker (which never imports torch) can use it. It holds the names of every supported
torch (2.6 and later); the hang watch skips a name that the running torch lacks.
"""

from __future__ import annotations

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        # FSDP2 of newer torch (2.13) gathers and reduce-scatters with these; older
        # torch (2.6) with all_gather_into_tensor and reduce_scatter_tensor.
        "all_gather_single",
        "all_gather_object",
        "all_gather_coalesced",
        "all_reduce_coalesced",
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
        "reduce_scatter_single",
        "scatter",
        "scatter_object_list",
        # Creating a group is collective too: every rank of the world takes part.
        "new_group",
    }
)

# Point-to-point calls block until the peer answers: a rank can wait in them forever too.
# batch_isend_irecv returns at once: the rank waits in its works' wait(). isend and
# irecv are left alone: torch tells them apart by identity (`op is isend` in P2POp and
# batch_isend_irecv), which a wrapper would break.
POINT_TO_POINT = frozenset(
    {"send", "recv", "batch_isend_irecv", "send_object_list", "recv_object_list"}
)
