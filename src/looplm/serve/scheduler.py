"""The engine's scheduler: :mod:`looplm.decode.scheduler`, re-exported here.

It is the one scheduler of every batch of rows (pure Python, no torch): the serving engine's (:mod:`.engine`) and the
offline depth-batched decoder's (:meth:`looplm.decode.depth_schedule.DepthBatchedDecoder.run`), so the two cannot
drift apart. It lives in decode/ because decode/ must not import serve/ (serve/ imports decode/).
"""

from __future__ import annotations

from ..decode.scheduler import (  # noqa: F401
    PrefillChunk,
    Request,
    RequestStatus,
    ScheduledToken,
    Scheduler,
    SchedulerOutput,
)

__all__ = ["PrefillChunk", "Request", "RequestStatus", "ScheduledToken", "Scheduler", "SchedulerOutput"]
