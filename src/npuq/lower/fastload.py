"""Loading an artifact's programs for the export, without three slow steps of torch.export.load.

``torch.export.load`` (torch 2.13) spends most of an export of SmolLM2-135M in:

- turning the program's JSON (14 MB) into torch's schema dataclasses with
  ``torch._export.serde.serialize._dict_to_dataclass``, which calls ``typing.get_type_hints``
  again for each of the ~500,000 objects it builds (pytorch issue #196452, open);
- giving each of the ~7,000 graph values its ``meta["val"]``: ``deserialize_tensor_meta``
  makes an empty FakeTensor by dispatching ``torch.empty_strided`` through the FakeTensorMode
  (its cache and checks), about 1.5 ms a value;
- generating and compiling the Python code of the graph module, twice per program
  (``_create_graph_module_for_export``), code the lowering never runs.

:func:`faster_loading` swaps in, for the duration of a ``with`` block: a decoder that follows
the same rules but looks the hints, fields and branch of each schema class up once
(:func:`dict_to_dataclass`); for tensors of static shape, the FakeTensor built the way the fake
mode's own constructor rule builds it (``torch._subclasses.fake_impls.constructors``: an
``empty_strided`` on the meta device wrapped as ``FakeTensor(mode, meta, device)``); and
torch's ``_LazyGraphModule``, which generates the code when it is first needed. The program
is the same; ``tests/lower/test_lower_fastload.py`` compares whole programs loaded both ways.
Each stand-in is skipped, and torch's own code runs, when torch lacks what it relies on.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types
import typing
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_Decoder = Callable[[Any], Any]
_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, torch's own value) while swapped


def _serde():
    try:
        from torch._export.serde import schema, serialize
        from torch._export.serde.union import _Union
    except ImportError:
        return None
    if not all(callable(getattr(serialize, n, None)) for n in ("_dict_to_dataclass", "_resolve_schema_cls")):
        return None
    return schema, serialize, _Union


class _SchemaDecoder:
    """One decoder function per type annotation, built on first use (the schema is recursive:
    a Graph holds Nodes whose Arguments can hold Graphs, so children are looked up lazily)."""

    def __init__(self, schema, serialize, union_base) -> None:
        self.globalns = vars(schema)
        self.resolve = serialize._resolve_schema_cls
        self.union_base = union_base
        self.union_create = getattr(union_base.create, "__func__", None)
        self.union_tag = getattr(sys.modules.get(union_base.__module__), "_UnionTag", None)
        self.cache: dict[Any, _Decoder] = {}

    def __call__(self, cls: Any, data: Any) -> Any:
        return self.decoder(cls)(data)

    def decoder(self, cls: Any) -> _Decoder:
        try:
            return self.cache[cls]
        except KeyError:
            pass
        except TypeError:  # an unhashable annotation: decode it uncached
            return self._build(cls)
        fn = self.cache[cls] = self._build(cls)
        return fn

    def _build(self, cls: Any) -> _Decoder:
        # The branches of torch's _dict_to_dataclass (2.13), in its order.
        cls = self.resolve(cls)
        if isinstance(cls, str):
            raise AssertionError(f"Unresolved class type: '{cls}'.")
        origin = typing.get_origin(cls)
        if origin is typing.Annotated:
            return self._lazy(cls.__origin__)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
            ty_args = typing.get_args(cls)
            inner = self._lazy(ty_args[0])

            def optional(data):
                if data is None:
                    return None
                if len(ty_args) != 2:
                    raise AssertionError(f"expected 2 type args, got {len(ty_args)}")
                return inner(data)

            return optional
        if isinstance(cls, type) and issubclass(cls, self.union_base):
            hints = typing.get_type_hints(cls, globalns=self.globalns)
            create = self._union_create(cls)

            slots: dict[str, _Decoder] = {}

            def union(data):
                if not isinstance(data, dict):
                    raise AssertionError(f"expected dict, got {type(data).__name__}")
                if len(data) != 1:
                    raise AssertionError(f"expected dict with 1 key, got {len(data)}")
                _type, _value = next(iter(data.items()))
                if not isinstance(_type, str):
                    raise AssertionError(f"expected str key, got {type(_type).__name__}")
                dec = slots.get(_type)
                if dec is None:
                    dec = slots[_type] = self.decoder(hints[_type])
                return create(_type, dec(_value))

            return union
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls, globalns=self.globalns)
            names = [f.name for f in dataclasses.fields(cls)]
            bound: list[tuple[str, _Decoder]] = []

            def record(data):
                if not bound:  # children bound on first use: the class may contain itself
                    bound.extend((name, self.decoder(hints[name])) for name in names)
                # Keys the class does not define are ignored, as torch does (forward compatibility).
                return cls(**{name: dec(data[name]) for name, dec in bound if name in data})

            return record

        args = typing.get_args(cls)
        children: list[_Decoder] = []

        def other(data):
            if isinstance(data, list):
                if len(data) == 0:
                    return data
                if not children:
                    children.append(self.decoder(args[0]))
                item = children[0]
                return [item(d) for d in data]
            if isinstance(data, dict):
                value = self.decoder(args[1])
                return {k: value(v) for k, v in data.items()}
            if cls is float:
                return float(data)
            return data

        return other

    def _union_create(self, cls: Any) -> Callable[[str, Any], Any]:
        """``cls.create(**{tag: value})``; when ``create`` is _Union's own, its body with the
        all-None field dict built once per class instead of once per object."""
        if getattr(cls.create, "__func__", None) is not self.union_create or self.union_tag is None:
            return lambda tag, value: cls.create(**{tag: value})
        nones = {f.name: None for f in dataclasses.fields(cls)}
        make_tag = self.union_tag.create

        def create(tag, value):
            obj = cls(**{**nones, tag: value})
            obj._type = make_tag(tag, cls)
            return obj

        return create

    def _lazy(self, cls: Any) -> _Decoder:
        return lambda data: self.decoder(cls)(data)


def dict_to_dataclass(cls: Any, data: Any) -> Any:
    """torch's ``_dict_to_dataclass(cls, data)`` with the per-class work done once per call."""
    serde = _serde()
    if serde is None:
        raise RuntimeError("torch._export.serde has no _dict_to_dataclass to stand in for")
    return _SchemaDecoder(*serde)(cls, data)


