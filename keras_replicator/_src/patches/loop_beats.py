"""What the hang watchdog sees of Keras' loops beyond the training steps.

The watchdog (`training/hang_watchdog.py`) needs a beat per step and a
pause while a checkpoint is written. Keras has no hook for either that
every loop passes through without a callback of the user's. The loops'
entry points (`trainer_loops`), the train batch end and
`BackupAndRestore`'s save (`preemption`) belong to other patches, which
call the watchdog themselves; this patch owns the rest:

- `CallbackList.on_test_batch_end` and `on_predict_batch_end`: the step
  ran (the first one is traced, the clock starts), then, after the
  callbacks returned, a beat of the innermost watched loop (`evaluate`,
  validation inside `fit`, `predict`);
- `ModelCheckpoint._save_model`: the watchdog's clock stops while it
  saves, on this worker and, through the coordination service, for the
  workers waiting for it.

A beat with no watched loop (a model under no strategy or a stock one) does
nothing.
"""

from __future__ import annotations

import keras
from keras.src.callbacks import callback_list

from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry
from keras_replicator._src.training import hang_watchdog


def _on_test_batch_end(original, self, batch, logs=None):
    hang_watchdog.arm()
    original(self, batch, logs)
    hang_watchdog.beat()


def _on_predict_batch_end(original, self, batch, logs=None):
    hang_watchdog.arm()
    original(self, batch, logs)
    hang_watchdog.beat()


def _save_model(original, self, *args, **kwargs):
    if not traits.is_in_graph(traits.model_strategy(self.model)):
        return original(self, *args, **kwargs)
    with hang_watchdog.paused():
        return original(self, *args, **kwargs)


_List = callback_list.CallbackList

PATCH = registry.register(
    registry.Patch(
        name="hang_watchdog",
        targets=(
            registry.Target(_List, "on_test_batch_end", _on_test_batch_end),
            registry.Target(
                _List, "on_predict_batch_end", _on_predict_batch_end
            ),
            registry.Target(
                keras.callbacks.ModelCheckpoint, "_save_model", _save_model
            ),
        ),
        applies_to=frozenset(traits.IN_GRAPH),
        pins=(
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                (
                    "callbacks.on_test_batch_end(end_step, logs)",
                    "callbacks.on_predict_batch_end(",
                ),
                keras=">=3.11",
            ),
            # Keras 3.10's loops pass the execution's first step.
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                (
                    "callbacks.on_test_batch_end(step, logs)",
                    "callbacks.on_predict_batch_end(step, "
                    '{"outputs": batch_outputs})',
                ),
                keras="<3.11",
            ),
            registry.Pin(
                "keras.src.callbacks.model_checkpoint",
                ("def _save_model(self, epoch, batch, logs):",),
            ),
        ),
        delete_when=(
            "Keras or TensorFlow end a worker whose loop makes no progress "
            "(a hang watchdog, as PyTorch's NCCL watchdog), or Keras gives "
            "a per-batch hook outside the user's callbacks"
        ),
    )
)
