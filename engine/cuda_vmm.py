"""Device memory another process can map and keep alive: CUDA's virtual memory management API.

`cudaMalloc` memory exported with CUDA IPC stays valid in an importing process only while the
exporting process keeps it; its death leaves the importer's mapping undefined. An allocation
made with `cuMemCreate` and exported as a POSIX file descriptor (`cuMemExportToShareableHandle`)
is freed only when every handle to it, in any process, is released and every mapping unmapped,
so a process that imported it keeps it after the one that made it is killed. `DeviceMemory`
makes or imports one such allocation, maps it read-write on one GPU, and gives it to torch as a
uint8 tensor (`tensor`); `export_fd` gives a new descriptor for another process (sent over a
Unix socket, `socket.send_fds`).

Calls the driver (libcuda.so.1) through ctypes: no build step, no extra package. Needs a CUDA
context current on the calling thread (torch makes one with its first CUDA tensor on the device).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

# Enumerations of cuda.h (CUDA 11.2 and later).
_ALLOCATION_TYPE_PINNED = 1
_HANDLE_TYPE_POSIX_FD = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READ_WRITE = 3
_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({result})")


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _HANDLE_TYPE_POSIX_FD
    prop.location = _Location(_LOCATION_TYPE_DEVICE, device)
    return prop


_ATTR_VIRTUAL_MEMORY_MANAGEMENT = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD_HANDLES = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED


def can_share(device: int) -> bool:
    """Whether GPU `device` (an index this process sees) makes memory another process can map:
    the virtual memory management API with POSIX file descriptor handles (not every platform has
    them: WSL, some virtual GPUs). False without a driver. Makes no context."""
    try:
        lib = _driver()
    except OSError:
        return False
    dev = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return False
    for attr in (_ATTR_VIRTUAL_MEMORY_MANAGEMENT, _ATTR_POSIX_FD_HANDLES):
        value = ctypes.c_int()
        if lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev) != 0 or not value.value:
            return False
    return True


def granularity(device: int) -> int:
    """The size every allocation of `device` is rounded up to (2 MiB on current GPUs)."""
    size = ctypes.c_size_t()
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(_prop(device)),
                                                   _GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
    return size.value


class DeviceMemory:
    """`nbytes` (rounded up to the granularity) of one GPU's memory, made here (`fd` None) or
    imported from another process's exported descriptor `fd` (this object closes it). `tensor`
    is a uint8 view of it; `close` unmaps it and releases this process's handle."""

    def __init__(self, device: torch.device, nbytes: int, fd: int | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"DeviceMemory needs a CUDA device, got {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(0, device=self.device)  # the device's context, current on this thread
            index = self.device.index
            step = granularity(index)
            self.size = -(-nbytes // step) * step
            lib, self.handle, self.ptr = _driver(), ctypes.c_ulonglong(), ctypes.c_ulonglong()
            if fd is None:
                _check(lib.cuMemCreate(ctypes.byref(self.handle), ctypes.c_size_t(self.size),
                                       ctypes.byref(_prop(index)), ctypes.c_ulonglong(0)), "cuMemCreate")
            else:
                try:
                    _check(lib.cuMemImportFromShareableHandle(ctypes.byref(self.handle), ctypes.c_void_p(fd),
                                                              _HANDLE_TYPE_POSIX_FD), "cuMemImportFromShareableHandle")
                except BaseException:
                    os.close(fd)
                    raise
            # The descriptor is kept: a handle imported from one cannot be exported again
            # (CUDA_ERROR_INVALID_VALUE), so a process that imported the memory hands on copies
            # of the descriptor it received (`export_fd`), and the one that made it does the same.
            self._fd = fd
            mapped = False
            try:
                if self._fd is None:
                    self._fd = self._export()
                _check(lib.cuMemAddressReserve(ctypes.byref(self.ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                                               ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
                _check(lib.cuMemMap(self.ptr, ctypes.c_size_t(self.size), ctypes.c_size_t(0), self.handle,
                                    ctypes.c_ulonglong(0)), "cuMemMap")
                mapped = True
                access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, index), _ACCESS_READ_WRITE)
                _check(lib.cuMemSetAccess(self.ptr, ctypes.c_size_t(self.size), ctypes.byref(access),
                                          ctypes.c_size_t(1)), "cuMemSetAccess")
            except BaseException:  # give back what was taken: the handle holds the memory itself
                if mapped:
                    lib.cuMemUnmap(self.ptr, ctypes.c_size_t(self.size))
                if self.ptr.value:
                    lib.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.size))
                    self.ptr = ctypes.c_ulonglong(0)
                lib.cuMemRelease(self.handle)
                if self._fd is not None:
                    os.close(self._fd)
                raise
        self.tensor = torch.as_tensor(_CudaArray(self.ptr.value, nbytes), device=self.device)

    def _export(self) -> int:
        fd = ctypes.c_int()
        _check(_driver().cuMemExportToShareableHandle(ctypes.byref(fd), self.handle, _HANDLE_TYPE_POSIX_FD,
                                                      ctypes.c_ulonglong(0)), "cuMemExportToShareableHandle")
        return fd.value

    def export_fd(self) -> int:
        """A new file descriptor for this memory, for another process (the caller closes it)."""
        return os.dup(self._fd)

    def close(self) -> None:
        """Unmap and release this process's hold (the memory lives on in other processes holding it)."""
        if self.ptr.value:
            lib = _driver()
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                lib.cuMemUnmap(self.ptr, ctypes.c_size_t(self.size))
                lib.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.size))
                lib.cuMemRelease(self.handle)
            os.close(self._fd)
            self.ptr = ctypes.c_ulonglong(0)


class _CudaArray:
    """The device pointer as `__cuda_array_interface__`, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


__all__ = ["DeviceMemory", "can_share", "granularity"]
