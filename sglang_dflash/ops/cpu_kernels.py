"""sgl-kernel CPU operators that the PyPI wheel lacks, written in torch and registered under
`torch.ops.sgl_kernel` so that SGLang's own wrappers find them at call time.

  assign_req_to_token_pool_cpu   req_to_token[r, start:end] = out_cache_loc (concatenated per request)
  assign_extend_cache_locs_cpu   out_cache_loc = req_to_token[r, start:end] (the reverse gather)
  copy_all_layer_kv_cache_cpu    in every KV buffer (given by raw pointer and row stride in bytes),
                                 row tgt_loc[i] = row src_loc[i]

Offsets may come as int32 or int64 (SGLang's callers pass both).
"""

from __future__ import annotations

import ctypes

import torch

_lib: torch.library.Library | None = None


def _spans(start: torch.Tensor, end: torch.Tensor):
    lens = (end.long() - start.long()).tolist()
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return list(zip(start.long().tolist(), lens, offsets))


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len=0):
    width = req_to_token.shape[1]
    for r, (s, n, o) in zip(req_pool_indices.long().tolist(), _spans(start_offset, end_offset)):
        if s + n > width:  # a slice past the row would drop (or broadcast) the slots, which then leak
            raise IndexError(f"assign_req_to_token_pool: positions {s}..{s + n - 1} of request row {r} run past "
                             f"req_to_token's width {width}")
        req_to_token[r, s:s + n] = out_cache_loc[o:o + n].to(req_to_token.dtype)


def assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len=0):
    for r, (s, n, o) in zip(req_pool_indices.long().tolist(), _spans(start_offset, end_offset)):
        out_cache_loc[o:o + n] = req_to_token[r, s:s + n].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc):
    if tgt_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        memory = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        view = torch.frombuffer(memory, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src]  # gathers the source rows before writing


OPS = {
    "assign_req_to_token_pool_cpu": (
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()", assign_req_to_token_pool),
    "assign_extend_cache_locs_cpu": (
        "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()", assign_extend_cache_locs),
    "copy_all_layer_kv_cache_cpu": (
        "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache),
}


def register_missing_cpu_ops() -> list[str]:
    """Register each op that torch.ops.sgl_kernel does not already have; returns the names registered."""
    global _lib
    import sgl_kernel  # noqa: F401  (loads the wheel's own ops first)

    missing = [name for name in OPS if not hasattr(torch.ops.sgl_kernel, name)]
    if missing:
        _lib = _lib or torch.library.Library("sgl_kernel", "FRAGMENT")
        for name in missing:
            schema, fn = OPS[name]
            _lib.define(schema)
            _lib.impl(name, fn, "CPU")
    return missing
