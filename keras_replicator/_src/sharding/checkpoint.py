"""Sharded checkpoints: every process writes its own blocks; any mesh reads.

A checkpoint is a directory:

```
directory/
  index.json            # what every file holds; written last, atomically
  ckpt-<step>/
    process-<k>.bin     # process k's blocks, raw bytes in C order
    process-<k>.json    # process k's part of the index
```

- **Saving** gathers nothing: each distinct block is written once, by the
  process of the lowest replica holding it; a replicated variable
  (`DataParallel`, a plain replicator, optimizer counters) by process 0. Each
  block carries a CRC-32. `save` copies this process's blocks to host memory
  and returns; a background thread writes the files and the index, and the
  next `save` (or a `load`) first waits for it.
- **The index is the commit.** Once every process's files are synced (its
  `process-<k>.json` renamed into place last), process 0 merges the parts
  into `index.json.tmp` and renames it over `index.json`. A crash or SIGTERM
  before that leaves the previous index, naming only a complete checkpoint's
  files, which are removed only after the rename (`checkpoint_commit`).
- **Loading onto any mesh.** For each block it now holds, a process reads
  only the saved blocks that intersect it, through memory maps (and, with
  `verify=True`, checksums each touched block once). The index is checked
  against the model (every variable, shape and dtype) before any weight
  changes. Any mesh or process count reads, `DataParallel` and one device too.

Not `tf.train.Checkpoint`: it saves a `MirroredVariable` as its primary
component, for a sharded variable one block (and its per-task sharding writes
each variable from the task holding it, not blocks with coordinates). Not
TensorStore: a new dependency for what raw bytes, `numpy.memmap` and a JSON
index do. The files assume storage every process sees (one host's disk, a
shared file system), as PyTorch's distributed checkpoint and Orbax do.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import tensorflow as tf

from keras_replicator._src.core import placements
from keras_replicator._src.core import trace_events
from keras_replicator._src.sharding import checkpoint_commit
from keras_replicator._src.sharding import checkpoint_files
from keras_replicator._src.sharding import sharded

CheckpointSave = checkpoint_commit.CheckpointSave
wait_for_saves = checkpoint_commit.wait_for_saves


def _variables(model, build_optimizer: bool = False) -> dict[str, Any]:
    """`{key: variable}` for the model's weights and its optimizer's.

    Keys are `"model/<i>"` and `"optimizer/<i>"`, in `model.weights` and
    `optimizer.variables` order: variables match by structure, as in Keras'
    weight files, not by paths, whose auto-numbered names (`sequential_2/`)
    differ between runs. The index keeps each path for messages.
    """
    optimizer = getattr(model, "optimizer", None)
    if build_optimizer and optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    found = {f"model/{i}": v for i, v in enumerate(model.weights)}
    if optimizer is not None and optimizer.built:
        found.update(
            {f"optimizer/{i}": v for i, v in enumerate(optimizer.variables)}
        )
    return found


def _strategy_of(variables) -> Any:
    for variable in variables:
        inner = getattr(variable, "_value", variable)
        strategy = getattr(inner, "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return None


def _snapshot(component) -> np.ndarray:
    """A host value of one variable component, as it is now.

    On the CPU no copy: the array holds the variable's buffer, which an
    update copies first while it is still read (copy-on-write), so only a
    variable updated before the writer lets go costs a copy. Elsewhere
    `np.asarray` copies the value to the host.
    """
    return np.asarray(component.value())


def _first_copy(variable) -> np.ndarray:
    """This process's first copy of a replicated variable.

    A plain read of one component: it works whatever strategy or
    distribution is current (a model saved after another was built).
    """
    inner = getattr(variable, "_value", variable)
    copies = getattr(inner, "values", None) or (inner,)
    return _snapshot(copies[0])


def _host_blocks(key, variable, process) -> tuple[dict, list]:
    """`(index entry, [(begin, host array)])`: this process's part."""
    inner = getattr(variable, "_value", variable)
    dtype = tf.as_dtype(inner.dtype).name
    shape = [int(d) for d in variable.shape]
    placement = placements.of(variable)
    entry = {
        "path": variable.path,
        "dtype": dtype,
        "shape": shape,
        "layout": None,
    }
    blocks = []
    if placement is None:
        if process == 0:
            value = _first_copy(variable)
            blocks.append(([0] * len(shape), value))
        return entry, blocks
    entry["layout"] = [
        None if a is None else placement.axis_names[a]
        for a in placement.dim_axes
    ]
    entry["mesh_shape"] = list(placement.mesh_shape)
    strategy = inner.distribute_strategy
    owners: dict[tuple, int] = {}
    for r in range(placement.num_devices):
        owners.setdefault(placement.begin(r), r)
    for r, component in zip(
        sharded.local_replicas(strategy), inner.values, strict=True
    ):
        begin = placement.begin(r)
        if owners[begin] == r:
            blocks.append((list(begin), _snapshot(component)))
    return entry, blocks


