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
    packed = torch.arange(total_rows, device=source.device)

    def rows_of(seg_row: torch.Tensor) -> torch.Tensor:
        return packed + (seg_row.long() - seg_start[:-1]).repeat_interleave(lengths, output_size=total_rows)

    source_rows = rows_of(seg_source_row)
    if target.shape[0] == total_rows and torch.equal(seg_target_row.long(), seg_start[:-1]):
        torch.index_select(source, 0, source_rows, out=target)  # gather into a packed output
    else:
        target.index_copy_(0, rows_of(seg_target_row), source.index_select(0, source_rows))
