"""A side CUDA stream for the connector's row copies, ordered after the model's work.

The output thread's scatter and gather must neither queue behind the next forward pass on
the model's stream nor read a step's snapshot before the model's stream has written it, and
the snapshot's memory (allocated on the model's stream) must not be reused while the side
stream still reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class SideStream:
    """``mark_ready()`` on the model's thread when a tensor is enqueued; later, on any thread,
    ``run(fn, tensor, ready)`` runs ``fn`` on the side stream once that point is reached."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def mark_ready(self) -> torch.cuda.Event:
        """An event at the current point of the current (model's) stream."""
        event = torch.cuda.Event()
        event.record()
        return event

    def run(self, fn: Callable[[], T], tensor: torch.Tensor, ready: torch.cuda.Event) -> T:
        self.stream.wait_event(ready)
        tensor.record_stream(self.stream)  # the allocator keeps its memory until our reads finish
        with torch.cuda.stream(self.stream):
            return fn()