def _agreed_name(
    model, directory, step, process, processes, number, timeout
) -> tuple[str, int, bool]:
    """`_name` as process 0 reads it, the same on every process.

    Another host's network file system may still show the folder as it was
    before process 0's last commit (a cached lookup), so process 0 publishes
    what it read in the coordination service's key-value store.
    """
    step = _step(model, step)  # A bad `step` fails on every process alike.
    key = f"keras_replicator/checkpoint/{number}/name"
    if process == 0 or processes == 1:
        found = _name(directory, step)
        if processes > 1:
            sharded.publish(key, json.dumps(found))
        return found
    text = sharded.published(
        key,
        timeout,
        lambda seconds: (
            "A sharded checkpoint is named by process 0, which did not "
            f"name this one within {seconds:g} s (it may have failed). "
            f"Received: directory={str(directory)!r}"
        ),
    )
    name, sequence, replaces = json.loads(text)
    return name, sequence, replaces


def _step(model, step) -> int:
    """The step a checkpoint is named after: `step`, else the optimizer's."""
    if step is None:
        optimizer = getattr(model, "optimizer", None)
        step = (
            int(_first_copy(optimizer.iterations))
            if optimizer is not None and optimizer.built
            else 0
        )
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(
            f"`step` must be an integer or None. Received: step={step!r}"
        )
    return int(step)


def _name(directory, step: int) -> tuple[str, int, bool]:
    """The new checkpoint's name, its number, and whether one is there.

    The third: whether `directory` holds a committed checkpoint (an abandoned
    save leaves one). Read from the committed index, not a directory listing.
    """
    name = f"ckpt-{step}"
    index = checkpoint_files.read_index(directory)
    sequence = 0 if index is None else index.get("sequence", 0) + 1
    if index is not None and index["checkpoint"] == name:
        # The same step again: a new name keeps the committed files until
        # the new index replaces them.
        name = f"ckpt-{step}-{sequence}"
    return name, sequence, index is not None