def _tensor_meta_stand_in(serialize) -> Callable | None:
    """A ``GraphModuleDeserializer.deserialize_tensor_meta`` that, for static sizes and
    strides, makes the FakeTensor as FakeTensorMode's constructor rule makes it."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return None
    cls = getattr(serialize, "GraphModuleDeserializer", None)
    original = vars(cls).get("deserialize_tensor_meta") if isinstance(cls, type) else None
    dtypes = getattr(serialize, "_SERIALIZE_TO_TORCH_DTYPE", None)
    device_of = getattr(serialize, "deserialize_device", None)
    if original is None or not isinstance(dtypes, dict) or not callable(device_of) \
            or not callable(getattr(cls, "deserialize_sym_int", None)):
        return None
    import torch

    def deserialize_tensor_meta(self, tensor_meta):
        sizes = [self.deserialize_sym_int(v) for v in tensor_meta.sizes]
        strides = [self.deserialize_sym_int(v) for v in tensor_meta.strides]
        if not all(type(x) is int for x in sizes) or not all(type(x) is int for x in strides):
            return original(self, tensor_meta)  # symbolic shapes: torch's own way
        meta = torch.empty_strided(sizes, strides, dtype=dtypes[tensor_meta.dtype], device="meta")
        fake = FakeTensor(self.fake_tensor_mode, meta, device_of(tensor_meta.device))
        if tensor_meta.requires_grad:
            fake.requires_grad_(True)
        return fake

    return deserialize_tensor_meta


def _lazy_graph_module_stand_in() -> tuple[Any, str, Any] | None:
    """``_create_graph_module_for_export(root, graph)`` making torch's ``_LazyGraphModule``:
    its Python code is generated when first used (``.code``, a call), not when the loader
    builds it (twice a program); the lowering only walks the graph."""
    try:
        from torch.export import exported_program
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return None
    if not callable(getattr(exported_program, "_create_graph_module_for_export", None)):
        return None

    def _create_graph_module_for_export(root, graph):
        return _LazyGraphModule(root, graph)

    return exported_program, "_create_graph_module_for_export", _create_graph_module_for_export


def _stand_ins() -> list[tuple[Any, str, Any]]:
    serde = _serde()
    if serde is None:
        return []
    serialize = serde[1]
    out: list[tuple[Any, str, Any]] = [(serialize, "_dict_to_dataclass", _SchemaDecoder(*serde))]
    meta = _tensor_meta_stand_in(serialize)
    if meta is not None:
        out.append((serialize.GraphModuleDeserializer, "deserialize_tensor_meta", meta))
    lazy = _lazy_graph_module_stand_in()
    if lazy is not None:
        out.append(lazy)
    return out


@contextmanager
def faster_loading() -> Iterator[int]:
    """Within the block, torch.export.load uses the stand-ins of this module; yields how many
    are in place (0: torch differs from what they follow, and loads the usual way).
    Re-entrant and thread-safe; torch's own functions are put back when the last block exits."""
    global _depth
    with _lock:
        if _depth == 0:
            for owner, name, value in _stand_ins():
                _saved.append((owner, name, getattr(owner, name) if isinstance(owner, types.ModuleType) else vars(owner)[name]))
                setattr(owner, name, value)
        _depth += 1
        count = len(_saved)
    try:
        yield count
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _saved:
                    owner, name, value = _saved.pop()
                    setattr(owner, name, value)
