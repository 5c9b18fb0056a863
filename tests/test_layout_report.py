"""`kr.layout_report` and the warnings of a model's first ModelParallel fit.

The report's bytes per device are what `kr.shard_shapes` says each device
holds. The guide's key `"d1/kernel"` shards nothing on a `Sequential`
model (whose path is `sequential/d1/kernel`): the first `fit` warns and
names the key. A mixture-of-experts weight (3-D, over 1 MB) that no key
matches stays whole on every device: the first `fit` names it.
"""

import logging
import math

import keras
import numpy as np
import pytest

import keras_replicator as kr
from tests import helpers


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _model_parallel(keys):
    keras.distribution.set_distribution(helpers.model_parallel((1, 4), keys))


def _fit(model, inputs=8, outputs=4):
    x = np.ones((16, inputs), "float32")
    y = np.ones((16, outputs), "float32")
    model.fit(x, y, batch_size=8, verbose=0)


def _sequential():
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="d1"),
            keras.layers.Dense(4, name="d2"),
        ]
    )
    model.compile("adam", "mse")
    return model


def test_the_report_counts_what_shard_shapes_says_each_device_holds():
    _model_parallel({".*d1/kernel": (None, "model")})
    model = _sequential()
    _fit(model)
    lines = []
    report = kr.layout_report(model, print_fn=lines.append)
    weights = sum(
        math.prod(next(iter(kr.shard_shapes(v).values())))
        * np.dtype(v.dtype).itemsize
        for v in model.weights
    )
    slots = sum(
        math.prod(next(iter(kr.shard_shapes(v).values())))
        * np.dtype(v.dtype).itemsize
        for v in model.optimizer.variables
    )
    assert report.weights_bytes == weights
    assert report.optimizer_bytes == slots
    kernel = next(r for r in report.rows if r.path.endswith("d1/kernel"))
    assert kernel.key == ".*d1/kernel"
    assert kernel.block == (8, 4)
    assert report.largest_gather_bytes == 8 * 16 * 4
    assert kernel.path in lines[0]


def test_the_report_prints_nothing_unless_asked_and_its_str_is_the_table(
    capsys,
):
    _model_parallel({".*d1/kernel": (None, "model")})
    model = _sequential()
    _fit(model)
    report = kr.layout_report(model)
    assert capsys.readouterr().out == ""
    print(report)  # as `print(kr.layout_report(model))`: the table, once
    out = capsys.readouterr().out
    assert out == str(report) + "\n"
    assert out.count("per device: weights") == 1
    kr.layout_report(model, print_fn=print)
    assert capsys.readouterr().out == out


def test_columns_stay_aligned_for_long_keys():
    key = ".*/(?:a_layer_with_a_long_name|d1)/kernel"
    _model_parallel({key: (None, "model")})
    model = _sequential()
    _fit(model)
    report = kr.layout_report(model)
    header, *lines = str(report).splitlines()[: 1 + len(report.rows)]
    # Every row's block starts under "per device", its bytes end under
    # "bytes", whatever the length of the key before them.
    start = header.index("per device")
    for row, line in zip(report.rows, lines, strict=True):
        assert line.index(str(row.block), header.index("key")) == start, (
            f"\n{header}\n{line}"
        )
        assert len(line) == len(header)
    kernel = next(line for line in lines if "d1/kernel " in line)
    assert key in kernel


def test_a_sharded_slot_shows_the_key_of_its_variable():
    _model_parallel({".*d1/kernel": (None, "model")})
    model = _sequential()
    _fit(model)
    report = kr.layout_report(model)
    slots = [
        r for r in report.rows if r.optimizer and r.shape == (8, 16)
    ]  # Adam's two moments of d1/kernel
    assert len(slots) == 2, report.rows
    for slot in slots:
        assert slot.block == (8, 4)
        assert slot.key == ".*d1/kernel"
        (line,) = [
            line for line in str(report).splitlines() if slot.path in line
        ]
        assert ".*d1/kernel" in line
    # The slots of variables no key matched stay unmatched.
    bias = [r for r in report.rows if r.optimizer and r.shape == (4,)]
    assert bias and all(r.key is None for r in bias)


def test_a_key_that_misses_the_sequential_prefix_warns_and_is_named(caplog):
    _model_parallel({"d1/kernel": (None, "model")})
    model = _sequential()
    with caplog.at_level(logging.WARNING, logger="keras_replicator"):
        _fit(model)
        _fit(model)
    warnings = [r.getMessage() for r in caplog.records if "layout" in r.message]
    assert len(warnings) == 1, warnings  # once per model
    assert "matched no variable" in warnings[0]
    assert "'d1/kernel'" in warnings[0]
    assert set(kr.shard_shapes(model.get_layer("d1").kernel).values()) == {
        (8, 16)
    }


class _Experts(keras.layers.Layer):
    """A mixture-of-experts weight: (experts, in, out)."""

    def build(self, input_shape):
        self.experts = self.add_weight(
            shape=(8, input_shape[-1], 256), name="experts"
        )

    def call(self, x):
        return keras.ops.mean(
            keras.ops.einsum("bi,eio->beo", x, self.experts), axis=1
        )


def test_a_large_moe_weight_no_key_matches_warns(caplog):
    _model_parallel({".*dense/kernel": (None, "model")})
    model = keras.Sequential(
        [keras.Input((256,)), _Experts(name="moe"), keras.layers.Dense(4)]
    )
    model.compile("adam", "mse")
    with caplog.at_level(logging.WARNING, logger="keras_replicator"):
        _fit(model, inputs=256)
    (warning,) = [
        r.getMessage() for r in caplog.records if "layout" in r.message
    ]
    assert "/moe/experts (8, 256, 256) (2.0 MiB)" in warning
    assert "stay whole on every device" in warning


def test_no_warning_for_a_map_that_shards_what_it_names(caplog):
    _model_parallel({".*d1/kernel": (None, "model")})
    model = _sequential()
    with caplog.at_level(logging.WARNING, logger="keras_replicator"):
        _fit(model)
    assert not [r for r in caplog.records if "layout map" in r.message]


def test_an_unbuilt_model_is_refused():
    with pytest.raises(ValueError, match="Received: model="):
        kr.layout_report(keras.Sequential([keras.layers.Dense(2)]))


def test_output_hints_are_not_unmatched_keys_but_a_stray_key_is():
    _model_parallel(
        {
            ".*d1/kernel": (None, "model"),
            ".*d1/output": ("batch", None),  # Keras' "<layer>/output" hint.
            ".*d2_output": ("batch", None),  # Names no variable or output.
        }
    )
    model = _sequential()
    _fit(model)
    report = kr.layout_report(model, print_fn=None)
    assert report.unmatched_keys == (".*d2_output",)