@trace_events.spanned("checkpoint save", trace_events.SAVE)
def save(
    model,
    directory,
    *,
    step=None,
    metadata=None,
    asynchronous=True,
    timeout_seconds=checkpoint_commit.DEFAULT_TIMEOUT,
    on_commit=None,
) -> CheckpointSave:
    """Saves `model`'s weights and optimizer state as a sharded checkpoint.

    Every process calls it at the same point, with the same directory. Under
    `ModelParallel` nothing is gathered: each process writes the blocks it
    holds.

    Args:
        model: A Keras model (built).
        directory: The checkpoint directory (created if missing).
        step: The step the checkpoint's name carries. Defaults to the
            optimizer's iteration count (0 before the first step).
        metadata: A JSON-serialisable dict stored in the index and returned
            by `load` (a training position, a config). Defaults to `{}`.
        asynchronous: If True (the default), return once this process's
            blocks are in host memory and write in a background thread; the
            handle's `wait()` blocks until the index is written. If False,
            return when it is.
        timeout_seconds: How long a process waits for the others at each
            stage, in seconds. Defaults to 600.
        on_commit: If set, called without arguments in process 0 once the
            index is in place (before older checkpoints are removed).

    Returns:
        A `CheckpointSave`.

    Raises:
        TypeError: If `metadata` is not JSON-serialisable, or `step` is not
            an integer.
    """
    metadata = {} if metadata is None else metadata
    try:
        json.dumps(metadata)
    except TypeError as error:
        raise TypeError(
            "`metadata` must be a JSON-serialisable dict. "
            f"Received: metadata={metadata!r}"
        ) from error
    wait_for_saves()
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    variables = _variables(model)
    strategy = _strategy_of(variables.values())
    process, processes = sharded.process_of(strategy)
    number = checkpoint_commit.agree(processes, timeout_seconds)
    name, sequence, replaces = _agreed_name(
        model, directory, step, process, processes, number, timeout_seconds
    )
    checkpoint_commit.begin(
        directory, name, process, processes, timeout_seconds, number
    )
    parts = {
        key: _host_blocks(key, variable, process)
        for key, variable in variables.items()
    }
    arguments = (directory, name, sequence, process, processes, parts, metadata)
    if not asynchronous:
        checkpoint_commit.write(*arguments, timeout_seconds, on_commit)
        return CheckpointSave(directory, name)
    handle = CheckpointSave(directory, name)
    handle._number, handle._processes = number, processes
    handle._timeout = timeout_seconds
    handle._replaces = replaces

    checkpoint_commit.start(handle, arguments, timeout_seconds, on_commit)
    return handle


def _problems(variables, index) -> list[str]:
    saved = index["variables"]
    problems = []
    for group in ("model", "optimizer"):
        ours = [k for k in variables if k.startswith(group + "/")]
        theirs = [k for k in saved if k.startswith(group + "/")]
        if ours and len(ours) != len(theirs):
            problems.append(
                f"the checkpoint holds {len(theirs)} {group} variables, the "
                f"model {len(ours)}"
            )
    for key, variable in variables.items():
        entry = saved.get(key)
        inner = getattr(variable, "_value", variable)
        dtype = tf.as_dtype(inner.dtype).name
        shape = [int(d) for d in variable.shape]
        name = f"{variable.path} ({key})"
        if entry is None:
            problems.append(f"{name}: not in the checkpoint")
        elif key.startswith("model/") and (
            entry["path"].rpartition("/")[2] != variable.name
        ):
            # Matched by position; a variable's own name does not carry
            # the auto-numbered names of its model or layers.
            problems.append(
                f"{name}: named {variable.name!r} in the model, "
                f"{entry['path'].rpartition('/')[2]!r} in the checkpoint "
                f"(as {entry['path']})"
            )
        elif entry["shape"] != shape:
            problems.append(
                f"{name}: shape {tuple(entry['shape'])} in the checkpoint "
                f"(as {entry['path']}), {tuple(shape)} in the model"
            )
        elif entry["dtype"] != dtype:
            problems.append(
                f"{name}: dtype {entry['dtype']} in the checkpoint (as "
                f"{entry['path']}), {dtype} in the model"
            )
        else:
            covered = sum(int(np.prod(b["shape"])) for b in entry["blocks"])
            if covered != int(np.prod(shape)):
                problems.append(
                    f"{name}: the checkpoint's blocks cover {covered} of "
                    f"{int(np.prod(shape))} elements"
                )
    return problems


