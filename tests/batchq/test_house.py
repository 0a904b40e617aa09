"""The house rules of the library code, checked on its source (docs/design.md, "Parts").

* Layers, bottom up: errors, the frame format (batchq.wire), the client (batchq.client:
  connections), the protocol (batchq.protocol: keys, formats, scripts and their calls);
  the producer and the trainer import only those; monitoring and the host's processes
  may import those too; nothing imports the CLI; the two sides never import each other.
* No module reads another object's underscore attribute (``x._name`` where ``x`` is not
  ``self`` or ``cls``), except the few third-party internals listed below, each the only
  way to something measured, each checked by a test of its own module.
* No frame inspection (``sys._getframe``, ``inspect.currentframe``/``stack``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("batchq", "producer", "consumer")

# The core's layers, and what each may import of the core (besides itself).
CORE_ALLOWED = {
    "batchq.errors": set(),
    "batchq.wire": {"batchq.errors"},
    "batchq.client": {"batchq.errors", "batchq.wire"},
    "batchq.protocol": {"batchq.errors", "batchq.wire", "batchq.client"},
    "batchq.monitoring": {"batchq.errors", "batchq.wire", "batchq.protocol", "batchq.client"},
    "batchq.host": {
        "batchq.errors",
        "batchq.wire",
        "batchq.protocol",
        "batchq.client",
        "batchq.monitoring",
    },
}
SIDE_ALLOWED = {"batchq.errors", "batchq.wire", "batchq.protocol", "batchq.client"}

# Third-party internals: (file, attribute) -> why there is no public way.
PRIVATE_ALLOWED = {
    ("consumer/torch_memory.py", "_C"): "torch has no public use count of a storage",
    ("consumer/torch_memory.py", "_storage_Use_Count"): "the same",
    ("consumer/torch_memory.py", "_cdata"): "the same (the storage's handle)",
    ("batchq/host/procs.py", "_exit"): (
        "os._exit is Python's public way to end a forked child without running the "
        "parent's cleanup (its name only looks private)"
    ),
    ("producer/isolation.py", "_exit"): "the same (a forked child that tries a read)",
    ("consumer/torch.py", "_add_dataloader"): (
        "Accelerate's GradientState learns of the loader being iterated (whose "
        "end_of_dataloader makes accumulate() sync at an epoch's end) only so; its own "
        "loaders (DataLoaderStateMixin.begin) call it"
    ),
    ("consumer/torch.py", "_remove_dataloader"): "the same (DataLoaderStateMixin.end)",
    ("producer/torch/iterable.py", "_worker_info"): (
        "torch's get_worker_info() reads this module global, which DataLoader's own worker "
        "loop sets the same way; nothing public sets it"
    ),
}
# A namedtuple's public API is spelled with an underscore (to leave field names free).
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append((".".join(parts), path))
    return out


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names)
    return names


def _layer(name: str) -> str | None:
    for layer in sorted(CORE_ALLOWED, key=len, reverse=True):
        if name == layer or name.startswith(layer + "."):
            return layer
    if name == "batchq.cli" or name.startswith("batchq.cli."):
        return "batchq.cli"
    return None


def _layer_problems() -> list[str]:
    problems = []
    for module, path in _modules():
        side = module.split(".")[0]
        own = _layer(module)
        for imported in _imports(path):
            top = imported.split(".")[0]
            if top not in LIBRARY:
                continue
            target = _layer(imported)
            if target is None and top == "batchq":
                continue  # the package itself (batchq/__init__: the errors' re-export)
            if side in ("producer", "consumer"):
                other = "consumer" if side == "producer" else "producer"
                if top == other:
                    problems.append(f"{module} imports {imported}: the sides never meet")
                elif top == "batchq" and target not in SIDE_ALLOWED:
                    problems.append(f"{module} imports {imported} ({target})")
            elif own == "batchq.cli" or own is None:
                continue  # the CLI runs both sides; batchq/__init__ and __main__
            elif top != "batchq":
                problems.append(f"{module} ({own}) imports the side {imported}")
            elif target == "batchq.cli":
                problems.append(f"{module} imports the CLI ({imported})")
            elif target != own and target not in CORE_ALLOWED[own]:
                problems.append(f"{module} ({own}) imports {imported} ({target})")
    return problems


def test_every_module_imports_only_the_layers_below_it() -> None:
    assert _layer_problems() == []


def test_the_layer_checker_knows_the_layers() -> None:
    # The checker itself: every module is placed in its layer.
    assert _layer("batchq.wire.codec") == "batchq.wire"
    assert _layer("batchq.monitoring.rows") == "batchq.monitoring"
    assert _layer("batchq.cli.serve") == "batchq.cli"
    assert "consumer.reader.thread" in {m for m, _ in _modules()}


def _private_reads() -> list[str]:
    found = []
    for _module, path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in NAMEDTUPLE_API:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (rel, name) in PRIVATE_ALLOWED:
                continue
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_objects_underscore_attribute() -> None:
    assert _private_reads() == []


@pytest.mark.parametrize("call", ["_getframe", "currentframe", "stack"])
def test_no_frame_inspection(call: str) -> None:
    hits = []
    for _module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == call
                and isinstance(node.value, ast.Name)
                and node.value.id in ("sys", "inspect")
            ):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert hits == []
