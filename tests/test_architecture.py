"""The layering rules of the package, checked from its source.

- Every assignment to an attribute of a Keras or TensorFlow module or class
  (`tf_trainer.TensorFlowTrainer.fit = ...`, `setattr(mdi, ...)`) is in
  `keras_replicator/_src/patches/`. Instances (a layer, an optimizer) are
  not patches and are not counted.
- No two modules of `keras_replicator` import each other in a loop, counting
  imports inside functions too and the package `__init__` an import runs
  (`from keras_replicator._src.patches import replica_mean` first runs
  `patches/__init__.py`, which imports every patch); patches never import
  replicators.
- No two folders of `_src` import each other, none imports the command line
  (`cli/`, on top), and the sharding mechanics
  import neither the patches, the replicators nor the `distribution/` front
  door above them.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_replicator"
PATCHES = PACKAGE / "_src" / "patches"
UPSTREAM = ("keras", "tensorflow", "tf_keras")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _upstream_names(tree):
    """Names bound to Keras/TF modules or their objects by imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UPSTREAM:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UPSTREAM:
                names.update(a.asname or a.name for a in node.names)
    return names


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def _upstream_assignments(path):
    tree = ast.parse(path.read_text())
    upstream = _upstream_names(tree)
    # Module-level aliases of upstream objects: `_Trainer = tf_trainer.X`.
    for node in tree.body:
        if isinstance(node, ast.Assign) and _root(node.value) in upstream:
            upstream.update(
                t.id for t in node.targets if isinstance(t, ast.Name)
            )
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = getattr(node, "targets", None) or [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            if isinstance(target, ast.Attribute) and _root(target) in upstream:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_patches_assign_keras_or_tensorflow_attributes():
    outside = [
        hit
        for name, path in _modules()
        if PATCHES not in path.parents
        for hit in _upstream_assignments(path)
    ]
    assert not outside, f"move these into _src/patches/: {outside}"


def test_the_check_sees_the_patches_themselves(tmp_path):
    # The patch modules only name their targets (the registry assigns), so
    # the registry is where the scan must find an assignment.
    assert _upstream_assignments(PATCHES / "registry.py") == []
    sample = PATCHES.parent / "core" / "traits.py"
    assert _upstream_assignments(sample) == []
    source = "import keras\nkeras.Model.fit = None\nsetattr(keras, 'x', 1)\n"
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert len(_upstream_assignments(probe)) == 2


def _imports():
    known = dict(_modules())
    graph = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    parent = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{node.module}"
                for alias in node.names:
                    # `from pkg import module` needs the module; `from
                    # module import name` needs the module itself.
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in known else base)
        # Importing `a.b.c` first runs `a/__init__` and `a/b/__init__`,
        # unless they are this module's own packages (already running).
        own = _packages(name if is_package else name.rpartition(".")[0])
        edges |= {p for e in set(edges) for p in _packages(e)} - own
        graph[name] = {e for e in edges if e in known and e != name}
    return graph


