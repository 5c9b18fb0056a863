"""Worker of test_sampling.py: sampling loops under ModelParallel.

`keras.distribution.initialize()` (over gRPC, or over MPI when the test
starts the workers under mpiexec), then each case of `sampling_reference`
on a (1, 2) mesh whose model axis spans the two processes, its own layout
map for each. Writes every case's outputs, which weights were split (and
their blocks), and the transport.
"""

import keras

import keras_replicator as kr
from keras_replicator._src.distribution import runtime
from tests.multi_worker import harness
from tests.multi_worker import sampling_reference as ref

keras.distribution.initialize()
mesh = keras.distribution.DeviceMesh(
    (1, 2), ("batch", "model"), keras.distribution.list_devices()
)
out, split = {}, {}
for layout in ref.LAYOUTS:
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=ref.layout_map(layout, mesh), batch_dim_name="batch"
        )
    )
    for sampler in ref.SAMPLERS:
        out[f"{layout}_{sampler}"] = ref.generate(layout, sampler)
    split[layout] = ref.split_weights(layout)
    if layout == "auto":
        out["custom_loop"] = ref.custom_loop()
        split["custom_loop"] = ref.split_weights("custom_loop")
replicator = runtime.replicator_for(keras.distribution.distribution())
harness.write_result(
    {
        "outputs": out,
        "split": split,
        "transport": replicator.transport,
        "process": kr.process_index(),
    }
)
