"""Variables stored in blocks: layouts, block-wise draws, gather/reduce, remat.

The mechanics of `keras.distribution`'s sharded variables, below `patches/`:
the Keras hooks that call into these modules are patches
(`patches/sharded_variables.py`, `patches/trainer_loops.py`), and nothing
here imports a patch, a replicator or the `distribution/` front door.
"""
