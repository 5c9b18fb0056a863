"""The patch registry: pins, one owner per attribute, order and reversal."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src import patches
from keras_replicator._src.core import traits
from keras_replicator._src.patches import exact_eval
from keras_replicator._src.patches import registry

# The pins that describe the installed Keras and TensorFlow.
PINS = [
    pytest.param(patch, pin, id=f"{patch.name}:{pin.module}:{i}")
    for patch in registry.patches()
    for i, pin in enumerate(patch.pins)
    if pin.applies()
]
TARGETS = [(t.owner, t.name) for p in registry.patches() for t in p.targets]
_MISSING = object()


@pytest.mark.parametrize(("patch", "pin"), PINS)
def test_upstream_code_a_patch_mirrors_is_unchanged(patch, pin):
    # When this fails, Keras or TensorFlow changed code a patch mirrors or
    # relies on: re-read the patch against the new code, then update it.
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(pin.module))
    missing = [line for line in pin.lines if line not in source]
    assert not missing, f"{patch.name}: {pin.module} no longer has {missing}"


def test_every_patch_declares_when_it_applies_and_when_it_goes():
    names = [p.name for p in registry.patches()]
    assert len(names) == len(set(names))
    for patch in registry.patches():
        assert patch.targets and patch.pins, patch.name
        assert patch.applies_to <= set(traits.KINDS), patch.name
        assert patch.delete_when.strip(), patch.name


def test_each_attribute_has_one_owner():
    assert len(TARGETS) == len({(id(o), n) for o, n in TARGETS})
    target = registry.patches()[0].targets[0]
    duplicate = registry.Patch(
        name="duplicate",
        targets=(registry.Target(target.owner, target.name, lambda o: o),),
        applies_to=frozenset({"local"}),
        pins=(),
        delete_when="never",
    )
    with pytest.raises(ValueError, match="one patch owns each attribute"):
        registry.register(duplicate)


def test_a_patch_names_only_known_kinds():
    with pytest.raises(ValueError, match="Received: applies_to=\\['gpu'\\]"):
        registry.Patch(
            name="x",
            targets=(),
            applies_to=frozenset({"gpu"}),
            pins=(),
            delete_when="",
        )


class _Loops:
    """Stands in for a replicator's own Keras loops; records the calls."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def loop(model, replicator, **arguments):
            self.calls.append((name, arguments.get("x")))
            return name

        return loop


class _AsyncKind:
    """A strategy of the "async" kind, as far as the patches can tell."""

    replicator_kind = "async"

    def __init__(self):
        self.keras_loops = _Loops()


def _model(strategy=None):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    if strategy is not None:
        model._distribute_strategy = strategy
    return model


@pytest.fixture(scope="module")
def padded_eval_data():
    # What the sharder hands to evaluate in eval mode with static shapes.
    examples = tf.data.Dataset.from_tensor_slices(
        (np.ones((6, 2), "float32"), np.ones((6, 1), "float32"))
    )
    return kr.LocalReplicator(2).distribute(
        examples, 4, mode="eval", static_shapes=True
    )


# What a program can do that installs patches: create a replicator of each
# kind (what its constructor installs), or make a sharder input in eval mode.
TRIGGERS = {
    **{
        kind: (lambda kind=kind: patches.install_for(kind))
        for kind in traits.KINDS
    },
    "shard_eval": lambda: kr.data.shard(
        tf.data.Dataset.range(4), 2, mode="eval"
    ),
}
SEQUENCES = [
    seq for n in (2, 3) for seq in itertools.permutations(sorted(TRIGGERS), n)
]


