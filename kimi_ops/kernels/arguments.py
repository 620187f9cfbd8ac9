"""Host-side arguments of the kernels: the peers' box address tables (memory of our own,
outside torch's allocator), placeholders for unused arguments, the alignment check."""

import torch

_addresses: dict[tuple, torch.Tensor] = {}


class _DeviceWords:
    """int64 words in memory of our own (cuMemAlloc), outside torch's allocator: a
    cudagraph tree's warm-up routes torch allocations into its pool, which it later
    reuses, and a kernel would then read another tensor's bytes as peer addresses."""

    def __init__(self, values: tuple[int, ...], device: torch.device):
        from cuda.bindings import driver

        data = torch.tensor(values, dtype=torch.int64).numpy().tobytes()
        with torch.cuda.device(device):
            error, self.pointer = driver.cuMemAlloc(len(data))
            if error == driver.CUresult.CUDA_SUCCESS:
                (error,) = driver.cuMemcpyHtoD(self.pointer, data, len(data))
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"the mailbox address table: {error}")
        self.__cuda_array_interface__ = {
            "shape": (len(values),), "typestr": "<i8", "data": (int(self.pointer), False), "version": 3,
        }


def addresses(tensors) -> torch.Tensor:
    """The tensors' base addresses as a device int64 tensor (the peers' boxes), built
    once per address tuple and never freed: boxes are allocated once, and their owner
    registers them (``prepare``) before any CUDA-graph capture."""
    key = tuple(t.data_ptr() for t in tensors)
    if key not in _addresses:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the mailbox addresses were not registered before CUDA-graph capture: run once first")
        device = tensors[0].device
        _addresses[key] = torch.as_tensor(_DeviceWords(key, device), device=device)
    return _addresses[key]


def register_addresses(peer_lists) -> None:
    """Build the address tables of these box lists now (wrapper construction): never in a
    capture, and never in a cudagraph-tree warm-up, whose pool would hold them. CPU boxes
    (kimi_ops.prepare's work list) have none."""
    for boxes in peer_lists:
        if boxes and boxes[0].is_cuda:
            addresses(boxes)


def placeholder(tensor: torch.Tensor, dtype: torch.dtype, dims: int = 1, elements: int = 1) -> torch.Tensor:
    """``elements`` elements of ``tensor`` viewed as ``dtype`` (``dims`` dimensions, the first
    of them ``elements`` long) for an argument the kernel's mode never touches (no
    allocation: nothing outlives the call, e.g. in a cudagraph-tree pool). A row view of a
    wider matrix gives its first row's elements."""
    source = tensor.view(-1) if tensor.is_contiguous() else tensor[(0,) * (tensor.dim() - 1)]
    return source.view(dtype)[:elements].view([elements] + [1] * (dims - 1))


def tma_rows(t):
    """[B, K] ``t`` as a TMA descriptor takes it: torch gives a single row any stride (never
    read), the descriptor wants a 16-byte multiple, so one row gets the compact one."""
    if t.shape[0] == 1 and t.stride(0) != t.shape[1]:
        return t.as_strided(t.shape, (t.shape[1], 1))
    return t


def aligned(*tensors) -> bool:
    """16-byte aligned data and rows of whole 16-byte packets (a row view of a wider
    matrix passes where its row stride does)."""
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0
                                              for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)
               for t in tensors)
