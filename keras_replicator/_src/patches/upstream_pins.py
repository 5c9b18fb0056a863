"""The pins of the private Keras and TensorFlow names `upstream/` exports.

Not a patch (it replaces nothing): it registers pins so that the registry
checks what the rest of the package reads of Keras' and TensorFlow's
private modules (`keras_replicator/_src/upstream`) exactly as it checks
the patches' own pins: every attribute must exist on the
installed release (at import, so `make test-compat` checks each supported
pair), and a release newer than the supported range is accepted only if
they all still do.
"""

from __future__ import annotations

from keras_replicator._src import upstream
from keras_replicator._src.patches import registry

PINS = registry.register_pins(
    "upstream",
    tuple(
        registry.Pin(module, (), attributes=attributes)
        for module, attributes in sorted(upstream.PINS.items())
    ),
    "Keras and TensorFlow export what upstream/ reads (each name then "
    "leaves the door)",
)