def _packages(name):
    """`name` and the packages that hold it: a.b.c -> {a, a.b, a.b.c}."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _cycle(graph):
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt, [*stack, nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


# A package's __init__ re-exports its modules: `pkg` -> `pkg.mod` edges are
# the facade, not a loop, as long as `pkg.mod` does not import `pkg` back.
def test_no_import_cycles_inside_the_package():
    graph = _imports()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_follows_package_inits(tmp_path, monkeypatch):
    # The loop the sharded variables once had: a module imports a patch,
    # the patches' __init__ imports another patch, which imports it back.
    root = tmp_path / "keras_replicator"
    files = {
        "__init__.py": "",
        "_src/__init__.py": "",
        "_src/sharding/__init__.py": "",
        "_src/sharding/sharded.py": (
            "from keras_replicator._src.patches import replica_mean\n"
        ),
        "_src/patches/__init__.py": (
            "from keras_replicator._src.patches import sharded_variables\n"
        ),
        "_src/patches/replica_mean.py": "",
        "_src/patches/sharded_variables.py": (
            "from keras_replicator._src.sharding import sharded\n"
        ),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setitem(globals(), "PACKAGE", root)
    cycle = _cycle(_imports())
    assert cycle is not None
    assert "keras_replicator._src.patches" in cycle


def _folder(module):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def _folder_edges():
    edges = set()
    for module, targets in _imports().items():
        for target in targets:
            pair = (_folder(module), _folder(target))
            if None not in pair and pair[0] != pair[1]:
                edges.add(pair)
    return edges


# None: the command line (`cli/`), which starts replicators (`kr.auto()`
# for `env`, a LocalReplicator for `demo`), sits on top, and the launcher
# (`cluster/`) starts parameter servers by name, importing no replicator.
KNOWN_MUTUAL = []


def test_the_command_line_sits_on_top():
    below = sorted(
        (a, b) for a, b in _folder_edges() if b == "cli" and a != "cli"
    )
    assert not below, f"folders that import the command line: {below}"


def test_no_two_folders_import_each_other():
    edges = _folder_edges()
    mutual = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert mutual == KNOWN_MUTUAL, f"folders that import each other: {mutual}"


def test_sharding_sits_below_patches_replicators_and_the_front_door():
    upward = sorted(
        (a, b)
        for a, b in _folder_edges()
        if a == "sharding" and b in ("patches", "replicators", "distribution")
    )
    assert not upward, upward


@pytest.mark.parametrize("name", ["patches", "core", "collectives"])
def test_lower_layers_never_import_replicators(name):
    graph = _imports()
    prefix = f"keras_replicator._src.{name}"
    for module, edges in graph.items():
        if module == prefix or module.startswith(prefix + "."):
            upward = [e for e in edges if ".replicators" in e]
            assert not upward, f"{module} imports {upward}"


# Keras' and TensorFlow's private code.
_PRIVATE = ("keras.src", "tensorflow.python")
# Where it may be imported: the patches (beside their pins) and the door.
_PRIVATE_DOORS = (PATCHES, PACKAGE / "_src" / "upstream")


def _private_imports(path):
    """The private Keras/TensorFlow modules `path` imports, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                continue
            names = [node.module]
        for name in names:
            if any(name == p or name.startswith(p + ".") for p in _PRIVATE):
                found.append(f"{name} (line {node.lineno})")
    return found


def test_private_keras_and_tensorflow_code_only_through_the_door():
    # Everything else reads `keras.src` and `tensorflow.python` through
    # `_src/upstream`, whose names are pinned (`patches/upstream_pins.py`).
    leaks = {}
    for _, path in _modules():
        if any(path.is_relative_to(door) for door in _PRIVATE_DOORS):
            continue
        found = _private_imports(path)
        if found:
            leaks[str(path.relative_to(PACKAGE))] = found
    assert not leaks, f"private imports outside the door: {leaks}"


def test_the_door_check_sees_a_private_import(tmp_path):
    module = tmp_path / "leaky.py"
    module.write_text(
        "def f():\n    from tensorflow.python.eager import context\n"
        "import keras.src.utils as u\n"
    )
    assert sorted(_private_imports(module)) == [
        "keras.src.utils (line 3)",
        "tensorflow.python.eager (line 2)",
    ]


def test_each_module_name_appears_once():
    # Two `layout.py` (processes and tensors), two `preemption.py`: a reader
    # could not tell which one a name meant.
    names = {}
    for _, path in _modules():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(
                str(path.relative_to(PACKAGE))
            )
    twice = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not twice, twice


# A module a reader can hold: split one that grows past this by concern.
MAX_MODULE_LINES = 800


def test_no_module_is_longer_than_a_reader_can_hold():
    lengths = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
        for _, path in _modules()
    }
    long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not long, long
