"""Pure-torch twin of ``segment_copy.copy_segments``: the test oracle and the CPU path.

Same arguments, same result; per-row indices are expanded with vectorised torch ops, never a
Python loop over rows.
"""

import torch


def copy_segments_torch(
    source: torch.Tensor,
    target: torch.Tensor,
    seg_start: torch.Tensor,
    seg_source_row: torch.Tensor,
    seg_target_row: torch.Tensor,
    total_rows: int,
) -> None:
    if total_rows == 0:
        return
    seg_start = seg_start.long()
    lengths = seg_start[1:] - seg_start[:-1]
    within = torch.arange(total_rows, device=source.device) - seg_start[:-1].repeat_interleave(
        lengths, output_size=total_rows
    )
    source_rows = seg_source_row.long().repeat_interleave(lengths, output_size=total_rows) + within
    target_rows = seg_target_row.long().repeat_interleave(lengths, output_size=total_rows) + within
    target.index_copy_(0, target_rows, source.index_select(0, source_rows))
