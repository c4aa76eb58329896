#pragma once
/// Unsharded buffers whose storage comes and goes in place: every view of a buffer (a
/// module's parameters, tensors autograd saved) stays valid while its memory is freed, and
/// sees data again once the buffer is re-allocated and gathered into (PyTorch's
/// `_free_storage` / `_alloc_storage`). On the CPU freed blocks go to a small pool of
/// same-size blocks instead of malloc; on CUDA the caching allocator does that.
#include <cstddef>

#include <ATen/core/Tensor.h>

namespace tessera::core::fsdp {

/// Bytes `t` needs (numel x element size), whatever its storage holds now.
std::size_t storage_bytes(const at::Tensor& t);
/// Frees `t`'s storage in place; `recycle`: hand the CPU block to the pool for reuse.
void free_storage(const at::Tensor& t, bool recycle = true);
/// Gives `t`'s storage its size again (contents undefined); a no-op if it has it.
void alloc_storage(const at::Tensor& t);

}  // namespace tessera::core::fsdp
