"""CUDA tensors that are only DLPack descriptions (no memory, no driver), for calling a
compiled kernel's launcher on a CPU-only machine: its argument checks (dtypes, fixed sizes,
alignment) run, then the launch fails for want of a driver. A launcher that rejects the
arguments its adapter builds raises ValueError instead."""

import ctypes

import tvm_ffi


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor)))]
KDL_CUDA, CODES = 2, {"bf16": (4, 16), "i32": (0, 32), "i64": (0, 64)}
_kept = []  # the descriptions outlive the calls


@ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
def _no_delete(_):
    pass


def cuda_standin(shape, dtype: str = "bf16"):
    """A contiguous CUDA tensor of ``shape`` at a 1 KB-aligned address that is never read."""
    code, bits = CODES[dtype]
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    sizes, steps = (ctypes.c_int64 * len(shape))(*shape), (ctypes.c_int64 * len(shape))(*strides)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(0x10000000, DLDevice(KDL_CUDA, 0), len(shape), DLDataType(code, bits, 1), sizes,
                                 steps, 0)
    managed.deleter = _no_delete
    _kept.extend([sizes, steps, managed])
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return tvm_ffi.from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))