@pytest.mark.parametrize(
    "sequence", SEQUENCES, ids=["+".join(s) for s in SEQUENCES]
)
def test_any_install_order_dispatches_by_strategy_and_reverses(
    sequence, padded_eval_data, restore_patches
):
    registry.uninstall_all()
    stock = {
        (id(o), n): (vars(o).get(n, _MISSING), getattr(o, n, _MISSING))
        for o, n in TARGETS
    }
    for trigger in sequence:
        TRIGGERS[trigger]()
    expected = {
        name
        for kind in sequence
        if kind in traits.KINDS
        for name in registry.for_kind(kind)
    }
    assert set(registry.installed()) == expected
    # One layer of replacement, over the stock object, whatever the order.
    for owner, name in TARGETS:
        current = getattr(owner, name, _MISSING)
        before = stock[(id(owner), name)][1]
        if any(n in expected for n in _owners(owner, name)):
            if isinstance(before, property):
                # A property's getter is replaced.
                assert current.fget.__wrapped__ is before.fget
            elif before is not _MISSING:
                assert current.__wrapped__ is before
        else:
            assert current is before
    if "trainer_loops" in expected:
        # An async-kind model's evaluate takes its replicator's loop, with
        # sharder-padded data too; other models take Keras' own evaluate.
        async_model = _model(_AsyncKind())
        data = padded_eval_data
        assert async_model.evaluate(data) == "evaluate"
        assert async_model.fit(data) == "fit"
        assert async_model.predict(data) == "predict"
        loops = async_model.distribute_strategy.keras_loops
        assert [c[0] for c in loops.calls] == ["evaluate", "fit", "predict"]
        assert loops.calls[0][1] is data
        plain = _model()
        x = np.ones((4, 2), "float32")
        assert np.isfinite(plain.evaluate(x, x[:, :1], verbose=0))
        assert not getattr(plain, exact_eval._EXACT_ATTR, False)
    registry.uninstall_all()
    for owner, name in TARGETS:
        here, resolved = stock[(id(owner), name)]
        assert vars(owner).get(name, _MISSING) is here
        assert getattr(owner, name, _MISSING) is resolved


def _owners(owner, name):
    return [
        p.name
        for p in registry.patches()
        for t in p.targets
        if t.owner is owner and t.name == name
    ]


def test_no_strategy_and_stock_strategies_take_stock_paths(restore_patches):
    # Every patch installed: a model under no strategy and one under a stock
    # MirroredStrategy train exactly as with every patch uninstalled. (Not
    # with steps_per_execution > 1: stock TensorFlow fails there under a
    # MirroredStrategy, and nested_collectives makes it work.)
    def train(strategy):
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((4,)),
                    keras.layers.Dense(3),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(
                keras.optimizers.Adam(0.01, clipnorm=0.5),
                "mse",
                metrics=["mae"],
            )
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 4)).astype("float32")
        y = rng.normal(size=(32, 1)).astype("float32")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        loss = model.evaluate(x, y, batch_size=8, verbose=0)
        return model.get_weights(), history.history, loss

    def stock_strategies():
        return (
            tf.distribute.get_strategy(),
            tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]),
        )

    for kind in traits.KINDS:
        patches.install_for(kind)
    patched = [train(s) for s in stock_strategies()]
    registry.uninstall_all()
    stock = [train(s) for s in stock_strategies()]
    for (w, h, e), (sw, sh, se) in zip(patched, stock, strict=True):
        for a, b in zip(w, sw, strict=True):
            np.testing.assert_array_equal(a, b)
        assert h == sh
        np.testing.assert_array_equal(e, se)


def test_the_doors_names_are_pinned_on_the_installed_release():
    # Every private module `upstream/` reads is pinned by what it reads,
    # checked at import as a patch's pins are.
    from keras_replicator._src import upstream

    (holder,) = [h for h in registry.pin_holders() if h.name == "upstream"]
    assert {pin.module for pin in holder.pins} == set(upstream.PINS)
    with pytest.raises(ImportError, match="no_such_attribute"):
        registry.register_pins(
            "probe",
            (
                registry.Pin(
                    "tensorflow.python.eager.context",
                    (),
                    ("no_such_attribute",),
                ),
            ),
            "never",
        )
