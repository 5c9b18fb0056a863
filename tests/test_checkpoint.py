"""Sharded checkpoints (`kr.save_checkpoint`, `kr.load_checkpoint`).

On this process's 4 CPU replicas: a `ModelParallel` model trained a few
steps saves without gathering, each distinct block once; the checkpoint
loads onto another mesh, under `DataParallel` and on one device, with the
weights and optimizer state it was saved with, and training goes on from
there as it would have without the round trip. A mismatch is refused
before any weight changes; a save that fails leaves the previous
checkpoint; a corrupt block is caught by its checksum. The multi-process
half (each process writes only its blocks) is in
`tests/multi_worker/test_checkpoint.py`.
"""

import errno
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.sharding import checkpoint_commit
from keras_replicator._src.sharding import checkpoint_files
from keras_replicator._src.sharding import sharded
from tests import helpers

WIDTH = 16


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _model_parallel(shape):
    return helpers.model_parallel(
        shape, {".*d0/kernel": (None, "model"), ".*d1/kernel": ("model", None)}
    )


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return x, y


def _model(width=WIDTH, jit_compile=False):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(width, activation="relu", name="d0"),
            keras.layers.Dense(4, name="d1"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
    return model


def _fit(model, steps=2):
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=steps // 2, shuffle=False, verbose=0)


def _state(model):
    return [np.array(v.numpy()) for v in model.weights] + [
        np.array(v.numpy()) for v in model.optimizer.variables
    ]


def _assert_same(a, b, atol=0.0):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def _trained_on(distribution, tmp_path, **save_args):
    keras.distribution.set_distribution(distribution)
    model = _model()
    _fit(model)
    kr.save_checkpoint(model, tmp_path / "ckpt", **save_args).wait()
    return model


def _fresh_on(distribution):
    keras.distribution.set_distribution(distribution)
    return _model()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device: the state after 2 steps and after 2 more."""
    keras.distribution.set_distribution(None)
    model = _model()
    _fit(model)
    after_two = _state(model)
    _fit(model)
    return after_two, _state(model)


@pytest.mark.parametrize(
    "target",
    ["mesh_2x2", "data_parallel", "one_device", "mesh_1x4"],
)
def test_a_model_parallel_save_loads_anywhere_and_training_goes_on(
    tmp_path, reference, target
):
    after_two, after_four = reference
    saved = _trained_on(_model_parallel((1, 4)), tmp_path, metadata={"e": 1})
    saved_state = _state(saved)
    _assert_same(saved_state, after_two, atol=1e-6)
    distribution = {
        "mesh_2x2": lambda: _model_parallel((2, 2)),
        "data_parallel": lambda: keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()[:4]
        ),
        "one_device": lambda: None,
        "mesh_1x4": lambda: _model_parallel((1, 4)),
    }[target]()
    model = _fresh_on(distribution)
    metadata = kr.load_checkpoint(model, tmp_path / "ckpt")
    assert metadata == {"e": 1}
    _assert_same(_state(model), saved_state)
    _fit(model)
    _assert_same(_state(model), after_four, atol=1e-5)


def test_saving_gathers_nothing_and_writes_each_block_once(
    tmp_path, monkeypatch
):
    keras.distribution.set_distribution(_model_parallel((2, 2)))
    model = _model()
    _fit(model)
    reads = []
    original = sharded.full_value
    monkeypatch.setattr(
        sharded, "full_value", lambda v: reads.append(v) or original(v)
    )
    kr.save_checkpoint(model, tmp_path / "ckpt").wait()
    assert reads == []
    index = json.loads((tmp_path / "ckpt/index.json").read_text())
    assert index["checkpoint"] == "ckpt-2"
    kernel = index["variables"]["model/0"]
    assert kernel["path"] == model.weights[0].path
    assert kernel["layout"] == [None, "model"]
    # A (2, 2) mesh holds each column block twice; the file holds it once.
    assert sorted(b["begin"] for b in kernel["blocks"]) == [[0, 0], [0, 8]]
    assert all(b["shape"] == [8, 8] for b in kernel["blocks"])
    every = [*model.weights, *model.optimizer.variables]
    total = sum(int(np.prod(v.shape)) * 4 for v in every if v.dtype != "int64")
    total += sum(8 for v in every if v.dtype == "int64")
    files = list((tmp_path / "ckpt").glob("ckpt-2/process-*.bin"))
    assert [f.name for f in files] == ["process-0.bin"]
    assert files[0].stat().st_size == total


def test_a_mismatch_is_refused_before_any_weight_changes(tmp_path):
    _trained_on(_model_parallel((1, 4)), tmp_path)
    keras.distribution.set_distribution(_model_parallel((1, 4)))
    model = _model(width=2 * WIDTH)
    before = [np.array(v.numpy()) for v in model.weights]
    with pytest.raises(ValueError, match="no weight was changed") as error:
        kr.load_checkpoint(model, tmp_path / "ckpt")
    assert "d0/kernel (model/0): shape (8, 16) in the checkpoint" in str(
        error.value
    )
    _assert_same([np.array(v.numpy()) for v in model.weights], before)


class _Scale(keras.layers.Layer):
    def __init__(self, weight_name, **kwargs):
        super().__init__(**kwargs)
        self.weight_name = weight_name

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(input_shape[-1],), name=self.weight_name
        )

    def call(self, x):
        return x * self.w


def test_a_renamed_variable_is_refused(tmp_path):
    def build(name):
        model = keras.Sequential([keras.Input((4,)), _Scale(name)])
        model.compile("adam", "mse")
        return model

    kr.save_checkpoint(build("scale"), tmp_path, asynchronous=False)
    with pytest.raises(ValueError, match="named 'gain' in the model"):
        kr.load_checkpoint(build("gain"), tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_process_file_is_refused_before_any_weight_changes(
    tmp_path, damage
):
    _trained_on(_model_parallel((1, 4)), tmp_path)
    data = next((tmp_path / "ckpt").glob("ckpt-*/process-0.bin"))
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:-5])
    model = _fresh_on(_model_parallel((1, 4)))
    before = [np.array(v.numpy()) for v in model.weights]
    with pytest.raises(ValueError, match=f"process-0.bin: .*{damage}"):
        kr.load_checkpoint(model, tmp_path / "ckpt")
    _assert_same([np.array(v.numpy()) for v in model.weights], before)


def test_loading_an_empty_directory_names_it(tmp_path):
    model = _model()
    with pytest.raises(FileNotFoundError, match="No sharded checkpoint"):
        kr.load_checkpoint(model, tmp_path)


def test_a_save_that_fails_leaves_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    saved = _trained_on(_model_parallel((1, 4)), tmp_path)
    expected = _state(saved)
    _fit(saved)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_commit, "commit", crash)
    handle = kr.save_checkpoint(saved, tmp_path / "ckpt")
    with pytest.raises(OSError, match="disk full"):
        handle.wait()
    monkeypatch.undo()
    index = json.loads((tmp_path / "ckpt/index.json").read_text())
    assert index["checkpoint"] == "ckpt-2"
    model = _fresh_on(_model_parallel((1, 4)))
    kr.load_checkpoint(model, tmp_path / "ckpt")
    _assert_same(_state(model), expected)
    # The next save replaces the leftover and the old checkpoint.
    kr.save_checkpoint(saved, tmp_path / "ckpt").wait()
    folders = sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*"))
    assert folders == ["ckpt-4"]


@pytest.mark.parametrize(
    "mesh, jit_compile",
    # XLA refuses sharded variables, so it runs on one device.
    [((1, 4), False), (None, True)],
)
def test_a_save_returns_before_its_files_are_written(
    tmp_path, monkeypatch, mesh, jit_compile
):
    distribution = mesh and _model_parallel(mesh)
    keras.distribution.set_distribution(distribution)
    model = _model(jit_compile=jit_compile)
    _fit(model)
    release = threading.Event()
    original = checkpoint_files.write_part

    niceness = []

    def slow(*args):
        niceness.append(
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
        assert release.wait(60)
        original(*args)

    monkeypatch.setattr(checkpoint_files, "write_part", slow)
    handle = kr.save_checkpoint(model, tmp_path / "ckpt")
    # The blocks are snapshots that share the variables' buffers (no
    # copy): training on, compiled by XLA or not, must not change them.
    expected = _state(model)
    _fit(model)
    assert not handle.done()
    assert not (tmp_path / "ckpt/index.json").exists()
    release.set()
    handle.wait()
    # The writer thread yields the cores to training (Linux).
    assert niceness == [19 if sys.platform.startswith("linux") else 0]
    assert os.getpriority(os.PRIO_PROCESS, 0) < 19
    fresh = _fresh_on(distribution)
    kr.load_checkpoint(fresh, tmp_path / "ckpt")
    _assert_same(_state(fresh), expected)


@pytest.mark.parametrize("where", ["before", "flush", "checksum"])
def test_an_abandoned_save_stops_and_leaves_the_previous_checkpoint(
    tmp_path, monkeypatch, where
):
    saved = _trained_on(_model_parallel((1, 4)), tmp_path)
    expected = _state(saved)
    _fit(saved)
    # The writer pauses at `where` until the stop is set: the check right
    # after it must find the stop, so nothing more is written or summed.
    reached, go = threading.Event(), threading.Event()
    after_stop = []

    def pause():
        reached.set()
        assert go.wait(60)

    write = checkpoint_files.DirectFile.write

    def counted_write(self, raw):
        if go.is_set():
            after_stop.append("write")
        write(self, raw)

    monkeypatch.setattr(checkpoint_files.DirectFile, "write", counted_write)
    if where == "before":
        monkeypatch.setattr(checkpoint_commit, "yield_to_training", pause)
    elif where == "flush":
        monkeypatch.setattr(checkpoint_files.DirectFile, "_STAGING", 64)
        flush = checkpoint_files.DirectFile._flush

        def flush_then_pause(self, length):
            if go.is_set():
                after_stop.append("flush")
            flush(self, length)
            if not go.is_set():
                pause()

        monkeypatch.setattr(
            checkpoint_files.DirectFile, "_flush", flush_then_pause
        )
    else:
        monkeypatch.setattr(checkpoint_files, "_CRC_CHUNK", 64)
        crc32 = checkpoint_files.zlib.crc32

        def pause_then_crc(data, value):
            if go.is_set():
                after_stop.append("crc32")
            else:
                pause()
            return crc32(data, value)

        monkeypatch.setattr(checkpoint_files.zlib, "crc32", pause_then_crc)
    handle = kr.save_checkpoint(saved, tmp_path / "ckpt")
    assert reached.wait(60)
    handle._stop.set()
    go.set()
    handle._abandon()
    monkeypatch.undo()
    assert handle.done()
    assert after_stop == []
    handle.wait()  # No error: an abandoned save is no failure.
    index = json.loads((tmp_path / "ckpt/index.json").read_text())
    assert index["checkpoint"] == "ckpt-2"
    assert list((tmp_path / "ckpt/ckpt-4").iterdir()) == []
    model = _fresh_on(_model_parallel((1, 4)))
    kr.load_checkpoint(model, tmp_path / "ckpt")
    _assert_same(_state(model), expected)
    # The next save goes on as usual.
    kr.save_checkpoint(saved, tmp_path / "ckpt").wait()
    assert (
        json.loads((tmp_path / "ckpt/index.json").read_text())["checkpoint"]
        == "ckpt-4"
    )


def test_a_corrupt_block_is_caught_by_its_checksum(tmp_path):
    _trained_on(_model_parallel((1, 4)), tmp_path)
    data = next((tmp_path / "ckpt").glob("ckpt-*/process-0.bin"))
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    model = _fresh_on(_model_parallel((1, 4)))
    before = [np.array(v.numpy()) for v in model.weights]
    with pytest.raises(ValueError, match="corrupt"):
        kr.load_checkpoint(model, tmp_path / "ckpt")
    # Checked before any assignment: nothing changed.
    _assert_same([np.array(v.numpy()) for v in model.weights], before)


@pytest.mark.parametrize("refuse", [False, True], ids=["direct", "refused"])
def test_block_files_hold_the_exact_bytes(tmp_path, monkeypatch, refuse):
    """Through the staging buffer: several fills, a tail, any dtype.

    `refuse` stands for a file system that takes `O_DIRECT` at open and
    refuses its writes (EINVAL): the file is then written through the
    page cache, with the same bytes.
    """
    monkeypatch.setattr(checkpoint_files.DirectFile, "_STAGING", 3 * 4096)
    if refuse:
        real = os.pwritev
        refused = []

        def pwritev(fd, buffers, offset):
            if not refused:
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", pwritev)
    rng = np.random.default_rng(0)
    blocks = [
        rng.normal(size=(37, 211)).astype("float32"),  # 31228 bytes
        np.zeros((0, 5), "float32"),
        tf.constant(rng.normal(size=(5,)), "bfloat16").numpy(),
        rng.integers(0, 2**40, size=(4097,)),
    ]
    parts = {
        f"model/{i}": ({"path": f"v{i}"}, [([0] * np.ndim(b), b)])
        for i, b in enumerate(blocks)
    }
    checkpoint_files.write_part(tmp_path, 0, parts)
    # Each snapshot is let go once written (its variable then updates in
    # place, without a copy).
    assert [a for _, b in parts.values() for _, a in b] == [None] * 4
    data = (tmp_path / "process-0.bin").read_bytes()
    expected = b"".join(np.asarray(b).tobytes() for b in blocks)
    assert data == expected
    manifest = json.loads((tmp_path / "process-0.json").read_text())
    offsets = [manifest[f"model/{i}"]["blocks"][0]["offset"] for i in range(4)]
    assert offsets == [0, 31228, 31228, 31238]
    crcs = [manifest[f"model/{i}"]["blocks"][0]["crc32"] for i in range(4)]
    assert crcs == [checkpoint_files.checksum(b) for b in blocks]
    if refuse:
        assert refused == [0]


def test_bfloat16_weights_round_trip(tmp_path):
    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, name="d0", dtype="bfloat16"),
                keras.layers.Dense(4, name="d1", dtype="bfloat16"),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    keras.distribution.set_distribution(_model_parallel((1, 4)))
    model = build()
    _fit(model)
    kr.save_checkpoint(model, tmp_path / "ckpt").wait()
    expected = [np.asarray(v.numpy(), np.float32) for v in model.weights]
    keras.distribution.set_distribution(None)
    fresh = build()
    kr.load_checkpoint(fresh, tmp_path / "ckpt")
    assert fresh.weights[0].dtype == "bfloat16"
    _assert_same(
        [np.asarray(v.numpy(), np.float32) for v in fresh.weights], expected
    )


def test_converting_to_a_file_that_keras_cannot_name_is_refused(tmp_path):
    from keras_replicator._src.sharding import checkpoint as module

    model = _model()
    kr.save_checkpoint(model, tmp_path / "ckpt", asynchronous=False)
    with pytest.raises(ValueError, match="Received: filepath="):
        module.to_weights(model, tmp_path / "ckpt", tmp_path / "w.h5")


def test_bad_arguments_name_the_value(tmp_path):
    model = _model()
    with pytest.raises(TypeError, match="Received: metadata="):
        kr.save_checkpoint(model, tmp_path, metadata={"x": object()})
    with pytest.raises(TypeError, match="Received: step="):
        kr.save_checkpoint(model, tmp_path, step="last")


KILLED = """
import json, sys, time
import keras_replicator as kr

kr.configure_cpu_replicas(2)
import keras
import numpy as np

directory = sys.argv[1]
devices = keras.distribution.list_devices()[:2]
mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*kernel"] = (None, "model")
keras.distribution.set_distribution(keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="batch"))
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,)),
                          keras.layers.Dense(2048, name="a"),
                          keras.layers.Dense(2048, name="b"),
                          keras.layers.Dense(4, name="c")])
