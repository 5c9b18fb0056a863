"""Guards the Keras internals that keras_compat answers."""

import inspect

from keras.src.backend.tensorflow import trainer

from keras_replicator._src import keras_compat


def test_keras_trainer_still_makes_the_calls_we_answer():
    # If this fails, Keras changed how its TF trainer reduces under a
    # multi-worker strategy: re-check keras_compat against the new code and
    # run tests/multi_worker/test_fit.py.
    source = inspect.getsource(trainer)
    for line in keras_compat.KERAS_TRAINER_CALLS:
        assert line in source, line


def test_keras_trainer_detects_multi_worker_by_isinstance():
    # Our replicator reaches the multi-worker branches only because it is a
    # MultiWorkerMirroredStrategy subclass.
    source = inspect.getsource(trainer._collective_all_reduce_multi_worker)
    assert (
        "isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)"
        in (source)
    )
