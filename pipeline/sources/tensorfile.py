"""A safetensors file written one tensor at a time.

safetensors' own writers (`save_file`, `serialize_file`) take every tensor at
once, as one dict in memory. The calibration of a 1.75B model holds 6.3 GB of
second moments (fp32) by the end; layer by layer, each layer's are final long
before the next is done. This writer keeps only the one being written: the
header region is reserved up front (its size bounded by the tensor names,
known before the first tensor), the data follows it tensor after tensor, and
the header is written last into the reserved room, padded with spaces, which
the format allows (the JSON header may end in whitespace; offsets are relative
to the data start, and the tensors cover the data contiguously, as the reader
checks). The result is an ordinary safetensors file: `safe_open` reads it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float64": "F64",
           "torch.int32": "I32", "torch.int64": "I64", "torch.uint8": "U8", "torch.int8": "I8"}
_TORCH_NAMES = {code: name.split(".")[1] for name, code in _DTYPES.items()}  # "F32" -> "float32"
_ENTRY_BOUND = 160  # bytes per entry beyond its name: {"dtype":"F32","shape":[a,b,...],"data_offsets":[x,y]}


class TensorFileError(RuntimeError):
    pass


class StreamWriter:
    """`with StreamWriter(path, names) as w: w.add(name, tensor) ...`: `names` are every name that may
    be added (they bound the header); tensors are written in the order added. On an exception the
    partial file is removed."""

    def __init__(self, path, names, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        bound = sum(len(json.dumps(n)) + _ENTRY_BOUND for n in names)
        bound += len(json.dumps({"__metadata__": self.metadata})) + 64
        self.reserved = (bound + 7) // 8 * 8  # the data starts 8-byte aligned, as safetensors' own files do
        self.allowed = set(names)
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self.f = None

    def __enter__(self):
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", self.reserved))
        self.f.write(b" " * self.reserved)
        return self

    def add(self, name: str, tensor) -> None:
        if name not in self.allowed:
            raise TensorFileError(f"{name} was not among the names the header was sized for")
        if name in self.entries:
            raise TensorFileError(f"{name} was written twice")
        dtype = _DTYPES.get(str(tensor.dtype))
        if dtype is None:
            raise TensorFileError(f"{name}: dtype {tensor.dtype} is not written by this writer")
        import torch

        t = tensor.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        if n:
            self.f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
        self.entries[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [self.offset, self.offset + n]}
        self.offset += n

    def __exit__(self, exc_type, exc, tb):
        ok = False
        try:
            if exc_type is None:
                header = {**({"__metadata__": self.metadata} if self.metadata else {}), **self.entries}
                raw = json.dumps(header, separators=(",", ":")).encode()
                if len(raw) > self.reserved:  # the bound is generous; this would be a bug in it
                    raise TensorFileError(f"the header ({len(raw)} bytes) outgrew its reserved {self.reserved}")
                self.f.seek(8)
                self.f.write(raw + b" " * (self.reserved - len(raw)))
                ok = True
        finally:
            self.f.close()
            if not ok:
                self.path.unlink(missing_ok=True)
        return False


class SpilledTensors:
    """A dict of tensors whose first value for each name goes to a spill file as it is set, and is read
    back from it when asked for; a name set again is held in memory from then on. For the quantize stage's
    codes: 1.75 GB of uint8 on the 1.75B geometry, each read once or twice after it is made, a few
    (the units requantized at 8 bits, the head's two widths) replaced. `write(path, order)` writes the
    final file a tensor at a time; `close()` removes the spill."""

    def __init__(self, spill, names):
        self.names = list(names)
        self.spill = StreamWriter(spill, self.names).__enter__()
        self.held: dict = {}
        self._reader = None

    def __setitem__(self, name: str, tensor) -> None:
        if name in self.spill.entries or name in self.held:
            self.held[name] = tensor
        else:
            self.spill.add(name, tensor)

    def __contains__(self, name: str) -> bool:
        return name in self.held or name in self.spill.entries

    def __getitem__(self, name: str):
        import torch

        if name in self.held:
            return self.held[name]
        entry = self.spill.entries[name]
        self.spill.f.flush()
        if self._reader is None:
            self._reader = open(self.spill.path, "rb")
        begin, end = entry["data_offsets"]
        self._reader.seek(8 + self.spill.reserved + begin)
        raw = bytearray(self._reader.read(end - begin))
        dtype = getattr(torch, _TORCH_NAMES[entry["dtype"]])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return t.reshape(entry["shape"])

    def write(self, path, metadata: dict[str, str] | None = None) -> None:
        """Every name set, in the order the names were given, into an ordinary safetensors file."""
        present = [n for n in self.names if n in self]
        with StreamWriter(path, present, metadata) as out:
            for name in present:
                out.add(name, self[name])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self.spill.f.close()
        self.spill.path.unlink(missing_ok=True)


def load_onnx(path) -> "onnx.ModelProto":  # noqa: F821 - onnx is imported inside
    """`onnx.load(path)` with its external data, read by hand.

    Why not onnx.load: onnx 1.23 refuses external data whose file has more than
    one hard link ("potential hardlink attack"), and DVC's hardlink cache
    (`cache.type hardlink`, what a multi-GB build wants) links every stage
    output into the cache. The files read here are the pipeline's own stage
    outputs, and the attack guarded against (a model naming another file) is
    refused the same way: a location must be a plain file name beside the model."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    _fill(model, path.parent, path)
    return model


def _fill(model, base: Path, path: Path) -> None:
    """Read every external tensor of `model` (whose files lie in `base`) into the model (load_onnx)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    handles = {}
    try:
        for tensor in _all_tensors(model):
            if not uses_external_data(tensor):
                continue
            info = _external_info(tensor, path)
            f = handles.get(info.location)
            if f is None:
                f = handles[info.location] = open(base / info.location, "rb")
            f.seek(info.offset or 0)
            data = f.read() if info.length is None else f.read(info.length)
            if info.length is not None and len(data) != info.length:
                raise TensorFileError(f"{path}: external data of {tensor.name!r} is truncated")
            tensor.raw_data = data
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    finally:
        for f in handles.values():
            f.close()


def _external_info(tensor, path):
    """The tensor's external data entry, refused unless its location is a plain file name beside the model."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(tensor)
    if Path(info.location).name != info.location or info.location in ("", ".", ".."):
        raise TensorFileError(f"{path}: tensor {tensor.name!r} names external data "
                              f"{info.location!r}, not a file beside the model")
    return info


def onnx_initializers(path, names):
    """(name, numpy array) for each initializer of the ONNX model at `path` named in `names`, read one at a
    time (load_onnx's reading, without holding the model's weights)."""
    import onnx
    from onnx import numpy_helper

    path = Path(path)
    skeleton = onnx.load(str(path), load_external_data=False)
    wanted = set(names)
    for init in skeleton.graph.initializer:
        if init.name in wanted:
            one = onnx.ModelProto()
            one.graph.initializer.append(init)
            _fill(one, path.parent, path)
            yield init.name, numpy_helper.to_array(one.graph.initializer[0])


def _all_tensors(model):
    """Every TensorProto of a model: initializers and Constant values, subgraphs included."""
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


_CHUNK = 64 << 20  # share_external_data reads and copies a tensor's bytes this much at a time


def share_external_data(primary, secondary) -> dict:
    """Point every external tensor of the ONNX model `secondary` whose bytes equal one of the model
    `primary`'s (both in one folder) at the primary's copy, and rewrite the secondary's own data file
    with the rest: a phone build's prompt graph and its token graph hold the same weights (their
    codes checked equal by `qnn.same_weights`), written twice by onnx.save, which knows one model at a time.

    Matched by content (sha256 of the bytes), not by name: the exporter names a graph's constants by
    where they are used. Read and copied in chunks (a 1.75B model's embedding is 2 GB in one tensor).
    The secondary's data file is written beside and renamed over the old one, never changed in place:
    DVC's hardlink cache shares a stage output's inode with the cache.
    Returns {"shared": tensors, "shared_bytes", "own_bytes"}."""
    import hashlib
    import os

    import onnx
    from onnx.external_data_helper import uses_external_data

    primary, secondary = Path(primary), Path(secondary)
    if primary.parent != secondary.parent:
        raise TensorFileError(f"{secondary} and {primary}: external data is shared only within one folder")
    base = primary.parent
    handles = {}

    def chunks(info):
        f = handles.get(info.location)
        if f is None:
            f = handles[info.location] = open(base / info.location, "rb")
        f.seek(info.offset or 0)
        left = info.length
        while left is None or left > 0:
            data = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not data:
                break
            left = None if left is None else left - len(data)
            yield data

    def digest(info) -> tuple[bytes, int]:
        h, n = hashlib.sha256(), 0
        for data in chunks(info):
            h.update(data)
            n += len(data)
        return h.digest(), n

    first = onnx.load(str(primary), load_external_data=False)
    second = onnx.load(str(secondary), load_external_data=False)
    own_name = secondary.name + ".data"
    tmp = base / f".{own_name}.tmp"
    shared = shared_bytes = own_bytes = 0
    try:
        by_content = {}
        for tensor in _all_tensors(first):
            if uses_external_data(tensor):
                info = _external_info(tensor, primary)
                key, n = digest(info)
                by_content.setdefault(key, (info.location, info.offset or 0, n))
        with open(tmp, "wb") as out:
            for tensor in _all_tensors(second):
                if not uses_external_data(tensor):
                    continue
                info = _external_info(tensor, secondary)
                key, n = digest(info)
                hit = by_content.get(key)
                if hit is not None:
                    location, offset, length = hit
                    shared, shared_bytes = shared + 1, shared_bytes + length
                else:  # its own: aligned to a page as onnx.save aligns large tensors (ORT maps those)
                    if n > 1 << 20 and out.tell() % 4096:
                        out.write(b"\0" * (4096 - out.tell() % 4096))
                    location, offset, length = own_name, out.tell(), n
                    for data in chunks(info):
                        out.write(data)
                    own_bytes += n
                del tensor.external_data[:]
                for k, v in (("location", location), ("offset", offset), ("length", length)):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, str(v)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for f in handles.values():
            f.close()
    # Both written beside and renamed over (the data file first): a stage's outputs are moved into place
    # only once it completes, so a stop between the renames leaves nothing a build reads.
    graph_tmp = base / f".{secondary.name}.tmp"
    graph_tmp.write_bytes(second.SerializeToString())
    if own_bytes:
        os.replace(tmp, base / own_name)
    else:
        tmp.unlink()
        (base / own_name).unlink(missing_ok=True)
    os.replace(graph_tmp, secondary)
    return {"shared": shared, "shared_bytes": shared_bytes, "own_bytes": own_bytes}