model.compile(keras.optimizers.Adam(1e-3), "mse")
x = np.ones((8, 256), "float32")
y = np.ones((8, 4), "float32")
model.fit(x, y, batch_size=8, verbose=0)
kr.save_checkpoint(model, directory, asynchronous=False)
sums = [float(np.abs(v.numpy().astype("float64")).sum())
        for v in [*model.weights, *model.optimizer.variables]]
with open(directory + ".first.json", "w") as f:
    json.dump(sums, f)
model.fit(x, y, batch_size=8, verbose=0)
# The second save writes its part, then stalls before its commit: the kill
# always lands mid-save, however fast the disk.
from keras_replicator._src.sharding import checkpoint_files
write_part = checkpoint_files.write_part
def write_part_then_stall(*args, **kwargs):
    write_part(*args, **kwargs)
    print("written", flush=True)
    time.sleep(600)
checkpoint_files.write_part = write_part_then_stall
print("saving", flush=True)
kr.save_checkpoint(model, directory)  # in the background
time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_a_process_killed_while_a_save_is_written_resumes_from_the_last(
    tmp_path,
):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(directory)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert process.stdout.readline().strip() == b"saving"
        # SIGKILL once the second save's part is on disk, before its commit.
        assert process.stdout.readline().strip() == b"written"
        assert (directory / "ckpt-2").exists()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    index = json.loads((directory / "index.json").read_text())
    assert index["checkpoint"] == "ckpt-1"
    sums = json.loads((tmp_path / "ckpt.first.json").read_text())
    # The restart: a fresh process (here, one device) loads the last
    # complete checkpoint.
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(2048, name="a"),
            keras.layers.Dense(2048, name="b"),
            keras.layers.Dense(4, name="c"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    kr.load_checkpoint(model, directory)
    loaded = [
        float(np.abs(v.numpy().astype("float64")).sum())
        for v in [*model.weights, *model.optimizer.variables]
    ]
    np.testing.assert_allclose(loaded, sums, rtol=1e-12)


GEMMA = Path(__file__).resolve().parents[1] / "examples/gemma_model_parallel.py"


@pytest.mark.timeout(300)
def test_the_command_round_trips_a_keras_hub_gemma_checkpoint(tmp_path):
    import keras_hub

    example = runpy.run_path(str(GEMMA))
    devices = keras.distribution.list_devices()[:4]
    mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"), devices)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )
    )
    model = example["build_model"]()
    model.fit(example["dataset"](8).take(2), shuffle=False, verbose=0)
    kr.save_checkpoint(model, tmp_path / "ckpt").wait()
    trained = _state(model)
    assert any(
        entry["layout"] and any(entry["layout"])
        for entry in json.loads((tmp_path / "ckpt/index.json").read_text())[
            "variables"
        ].values()
    )

    def convert(*args):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "keras_replicator._src.cli.main",
                "checkpoint",
                *args,
                f"--model={GEMMA}:build_model",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        )
        assert result.returncode == 0, result.stderr[-3000:]

    whole = tmp_path / "gemma.weights.h5"
    convert("to-weights", str(tmp_path / "ckpt"), str(whole))
    convert("from-weights", str(whole), str(tmp_path / "again"))
    keras.distribution.set_distribution(None)
    fresh = example["build_model"]()
    kr.load_checkpoint(fresh, tmp_path / "again")
    _assert_same(_state(fresh), trained)