@trace_events.spanned("checkpoint load", trace_events.SAVE)
def load(model, directory, *, verify=True) -> dict:
    """Loads a sharded checkpoint into `model`, on whatever mesh it has now.

    Every process calls it; each reads only the blocks it holds now. First
    waits for this process's save in flight, and builds the optimizer if the
    checkpoint holds optimizer state.

    Args:
        model: A built Keras model: on one device, under a replicator,
            `DataParallel` or `ModelParallel` on any mesh.
        directory: A directory `save_checkpoint` wrote.
        verify: If True (the default), check each block's CRC-32 the first
            time it is read.

    Returns:
        The `metadata` dict the checkpoint was saved with.

    Raises:
        FileNotFoundError: If `directory` holds no committed checkpoint.
        ValueError: If the checkpoint does not match the model (a missing
            variable, a shape or dtype), before any weight changes; or a
            block is corrupt.
    """
    wait_for_saves()
    directory = pathlib.Path(directory)
    index = checkpoint_files.read_index(directory)
    if index is None:
        raise FileNotFoundError(
            f"No sharded checkpoint in {directory} (no "
            f"{checkpoint_files.INDEX}: none was "
            f"saved there, or none completed). Received: directory="
            f"{str(directory)!r}"
        )
    has_optimizer = any(k.startswith("optimizer/") for k in index["variables"])
    variables = _variables(model, build_optimizer=has_optimizer)
    if not has_optimizer:
        variables = {
            k: v for k, v in variables.items() if k.startswith("model/")
        }
    problems = _problems(variables, index) + checkpoint_files.file_problems(
        directory, index
    )
    if problems:
        raise ValueError(
            "The sharded checkpoint does not match the model; no weight was "
            f"changed. Received: directory={str(directory)!r}, mismatches:\n  "
            + "\n  ".join(problems)
        )
    entries = index["variables"]
    plans = [
        _plan(
            variable,
            checkpoint_files.Reader(directory, key, entries[key], verify),
        )
        for key, variable in variables.items()
    ]
    if verify:
        # Every block this process reads is checked before any assignment,
        # so a corrupt block leaves the model as it was.
        for _, reader, boxes in plans:
            for begin, shape in boxes.values():
                reader.verify(begin, shape)
    for variable, reader, boxes in plans:
        if placements.of(variable) is None:
            ((begin, shape),) = boxes.values()
            variable.assign(reader.read(begin, shape))
            continue
        sharded.assign_blocks(
            variable, lambda r, rd=reader, b=boxes: rd.read(*b[r])
        )
    return index["metadata"]


def _plan(variable, reader) -> tuple:
    """`(variable, reader, {replica: (begin, shape)})` this process reads."""
    placement = placements.of(variable)
    if placement is None:
        shape = tuple(int(d) for d in variable.shape)
        return variable, reader, {None: ([0] * len(shape), shape)}
    strategy = variable._value.distribute_strategy
    return (
        variable,
        reader,
        {
            r: (list(placement.begin(r)), placement.local_shape)
            for r in sharded.local_replicas(strategy)
        },
    )


def to_weights(model, directory, filepath) -> None:
    """Converts a sharded checkpoint to a whole Keras `.weights.h5` file.

    Every process calls it, with a built `model` of the checkpoint's
    structure on any mesh: `load`, then `model.save_weights(filepath)`, which
    under `ModelParallel` gathers and writes one variable at a time from the
    chief.

    Raises:
        ValueError: If `filepath` does not end in `.weights.h5`, or the
            checkpoint holds optimizer state and `model` has no optimizer.
    """
    if not str(filepath).endswith(".weights.h5"):
        raise ValueError(
            "Keras writes weights to a file ending in `.weights.h5`. "
            f"Received: filepath={str(filepath)!r}"
        )
    index = checkpoint_files.read_index(pathlib.Path(directory))
    holds_optimizer = index is not None and any(
        k.startswith("optimizer/") for k in index["variables"]
    )
    if holds_optimizer and getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The checkpoint holds optimizer state and the model has no "
            "optimizer, so the state would be dropped: compile the model "
            f"first. Received: directory={str(directory)!r}"
        )
    load(model, directory)
    model.save_weights(filepath)


def from_weights(model, filepath, directory) -> None:
    """Converts a whole Keras `.weights.h5` file to a sharded checkpoint.

    Every process calls it, with a built `model` of the file's structure on
    any mesh: `model.load_weights(filepath)` (each process cuts its blocks,
    one variable at a time), then a synchronous `save`.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        # The file may hold the optimizer's state: give it somewhere to go.
        optimizer.build(model.trainable_variables)
    model.load_weights(filepath)
    save(model, directory, asynchronous=False)
